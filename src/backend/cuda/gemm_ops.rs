//! `CudaBackend::gemm` (see the `Backend` trait): its checks, the `k == 0`
//! scaling, and the cuBLASLt workspace, allocated on the first call; the
//! cuBLASLt handle, plans and tuning are [`Gemm`](super::gemm::Gemm)'s.

use super::backend::{CudaBackend, dt, ptr, ptr_at};
use super::gemm::{GemmPtrs, WORKSPACE_BYTES, map_problem};
use super::kernels::Args;
use crate::backend::{Category, DType, Mat, MatMut};
use crate::error::{Error, Result};

/// `CudaBackend::gemm` (see the `Backend` trait) and its cuBLASLt workspace.
impl CudaBackend {
    pub(super) fn gemm_impl(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let _span = self.span_shaped("gemm", || {
            format!(
                "{}x{}x{} {:?}->{:?} beta {beta}",
                a.l.rows,
                b.l.cols,
                a.l.cols,
                a.t.dtype(),
                c.t.dtype()
            )
        })?;
        let p = map_problem(&c.l, &a.l, &b.l)?;
        let (ab, cd) = (a.t.dtype(), c.t.dtype());
        if b.t.dtype() != ab || (cd != DType::F32 && cd != ab) {
            return Err(Error::Backend(format!(
                "gemm: a {ab:?}, b {:?}, c {cd:?}; a and b must share a dtype and c be F32 or that dtype",
                b.t.dtype()
            )));
        }
        self.bind()?;
        let (m, k, n) = (a.l.rows, a.l.cols, b.l.cols);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            let (rs, cs) = c.l.strides();
            let args = Args::new()
                .ptr(ptr(c.t))
                .i32(dt(c.t))
                .usize(c.l.offset)
                .usize(rs)
                .usize(cs)
                .usize(m)
                .usize(n)
                .f32(beta);
            return self.launch1d(self.kernels.scale2d, m * n, args);
        }
        let ptrs = GemmPtrs {
            a: ptr_at(a.t, a.l.offset),
            b: ptr_at(b.t, b.l.offset),
            c: ptr_at(c.t, c.l.offset),
            workspace: self.workspace_ptr()?,
        };
        self.gemm.run(&self.stream, &p, ab, cd, &ptrs, alpha, beta)
    }

    pub(super) fn workspace_ptr(&self) -> Result<u64> {
        if let Some(t) = self.gemm_ws.get() {
            return Ok(ptr(t));
        }
        let t = self.alloc(&[WORKSPACE_BYTES / 4], DType::F32, Category::Workspace)?;
        let p = ptr(&t);
        match self.gemm_ws.set(t) {
            Ok(()) => Ok(p),
            // Another thread won the race; use its workspace (ours is freed).
            Err(_) => Ok(ptr(self.gemm_ws.get().expect("set by the winner"))),
        }
    }
}
