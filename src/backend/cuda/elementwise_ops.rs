//! `CudaBackend`'s elementwise and row-wise ops: `fill`, `axpy` (and
//! `axpy_raw` on raw addresses), `sum_squares`, RMSNorm forward and backward
//! (and their forms fused with the residual add),
//! RoPE, SwiGLU forward and backward, embedding forward and backward, the fused
//! cross-entropy.

use super::attention::dt_flag;
use super::backend::{BLOCK, CudaBackend, dt, need, ptr};
use super::device::drv;
use super::kernels::{Args, grid_for, launch};
use crate::backend::GatedAct;
use crate::backend::norm_args::{AddRmsNormFwd, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
use crate::backend::{
    Backend, Category, DType, IGNORE, Mat, MatMut, Tensor, check_bias_views, check_same_numel,
};
use crate::error::{Error, Result};
use cudarc::driver::result;

/// Row-striding blocks of the RMSNorm backward (each adds its dw once).
const RMS_BWD_MAX_BLOCKS: usize = 1024;

/// Threads of a `bias_grad` block: 32 warps, each summing every 32nd row of
/// the block's 32 columns (the kernel's `part[32][33]`).
const BIAS_GRAD_THREADS: u32 = 1024;

/// Whether an elementwise kernel over `ts` may move 8 elements per load and
/// store: every tensor bf16 and 16-byte aligned, the count a multiple of 8.
fn vec8(ts: &[&Tensor<CudaBackend>]) -> bool {
    ts.iter().all(|t| vec8_part(t.dtype(), ptr(t), t.numel()))
}

/// [`vec8`] of one operand of `n` elements of `dtype` at device address `p`.
fn vec8_part(dtype: DType, p: u64, n: usize) -> bool {
    dtype == DType::BF16 && n.is_multiple_of(8) && p.is_multiple_of(16)
}

fn u32_grid(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Backend(format!("{what}: {n} rows exceed one launch")))
}

impl CudaBackend {
    /// `y[i] += alpha * x[i]` for `n` elements at raw device addresses (any
    /// dtype pair `axpy` accepts); queued on the backend's stream. Used by
    /// kernels outside the backend (cuDNN) that overwrite instead of accumulating.
    pub fn axpy_raw(
        &self,
        y: u64,
        ydt: DType,
        x: u64,
        xdt: DType,
        n: usize,
        alpha: f32,
    ) -> Result<()> {
        let vec = vec8_part(ydt, y, n) && vec8_part(xdt, x, n);
        let args = Args::new()
            .ptr(y)
            .i32(dt_flag(ydt))
            .ptr(x)
            .i32(dt_flag(xdt))
            .usize(n)
            .f32(alpha)
            .i32(vec as i32);
        self.launch1d(self.kernels.axpy, if vec { n / 8 } else { n }, args)
    }

    pub(super) fn fill_impl(&self, t: &mut Tensor<Self>, value: f32) -> Result<()> {
        let _span = self.span("fill")?;
        self.bind()?;
        if value.to_bits() == 0 {
            // +0.0 is all-zero bits in F32 and BF16: the driver's memset
            return self.zero_raw(ptr(t), t.bytes());
        }
        let args = Args::new()
            .ptr(ptr(t))
            .i32(dt(t))
            .usize(t.numel())
            .f32(value);
        self.launch1d(self.kernels.fill, t.numel(), args)
    }

    pub(super) fn axpy_impl(
        &self,
        y: &mut Tensor<Self>,
        alpha: f32,
        x: &Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("axpy")?;
        check_same_numel(y, x, "axpy")?;
        if y.dtype() != DType::F32 && y.dtype() != x.dtype() {
            return Err(Error::Backend(
                "axpy: y must be F32 or the dtype of x".into(),
            ));
        }
        self.bind()?;
        self.axpy_raw(ptr(y), y.dtype(), ptr(x), x.dtype(), x.numel(), alpha)
    }

