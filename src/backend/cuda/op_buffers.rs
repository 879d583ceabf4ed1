//! The buffers a CUDA device's ops take for themselves ([`OpBuffers`]), as
//! `CudaBackend`'s ops take them: the cuBLASLt workspace at the first
//! GEMM, token ids uploaded for the embedding and the loss, `sum_squares`'
//! f64 accumulator, and attention's buffers on the route the device takes
//! (cuDNN SDPA with its plan's workspace, or our kernels with their F32
//! scratch, kept mask bounds and the flash backward's workspace).
//!
//! The route is the one thing two CUDA devices may decide differently: a
//! real GPU asks its cuDNN (`super::rehearsal`), the planner's counted GPU
//! a planned cuDNN version's limits and estimates (`super::counted`). Each
//! implements [`CudaRoute`]; the rules here hold for both.

use super::{cudnn, flash, gemm};
use crate::backend::op_buffers::{AttnBuffers, AttnBwdDtypes, AttnShape, KeptWorkspace};
use crate::backend::{AttnMask, DType, OpBuffers};
use crate::error::{Error, Result};

/// How a CUDA device routes attention.
pub trait CudaRoute: Send + Sync {
    /// `Some(plan workspace bytes)` when the device runs an attention call
    /// of `shape` (`bwd`: the backward) on cuDNN SDPA, `None` for our
    /// kernels; an error when cuDNN was demanded and cannot serve.
    fn cudnn_plan_workspace(&self, shape: &cudnn::SdpaShape, bwd: bool) -> Result<Option<usize>>;
    /// Whether the flash kernels run a (non-empty, BF16) attention backward
    /// of this geometry.
    fn flash_bwd(&self, g: &AttnShape) -> Result<bool>;
    /// As [`Backend::attention_bwd_in_place`](crate::backend::Backend::attention_bwd_in_place).
    fn bwd_in_place(&self, g: &AttnShape) -> bool;
    /// Which passes of the calls cuDNN takes run its FP8 graphs
    /// (`--precision fp8-attention`, `fp8-attention-bwd`).
    fn fp8_attention(&self) -> crate::backend::fp8::Fp8Passes {
        crate::backend::fp8::Fp8Passes::default()
    }
}

/// The call as cuDNN SDPA sees it.
pub fn sdpa_shape(g: &AttnShape) -> cudnn::SdpaShape {
    cudnn::dense_shape(g.sq, g.sk, g.hq, g.hkv, g.d, g.mask.clone())
}

impl<R: CudaRoute> OpBuffers for R {
    fn compute_dtype(&self) -> DType {
        DType::BF16
    }
    /// cuBLASLt's rule: a and b share a dtype, c is F32 or that dtype.
    fn gemm_workspace(&self, a: DType, b: DType, c: DType) -> Result<Option<usize>> {
        if b != a || (c != DType::F32 && c != a) {
            return Err(Error::Backend(format!(
                "gemm: a {a:?}, b {b:?}, c {c:?}; a and b must share a dtype and c be F32 or that \
                 dtype"
            )));
        }
        Ok(Some(gemm::WORKSPACE_BYTES))
    }
    /// cuBLASLt's workspace, the one `gemm` keeps.
    fn fp8_gemm_workspace(&self) -> Result<Option<usize>> {
        Ok(Some(gemm::WORKSPACE_BYTES))
    }
    fn uploads_ids(&self) -> bool {
        true
    }
    /// One f64 on the device.
    fn sum_squares_scratch(&self) -> usize {
        2
    }
    /// cuDNN's kept workspace grown to the forward's need; on our kernels a
    /// documents mask's key bounds.
    fn attention_fwd(&self, g: &AttnShape, bf16: bool) -> Result<AttnBuffers> {
        if self.fp8_attention().forward && g.nonempty() {
            return fp8_buffers(self, g, false);
        }
        let plan = match bf16 && g.sq > 0 && g.hq > 0 {
            true => self.cudnn_plan_workspace(&sdpa_shape(g), false)?,
            false => None,
        };
        Ok(match plan {
            Some(plan_ws) => AttnBuffers {
                kept_workspace: Some(kept(cudnn::fwd_workspace_bytes(&sdpa_shape(g), plan_ws))),
                ..AttnBuffers::default()
            },
            None => AttnBuffers {
                mask_bounds: keeps_bounds(g),
                ..AttnBuffers::default()
            },
        })
    }
    fn attention_bwd(&self, g: &AttnShape, dt: &AttnBwdDtypes) -> Result<AttnBuffers> {
        if self.fp8_attention().backward && g.nonempty() {
            return fp8_buffers(self, g, true);
        }
        let on_cudnn = dt.inputs == [DType::BF16; 3] && dt.grads[1] == dt.grads[2] && g.nonempty();
        let plan = match on_cudnn {
            true => self.cudnn_plan_workspace(&sdpa_shape(g), true)?,
            false => None,
        };
        match plan {
            Some(plan_ws) => Ok(cudnn_bwd(g, dt, plan_ws)),
            None => native_bwd(self, g, dt),
        }
    }
    fn bwd_in_place(&self, g: &AttnShape) -> bool {
        CudaRoute::bwd_in_place(self, g)
    }
}

