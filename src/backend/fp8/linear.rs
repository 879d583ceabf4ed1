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
use super::attention::Fp8Passes;
use super::format::Fp8Format;
use crate::backend::memory::Category;
use crate::backend::ops::Backend;
use crate::backend::tensor::{DType, Mat, MatLayout, MatMut, Tensor};
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
    /// `Fp8`, and attention on cuDNN's FP8 graphs too (Q, K, V, O in E4M3,
    /// dO and the gradients in E5M2; `backend::fp8::attention`): Hopper,
    /// head dim 128, no documents or sliding windows.
    Fp8Attention,
    /// `Fp8Attention` in the backward only: the forward stays BF16 (FP8's
    /// rounding of O costs the loss more than the gradients' does).
    Fp8AttentionBwd,
}

impl Precision {
    /// The name a user writes (`bf16`, `fp8`, `fp8-attention`,
    /// `fp8-attention-bwd`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
            Precision::Fp8Attention => "fp8-attention",
            Precision::Fp8AttentionBwd => "fp8-attention-bwd",
        }
    }

    /// Whether the linear layers' GEMMs run on FP8 operands.
    pub fn fp8_linear(self) -> bool {
        self != Precision::Bf16
    }

    /// Which of attention's passes run on cuDNN's FP8 graphs.
    pub fn fp8_attention(self) -> Fp8Passes {
        Fp8Passes {
            forward: self == Precision::Fp8Attention,
            backward: matches!(self, Precision::Fp8Attention | Precision::Fp8AttentionBwd),
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
            "fp8-attention" => Ok(Precision::Fp8Attention),
            "fp8-attention-bwd" => Ok(Precision::Fp8AttentionBwd),
            other => Err(Error::Config(format!(
                "--precision {other}: expected bf16, fp8, fp8-attention or fp8-attention-bwd"
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

/// A GEMM operand quantized once for every GEMM that reads it (a block's
/// input, read by q, k and v in every stage and by their weight gradients;
/// the MLP's normed input, read by gate and up; an output's gradient, read
/// by its input-gradient GEMM as it is and by its weight gradient
/// transposed): the codes of the `[rows, cols]` matrix quantized, where
/// asked the codes of its transpose `[cols, rows]` too, and their one `[1]`
/// inverse scale.
pub struct Fp8Operand<B: Backend> {
    codes: Tensor<B>,           // [rows, cols]
    codes_t: Option<Tensor<B>>, // [cols, rows]
    scale_inv: Tensor<B>,       // [1]
}

impl<B: Backend> Fp8Operand<B> {
    /// `x` (`[rows, cols]`, any view) quantized to `format` under `fp8`
    /// (workspace, held until dropped); nothing under `bf16`.
    pub fn of(
        dev: &B,
        precision: Precision,
        x: Mat<'_, B>,
        format: Fp8Format,
    ) -> Result<Option<Self>> {
        Self::both(dev, precision, x, format, false)
    }

    /// [`Fp8Operand::of`] in both layouts from one read of `x`, where
    /// `transposed_too` (else as `of`): the codes of `x` and of `xᵀ` under
    /// the one scale of `x`, so each equals quantizing that layout alone.
    pub fn both(
        dev: &B,
        precision: Precision,
        x: Mat<'_, B>,
        format: Fp8Format,
        transposed_too: bool,
    ) -> Result<Option<Self>> {
        match precision.fp8_linear() {
            false => Ok(None),
            true => Self::new(dev, x, format, transposed_too).map(Some),
        }
    }

    /// The codes of `x` (and of `xᵀ` where `transposed_too`) in `format`.
    fn new(dev: &B, x: Mat<'_, B>, format: Fp8Format, transposed_too: bool) -> Result<Self> {
        let (rows, cols) = (x.l.rows, x.l.cols);
        let dtype = DType::of_fp8(format);
        let mut codes = dev.empty(&[rows, cols], dtype, Category::Workspace)?;
        let mut codes_t = match transposed_too {
            true => Some(dev.empty(&[cols, rows], dtype, Category::Workspace)?),
            false => None,
        };
        let mut scale_inv = dev.empty(&[1], DType::F32, Category::Workspace)?;
        dev.fp8_quantize(Fp8Quantize {
            src: x,
            dst: &mut codes,
            dst_t: codes_t.as_mut(),
            scale_inv: &mut scale_inv,
        })?;
        Ok(Fp8Operand {
            codes,
            codes_t,
            scale_inv,
        })
    }

    /// The codes of the matrix quantized, `[rows, cols]`.
    pub fn codes(&self) -> Fp8Ref<'_, B> {
        Fp8Ref {
            codes: self.codes.mat(),
            scale_inv: &self.scale_inv,
        }
    }

    /// The codes of its transpose, `[cols, rows]` (quantized by `both`).
    pub fn codes_t(&self) -> Option<Fp8Ref<'_, B>> {
        let t = self.codes_t.as_ref()?;
        Some(Fp8Ref {
            codes: t.mat(),
            scale_inv: &self.scale_inv,
        })
    }

    /// Frees the transpose's codes (its last reader has run).
    pub fn drop_codes_t(&mut self) {
        self.codes_t = None;
    }

    /// Rows `r` of the transpose's codes: the weight-gradient operand of
    /// columns `r` of the matrix quantized, under the whole matrix's scale.
    pub fn codes_t_rows(&self, r: std::ops::Range<usize>) -> Option<Fp8Ref<'_, B>> {
        let t = self.codes_t.as_ref()?;
        let n = t.row_len();
        Some(Fp8Ref {
            codes: t.view(MatLayout::block(r.start * n, r.len(), n, n)),
            scale_inv: &self.scale_inv,
        })
    }
}

/// Codes a GEMM reads as one operand (`[rows, k]`, row-major: K-major)
/// and their `[1]` inverse scale.
pub struct Fp8Ref<'a, B: Backend> {
    codes: Mat<'a, B>,
    scale_inv: &'a Tensor<B>,
}

impl<B: Backend> Clone for Fp8Ref<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Fp8Ref<'_, B> {}

impl<'a, B: Backend> Fp8Ref<'a, B> {
    /// These codes, where they stand for `x` in `format`.
    fn stands_for(self, x: Mat<'_, B>, format: Fp8Format) -> Result<(Mat<'a, B>, &'a Tensor<B>)> {
        let (l, want) = (self.codes.l, [x.l.rows, x.l.cols]);
        if [l.rows, l.cols] != want || l.trans || self.codes.t.dtype() != DType::of_fp8(format) {
            return Err(Error::Backend(format!(
                "a quantized operand of shape {:?} in {:?} read as {want:?} in {format:?}",
                [l.rows, l.cols],
                self.codes.t.dtype()
            )));
        }
        Ok((self.codes, self.scale_inv))
    }
}

/// Operands of a [`LinearGemm`] quantized beforehand ([`Fp8Operand`]):
/// `a` as `[m, k]`, `b` as its transpose `[n, k]`. Read under `fp8` only.
pub struct Quantized<'a, B: Backend> {
    pub a: Option<Fp8Ref<'a, B>>,
    pub b: Option<Fp8Ref<'a, B>>,
}