    pub(super) fn add_bias_rows_impl(
        &self,
        x: MatMut<'_, Self>,
        bias: Mat<'_, Self>,
    ) -> Result<()> {
        let _span = self.span("add_bias_rows")?;
        check_bias_views(&x.l, &bias.l, "add_bias_rows")?;
        if bias.t.dtype() != DType::F32 && bias.t.dtype() != x.t.dtype() {
            return Err(Error::Backend(
                "add_bias_rows: the bias must be F32 or the dtype of x".into(),
            ));
        }
        self.bind()?;
        let ((rs, cs), (_, bcs)) = (x.l.strides(), bias.l.strides());
        let args = Args::new()
            .ptr(ptr(x.t))
            .i32(dt(x.t))
            .usize(x.l.offset)
            .usize(rs)
            .usize(cs)
            .ptr(ptr(bias.t))
            .i32(dt(bias.t))
            .usize(bias.l.offset)
            .usize(bcs)
            .usize(x.l.rows)
            .usize(x.l.cols);
        // 8 elements a thread where a row's elements are contiguous bf16 and
        // every row starts 16-byte aligned
        let vec = x.t.dtype() == DType::BF16
            && cs == 1
            && rs.is_multiple_of(8)
            && x.l.cols.is_multiple_of(8)
            && (ptr(x.t) + 2 * x.l.offset as u64).is_multiple_of(16);
        let n = x.l.rows * x.l.cols;
        let args = args.i32(vec as i32);
        self.launch1d(
            self.kernels.add_bias_rows,
            if vec { n / 8 } else { n },
            args,
        )
    }

