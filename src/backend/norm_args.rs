//! The descriptors of the RMSNorm ops ([`RmsNormFwd`], [`AddRmsNormFwd`],
//! [`RmsNormBwd`]) and of RoPE ([`RopeRotate`]), each with its argument
//! check. The [`Backend`](super::Backend) trait's provided methods check a
//! call once for every device before the device's `run_*` (the CPU
//! reference, the CUDA backend and the rehearsal): a call one refuses,
//! each refuses alike.

use super::check_same_numel;
use super::op_kinds::RmsNorm;
use super::tensor::{DType, Tensor, TensorDevice};
use crate::error::{Error, Result};

/// RMSNorm forward: `y = x / rms(x) · (w + offset)`; x, y `[rows, dim]`,
/// w `[dim]`.
pub struct RmsNormFwd<'a, B: TensorDevice> {
    pub x: &'a Tensor<B>,
    pub w: &'a Tensor<B>,
    pub norm: RmsNorm,
    pub y: &'a mut Tensor<B>,
}

/// A residual add and the RMSNorm of its sum: `x += y`, then
/// `out = x / rms(x) · (w + offset)`; x, y, out `[rows, dim]` (x F32 or
/// the dtype of y), w `[dim]`.
pub struct AddRmsNormFwd<'a, B: TensorDevice> {
    pub x: &'a mut Tensor<B>,
    pub y: &'a Tensor<B>,
    pub w: &'a Tensor<B>,
    pub norm: RmsNorm,
    pub out: &'a mut Tensor<B>,
}

/// RMSNorm backward of `x` `[rows, dim]` by `w` `[dim]` given `dy`: `dx`
/// written (or added into), `dw` accumulated in F32 (`None`: a frozen
/// weight, whose gradient is not computed).
pub struct RmsNormBwd<'a, B: TensorDevice> {
    pub x: &'a Tensor<B>,
    pub w: &'a Tensor<B>,
    pub dy: &'a Tensor<B>,
    pub norm: RmsNorm,
    pub dx: &'a mut Tensor<B>,
    pub dw: Option<&'a mut Tensor<B>>,
}

/// Rotary embedding of `x` `[s, heads, d]` in place, HF "rotate half"
/// convention, by F32 tables `cos`, `sin` `[s, d/2]`; `inverse` rotates by
/// the negative angle (the backward).
pub struct RopeRotate<'a, B: TensorDevice> {
    pub x: &'a mut Tensor<B>,
    pub cos: &'a Tensor<B>,
    pub sin: &'a Tensor<B>,
    pub inverse: bool,
}

/// The geometry of a RoPE call, checked ([`RopeRotate::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Rows (positions).
    pub s: usize,
    pub heads: usize,
    /// The head dim (even).
    pub d: usize,
}

/// The rows of a norm over `n` elements with a weight of `dim`: an error
/// unless they are whole rows.
fn norm_rows(n: usize, dim: usize, op: &str) -> Result<usize> {
    if dim == 0 || !n.is_multiple_of(dim) {
        return Err(Error::Backend(format!(
            "{op}: {n} elements are not rows of the norm weight's {dim}"
        )));
    }
    Ok(n / dim)
}

/// Checks that `t` (called `name`) is of dtype `want`.
fn need<B: TensorDevice>(t: &Tensor<B>, want: DType, op: &str, name: &str) -> Result<()> {
    if t.dtype() != want {
        return Err(Error::Backend(format!(
            "{op}: {name} must be {want:?}, got {:?} (see the Backend dtype contract)",
            t.dtype()
        )));
    }
    Ok(())
}

impl<B: TensorDevice> RmsNormFwd<'_, B> {
    /// The call's rows: `y` shaped like `x`, whole rows of `w`.
    pub fn check(&self) -> Result<usize> {
        const OP: &str = "rms_norm_fwd";
        check_same_numel(self.x, self.y, OP)?;
        norm_rows(self.x.numel(), self.w.numel(), OP)
    }
}

impl<B: TensorDevice> AddRmsNormFwd<'_, B> {
    /// The call's rows: `y` and `out` shaped like `x`, whole rows of `w`,
    /// `x` F32 or the dtype of `y`.
    pub fn check(&self) -> Result<usize> {
        const OP: &str = "add_rms_norm_fwd";
        check_same_numel(self.x, self.y, OP)?;
        check_same_numel(self.x, self.out, OP)?;
        let rows = norm_rows(self.x.numel(), self.w.numel(), OP)?;
        if self.x.dtype() != DType::F32 && self.x.dtype() != self.y.dtype() {
            return Err(Error::Backend(format!(
                "{OP}: x must be F32 or the dtype of y ({:?}), got {:?}",
                self.y.dtype(),
                self.x.dtype()
            )));
        }
        Ok(rows)
    }
}

