//! `CudaBackend` under a [`Rehearsal`](crate::backend::rehearsal::Rehearsal):
//! its allocator (the stream-ordered pool, pinned host memory for
//! `Category::Offload`) and the route its attention ops take (cuDNN or
//! our kernels, cuDNN's plan and its workspace, the flash backward), so a
//! rehearsal allocates what a real step on this GPU allocates.

use super::backend::CudaBackend;
use super::op_buffers::CudaRoute;
use super::{cudnn, flash};
use crate::backend::rehearsal::{AttnShape, OpBuffers, Rehearsable};
use crate::backend::{Backend, Category, DType, MemoryLedger, PoolReport};
use crate::error::Result;
use std::sync::Arc;

impl Rehearsable for CudaBackend {
    type Storage = super::pool::CudaStorage;

    fn device_name(&self) -> String {
        self.name.clone()
    }
    fn device_ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn op_buffers(&self) -> &dyn OpBuffers {
        self
    }
    fn alloc_unwritten(
        &self,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Self::Storage> {
        self.bind()?;
        self.storage(shape, dtype, cat)
    }
    fn device_pool_report(&self) -> Result<Option<PoolReport>> {
        self.pool_report()
    }
}

impl CudaRoute for CudaBackend {
    /// The route `attention_fwd`/`attention_bwd` take (`cudnn_for`: the
    /// kernel choice, cuDNN's limits and availability), and then the
    /// workspace of the plan cuDNN builds for the call.
    fn cudnn_plan_workspace(&self, shape: &cudnn::SdpaShape, bwd: bool) -> Result<Option<usize>> {
        match self.cudnn_for(shape, bwd)? {
            Some(c) => c.plan_workspace(shape, bwd).map(Some),
            None => Ok(None),
        }
    }
    /// Our backward runs on the flash kernels where they are loaded and
    /// take the geometry (`attention::flash_bwd_unsupported`; the engine's
    /// views are aligned).
    fn flash_bwd(&self, g: &AttnShape) -> Result<bool> {
        Ok(self.flash_functions()?.is_some()
            && flash::check_supported(g.sq, g.sk, g.hq, g.hkv, g.d, &g.mask).is_ok())
    }
    fn bwd_in_place(&self, g: &AttnShape) -> bool {
        self.attention_bwd_in_place(g)
    }
    fn fp8_attention(&self) -> crate::backend::fp8::Fp8Passes {
        self.attn_fp8
    }
}
