//! The precision of a run's linear layers ([`Precision`], `--precision`)
//! and the one GEMM they all call ([`linear_gemm`]): the device's `gemm`
//! under `bf16`, or both operands quantized with their own tensor-wise
//! scales and multiplied by `fp8_gemm` under `fp8`.
//!
//! The recipe under `fp8` (TransformerEngine's "HYBRID"): weights and
//! activations in E4M3, gradients in E5M2, for each of a linear layer's
//! three GEMMs ([`LinearRole`]). Every operand is quantized where the GEMM
//! reads it, as the matrix it reads (`[m, k]` for `a`, `[n, k]` for `b`,
//! so both are K-major, as an FP8 GEMM on Hopper wants them), with the
//! scale of its own largest magnitude.

use super::args::{Fp8Gemm, Fp8Quantize};
use super::format::Fp8Format;
use crate::backend::memory::Category;
use crate::backend::ops::Backend;
use crate::backend::tensor::{DType, Mat, MatMut, Tensor};
use crate::error::{Error, Result};

/// What the linear layers' GEMMs compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// The device's compute dtype (BF16 on a GPU, F32 on the CPU reference).
    #[default]
    Bf16,
    /// FP8 operands (E4M3 weights and activations, E5M2 gradients),
    /// accumulated in f32, outputs in the compute dtype.
    Fp8,
}

impl Precision {
    /// The name a user writes (`bf16`, `fp8`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bf16" => Ok(Precision::Bf16),
            "fp8" => Ok(Precision::Fp8),
            other => Err(Error::Config(format!(
                "--precision {other}: expected bf16 or fp8"
            ))),
        }
    }
}

/// Which of a linear layer's three GEMMs a call is, `Y = X·Wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearRole {
    /// `Y = X·Wᵀ`: `a` the activations, `b` the weight (transposed view).
    Forward,
    /// `dX = dY·W`: `a` the output's gradient, `b` the weight.
    InputGrad,
    /// `dW += dYᵀ·X`: `a` the output's gradient (transposed view), `b`
    /// the activations.
    WeightGrad,
}

impl LinearRole {
    /// The formats of `a` and `b` (gradients E5M2, the rest E4M3).
    pub fn formats(self) -> (Fp8Format, Fp8Format) {
        match self {
            LinearRole::Forward => (Fp8Format::E4M3, Fp8Format::E4M3),
            LinearRole::InputGrad | LinearRole::WeightGrad => (Fp8Format::E5M2, Fp8Format::E4M3),
        }
    }
}

/// One linear layer's GEMM: `c = alpha · a @ b + beta · c`.
pub struct LinearGemm<'a, B: Backend> {
    pub c: MatMut<'a, B>, // [m, n]
    pub a: Mat<'a, B>,    // [m, k]
    pub b: Mat<'a, B>,    // [k, n]
    pub alpha: f32,
    pub beta: f32,
    pub role: LinearRole,
}

impl<'a, B: Backend> LinearGemm<'a, B> {
    /// `c = a @ b` (alpha 1, beta 0) as `role`.
    pub fn new(role: LinearRole, c: MatMut<'a, B>, a: Mat<'a, B>, b: Mat<'a, B>) -> Self {
        LinearGemm {
            c,
            a,
            b,
            alpha: 1.0,
            beta: 0.0,
            role,
        }
    }
    /// `c += a @ b` instead (beta 1).
    pub fn accumulate(self) -> Self {
        LinearGemm { beta: 1.0, ..self }
    }
}

/// Runs `g` in `precision`: `Backend::gemm` under `bf16` (exactly as
/// before FP8 existed); under `fp8`, quantizes `a` and `b` (the transposed
/// view of `b`, so that both are K-major) and runs `Backend::fp8_gemm`.
pub fn linear_gemm<B: Backend>(dev: &B, precision: Precision, g: LinearGemm<'_, B>) -> Result<()> {
    if precision == Precision::Bf16 {
        return dev.gemm(g.c, g.a, g.b, g.alpha, g.beta);
    }
    let (fa, fb) = g.role.formats();
    let (qa, sa) = quantize(dev, g.a, fa)?; // [m, k]
    let (qb, sb) = quantize(dev, g.b.t(), fb)?; // [n, k]
    dev.fp8_gemm(Fp8Gemm {
        c: g.c,
        a: qa.mat(),
        a_scale_inv: &sa,
        b: qb.mat().t(),
        b_scale_inv: &sb,
        alpha: g.alpha,
        beta: g.beta,
    })
}

/// `src` (`[rows, cols]`) quantized to `format` as a dense `[rows, cols]`
/// tensor, and its `[1]` inverse scale (both workspace).
fn quantize<B: Backend>(
    dev: &B,
    src: Mat<'_, B>,
    format: Fp8Format,
) -> Result<(Tensor<B>, Tensor<B>)> {
    let (rows, cols) = (src.l.rows, src.l.cols);
    let mut q = dev.empty(&[rows, cols], DType::of_fp8(format), Category::Workspace)?;
    let mut s = dev.empty(&[1], DType::F32, Category::Workspace)?;
    dev.fp8_quantize(Fp8Quantize {
        src,
        dst: &mut q,
        dst_t: None,
        scale_inv: &mut s,
    })?;
    Ok((q, s))
}
