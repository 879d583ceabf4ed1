//! The memory planner's device: a [`Rehearsal`] on a device of no memory.
//! Its tensors carry shape, dtype and bytes (recorded in its
//! [`MemoryLedger`] like any backend's) but no storage, and its ops
//! allocate what the device it models would allocate (the outputs the
//! caller asks for, and the op's own workspaces and kept buffers, as the
//! modelled device's [`OpBuffers`] size them), computing nothing. Running
//! the engine's own step on it gives the step's ledger without a device:
//! the memory planner's prediction (`plan::engine`).

use super::op_buffers::{OpBuffers, ReferenceBuffers};
use super::rehearsal::{Rehearsable, Rehearsal};
use super::{Category, DType, MemoryLedger};
use crate::error::Result;
use std::sync::Arc;

/// The storage of a counted tensor: none.
pub struct NoMemory;

/// A device of no memory whose ops take what `rules` say.
pub struct Counted {
    ledger: Arc<MemoryLedger>,
    rules: Arc<dyn OpBuffers>,
}

/// A backend that allocates what the device it models would and computes
/// nothing (module docs).
pub type CountingBackend = Rehearsal<Counted>;

impl CountingBackend {
    /// A counting backend, with an empty ledger, of the device whose ops
    /// take the buffers `rules` say (the CPU reference's:
    /// [`CountingBackend::reference`]; a planned GPU's:
    /// `backend::cuda::counted::CountedCuda`).
    pub fn new(rules: Arc<dyn OpBuffers>) -> Self {
        Rehearsal::on(Counted {
            ledger: Arc::new(MemoryLedger::new()),
            rules,
        })
    }

    /// A counting backend of the CPU reference: F32, no buffers of the
    /// ops' own.
    pub fn reference() -> Self {
        Self::new(Arc::new(ReferenceBuffers))
    }
}

impl Rehearsable for Counted {
    type Storage = NoMemory;

    fn device_name(&self) -> String {
        let dtype = match self.rules.compute_dtype() {
            DType::F32 => "f32",
            _ => "bf16",
        };
        format!("counting {dtype}")
    }
    fn device_ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn op_buffers(&self) -> &dyn OpBuffers {
        &*self.rules
    }
    /// Any dtype, as the devices counted store any (the CPU's narrower
    /// values in f32 cells: `backend::cpu`).
    fn alloc_unwritten(&self, _shape: &[usize], _dtype: DType, _cat: Category) -> Result<NoMemory> {
        Ok(NoMemory)
    }
}
