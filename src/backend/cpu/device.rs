//! The CPU reference device: one rank's ledger and op profile, and its
//! tensors' storage (zeroed pages a rehearsal never touches).

use super::cells::CpuStorage;
use crate::backend::op_buffers::{OpBuffers, ReferenceBuffers};
use crate::backend::profile::HostProfile;
use crate::backend::rehearsal::Rehearsable;
use crate::backend::{Backend, Category, DType, MemoryLedger, TensorDevice};
use crate::error::Result;
use std::sync::Arc;

/// CPU f32 backend. One instance per rank; each has its own ledger.
pub struct CpuBackend {
    pub(super) ledger: Arc<MemoryLedger>,
    /// Host wall-clock time of each op, once enabled (`--profile`).
    pub(super) profile: HostProfile,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            ledger: Arc::new(MemoryLedger::new()),
            profile: HostProfile::default(),
        }
    }

    /// `n` zeros, or an out-of-memory error: a zeroed allocation (calloc)
    /// whose untouched pages cost no memory, so a rehearsal of a model
    /// larger than the host's memory allocates all of it without using it
    /// (`Rehearsable::alloc_unwritten`).
    pub(super) fn lazy_zeros(&self, n: usize) -> Result<Vec<f32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let oom = || {
            crate::backend::out_of_memory(
                &self.name(),
                &self.ledger,
                n.saturating_mul(4),
                String::new(),
            )
        };
        let layout = std::alloc::Layout::array::<f32>(n).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size (n > 0).
        let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        if p.is_null() {
            return Err(oom());
        }
        // SAFETY: `p` was allocated by the global allocator with the layout
        // of `n` f32s, all of them initialised (zero bits are 0.0).
        Ok(unsafe { Vec::from_raw_parts(p, n, n) })
    }

    pub(super) fn storage(&self, n: usize, fill: f32) -> CpuStorage {
        CpuStorage(vec![fill; n])
    }
}

impl TensorDevice for CpuBackend {
    type Storage = CpuStorage;
}

/// The CPU under a [`Rehearsal`](crate::backend::rehearsal::Rehearsal): tensors of
/// zeroed pages never written (no NaN fill), so a rehearsal maps only
/// what it touches; the ops take no buffers of their own.
impl Rehearsable for CpuBackend {
    type Storage = CpuStorage;

    fn device_name(&self) -> String {
        self.name()
    }
    fn device_ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn op_buffers(&self) -> &dyn OpBuffers {
        &ReferenceBuffers
    }
    fn alloc_unwritten(
        &self,
        shape: &[usize],
        _dtype: DType,
        _cat: Category,
    ) -> Result<CpuStorage> {
        Ok(CpuStorage(self.lazy_zeros(shape.iter().product())?))
    }
}