/// A linear layer's output gradient `dy` (`[m, n]` of `Y = X·Wᵀ`) and the
/// two GEMMs that read it: the weight gradient `dW += dyᵀ·X` and the input
/// gradient `dX = dy·W`. Under fp8 `dy` is quantized once, in both layouts
/// where a weight gradient is asked for.
pub struct OutputGrad<'a, B: Backend> {
    dy: Mat<'a, B>,
    dy8: Option<Fp8Operand<B>>,
    precision: Precision,
}

impl<'a, B: Backend> OutputGrad<'a, B> {
    /// `dy`, quantized under fp8 (transposed too where `weight_grad`).
    pub fn new(dev: &B, precision: Precision, dy: Mat<'a, B>, weight_grad: bool) -> Result<Self> {
        let dy8 = Fp8Operand::both(dev, precision, dy, Fp8Format::E5M2, weight_grad)?;
        Ok(OutputGrad { dy, dy8, precision })
    }

    /// `dy`'s codes as the input gradient reads them (under fp8).
    pub fn codes(&self) -> Option<Fp8Ref<'_, B>> {
        self.dy8.as_ref().map(Fp8Operand::codes)
    }

    /// Frees the transposed codes once the weight gradient has run.
    pub fn weight_grad_done(&mut self) {
        if let Some(dy8) = self.dy8.as_mut() {
            dy8.drop_codes_t();
        }
    }

    /// `dw += dyᵀ·x` (`dw` `[n, k]`, `x` `[m, k]`), with `xᵀ`'s codes
    /// where they were quantized beforehand.
    pub fn weight_grad(
        &self,
        dev: &B,
        dw: MatMut<'_, B>,
        (x, xt8): (Mat<'_, B>, Option<Fp8Ref<'_, B>>),
    ) -> Result<()> {
        let g = LinearGemm::new(LinearRole::WeightGrad, dw, self.dy.t(), x).accumulate();
        let pre = Quantized {
            a: self.dy8.as_ref().and_then(Fp8Operand::codes_t),
            b: xt8,
        };
        linear_gemm_quantized(dev, self.precision, g, pre)
    }

    /// `dx = dy·w + beta·dx` (`w` `[n, k]`), with `wᵀ`'s codes where they
    /// were quantized beforehand.
    pub fn input_grad(
        &self,
        dev: &B,
        (dx, beta): (MatMut<'_, B>, f32),
        (w, wt8): (Mat<'_, B>, Option<Fp8Ref<'_, B>>),
    ) -> Result<()> {
        let g = LinearGemm {
            beta,
            ..LinearGemm::new(LinearRole::InputGrad, dx, self.dy, w)
        };
        let pre = Quantized {
            a: self.dy8.as_ref().map(Fp8Operand::codes),
            b: wt8,
        };
        linear_gemm_quantized(dev, self.precision, g, pre)
    }
}

