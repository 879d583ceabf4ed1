//! The memory planner's CUDA device ([`CountedCuda`]): the attention route
//! `CudaBackend` would take under a planned cuDNN version (its limits,
//! `cudnn::select`), with cuDNN's forward plan workspace as 0 and its
//! backward one as estimated, for a
//! [`CountingBackend`](crate::backend::counting::CountingBackend) to
//! allocate what such a GPU's ops allocate (`super::op_buffers`).

use super::op_buffers::{CudaRoute, sdpa_shape};
use super::{cudnn, flash};
use crate::backend::op_buffers::AttnShape;
use crate::error::Result;

/// A CUDA device computing in BF16 with cuDNN `cudnn` (e.g. 91400; `None`:
/// our kernels only, `--attn-kernel native`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountedCuda {
    pub cudnn: Option<usize>,
    /// The passes of the calls cuDNN takes that run its FP8 graphs
    /// (`--precision fp8-attention`, `fp8-attention-bwd`).
    pub fp8_attention: crate::backend::fp8::Fp8Passes,
}

impl CountedCuda {
    /// Whether cuDNN SDPA takes a call of `shape` (`bwd`: the backward).
    fn on_cudnn(&self, shape: &cudnn::SdpaShape, bwd: bool) -> bool {
        self.cudnn
            .is_some_and(|v| cudnn::select::shape_supported(v, shape, bwd).is_ok())
    }
}

impl CudaRoute for CountedCuda {
    /// cuDNN's forward plan workspace counts as 0, inside the room a
    /// forward keeps for it anyway (`cudnn::FWD_PLAN_RESERVE`); the
    /// backward's is `cudnn::estimated_bwd_plan_workspace`.
    fn cudnn_plan_workspace(&self, shape: &cudnn::SdpaShape, bwd: bool) -> Result<Option<usize>> {
        Ok(match (self.on_cudnn(shape, bwd), bwd) {
            (false, _) => None,
            (true, false) => Some(0),
            (true, true) if shape.fp8 => Some(cudnn::estimated_fp8_bwd_plan_workspace(shape)),
            (true, true) => Some(cudnn::estimated_bwd_plan_workspace(shape)),
        })
    }
    fn flash_bwd(&self, g: &AttnShape) -> Result<bool> {
        Ok(flash::check_supported(g.sq, g.sk, g.hq, g.hkv, g.d, &g.mask).is_ok())
    }
    fn bwd_in_place(&self, g: &AttnShape) -> bool {
        g.nonempty() && self.on_cudnn(&sdpa_shape(g), true)
    }
    fn fp8_attention(&self) -> crate::backend::fp8::Fp8Passes {
        self.fp8_attention
    }
}
