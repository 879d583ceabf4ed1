//! A LoRA adapter's part of a linear layer on device tensors, never merged
//! into the weight: forward `y += scale · (x·Aᵀ)·Bᵀ` and its backward
//! (`dA`, `dB` accumulated, the adapter's `dx` added), as GEMMs of the
//! backend. It lives here, below the decoder, because the attention
//! strategies run the q/k/v/o projections; the decoder's MLP uses it too.
//! A [`DeltaPart`] restricts both to the input columns of `A` and output
//! rows of `B` one attention stage owns (`lora_math::head_slice`). The host
//! f32 reference they must equal is `model/lora_math.rs`; shapes follow
//! PEFT (`A` `[r, in]`, `B` `[out, r]`).

use crate::backend::{Backend, Category, DType, Mat, MatLayout, MatMut, Tensor};
use crate::error::{Error, Result};
use std::ops::Range;

/// One adapter's factors on the device, in the weight dtype.
pub struct LoraPair<B: Backend> {
    /// `lora_A` `[r, in]`.
    pub a: Tensor<B>,
    /// `lora_B` `[out, r]`.
    pub b: Tensor<B>,
    /// `alpha / r` (rsLoRA: `alpha / √r`).
    pub scale: f32,
}

/// The F32 gradients of a [`LoraPair`], accumulated (`+=`) by
/// [`lora_delta_bwd`] like every weight gradient of a step.
pub struct LoraPairGrads<B: Backend> {
    /// `[r, in]`.
    pub da: Tensor<B>,
    /// `[out, r]`.
    pub db: Tensor<B>,
}

impl<B: Backend> LoraPair<B> {
    /// Uploads host factors `a` `[r, in]` and `b` `[out, r]` in `dtype`
    /// (ledger category `Weights`).
    pub fn upload(
        dev: &B,
        a: &[f32],
        b: &[f32],
        shapes: [[usize; 2]; 2],
        dtype: DType,
        scale: f32,
    ) -> Result<LoraPair<B>> {
        Ok(LoraPair {
            a: dev.from_host(a, &shapes[0], dtype, Category::Weights)?,
            b: dev.from_host(b, &shapes[1], dtype, Category::Weights)?,
            scale,
        })
    }

    /// `(rank, in_features, out_features)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.a.shape()[0], self.a.shape()[1], self.b.shape()[0])
    }
}

impl<B: Backend> LoraPairGrads<B> {
    /// Zero F32 gradients shaped like `pair` (ledger category `Grads`).
    pub fn zeros(dev: &B, pair: &LoraPair<B>) -> Result<LoraPairGrads<B>> {
        Ok(LoraPairGrads {
            da: dev.zeros(pair.a.shape(), DType::F32, Category::Grads)?,
            db: dev.zeros(pair.b.shape(), DType::F32, Category::Grads)?,
        })
    }
}

/// The input columns (of `A`) and output rows (of `B`) a computation
/// touches: the whole adapter, a head range's rows of `B` (q/k/v), or a
/// head range's columns of `A` (o_proj), as `lora_math::HeadSlice` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaPart {
    pub cols: Range<usize>,
    pub rows: Range<usize>,
}

impl DeltaPart {
    /// Every column and row of `pair`.
    pub fn whole<B: Backend>(pair: &LoraPair<B>) -> DeltaPart {
        let (_, n_in, n_out) = pair.dims();
        DeltaPart {
            cols: 0..n_in,
            rows: 0..n_out,
        }
    }

    /// Every input column of `n_in` and output `rows` (a head range's rows
    /// of q/k/v).
    pub fn out_rows(n_in: usize, rows: Range<usize>) -> DeltaPart {
        DeltaPart {
            cols: 0..n_in,
            rows,
        }
    }

    /// Input `cols` (a head range's columns of o_proj) and every output row of `n_out`.
    pub fn in_cols(cols: Range<usize>, n_out: usize) -> DeltaPart {
        DeltaPart {
            cols,
            rows: 0..n_out,
        }
    }

