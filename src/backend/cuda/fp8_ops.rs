//! The FP8 ops on CUDA: quantization by the kernels of `kernels/fp8.cu`
//! (the amax reduced into the inverse scale's cell, the cast, the inverse
//! scale written in place: no buffer of its own) and the GEMM by cuBLASLt
//! (`Gemm::run_fp8`, on the workspace `gemm` keeps). Devices below compute
//! capability 8.9 (Ada, Hopper) have no FP8 tensor cores: a run there is
//! refused where it chooses `--precision fp8`.

use super::attention::dt_flag;
use super::backend::{BLOCK, CudaBackend, ptr, ptr_at};
use super::device::drv;
use super::gemm::{GemmPtrs, map_problem};
use super::kernels::{Args, launch};
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use crate::backend::{DType, Tensor};
use crate::error::{Error, Result};

/// The most blocks of an amax launch: enough to fill any GPU, few enough
/// that one atomic per block costs nothing.
const AMAX_BLOCKS: usize = 1024;
/// The most blocks of a cast launch (its blocks step over lines or tiles).
const CAST_BLOCKS: usize = 4096;

/// The `fmt` flag of the FP8 kernels (as `dt_flag` numbers the dtypes).
fn fmt_flag(f: Fp8Format) -> i32 {
    dt_flag(DType::of_fp8(f))
}

impl CudaBackend {
    /// FP8 needs compute capability 8.9 or above.
    pub(super) fn supports_fp8_impl(&self) -> Result<()> {
        let (maj, min) = drv(self.ctx.compute_capability(), "compute capability")?;
        if (maj, min) < (8, 9) {
            return Err(Error::Config(format!(
                "--precision fp8 needs a GPU of compute capability 8.9 or above (Ada, Hopper); \
                 {} is {maj}.{min}: use --precision bf16",
                self.name
            )));
        }
        Ok(())
    }

    /// The three launches of a quantization (module docs of `fp8.cu`).
    pub(super) fn fp8_quantize_impl(&self, f: Fp8Format, a: Fp8Quantize<'_, Self>) -> Result<()> {
        let _span = self.span("fp8_quantize")?;
        self.bind()?;
        let l = a.src.l;
        let (rs, cs) = l.strides();
        let cell = ptr(a.scale_inv);
        self.zero_raw(cell, 4)?;
        let n = l.rows * l.cols;
        let src = || {
            Args::new()
                .ptr(ptr_at(a.src.t, l.offset))
                .i32(dt_flag(a.src.t.dtype()))
                .usize(l.rows)
                .usize(l.cols)
                .usize(rs)
                .usize(cs)
        };
        if n > 0 {
            // a block per line along the larger stride, a bounded grid
            let lines = if rs < cs { l.cols } else { l.rows };
            let amax_grid = (lines.min(AMAX_BLOCKS) as u32, 1, 1);
            let amax = src().ptr(cell);
            launch(
                &self.stream,
                self.kernels.fp8_amax,
                amax_grid,
                BLOCK,
                0,
                amax,
            )?;
            // up to a block per 32 x 32 tile, a bounded grid
            let tiles = l.rows.div_ceil(32) * l.cols.div_ceil(32);
            let cast_grid = (tiles.min(CAST_BLOCKS) as u32, 1, 1);
            let dst_t = a.dst_t.as_deref().map_or(0, |t: &Tensor<Self>| ptr(t));
            let args = src().ptr(cell).i32(fmt_flag(f)).ptr(ptr(a.dst)).ptr(dst_t);
            launch(
                &self.stream,
                self.kernels.fp8_cast,
                cast_grid,
                BLOCK,
                0,
                args,
            )?;
        }
        let args = Args::new().ptr(cell).i32(fmt_flag(f));
        launch(
            &self.stream,
            self.kernels.fp8_scale_inv,
            (1, 1, 1),
            32,
            0,
            args,
        )
    }

    /// The codes of `src` scaled by `max / amax` with the amax already in
    /// the 4-byte cell at `amax_cell` (no reduction, no inverse written):
    /// a quantization with a scale set elsewhere. `dst` is dense row-major.
    pub(super) fn fp8_cast_with_amax(
        &self,
        f: Fp8Format,
        src: crate::backend::Mat<'_, Self>,
        dst: &Tensor<Self>,
        amax_cell: u64,
    ) -> Result<()> {
        let l = src.l;
        let (rs, cs) = l.strides();
        let tiles = l.rows.div_ceil(32) * l.cols.div_ceil(32);
        if l.rows * l.cols == 0 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(ptr_at(src.t, l.offset))
            .i32(dt_flag(src.t.dtype()))
            .usize(l.rows)
            .usize(l.cols)
            .usize(rs)
            .usize(cs)
            .ptr(amax_cell)
            .i32(fmt_flag(f))
            .ptr(ptr(dst))
            .ptr(0);
        let grid = (tiles.min(CAST_BLOCKS) as u32, 1, 1);
        launch(&self.stream, self.kernels.fp8_cast, grid, BLOCK, 0, args)
    }

    /// cuBLASLt's FP8 matmul of a checked call (`Gemm::run_fp8`).
    pub(super) fn fp8_gemm_impl(&self, g: &Fp8GemmShape, a: Fp8Gemm<'_, Self>) -> Result<()> {
        let _span = self.span("fp8_gemm")?;
        self.bind()?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            // nothing to multiply: c = beta · c, as `gemm` does
            let (rs, cs) = a.c.l.strides();
            let args = Args::new()
                .ptr(ptr(a.c.t))
                .i32(dt_flag(a.c.t.dtype()))
                .usize(a.c.l.offset)
                .usize(rs)
                .usize(cs)
                .usize(g.m)
                .usize(g.n)
                .f32(a.beta);
            return self.launch1d(self.kernels.scale2d, g.m * g.n, args);
        }
        let p = map_problem(&a.c.l, &a.a.l, &a.b.l)?;
        let ptrs = GemmPtrs {
            a: ptr_at(a.a.t, a.a.l.offset),
            b: ptr_at(a.b.t, a.b.l.offset),
            c: ptr_at(a.c.t, a.c.l.offset),
            workspace: self.workspace_ptr()?,
        };
        let types = (a.a.t.dtype(), a.b.t.dtype(), a.c.t.dtype());
        let scales = (ptr(a.a_scale_inv), ptr(a.b_scale_inv));
        let (alpha, beta) = (a.alpha, a.beta);
        (self.gemm).run_fp8(&self.stream, &p, types, &ptrs, scales, alpha, beta)
    }
}