    pub(super) fn bias_grad_impl(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()> {
        let _span = self.span("bias_grad")?;
        check_bias_views(&dy.l, &dbias.l, "bias_grad")?;
        if dbias.t.dtype() != DType::F32 {
            return Err(Error::Backend("bias_grad: the gradient must be F32".into()));
        }
        self.bind()?;
        let cols = dy.l.cols;
        if cols == 0 {
            return Ok(());
        }
        let ((rs, cs), (_, dcs)) = (dy.l.strides(), dbias.l.strides());
        let args = Args::new()
            .ptr(ptr(dbias.t))
            .usize(dbias.l.offset)
            .usize(dcs)
            .ptr(ptr(dy.t))
            .i32(dt(dy.t))
            .usize(dy.l.offset)
            .usize(rs)
            .usize(cs)
            .usize(dy.l.rows)
            .usize(cols);
        let blocks = u32_grid(cols.div_ceil(32), "bias_grad")?;
        launch(
            &self.stream,
            self.kernels.bias_grad,
            (blocks, 1, 1),
            BIAS_GRAD_THREADS,
            0,
            args,
        )
    }

    /// The squares of every tensor of `ts` summed into one f64 accumulator:
    /// a launch per tensor, then one download and one sync.
    pub(super) fn sum_squares_impl(&self, ts: &[&Tensor<Self>]) -> Result<f64> {
        self.bind()?;
        let span = self.span("sum_squares")?;
        let acc = self.zeros(&[2], DType::F32, Category::Workspace)?; // one f64
        for t in ts {
            let n = t.numel();
            if n == 0 {
                continue;
            }
            let blocks = grid_for(n, BLOCK).0.min(1024);
            let args = Args::new().ptr(ptr(t)).i32(dt(t)).usize(n).ptr(ptr(&acc));
            launch(
                &self.stream,
                self.kernels.sum_squares,
                (blocks, 1, 1),
                BLOCK,
                0,
                args,
            )?;
        }
        let mut out = [0f64; 1];
        // SAFETY: `acc` holds 8 bytes; we wait for the stream below.
        drv(
            unsafe { result::memcpy_dtoh_async(&mut out, ptr(&acc), self.stream.cu_stream()) },
            "download",
        )?;
        drop(span);
        self.synchronize()?;
        Ok(out[0])
    }

    pub(super) fn rms_norm_fwd_impl(&self, rows: usize, a: RmsNormFwd<'_, Self>) -> Result<()> {
        let _span = self.span("rms_norm")?;
        let RmsNormFwd { x, w, norm, y } = a;
        let dim = w.numel();
        self.bind()?;
        if rows == 0 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(ptr(x))
            .i32(dt(x))
            .ptr(ptr(w))
            .i32(dt(w))
            .ptr(ptr(y))
            .i32(dt(y))
            .usize(rows)
            .usize(dim)
            .f32(norm.eps)
            .f32(norm.weight_offset)
            .i32(vec8(&[x, w, y]) as i32);
        launch(
            &self.stream,
            self.kernels.rmsnorm_fwd,
            (u32_grid(rows, "rms_norm")?, 1, 1),
            BLOCK,
            0,
            args,
        )
    }

    /// `x += y`, then `out = rms_norm(x) * w` (`Backend::add_rms_norm_fwd`):
    /// one block per row, as `rms_norm_fwd`.
    pub(super) fn add_rms_norm_fwd_impl(
        &self,
        rows: usize,
        a: AddRmsNormFwd<'_, Self>,
    ) -> Result<()> {
        let _span = self.span("add_rms_norm")?;
        let AddRmsNormFwd { x, y, w, norm, out } = a;
        let dim = w.numel();
        self.bind()?;
        if rows == 0 {
            return Ok(());
        }
        let vec = vec8(&[x, y, w, out]);
        let args = Args::new()
            .ptr(ptr(x))
            .i32(dt(x))
            .ptr(ptr(y))
            .i32(dt(y))
            .ptr(ptr(w))
            .i32(dt(w))
            .ptr(ptr(out))
            .i32(dt(out))
            .usize(rows)
            .usize(dim)
            .f32(norm.eps)
            .f32(norm.weight_offset)
            .i32(vec as i32);
        launch(
            &self.stream,
            self.kernels.add_rmsnorm_fwd,
            (u32_grid(rows, "add_rms_norm")?, 1, 1),
            BLOCK,
            0,
            args,
        )
    }

    /// `rms_norm_bwd` writing `dx` (`add` false) or adding into it
    /// (`rms_norm_bwd_add`).
    pub(super) fn rms_norm_bwd_impl(
        &self,
        rows: usize,
        a: RmsNormBwd<'_, Self>,
        add: bool,
    ) -> Result<()> {
        let _span = self.span(if add {
            "rms_norm_bwd_add"
        } else {
            "rms_norm_bwd"
        })?;
        let RmsNormBwd {
            x,
            w,
            dy,
            norm,
            dx,
            dw,
        } = a;
        let dim = w.numel();
        self.bind()?;
        if rows == 0 {
            return Ok(());
        }
        let args = Args::new()
            .ptr(ptr(x))
            .i32(dt(x))
            .ptr(ptr(w))
            .i32(dt(w))
            .ptr(ptr(dy))
            .i32(dt(dy))
            .ptr(ptr(dx))
            .i32(dt(dx))
            // a frozen norm weight: null, and the kernel adds no dw
            .ptr(dw.as_deref().map_or(0, ptr))
            .usize(rows)
            .usize(dim)
            .f32(norm.eps)
            .f32(norm.weight_offset);
        // dw is summed per block in shared memory when it fits the default 48 KiB.
        let smem_dw = dw.is_some() && dim * 4 <= 40 << 10;
        let args = args
            .i32(smem_dw as i32)
            .i32(vec8(&[x, w, dy, dx]) as i32)
            .i32(add as i32);
        let blocks = rows.min(RMS_BWD_MAX_BLOCKS) as u32;
        let smem = if smem_dw { (dim * 4) as u32 } else { 0 };
        launch(
            &self.stream,
            self.kernels.rmsnorm_bwd,
            (blocks, 1, 1),
            BLOCK,
            smem,
            args,
        )
    }

    pub(super) fn rope_impl(&self, g: RopeShape, a: RopeRotate<'_, Self>) -> Result<()> {
        let _span = self.span("rope")?;
        let RopeRotate {
            x,
            cos,
            sin,
            inverse,
        } = a;
        let (s, heads, d) = (g.s, g.heads, g.d);
        let half = d / 2;
        self.bind()?;
        // bf16 rows of 8-pair groups, aligned: `rope_bf16x8` (no dtype flag)
        let aligned = [ptr(x), ptr(cos), ptr(sin)].iter().all(|p| p % 16 == 0);
        let vec8 = x.dtype() == DType::BF16 && half % 8 == 0 && aligned;
        let (kernel, items, args) = if vec8 {
            let k = self.kernels.rope_bf16x8;
            (k, s * heads * (half / 8), Args::new().ptr(ptr(x)))
        } else {
            let k = self.kernels.rope;
            (k, s * heads * half, Args::new().ptr(ptr(x)).i32(dt(x)))
        };
        let args = args
            .ptr(ptr(cos))
            .ptr(ptr(sin))
            .usize(s)
            .usize(heads)
            .usize(d)
            .f32(if inverse { -1.0 } else { 1.0 });
        self.launch1d(kernel, items, args)
    }

    pub(super) fn gated_act_fwd_impl(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("gated_act")?;
        check_same_numel(gate, up, "gated_act_fwd")?;
        check_same_numel(gate, out, "gated_act_fwd")?;
        self.bind()?;
        let args = Args::new()
            .ptr(ptr(gate))
            .i32(dt(gate))
            .ptr(ptr(up))
            .i32(dt(up))
            .ptr(ptr(out))
            .i32(dt(out))
            .usize(gate.numel())
            .i32(act.code());
        let vec = vec8(&[gate, up, out]);
        let threads = if vec { gate.numel() / 8 } else { gate.numel() };
        self.launch1d(self.kernels.gated_act_fwd, threads, args.i32(vec as i32))
    }

    pub(super) fn gated_act_bwd_impl(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("gated_act_bwd")?;
        check_same_numel(gate, up, "gated_act_bwd")?;
        check_same_numel(gate, dout, "gated_act_bwd")?;
        check_same_numel(gate, dgate, "gated_act_bwd")?;
        check_same_numel(gate, dup, "gated_act_bwd")?;
        self.bind()?;
        let args = Args::new()
            .ptr(ptr(gate))
            .i32(dt(gate))
            .ptr(ptr(up))
            .i32(dt(up))
            .ptr(ptr(dout))
            .i32(dt(dout))
            .ptr(ptr(dgate))
            .i32(dt(dgate))
            .ptr(ptr(dup))
            .i32(dt(dup))
            .usize(gate.numel())
            .i32(act.code());
        let vec = vec8(&[gate, up, dout, dgate, dup]);
        let threads = if vec { gate.numel() / 8 } else { gate.numel() };
        self.launch1d(self.kernels.gated_act_bwd, threads, args.i32(vec as i32))
    }

    pub(super) fn embedding_fwd_impl(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("embedding")?;
        let (vocab, h) = (table.rows(), table.row_len());
        if out.numel() != ids.len() * h {
            return Err(Error::Backend(
                "embedding_fwd: output is not [ids, hidden]".into(),
            ));
        }
        crate::backend::check_token_ids(ids, vocab)?;
        self.bind()?;
        let idt = self.upload_ids(ids)?;
        let args = Args::new()
            .ptr(ptr(table))
            .i32(dt(table))
            .ptr(ptr(&idt))
            .ptr(ptr(out))
            .i32(dt(out))
            .usize(ids.len())
            .usize(h)
            .f32(scale);
        self.launch1d(self.kernels.embedding_fwd, ids.len() * h, args)
    }

    pub(super) fn embedding_bwd_impl(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("embedding_bwd")?;
        need(dtable, DType::F32, "embedding_bwd", "dtable")?;
        let (vocab, h) = (dtable.rows(), dtable.row_len());
        if dout.numel() != ids.len() * h {
            return Err(Error::Backend(
                "embedding_bwd: dout is not [ids, hidden]".into(),
            ));
        }
        crate::backend::check_token_ids(ids, vocab)?;
        self.bind()?;
        let idt = self.upload_ids(ids)?;
        let args = Args::new()
            .ptr(ptr(dout))
            .i32(dt(dout))
            .ptr(ptr(&idt))
            .ptr(ptr(dtable))
            .usize(ids.len())
            .usize(h)
            .f32(scale);
        self.launch1d(self.kernels.embedding_bwd, ids.len() * h, args)
    }

    pub(super) fn cross_entropy_impl(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("cross_entropy")?;
        let v = logits.row_len();
        if logits.rows() != targets.len() {
            return Err(Error::Backend(
                "cross_entropy: one target per logits row".into(),
            ));
        }
        need(loss_sum, DType::F32, "cross_entropy", "loss_sum")?;
        if let Some(&t) = targets.iter().find(|&&t| t != IGNORE && t as usize >= v) {
            return Err(Error::Config(format!(
                "target id {t} is outside the vocabulary of {v}; check the data matches the model"
            )));
        }
        self.bind()?;
        if targets.is_empty() {
            return Ok(());
        }
        let tt = self.upload_ids(targets)?;
        let args = Args::new()
            .ptr(ptr(logits))
            .i32(dt(logits))
            .ptr(ptr(&tt))
            .usize(targets.len())
            .usize(v)
            .f32(grad_scale)
            // the gradient overwrites the logits (the kernel reads each
            // element before it writes it)
            .ptr(ptr(logits))
            .i32(dt(logits))
            .ptr(ptr(loss_sum));
        let rows = u32_grid(targets.len(), "cross_entropy")?;
        launch(
            &self.stream,
            self.kernels.cross_entropy,
            (rows, 1, 1),
            BLOCK,
            0,
            args,
        )
    }
}
