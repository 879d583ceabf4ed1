//! The CPU reference's GEMM: `matrixmultiply`'s f32 GEMM on strided
//! views, rounded to the output's dtype (its `gemm`, and its FP8 GEMM over
//! the codes' values).

use super::CpuBackend;
use super::cells::{data, data_mut, round_view};
use crate::backend::{Mat, MatMut};
use crate::error::{Error, Result};

/// `c = alpha * a @ b + beta * c` in f32 (`matrixmultiply`), rounded to
/// c's dtype: the reference's `gemm`, and its FP8 GEMM over the codes' values.
pub(super) fn sgemm(
    c: MatMut<'_, CpuBackend>,
    a: Mat<'_, CpuBackend>,
    b: Mat<'_, CpuBackend>,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    let (m, k, n) = (a.l.rows, a.l.cols, b.l.cols);
    if b.l.rows != k || c.l.rows != m || c.l.cols != n || c.l.trans {
        return Err(Error::Backend(format!(
            "gemm shapes: c {:?} = a {:?} @ b {:?}",
            c.l, a.l, b.l
        )));
    }
    let (rsa, csa) = a.l.strides();
    let (rsb, csb) = b.l.strides();
    let (rsc, csc) = c.l.strides();
    let (ao, bo, co) = (a.l.offset, b.l.offset, c.l.offset);
    let (cdt, cl) = (c.t.dtype(), c.l);
    let ad = data(a.t);
    let bd = data(b.t);
    let cd = data_mut(c.t);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                let x = &mut cd[co + i * rsc + j * csc];
                *x = if beta == 0.0 { 0.0 } else { beta * *x };
            }
        }
        round_view(cdt, cd, &cl);
        return Ok(());
    }
    // SAFETY: the views were bounds-checked against each buffer's length when
    // they were made (`MatLayout::check`), and `c` does not alias `a` or `b`
    // (it is borrowed mutably while they are borrowed immutably).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            ad.as_ptr().add(ao),
            rsa as isize,
            csa as isize,
            bd.as_ptr().add(bo),
            rsb as isize,
            csb as isize,
            beta,
            cd.as_mut_ptr().add(co),
            rsc as isize,
            csc as isize,
        );
    }
    round_view(cdt, cd, &cl);
    Ok(())
}
