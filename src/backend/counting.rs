//! The memory planner's device: a [`Rehearsal`] on a device of no memory.
//! Its tensors carry shape, dtype and bytes (recorded in its
//! [`MemoryLedger`] like any backend's) but no storage, and its ops
//! allocate what the device it models would allocate (the outputs the
//! caller asks for, and the op's own workspaces and kept buffers),
//! computing nothing. Running the engine's own step on it gives the step's
//! ledger without a device: the memory planner's prediction (`plan::engine`).
//!
//! It models a [`CountedDevice`]: the CPU reference (F32 only, no buffers of
//! its own) or a CUDA device (BF16 compute; the buffers
//! [`OpBuffers::Cuda`] names, and attention routed as `CudaBackend` routes
//! it for a planned cuDNN version: `cudnn::select`'s limits, cuDNN's
//! forward plan workspace as 0 and its backward one as estimated).

use super::rehearsal::{AttnShape, OpBuffers, Rehearsable, Rehearsal};
use super::{AttnMask, Category, DType, MemoryLedger};
use crate::backend::cuda::{cudnn, flash};
use crate::error::Result;
use std::sync::Arc;

/// The device whose allocations a [`CountingBackend`] reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountedDevice {
    /// The CPU reference: everything F32, no buffers of the backend's own.
    Cpu,
    /// A CUDA device computing in BF16. `cudnn`: the cuDNN version whose
    /// limits decide which attention calls run on cuDNN SDPA (`None`: our
    /// kernels only, `--attn-kernel native`).
    Cuda { cudnn: Option<usize> },
}

/// The storage of a counted tensor: none.
pub struct NoMemory;

/// A device of no memory standing for a [`CountedDevice`].
pub struct Counted {
    ledger: Arc<MemoryLedger>,
    device: CountedDevice,
}

/// A backend that allocates what its [`CountedDevice`] would and computes
/// nothing (module docs).
pub type CountingBackend = Rehearsal<Counted>;

impl CountingBackend {
    /// A counting backend of `device` with an empty ledger.
    pub fn new(device: CountedDevice) -> Self {
        Rehearsal::on(Counted {
            ledger: Arc::new(MemoryLedger::new()),
            device,
        })
    }

    /// The device this backend models.
    pub fn counted(&self) -> CountedDevice {
        self.device().device
    }
}

impl Counted {
    /// Whether cuDNN SDPA takes a call of `shape` (`bwd`: the backward).
    fn on_cudnn(&self, shape: &cudnn::SdpaShape, bwd: bool) -> bool {
        match self.device {
            CountedDevice::Cuda { cudnn: Some(v) } => {
                cudnn::select::shape_supported(v, shape, bwd).is_ok()
            }
            _ => false,
        }
    }
}

impl Rehearsable for Counted {
    type Storage = NoMemory;

    fn device_name(&self) -> String {
        match self.device {
            CountedDevice::Cpu => "counting cpu-f32".into(),
            CountedDevice::Cuda { .. } => "counting cuda-bf16".into(),
        }
    }
    fn device_ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn op_buffers(&self) -> OpBuffers {
        match self.device {
            CountedDevice::Cpu => OpBuffers::Cpu,
            CountedDevice::Cuda { .. } => OpBuffers::Cuda,
        }
    }
    /// Any dtype, as the devices counted store any (the CPU's narrower
    /// values in f32 cells: `backend::cpu`).
    fn alloc_unwritten(&self, _shape: &[usize], _dtype: DType, _cat: Category) -> Result<NoMemory> {
        Ok(NoMemory)
    }
    /// cuDNN's forward plan workspace counts as 0, inside the room a
    /// forward keeps for it anyway (`cudnn::FWD_PLAN_RESERVE`); the
    /// backward's is `cudnn::estimated_bwd_plan_workspace`.
    fn cudnn_plan_workspace(&self, shape: &cudnn::SdpaShape, bwd: bool) -> Result<Option<usize>> {
        Ok(match (self.on_cudnn(shape, bwd), bwd) {
            (false, _) => None,
            (true, false) => Some(0),
            (true, true) => Some(cudnn::estimated_bwd_plan_workspace(shape)),
        })
    }
    fn flash_bwd(&self, g: &AttnShape) -> Result<bool> {
        Ok(flash::check_supported(g.sq, g.sk, g.hq, g.hkv, g.d, &g.mask).is_ok())
    }
    fn bwd_in_place(&self, s: usize, hq: usize, hkv: usize, d: usize, mask: &AttnMask) -> bool {
        match self.device {
            CountedDevice::Cpu => true,
            CountedDevice::Cuda { .. } => {
                let shape = cudnn::dense_shape(s, s, hq, hkv, d, mask.clone());
                s > 0 && hq > 0 && self.on_cudnn(&shape, true)
            }
        }
    }
}