/// Runs `g` in `precision`: `Backend::gemm` under `bf16` (exactly as
/// before FP8 existed); under `fp8`, quantizes `a` and `b` (the transposed
/// view of `b`, so that both are K-major) and runs `Backend::fp8_gemm`.
pub fn linear_gemm<B: Backend>(dev: &B, precision: Precision, g: LinearGemm<'_, B>) -> Result<()> {
    linear_gemm_quantized(dev, precision, g, Quantized { a: None, b: None })
}

/// [`linear_gemm`] with operands that were quantized once for several
/// GEMMs; the same codes as quantizing them here, so the same result.
pub fn linear_gemm_quantized<B: Backend>(
    dev: &B,
    precision: Precision,
    g: LinearGemm<'_, B>,
    pre: Quantized<'_, B>,
) -> Result<()> {
    if precision == Precision::Bf16 {
        return dev.gemm(g.c, g.a, g.b, g.alpha, g.beta);
    }
    let (fa, fb) = g.role.formats();
    let (own_a, own_b);
    let a = match pre.a {
        Some(op) => op,
        None => {
            own_a = Fp8Operand::new(dev, g.a, fa, false)?; // [m, k]
            own_a.codes()
        }
    };
    let b = match pre.b {
        Some(op) => op,
        None => {
            own_b = Fp8Operand::new(dev, g.b.t(), fb, false)?; // [n, k]
            own_b.codes()
        }
    };
    let (qa, sa) = a.stands_for(g.a, fa)?;
    let (qb, sb) = b.stands_for(g.b.t(), fb)?;
    dev.fp8_gemm(Fp8Gemm {
        c: g.c,
        a: qa,
        a_scale_inv: sa,
        b: qb.t(),
        b_scale_inv: sb,
        alpha: g.alpha,
        beta: g.beta,
    })
}
