//! The FP8 ops as descriptors: a quantization ([`Fp8Quantize`]) and a GEMM
//! of two quantized operands ([`Fp8Gemm`]), each with its one argument
//! check. [`Backend::fp8_quantize`](crate::backend::Backend::fp8_quantize)
//! and [`fp8_gemm`](crate::backend::Backend::fp8_gemm) check a call here
//! before any device sees it, so the CPU reference, the CUDA backend and the
//! rehearsal refuse alike.

use super::format::Fp8Format;
use crate::backend::tensor::{DType, Mat, MatLayout, MatMut, Tensor, TensorDevice};
use crate::error::{Error, Result};

/// Quantizes a matrix view with its own tensor-wise scale
/// (`fp8::scale_for` of its largest magnitude): `dst = encode(src · scale)`
/// row-major, `dst_t` (if any) the same codes transposed, and `scale_inv =
/// 1 / scale` (what [`Fp8Gemm`] multiplies by).
pub struct Fp8Quantize<'a, B: TensorDevice> {
    /// `[rows, cols]`, F32 or BF16, any layout (a block, a transposed view).
    pub src: Mat<'a, B>,
    /// `[rows, cols]` F8E4M3 or F8E5M2, dense row-major, overwritten.
    pub dst: &'a mut Tensor<B>,
    /// `[cols, rows]`, the dtype of `dst`, dense row-major, overwritten.
    pub dst_t: Option<&'a mut Tensor<B>>,
    /// `[1]` F32, overwritten with `1 / scale`.
    pub scale_inv: &'a mut Tensor<B>,
}

/// `c = alpha · a_scale_inv · b_scale_inv · (a @ b) + beta · c` of two FP8
/// operands, accumulated in f32 and written in the dtype of `c`.
pub struct Fp8Gemm<'a, B: TensorDevice> {
    /// `[m, n]`, F32 or BF16, not transposed.
    pub c: MatMut<'a, B>,
    /// `[m, k]` view of an FP8 tensor.
    pub a: Mat<'a, B>,
    /// `[1]` F32: `a`'s inverse scale.
    pub a_scale_inv: &'a Tensor<B>,
    /// `[k, n]` view of an FP8 tensor.
    pub b: Mat<'a, B>,
    /// `[1]` F32: `b`'s inverse scale.
    pub b_scale_inv: &'a Tensor<B>,
    pub alpha: f32,
    pub beta: f32,
}

fn err<T>(msg: String) -> Result<T> {
    Err(Error::Backend(msg))
}

/// The FP8 format of `t`, or an error naming `what`.
fn format_of<B: TensorDevice>(t: &Tensor<B>, what: &str) -> Result<Fp8Format> {
    match t.dtype().fp8_format() {
        Some(f) => Ok(f),
        None => err(format!(
            "{what} must be F8E4M3 or F8E5M2, got {:?}",
            t.dtype()
        )),
    }
}

/// Checks a one-element F32 scale tensor.
fn check_scale<B: TensorDevice>(t: &Tensor<B>, what: &str) -> Result<()> {
    if t.dtype() != DType::F32 || t.numel() != 1 {
        return err(format!(
            "{what} must be a [1] F32 tensor, got {:?} {:?}",
            t.shape(),
            t.dtype()
        ));
    }
    Ok(())
}

/// Checks that `t` is a dense `[rows, cols]` matrix.
fn check_dense<B: TensorDevice>(t: &Tensor<B>, rows: usize, cols: usize, what: &str) -> Result<()> {
    if t.rows() != rows || t.row_len() != cols {
        return err(format!("{what} {:?} is not [{rows}, {cols}]", t.shape()));
    }
    Ok(())
}

impl<B: TensorDevice> Fp8Quantize<'_, B> {
    /// Checks the call: the source a float view, the outputs of one FP8
    /// format and of the source's (and its transpose's) shape. Returns the
    /// format.
    pub fn check(&self) -> Result<Fp8Format> {
        let (rows, cols) = (self.src.l.rows, self.src.l.cols);
        if !matches!(self.src.t.dtype(), DType::F32 | DType::BF16) {
            return err(format!(
                "fp8_quantize: the source must be F32 or BF16, got {:?}",
                self.src.t.dtype()
            ));
        }
        let f = format_of(self.dst, "fp8_quantize: the output")?;
        check_dense(self.dst, rows, cols, "fp8_quantize: the output")?;
        if let Some(t) = self.dst_t.as_deref() {
            if t.dtype() != self.dst.dtype() {
                return err(format!(
                    "fp8_quantize: the transposed output is {:?}, the output {:?}",
                    t.dtype(),
                    self.dst.dtype()
                ));
            }
            check_dense(t, cols, rows, "fp8_quantize: the transposed output")?;
        }
        check_scale(self.scale_inv, "fp8_quantize: the inverse scale")?;
        Ok(f)
    }
}

/// The formats of an FP8 GEMM's operands, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: Fp8Format,
    pub b: Fp8Format,
}

impl<B: TensorDevice> Fp8Gemm<'_, B> {
    /// Checks the call: FP8 operands (not both E5M2, as no device multiplies
    /// two gradients), an F32 or BF16 output of the product's shape, and
    /// the two scales.
    pub fn check(&self) -> Result<Fp8GemmShape> {
        let (a, b, c): (&MatLayout, &MatLayout, &MatLayout) = (&self.a.l, &self.b.l, &self.c.l);
        let fa = format_of(self.a.t, "fp8_gemm: a")?;
        let fb = format_of(self.b.t, "fp8_gemm: b")?;
        if fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2 {
            return err("fp8_gemm: a and b are both E5M2; one operand must be E4M3".into());
        }
        if !matches!(self.c.t.dtype(), DType::F32 | DType::BF16) {
            return err(format!(
                "fp8_gemm: c must be F32 or BF16, got {:?}",
                self.c.t.dtype()
            ));
        }
        if a.cols != b.rows || c.rows != a.rows || c.cols != b.cols || c.trans {
            return err(format!(
                "fp8_gemm: {}x{} @ {}x{} into {}x{}{}",
                a.rows,
                a.cols,
                b.rows,
                b.cols,
                c.rows,
                c.cols,
                if c.trans { " (transposed)" } else { "" }
            ));
        }
        check_scale(self.a_scale_inv, "fp8_gemm: a's inverse scale")?;
        check_scale(self.b_scale_inv, "fp8_gemm: b's inverse scale")?;
        Ok(Fp8GemmShape {
            m: a.rows,
            k: a.cols,
            n: b.cols,
            a: fa,
            b: fb,
        })
    }
}
