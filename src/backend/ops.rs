//! The [`Backend`] trait: the ops upipe needs from a device, and what
//! they read back to the host.

use super::attn_args::{AttentionBwd, AttentionFwd, AttnShape, LseMerge};
use super::copy_done::{ComputePoint, CopyDone};
use super::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use super::fused_update::{UpdateKernel, UpdateSlot};
use super::memory::{Category, MemoryLedger, PoolReport};
use super::norm_args::{AddRmsNormFwd, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
use super::op_kinds::GatedAct;
use super::profile;
use super::tensor::{DType, Mat, MatMut, Tensor, TensorDevice};
use crate::error::Result;
use std::sync::Arc;

/// The ops upipe needs from a device. All tensors passed to one backend's ops
/// were allocated by that backend. Ops that "accumulate" add into their output
/// (`out += ...`); all others overwrite it.
///
/// Dtype contract (CPU: everything is F32; CUDA: compute dtype is BF16):
/// - activations and their gradients (x, q, k, v, o, dO, dx, ...) are in the
///   compute dtype; LSE, RoPE tables and `loss_sum` are F32;
/// - parameter gradients, optimizer state and master weights are F32;
/// - `gemm`: `a` and `b` share a dtype, `c` is F32 or that dtype (accumulating
///   bf16 x bf16 into F32 weight gradients is the common case);
/// - `copy` converts between dtypes; `axpy` takes `y` F32 or the dtype of `x`;
/// - `attention_bwd` adds into or overwrites `dq`, `dk`, `dv` of F32 or compute dtype;
/// - `rms_norm_bwd` writes `dx` in the dtype of `dy` and accumulates F32 `dw` (if any);
///   `rms_norm_bwd_add` adds into such a `dx`; `add_rms_norm_fwd` adds `y`
///   into `x` under `axpy`'s rule and writes `out` as `rms_norm_fwd` writes `y`;
///   `embedding_bwd` accumulates an F32 `dtable`; norm/embedding weights used
///   in forward are in the compute dtype.
pub trait Backend: TensorDevice + Send + Sync + Sized + 'static {
    /// Short description, e.g. `cpu-f32` or `cuda:0 (NVIDIA H200)`.
    fn name(&self) -> String;
    /// The byte ledger of this device.
    fn ledger(&self) -> &Arc<MemoryLedger>;
    /// Element type of activations and compute copies of weights.
    fn compute_dtype(&self) -> DType;

    /// Whether this backend is a rehearsal ([`rehearsal::Rehearsal`], `upipe
    /// train --rehearse` and the memory planner): it allocates exactly what
    /// its device would and computes nothing, its host reads (`to_host`,
    /// `sum_squares`) return zeros and its tensors have no host view. The one
    /// question the layers above ask of a rehearsal, and only where they
    /// would otherwise read or write host data (initial weights, RoPE
    /// tables, token ids, counted targets, the host optimizer); ops and
    /// collectives never ask it. False for every real backend.
    fn rehearsing(&self) -> bool {
        false
    }
    /// Whether the engine may run, of a loop whose iterations allocate
    /// alike, only those that can allocate differently
    /// (`model::chunk_loop`): a rehearsal, which computes nothing, unless
    /// built to run every iteration. False for every real backend.
    fn collapses_alike_iterations(&self) -> bool {
        false
    }
    /// What the device allocator held beside the ledger (its reserved
    /// high-water since the last reset, and the device memory outside it
    /// now); `None` where there is no pool beside the ledger (the CPU).
    fn pool_report(&self) -> Result<Option<PoolReport>> {
        Ok(None)
    }

    /// Allocates a zero-filled tensor.
    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>>;
    /// Allocates a tensor with unspecified contents, for a buffer whose every
    /// element is written before it is read (saves the fill on devices). The
    /// CPU reference fills it with NaN, so a read before the write poisons
    /// the results the tests check.
    fn empty(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.zeros(shape, dtype, cat)
    }
    /// Creates a tensor from host f32 data (converted to `dtype`).
    #[allow(clippy::wrong_self_convention)]
    fn from_host(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>>;
    /// Overwrites an existing tensor with host f32 data (converted to its dtype).
    fn upload(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()>;
    /// Copies a tensor to the host as f32.
    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>>;
    /// Waits for all queued work on this device.
    fn synchronize(&self) -> Result<()>;

    /// Turns the op profile on (`upipe train --profile`); a backend that
    /// records none ignores it.
    fn enable_profile(&self) {}
    /// Tags the ops queued from now on with `phase` in the profile.
    fn set_phase(&self, _phase: profile::Phase) {}
    /// Waits for the ops recorded since the last call and returns them,
    /// forgetting them here; `None` when the profile is off.
    fn take_profile(&self) -> Result<Option<profile::StepProfile>> {
        Ok(None)
    }

    /// `c = alpha * a @ b + beta * c` on matrix views (any of them may be transposed views).
    fn gemm(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        alpha: f32,
        beta: f32,
    ) -> Result<()>;
    /// Whether this device runs the FP8 ops ([`fp8_quantize`](Backend::fp8_quantize),
    /// [`fp8_gemm`](Backend::fp8_gemm)); an error naming the fix where it
    /// cannot (a GPU older than compute capability 8.9). Asked once, where
    /// a run chooses `--precision fp8`.
    fn supports_fp8(&self) -> Result<()> {
        Ok(())
    }
    /// Quantizes a view to FP8 with its own tensor-wise scale
    /// ([`Fp8Quantize`]). Checks the call once for every device
    /// ([`Fp8Quantize::check`]) and runs it
    /// ([`run_fp8_quantize`](Backend::run_fp8_quantize)); devices do not
    /// override it.
    fn fp8_quantize(&self, a: Fp8Quantize<'_, Self>) -> Result<()> {
        let f = a.check()?;
        self.run_fp8_quantize(f, a)
    }
    /// The device's arithmetic of a quantization to `format` that
    /// [`fp8_quantize`](Backend::fp8_quantize) checked.
    fn run_fp8_quantize(&self, format: Fp8Format, a: Fp8Quantize<'_, Self>) -> Result<()>;
    /// `c = alpha · inv_a · inv_b · (a @ b) + beta · c` of FP8 operands
    /// ([`Fp8Gemm`]), accumulated in f32. Checks the call once for every
    /// device ([`Fp8Gemm::check`]) and runs it
    /// ([`run_fp8_gemm`](Backend::run_fp8_gemm)); devices do not override it.
    fn fp8_gemm(&self, a: Fp8Gemm<'_, Self>) -> Result<()> {
        let g = a.check()?;
        self.run_fp8_gemm(&g, a)
    }
    /// The device's arithmetic of an FP8 GEMM of shape `g` that
    /// [`fp8_gemm`](Backend::fp8_gemm) checked.
    fn run_fp8_gemm(&self, g: &Fp8GemmShape, a: Fp8Gemm<'_, Self>) -> Result<()>;
    /// Starts `dst = src` (whole tensors of one shape and dtype, e.g. device
    /// memory to host memory) on the device's copy stream where it has one,
    /// after the work queued so far, and returns before it finishes. Both
    /// tensors must stay alive until [`copy_wait`](Backend::copy_wait) of
    /// the returned token. The CPU copies at once.
    fn copy_start(&self, dst: &mut Tensor<Self>, src: &Tensor<Self>) -> Result<CopyDone> {
        self.copy(dst.mat_mut(), src.mat())?;
        Ok(CopyDone::finished())
    }
    /// A point in the order of the work queued so far, which a later
    /// [`copy_start_from`](Backend::copy_start_from) follows instead of all
    /// the work queued by then. The CPU has no work in flight.
    fn compute_point(&self) -> Result<ComputePoint> {
        Ok(ComputePoint::none())
    }
    /// [`copy_start`](Backend::copy_start), ordered only after `since`
    /// (`src` must not have been written since then): the copy need not
    /// wait for the work queued after that point.
    fn copy_start_from(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        since: &ComputePoint,
    ) -> Result<CopyDone> {
        let _ = since;
        self.copy_start(dst, src)
    }
    /// Orders work queued from now on after the copy (no host wait).
    fn copy_wait(&self, done: CopyDone) -> Result<()> {
        done.join()
    }
    /// [`copy_wait`](Backend::copy_wait), keeping the token for a later
    /// [`copy_finish`](Backend::copy_finish) (the host reuses the copy's
    /// source only after that).
    fn copy_order(&self, done: &CopyDone) -> Result<()> {
        done.order()
    }
    /// Waits on the host until the copy is done (before host code reads or
    /// writes a host-resident tensor the copy touches).
    fn copy_finish(&self, done: CopyDone) -> Result<()> {
        done.finish()
    }
    /// The elements of a host-resident F32 tensor (`Category::Offload`;
    /// on the CPU every tensor), for compute on the host. Every copy into
    /// it must have finished ([`copy_finish`](Backend::copy_finish)).
    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]>;
    /// [`host_f32`](Backend::host_f32), writable. No copy out of it may be
    /// in flight.
    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]>;
    /// A host-resident tensor's values, to read on the host: F32 elements,
    /// or the bits of a BF16 tensor where this backend keeps it narrow
    /// (the CPU keeps every tensor in f32 cells: [`host_f32`](Backend::host_f32)).
    /// Every copy into it must have finished.
    fn host_values<'t>(&self, t: &'t Tensor<Self>) -> Result<HostValues<'t>> {
        self.host_f32(t).map(HostValues::F32)
    }
    /// The bf16 bits of a host-resident BF16 tensor, writable (no copy out
    /// of it may be in flight). The CPU keeps every tensor in f32.
    fn host_bf16_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [u16]> {
        Err(crate::Error::Backend(format!(
            "host access to a {:?} tensor of shape {:?}: this backend keeps no bf16 host tensors",
            t.dtype(),
            t.shape()
        )))
    }
    /// A host-resident tensor's elements, writable, as this backend keeps
    /// them: F32 cells (the CPU's, whatever the dtype: a BF16 tensor's
    /// cells hold BF16 values, a U8 tensor's its codes), or a device's
    /// pinned BF16 bits or 8-bit codes. No copy out of it may be in flight.
    fn host_values_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<HostValuesMut<'t>> {
        self.host_f32_mut(t).map(HostValuesMut::F32)
    }
    /// Strided 2-D copy `dst = src` (same logical shape; converts dtype).
    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()>;
    /// Sets every element to `value`.
    fn fill(&self, t: &mut Tensor<Self>, value: f32) -> Result<()>;
    /// `y += alpha * x` elementwise (same number of elements).
    fn axpy(&self, y: &mut Tensor<Self>, alpha: f32, x: &Tensor<Self>) -> Result<()>;
    /// `x[r, c] += bias[c]`: a bias row added to every row of a view (a
    /// projection's q/k/v bias, `bias` a `[1, cols]` view in the dtype of
    /// `x` or F32).
    fn add_bias_rows(&self, x: MatMut<'_, Self>, bias: Mat<'_, Self>) -> Result<()>;
    /// `dbias[c] += Σ_r dy[r, c]`: a bias's gradient, the column sums of a
    /// view (`dbias` an F32 `[1, cols]` view; summed in a fixed order).
    fn bias_grad(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()>;
    /// Sum of squares of all elements (forces a sync on devices).
    fn sum_squares(&self, t: &Tensor<Self>) -> Result<f64>;
    /// Sum of squares of all elements of every tensor of `ts` (one sync on
    /// devices, however many tensors): what a gradient norm reads.
    fn sum_squares_all(&self, ts: &[&Tensor<Self>]) -> Result<f64> {
        let mut s = 0.0;
        for t in ts {
            s += self.sum_squares(t)?;
        }
        Ok(s)
    }

    /// RMSNorm over the last dim ([`RmsNormFwd`]): `y = x / rms(x) * w`
    /// (with `norm`'s eps and weight offset); x, y `[n, dim]`, w `[dim]`.
    /// Checks the call once for every device ([`RmsNormFwd::check`]) and
    /// runs it ([`run_rms_norm_fwd`](Backend::run_rms_norm_fwd)); devices
    /// do not override it.
    fn rms_norm_fwd(&self, a: RmsNormFwd<'_, Self>) -> Result<()> {
        let rows = a.check()?;
        self.run_rms_norm_fwd(rows, a)
    }
    /// The device's arithmetic of a norm of `rows` rows that
    /// [`rms_norm_fwd`](Backend::rms_norm_fwd) checked.
    fn run_rms_norm_fwd(&self, rows: usize, a: RmsNormFwd<'_, Self>) -> Result<()>;
    /// RMSNorm backward ([`RmsNormBwd`]): writes `dx`, accumulates `dw`
    /// (`None`: a frozen norm weight, whose gradient is not computed).
    /// Checks the call once for every device ([`RmsNormBwd::check`]) and
    /// runs it ([`run_rms_norm_bwd`](Backend::run_rms_norm_bwd)).
    fn rms_norm_bwd(&self, a: RmsNormBwd<'_, Self>) -> Result<()> {
        let rows = a.check()?;
        self.run_rms_norm_bwd(rows, a)
    }
    /// The device's arithmetic of a backward [`rms_norm_bwd`](Backend::rms_norm_bwd) checked.
    fn run_rms_norm_bwd(&self, rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()>;
    /// A residual add and the RMSNorm of its sum in one pass
    /// ([`AddRmsNormFwd`]): `x += y` (rounded to x's dtype, as
    /// [`axpy`](Backend::axpy) with alpha 1 rounds it), then `out = x /
    /// rms(x) * w` of the rounded sum, as
    /// [`rms_norm_fwd`](Backend::rms_norm_fwd) computes it; x, y, out
    /// `[n, dim]` (x F32 or the dtype of y, as for `axpy`), w `[dim]`.
    /// Equal, bit for bit, to `axpy(x, 1, y)` then `rms_norm_fwd`. Checks
    /// the call once for every device ([`AddRmsNormFwd::check`]) and runs
    /// it ([`run_add_rms_norm_fwd`](Backend::run_add_rms_norm_fwd)).
    fn add_rms_norm_fwd(&self, a: AddRmsNormFwd<'_, Self>) -> Result<()> {
        let rows = a.check()?;
        self.run_add_rms_norm_fwd(rows, a)
    }
    /// The device's arithmetic of a call [`add_rms_norm_fwd`](Backend::add_rms_norm_fwd) checked.
    fn run_add_rms_norm_fwd(&self, rows: usize, a: AddRmsNormFwd<'_, Self>) -> Result<()>;
    /// RMSNorm backward into a residual gradient ([`RmsNormBwd`]): `dx +=
    /// rms_norm_bwd(x, w, dy)`, `dx` holding the gradient that reaches `x`
    /// along the residual path. The norm's gradient is rounded to dx's
    /// dtype before the add (rounded again), so the result equals, bit for
    /// bit, `rms_norm_bwd` into a temporary `t` then `axpy(dx, 1, t)`,
    /// without the temporary. Accumulates `dw` (if any) as `rms_norm_bwd`
    /// does. Checked as [`rms_norm_bwd`](Backend::rms_norm_bwd), then run
    /// ([`run_rms_norm_bwd_add`](Backend::run_rms_norm_bwd_add)).
    fn rms_norm_bwd_add(&self, a: RmsNormBwd<'_, Self>) -> Result<()> {
        let rows = a.check()?;
        self.run_rms_norm_bwd_add(rows, a)
    }
    /// The device's arithmetic of a call [`rms_norm_bwd_add`](Backend::rms_norm_bwd_add) checked.
    fn run_rms_norm_bwd_add(&self, rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()>;
    /// Rotary embedding in place ([`RopeRotate`]), HF "rotate half"
    /// convention. `x: [s, n_heads, d]`, `cos, sin: [s, d/2]` (f32);
    /// `inverse` rotates by the negative angle (the backward). Checks the
    /// call once for every device ([`RopeRotate::check`]) and runs it
    /// ([`run_rope`](Backend::run_rope)).
    fn rope(&self, a: RopeRotate<'_, Self>) -> Result<()> {
        let g = a.check()?;
        self.run_rope(g, a)
    }
    /// The device's arithmetic of a rotation of geometry `g` that
    /// [`rope`](Backend::rope) checked.
    fn run_rope(&self, g: RopeShape, a: RopeRotate<'_, Self>) -> Result<()>;

    /// Attention forward ([`AttentionFwd`]): `o = softmax(scale·q·kᵀ) v`
    /// and its LSE, `q: [sq, hq, d]`, `k, v: [sk, hkv, d]` with `hq % hkv
    /// == 0`. Checks the call once for every device ([`AttentionFwd::check`])
    /// and runs it ([`run_attention_fwd`](Backend::run_attention_fwd));
    /// devices do not override it.
    fn attention_fwd(&self, a: AttentionFwd<'_, Self>) -> Result<()> {
        let g = a.check()?;
        self.run_attention_fwd(&g, a)
    }
    /// The device's arithmetic of a forward of geometry `g` that
    /// [`attention_fwd`](Backend::attention_fwd) checked.
    fn run_attention_fwd(&self, g: &AttnShape, a: AttentionFwd<'_, Self>) -> Result<()>;
    /// Attention backward ([`AttentionBwd`]) given the final `o` and `lse`
    /// of the full row (also when the call covers only one key block of it):
    /// adds into or overwrites `dq` and `dk`, `dv` as `writes` says. Checks
    /// the call once for every device ([`AttentionBwd::check`]) and runs it
    /// ([`run_attention_bwd`](Backend::run_attention_bwd)); devices do not
    /// override it.
    fn attention_bwd(&self, a: AttentionBwd<'_, Self>) -> Result<()> {
        let g = a.check()?;
        self.run_attention_bwd(&g, a)
    }
    /// The device's arithmetic of a backward of geometry `g` that
    /// [`attention_bwd`](Backend::attention_bwd) checked.
    fn run_attention_bwd(&self, g: &AttnShape, a: AttentionBwd<'_, Self>) -> Result<()>;
    /// Whether [`attention_bwd`](Backend::attention_bwd) of a call of
    /// geometry `g` (queries and keys alike, all in the compute dtype)
    /// writes an overwritten compute-dtype gradient in place, with no F32
    /// scratch: then a caller whose one call makes a gradient whole keeps
    /// it in the compute dtype for free. True where the compute dtype is F32.
    fn attention_bwd_in_place(&self, _g: &AttnShape) -> bool {
        self.compute_dtype() == DType::F32
    }
    /// Merges a partial attention result into a running one by log-sum-exp
    /// ([`LseMerge`]). Checks the call once for every device
    /// ([`LseMerge::check`]) and runs it ([`run_lse_merge`](Backend::run_lse_merge));
    /// devices do not override it.
    fn lse_merge(&self, a: LseMerge<'_, Self>) -> Result<()> {
        a.check()?;
        self.run_lse_merge(a)
    }
    /// The device's arithmetic of a merge [`lse_merge`](Backend::lse_merge) checked.
    fn run_lse_merge(&self, a: LseMerge<'_, Self>) -> Result<()>;

    /// A gated MLP's activation: `out = act(gate) · up` (SwiGLU, GeGLU).
    fn gated_act_fwd(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()>;
    /// Writes `dgate`, `dup` of [`gated_act_fwd`](Backend::gated_act_fwd)
    /// from `dout`.
    fn gated_act_bwd(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()>;
    /// `out[i] = scale · table[ids[i]]`, the product in f32 rounded to
    /// out's dtype; table `[vocab, hidden]`, out `[n, hidden]`. A family's
    /// embedding scale (Gemma's `√hidden`, `ModelConfig::embed_scale`), 1
    /// for the rest (the rows copied exactly).
    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()>;
    /// Accumulates `dtable[ids[i]] += scale · dout[i]`, the product in f32
    /// rounded to dout's dtype first (the scaled rows' gradient as the
    /// compute dtype holds it), then added in F32.
    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        dtable: &mut Tensor<Self>,
    ) -> Result<()>;
    /// Fused softmax cross-entropy on a chunk of logits `[n, vocab]`, in
    /// place: accumulates the summed loss of rows whose target is not
    /// `IGNORE` into `loss_sum` (`[1]`, f32) and overwrites `logits` with
    /// `dlogits = grad_scale * (softmax - onehot)` (zero rows for ignored
    /// targets), so a chunk's logits and their gradient share one buffer.
    fn cross_entropy(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()>;
    /// One fused optimizer update of `slots`, its arithmetic `kernel`'s
    /// ([`UpdateKernel`]: the optimizer's): run on the host over the slots'
    /// cells (the CPU), or as the kernel's launches of its program over
    /// their device addresses (a GPU); a rehearsal runs nothing. The caller
    /// has checked the slots for the kernel.
    fn fused_update(
        &self,
        kernel: &dyn UpdateKernel,
        slots: &mut [UpdateSlot<'_, Self>],
    ) -> Result<()>;
}

/// A host-resident tensor's elements ([`Backend::host_values`]).
#[derive(Debug, Clone, Copy)]
pub enum HostValues<'t> {
    F32(&'t [f32]),
    /// BF16 bits: each value is `f32::from_bits((bits as u32) << 16)`.
    Bf16(&'t [u16]),
}

/// A host-resident tensor's elements, writable
/// ([`Backend::host_values_mut`]).
#[derive(Debug)]
pub enum HostValuesMut<'t> {
    /// F32 cells: an F32 tensor's values, or the CPU's cells of any dtype.
    F32(&'t mut [f32]),
    /// BF16 bits.
    Bf16(&'t mut [u16]),
    /// 8-bit codes.
    U8(&'t mut [u8]),
}

/// Target id that contributes no loss (e.g. the last token of a sequence).
pub const IGNORE: u32 = u32::MAX;