impl<B: TensorDevice> RmsNormBwd<'_, B> {
    /// The call's rows: `dy` and `dx` shaped like `x`, `dw` (if any) an
    /// F32 tensor shaped like `w`, whole rows of `w`.
    pub fn check(&self) -> Result<usize> {
        const OP: &str = "rms_norm_bwd";
        check_same_numel(self.x, self.dy, OP)?;
        check_same_numel(self.x, self.dx, OP)?;
        if let Some(dw) = self.dw.as_deref() {
            check_same_numel(self.w, dw, OP)?;
            need(dw, DType::F32, OP, "dw")?;
        }
        norm_rows(self.x.numel(), self.w.numel(), OP)
    }
}

impl<B: TensorDevice> RopeRotate<'_, B> {
    /// The call's geometry: an even head dim, F32 tables of `[s, d/2]`.
    pub fn check(&self) -> Result<RopeShape> {
        const OP: &str = "rope";
        let shape = self.x.shape();
        let (s, d) = (self.x.rows(), shape.get(2).copied().unwrap_or(0));
        let heads = shape.get(1).copied().unwrap_or(0);
        let half = d / 2;
        if d % 2 != 0 || self.cos.numel() != s * half || self.sin.numel() != s * half {
            return Err(Error::Backend(format!(
                "{OP}: x {:?} needs cos/sin of [{s}, {half}], got {:?} and {:?}",
                shape,
                self.cos.shape(),
                self.sin.shape()
            )));
        }
        need(self.cos, DType::F32, OP, "cos")?;
        need(self.sin, DType::F32, OP, "sin")?;
        Ok(RopeShape { s, heads, d })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::rehearsal::Rehearsal;
    use crate::backend::{Backend, Category};

    /// One call's error on a backend, as text (`None`: it ran).
    fn refusals<B: Backend>(b: &B) -> Vec<Option<String>> {
        let t = |shape: &[usize], dt: DType| b.zeros(shape, dt, Category::Workspace).unwrap();
        let norm = RmsNorm::plain(1e-6);
        let (x, w) = (t(&[3, 4], DType::F32), t(&[4], DType::F32));
        let err = |r: Result<()>| r.err().map(|e| e.to_string());
        let mut out = Vec::new();
        // a weight whose length does not divide the rows
        let w5 = t(&[5], DType::F32);
        let mut y = t(&[3, 4], DType::F32);
        out.push(err(b.rms_norm_fwd(RmsNormFwd {
            x: &x,
            w: &w5,
            norm,
            y: &mut y,
        })));
        // a BF16 norm weight gradient
        let (dy, mut dx, mut dw) = (
            t(&[3, 4], DType::F32),
            t(&[3, 4], DType::F32),
            t(&[4], DType::BF16),
        );
        out.push(err(b.rms_norm_bwd_add(RmsNormBwd {
            x: &x,
            w: &w,
            dy: &dy,
            norm,
            dx: &mut dx,
            dw: Some(&mut dw),
        })));
        // an odd head dim, then tables of the wrong length
        for (d, rows) in [(3, 2), (4, 3)] {
            let mut q = t(&[2, 2, d], DType::F32);
            let (cos, sin) = (t(&[rows, d / 2], DType::F32), t(&[rows, d / 2], DType::F32));
            out.push(err(b.rope(RopeRotate {
                x: &mut q,
                cos: &cos,
                sin: &sin,
                inverse: false,
            })));
        }
        // a well-formed call runs
        let mut y = t(&[3, 4], DType::F32);
        out.push(err(b.rms_norm_fwd(RmsNormFwd {
            x: &x,
            w: &w,
            norm,
            y: &mut y,
        })));
        out
    }

    /// The checks run once for every device: the CPU reference and its
    /// rehearsal refuse the same calls with the same messages.
    #[test]
    fn every_device_refuses_alike() {
        let cpu = refusals(&CpuBackend::new());
        assert_eq!(cpu, refusals(&Rehearsal::on(CpuBackend::new())));
        let says = [
            "not rows of the norm weight's 5",
            "dw must be F32",
            "needs cos/sin",
            "needs cos/sin",
        ];
        for (got, want) in cpu.iter().zip(says) {
            let got = got.as_deref().unwrap_or("ran");
            assert!(got.contains(want), "{got} lacks {want}");
        }
        assert_eq!(cpu[4], None);
    }
}
