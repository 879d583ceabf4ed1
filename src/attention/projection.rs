//! The per-head steps the local and staged engines share around attention
//! itself: projection biases and their gradients, QK norm with RoPE and its
//! backward, and the output projection.

use super::lora_delta;
use super::rope::RopeTables;
use super::weights::AttentionWeights;
use crate::backend::RmsNorm;
use crate::backend::fp8::{LinearGemm, LinearRole, Precision, linear_gemm};
use crate::backend::{Backend, Category, RmsNormBwd, RmsNormFwd, RopeRotate, Tensor};
use crate::error::Result;

/// Adds the bias rows of `heads` (`bias [heads*d]`) to every row of `out`,
/// a `[rows, heads.len()*d]` view of a projection: `out[r, :] += bias[heads]`.
pub(crate) fn add_head_bias<B: Backend>(
    b: &B,
    out: crate::backend::MatMut<'_, B>,
    bias: &Tensor<B>,
    heads: &std::ops::Range<usize>,
    head_dim: usize,
) -> Result<()> {
    let w = heads.len() * head_dim;
    let row = crate::backend::MatLayout::block(heads.start * head_dim, 1, w, w);
    b.add_bias_rows(out, bias.view(row))
}

/// Accumulates the gradient of the bias rows of `heads` (`dbias [heads*d]`,
/// F32) from `dproj`, a `[rows, heads.len()*d]` view of the projection's
/// gradient: `dbias[heads] += Σ_r dproj[r, :]`.
pub(crate) fn head_bias_grad<B: Backend>(
    b: &B,
    dbias: &mut Tensor<B>,
    dproj: crate::backend::Mat<'_, B>,
    heads: &std::ops::Range<usize>,
    head_dim: usize,
) -> Result<()> {
    let w = heads.len() * head_dim;
    let row = crate::backend::MatLayout::block(heads.start * head_dim, 1, w, w);
    b.bias_grad(dbias.view_mut(row), dproj)
}

/// The output projection `y = O·Woᵀ` (plus the o_proj adapter's delta):
/// `o: [s, H, d]` → `y: [s, hidden]` (`Activations`). Forward and a checkpointed block's recompute from a kept
/// O call this one function, so both give the same `y`.
pub fn output_projection<B: Backend>(
    b: &B,
    o: &Tensor<B>,
    w: &AttentionWeights<B>,
    precision: Precision,
) -> Result<Tensor<B>> {
    let wo = &w.wo;
    // [s, hidden]
    let mut y = b.empty(&[o.rows(), wo.rows()], o.dtype(), Category::Activations)?;
    let (c, a, role) = (y.mat_mut(), o.mat(), LinearRole::Forward);
    let g = LinearGemm {
        c,
        a,
        b: wo.mat().t(),
        alpha: 1.0,
        beta: 0.0,
        role,
    };
    linear_gemm(b, precision, g)?;
    lora_delta::add_delta(b, w.lora.o.as_ref(), o.mat(), y.mat_mut())?;
    Ok(y)
}

/// Applies optional per-head RMSNorm then RoPE to `t: [n, heads, d]`.
/// Returns the rotated tensor and, when normalised, the pre-norm input (for backward).
pub(crate) fn norm_rope<B: Backend>(
    b: &B,
    t: Tensor<B>,
    norm: Option<&Tensor<B>>,
    eps: RmsNorm,
    rope: &RopeTables<B>,
    keep_raw: bool,
) -> Result<(Tensor<B>, Option<Tensor<B>>)> {
    let (mut out, raw) = match norm {
        Some(w) => {
            let mut y = b.empty(t.shape(), t.dtype(), Category::Workspace)?;
            b.rms_norm_fwd(RmsNormFwd {
                x: &t,
                w,
                norm: eps,
                y: &mut y,
            })?;
            (y, if keep_raw { Some(t) } else { None })
        }
        None => (t, None),
    };
    b.rope(RopeRotate {
        x: &mut out,
        cos: &rope.cos,
        sin: &rope.sin,
        inverse: false,
    })?;
    Ok((out, raw))
}

/// Backward of [`norm_rope`]: turns `d_out` (gradient w.r.t. the rotated
/// tensor) into the gradient w.r.t. its input, accumulating the norm weight's
/// gradient (`norm`: the weight and its gradient, `None` when frozen).
pub(crate) fn norm_rope_bwd<B: Backend>(
    b: &B,
    mut d_out: Tensor<B>,
    raw: Option<&Tensor<B>>,
    norm: Option<(&Tensor<B>, Option<&mut Tensor<B>>)>,
    eps: RmsNorm,
    rope: &RopeTables<B>,
) -> Result<Tensor<B>> {
    b.rope(RopeRotate {
        x: &mut d_out,
        cos: &rope.cos,
        sin: &rope.sin,
        inverse: true,
    })?;
    match (norm, raw) {
        (Some((w, dw)), Some(raw)) => {
            let mut dx = b.empty(d_out.shape(), d_out.dtype(), Category::Workspace)?;
            b.rms_norm_bwd(RmsNormBwd {
                x: raw,
                w,
                dy: &d_out,
                norm: eps,
                dx: &mut dx,
                dw,
            })?;
            Ok(dx)
        }
        _ => Ok(d_out),
    }
}