/// An FP8 call on cuDNN (`super::attention_fp8`): its scratch, and the
/// kept workspace grown to its FP8 plan's workspace; an error for a call
/// cuDNN's FP8 graphs do not take, as the device refuses it.
fn fp8_buffers(route: &impl CudaRoute, g: &AttnShape, bwd: bool) -> Result<AttnBuffers> {
    let shape = cudnn::SdpaShape {
        fp8: true,
        ..sdpa_shape(g)
    };
    let plan_ws = route.cudnn_plan_workspace(&shape, bwd)?.ok_or_else(|| {
        Error::Backend(format!(
            "FP8 attention: cuDNN does not take a call of sq {} sk {} hq {} hkv {} d {}",
            g.sq, g.sk, g.hq, g.hkv, g.d
        ))
    })?;
    // a forward keeps the room a BF16 one keeps for its plan
    let need = if bwd {
        plan_ws
    } else {
        cudnn::fwd_workspace_bytes(&shape, plan_ws)
    };
    Ok(AttnBuffers {
        scratch: super::attention_fp8::fp8_scratch(&shape, bwd),
        kept_workspace: Some(kept(need)),
        ..AttnBuffers::default()
    })
}

/// The kept workspace grown to `need` bytes.
fn kept(need: usize) -> KeptWorkspace {
    KeptWorkspace {
        need,
        bytes: cudnn::kept_workspace_bytes(need),
    }
}

/// Whether our kernels keep the call's key bounds: a documents mask over
/// some rows.
fn keeps_bounds(g: &AttnShape) -> bool {
    matches!(g.mask, AttnMask::Bounded(_)) && g.sq > 0
}

/// Elements of dQ, dK and dV.
fn grad_elems(g: &AttnShape) -> [usize; 3] {
    let kv = g.sk * g.hkv * g.d;
    [g.sq * g.hq * g.d, kv, kv]
}

/// On cuDNN: BF16 scratch for each gradient it does not write in place,
/// and the kept workspace grown to the plan's workspace (`plan_ws`), dQ
/// accumulator and sums.
fn cudnn_bwd(g: &AttnShape, dt: &AttnBwdDtypes, plan_ws: usize) -> AttnBuffers {
    let writes = [dt.writes.dq, dt.writes.dkv, dt.writes.dkv];
    let scratch = (0..3)
        .filter(|&i| !cudnn::bwd_writes_in_place(writes[i], dt.grads[i]))
        .map(|i| (grad_elems(g)[i], DType::BF16))
        .collect();
    AttnBuffers {
        scratch,
        kept_workspace: Some(kept(cudnn::bwd_workspace_bytes(&sdpa_shape(g), plan_ws))),
        ..AttnBuffers::default()
    }
}

/// On our kernels: F32 scratch for each gradient of another dtype, the
/// kept mask bounds, and the flash backward's transient workspace when the
/// flash kernels take the geometry.
fn native_bwd(route: &impl CudaRoute, g: &AttnShape, dt: &AttnBwdDtypes) -> Result<AttnBuffers> {
    let scratch = (0..3)
        .filter(|&i| dt.grads[i] != DType::F32)
        .map(|i| (grad_elems(g)[i], DType::F32))
        .collect();
    let flash = g.nonempty() && route.flash_bwd(g)?;
    Ok(AttnBuffers {
        scratch,
        kept_workspace: None,
        mask_bounds: keeps_bounds(g),
        transient_bytes: flash.then(|| flash::flash_bwd_workspace_bytes(g.sq, g.hq)),
    })
}