    /// `A[:, cols]` `[r, cols]` inside `A` `[r, in]`.
    fn a_view(&self, r: usize, n_in: usize) -> MatLayout {
        MatLayout::block(self.cols.start, r, self.cols.len(), n_in)
    }

    /// `B[rows]` `[rows, r]` inside `B` `[out, r]`.
    fn b_view(&self, r: usize) -> MatLayout {
        MatLayout::block(self.rows.start * r, self.rows.len(), r, r)
    }
}

/// Checks that `part` lies in `pair` and that `x` `[s, cols]` and `y`
/// `[s, rows]` fit it.
fn check_shapes<B: Backend>(
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: &MatLayout,
    y: &MatLayout,
) -> Result<()> {
    let (_, n_in, n_out) = pair.dims();
    let inside = part.cols.end <= n_in && part.rows.end <= n_out;
    let fits = x.cols == part.cols.len() && y.cols == part.rows.len();
    if !inside || !fits || x.rows != y.rows {
        return Err(Error::Backend(format!(
            "LoRA delta: x [{}, {}] and y [{}, {}] do not fit columns {:?} of A {:?} and \
             rows {:?} of B {:?} (x [s, cols], y [s, rows])",
            x.rows,
            x.cols,
            y.rows,
            y.cols,
            part.cols,
            pair.a.shape(),
            part.rows,
            pair.b.shape()
        )));
    }
    Ok(())
}

/// `h = x·A[:, cols]ᵀ` `[s, r]`, in `x`'s dtype (a transient buffer).
fn down<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: Mat<'_, B>,
) -> Result<Tensor<B>> {
    let (r, n_in, _) = pair.dims();
    let mut h = dev.empty(&[x.l.rows, r], x.t.dtype(), Category::Workspace)?;
    let a = pair.a.view(part.a_view(r, n_in));
    dev.gemm(h.mat_mut(), x, a.t(), 1.0, 0.0)?;
    Ok(h)
}

/// Forward: `y += scale · (x·Aᵀ)·Bᵀ` for `x` `[s, in]`, `y` `[s, out]`
/// (the base layer's `x·Wᵀ` already in `y`).
pub fn lora_delta_fwd<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    x: &Tensor<B>,
    y: &mut Tensor<B>,
) -> Result<()> {
    lora_delta_fwd_mat(dev, pair, &DeltaPart::whole(pair), x.mat(), y.mat_mut())
}

/// [`lora_delta_fwd`] on `part`: `y` `[s, rows] += scale ·
/// (x·A[:, cols]ᵀ)·B[rows]ᵀ` for `x` `[s, cols]` (for o_proj's columns
/// a partial sum over the head ranges).
pub fn lora_delta_fwd_part<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: &Tensor<B>,
    y: &mut Tensor<B>,
) -> Result<()> {
    lora_delta_fwd_mat(dev, pair, part, x.mat(), y.mat_mut())
}

/// [`lora_delta_fwd_part`] on matrix views (a tile's rows of a larger
/// output, a head range's columns).
pub fn lora_delta_fwd_mat<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: Mat<'_, B>,
    y: MatMut<'_, B>,
) -> Result<()> {
    check_shapes(pair, part, &x.l, &y.l)?;
    let r = pair.dims().0;
    let h = down(dev, pair, part, x)?; // [s, r]
    let b = pair.b.view(part.b_view(r));
    dev.gemm(y, h.mat(), b.t(), pair.scale, 1.0)
}

/// Backward of [`lora_delta_fwd`] given `dy` `[s, out]`: with
/// `h = x·Aᵀ` and `g = scale · dy·B` (both `[s, r]`),
/// `dB += scale · dyᵀ·h`, `dA += gᵀ·x`, and `dx += g·A` (`dx` `[s, in]`
/// already holds the base layer's `dy·W`).
pub fn lora_delta_bwd<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    x: &Tensor<B>,
    dy: &Tensor<B>,
    grads: &mut LoraPairGrads<B>,
    dx: &mut Tensor<B>,
) -> Result<()> {
    let part = DeltaPart::whole(pair);
    lora_delta_bwd_mat(dev, pair, &part, x.mat(), dy.mat(), grads, dx.mat_mut())
}

