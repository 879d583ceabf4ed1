//! A LoRA adapter's part of a linear layer on device tensors, never merged
//! into the weight: forward `y += scale · (x·Aᵀ)·Bᵀ` and its backward
//! (`dA`, `dB` accumulated, the adapter's `dx` added), as GEMMs of the
//! backend. It lives here, below the decoder, because the attention
//! strategies run the q/k/v/o projections; the decoder's MLP uses it too.
//! The host f32 reference it must equal is `model/lora_math.rs`; shapes
//! follow PEFT (`A` `[r, in]`, `B` `[out, r]`).

use crate::backend::{Backend, Category, DType, MatLayout, Tensor};
use crate::error::{Error, Result};

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

/// Checks that `x` `[s, in]` and `y` `[s, out]` fit `pair`.
fn check_shapes<B: Backend>(pair: &LoraPair<B>, x: &Tensor<B>, y: &Tensor<B>) -> Result<()> {
    let (_, n_in, n_out) = pair.dims();
    if x.row_len() != n_in || y.row_len() != n_out || x.rows() != y.rows() {
        return Err(Error::Backend(format!(
            "LoRA delta: x {:?} and y {:?} do not fit A {:?}, B {:?} (x [s, in], y [s, out])",
            x.shape(),
            y.shape(),
            pair.a.shape(),
            pair.b.shape()
        )));
    }
    Ok(())
}

/// `h = x·Aᵀ` `[s, r]`, in `x`'s dtype (a transient buffer).
fn down<B: Backend>(dev: &B, pair: &LoraPair<B>, x: &Tensor<B>) -> Result<Tensor<B>> {
    let r = pair.a.shape()[0];
    let mut h = dev.empty(&[x.rows(), r], x.dtype(), Category::Workspace)?;
    dev.gemm(h.mat_mut(), x.mat(), pair.a.mat().t(), 1.0, 0.0)?;
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
    check_shapes(pair, x, y)?;
    let h = down(dev, pair, x)?; // [s, r]
    dev.gemm(y.mat_mut(), h.mat(), pair.b.mat().t(), pair.scale, 1.0)
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
    check_shapes(pair, x, dy)?;
    check_shapes(pair, dx, dy)?;
    let r = pair.a.shape()[0];
    let h = down(dev, pair, x)?; // [s, r]
    let scale = pair.scale;
    dev.gemm(grads.db.mat_mut(), dy.mat().t(), h.mat(), scale, 1.0)?;
    drop(h);
    let mut g = dev.empty(&[x.rows(), r], x.dtype(), Category::Workspace)?; // [s, r]
    dev.gemm(g.mat_mut(), dy.mat(), pair.b.mat(), scale, 0.0)?;
    dev.gemm(grads.da.mat_mut(), g.mat().t(), x.mat(), 1.0, 1.0)?;
    let full = MatLayout::row_major(dx.rows(), dx.row_len());
    dev.gemm(dx.view_mut(full), g.mat(), pair.a.mat(), 1.0, 1.0)
}