/// [`lora_delta_bwd`] on `part` (`x`, `dx` `[s, cols]`, `dy` `[s, rows]`):
/// `dB[rows] += scale · dyᵀ·h`, `dA[:, cols] += gᵀ·x`, `dx += g·A[:, cols]`
/// with `h = x·A[:, cols]ᵀ`, `g = scale · dy·B[rows]`. Summed over the
/// parts of an adapter, these are [`lora_delta_bwd`]'s.
pub fn lora_delta_bwd_part<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: &Tensor<B>,
    dy: &Tensor<B>,
    grads: &mut LoraPairGrads<B>,
    dx: &mut Tensor<B>,
) -> Result<()> {
    lora_delta_bwd_mat(dev, pair, part, x.mat(), dy.mat(), grads, dx.mat_mut())
}

/// [`lora_delta_bwd_part`] on matrix views.
pub fn lora_delta_bwd_mat<B: Backend>(
    dev: &B,
    pair: &LoraPair<B>,
    part: &DeltaPart,
    x: Mat<'_, B>,
    dy: Mat<'_, B>,
    grads: &mut LoraPairGrads<B>,
    dx: MatMut<'_, B>,
) -> Result<()> {
    check_shapes(pair, part, &x.l, &dy.l)?;
    check_shapes(pair, part, &dx.l, &dy.l)?;
    let (r, n_in, _) = pair.dims();
    let (a_view, b_view) = (part.a_view(r, n_in), part.b_view(r));
    let h = down(dev, pair, part, x)?; // [s, r]
    let scale = pair.scale;
    dev.gemm(grads.db.view_mut(b_view), dy.t(), h.mat(), scale, 1.0)?;
    drop(h);
    let mut g = dev.empty(&[x.l.rows, r], x.t.dtype(), Category::Workspace)?; // [s, r]
    dev.gemm(g.mat_mut(), dy, pair.b.view(b_view), scale, 0.0)?;
    dev.gemm(grads.da.view_mut(a_view), g.mat().t(), x, 1.0, 1.0)?;
    dev.gemm(dx, g.mat(), pair.a.view(a_view), 1.0, 1.0)
}

/// A block's attention adapters by projection (`None`: not adapted): the
/// factors ([`LoraPair`]) in the weights, their gradients
/// ([`LoraPairGrads`]) in the gradients.
pub struct AttnAdapters<P> {
    pub q: Option<P>,
    pub k: Option<P>,
    pub v: Option<P>,
    pub o: Option<P>,
}

impl<P> Default for AttnAdapters<P> {
    fn default() -> Self {
        AttnAdapters {
            q: None,
            k: None,
            v: None,
            o: None,
        }
    }
}

impl<P> AttnAdapters<P> {
    /// Whether any projection is adapted.
    pub fn any(&self) -> bool {
        self.q.is_some() || self.k.is_some() || self.v.is_some() || self.o.is_some()
    }
}

/// `y += ` the adapter's delta when `pair` is present (the whole adapter).
pub fn add_delta<B: Backend>(
    dev: &B,
    pair: Option<&LoraPair<B>>,
    x: Mat<'_, B>,
    y: MatMut<'_, B>,
) -> Result<()> {
    match pair {
        Some(p) => lora_delta_fwd_mat(dev, p, &DeltaPart::whole(p), x, y),
        None => Ok(()),
    }
}

/// The adapter's backward when `pair` is present and trained: `dA`, `dB`
/// into `grads`, its input gradient added to `dx`.
pub fn add_delta_bwd<B: Backend>(
    dev: &B,
    pair: Option<&LoraPair<B>>,
    grads: Option<&mut LoraPairGrads<B>>,
    x: Mat<'_, B>,
    dy: Mat<'_, B>,
    dx: MatMut<'_, B>,
) -> Result<()> {
    match (pair, grads) {
        (Some(p), Some(g)) => lora_delta_bwd_mat(dev, p, &DeltaPart::whole(p), x, dy, g, dx),
        (None, None) => Ok(()),
        _ => Err(Error::Backend(
            "LoRA: an adapter and its gradients must come together".into(),
        )),
    }
}
