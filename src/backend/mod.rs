//! Backends: the only code that touches memory and kernels.
//!
//! A [`Backend`] owns one device (one rank). It hands out [`Tensor`]s whose
//! bytes are recorded in its [`MemoryLedger`], and runs the ops the model
//! needs on them. Strategies and the model are written once against this
//! trait; the CPU f32 backend is the reference every other backend is tested
//! against.

pub mod adamw_multi;
pub mod adamw_step;
pub mod arena;
pub mod bounded_mask;
pub mod compact_adamw;
pub mod counting;
pub mod cpu;
pub mod cuda;
pub mod host_adamw;
pub mod mask;
pub mod memory;
pub mod norm_args;
pub mod profile;
pub mod rehearsal;
pub mod tensor;

pub use adamw_multi::{AdamWPiece, AdamWSlot};
pub use adamw_step::AdamWStep;
pub use mask::{AttnMask, BoundedMask, RowPositions};
pub use memory::{Bytes, Category, MemoryLedger, MemoryStats};
pub use tensor::{DType, Mat, MatLayout, MatMut, Rows, RowsMut, Tensor, TensorRef};

use crate::error::Result;
use std::sync::Arc;

/// How [`Backend::attention_bwd`] writes one gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `grad += ...`: ring steps and the stages of a kv phase add up.
    Add,
    /// `grad = ...`: the call is the gradient's only contribution, so its
    /// buffer needs no zeroing and can be in the compute dtype (on cuDNN the
    /// kernel writes it directly, with no scratch and no add).
    Overwrite,
}

/// How [`Backend::attention_bwd`] writes `dq` and `dk`/`dv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnGradWrites {
    pub dq: GradWrite,
    pub dkv: GradWrite,
}

impl AttnGradWrites {
    /// Every gradient added into.
    pub const ADD: AttnGradWrites = AttnGradWrites {
        dq: GradWrite::Add,
        dkv: GradWrite::Add,
    };
}

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
pub trait Backend: Send + Sync + Sized + 'static {
    /// Device storage of one tensor.
    type Storage: Send + Sync;

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
    /// The most bytes the device allocator held from the device (its reserved
    /// high-water, fragmentation included) since the last reset; `None`
    /// where there is no pool beside the ledger (the CPU).
    fn reserved_peak(&self) -> Result<Option<usize>> {
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

    /// RMSNorm over the last dim: `y = x / rms(x) * w`; x, y `[n, dim]`, w `[dim]`.
    fn rms_norm_fwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        y: &mut Tensor<Self>,
    ) -> Result<()>;
    /// RMSNorm backward: writes `dx`, accumulates `dw` (`None`: a frozen
    /// norm weight, whose gradient is not computed).
    fn rms_norm_bwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        eps: f32,
        dx: &mut Tensor<Self>,
        dw: Option<&mut Tensor<Self>>,
    ) -> Result<()>;
    /// A residual add and the RMSNorm of its sum in one pass: `x += y`
    /// (rounded to x's dtype, as [`axpy`](Backend::axpy) with alpha 1
    /// rounds it), then `out = x / rms(x) * w` of the rounded sum, as
    /// [`rms_norm_fwd`](Backend::rms_norm_fwd) computes it; x, y, out
    /// `[n, dim]` (x F32 or the dtype of y, as for `axpy`), w `[dim]`.
    /// Equal, bit for bit, to `axpy(x, 1, y)` then `rms_norm_fwd(x, w, eps,
    /// out)`.
    fn add_rms_norm_fwd(
        &self,
        x: &mut Tensor<Self>,
        y: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()>;
    /// RMSNorm backward into a residual gradient: `dx += rms_norm_bwd(x, w,
    /// dy)`, `dx` holding the gradient that reaches `x` along the residual
    /// path. The norm's gradient is rounded to dx's dtype before the add
    /// (rounded again), so the result equals, bit for bit, `rms_norm_bwd`
    /// into a temporary `t` then `axpy(dx, 1, t)`, without the temporary.
    /// Accumulates `dw` (if any) as `rms_norm_bwd` does.
    fn rms_norm_bwd_add(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        eps: f32,
        dx: &mut Tensor<Self>,
        dw: Option<&mut Tensor<Self>>,
    ) -> Result<()>;
    /// Rotary embedding in place, HF "rotate half" convention. `x: [s, n_heads, d]`,
    /// `cos, sin: [s, d/2]` (f32). `inverse` rotates by the negative angle (the backward).
    fn rope(
        &self,
        x: &mut Tensor<Self>,
        cos: &Tensor<Self>,
        sin: &Tensor<Self>,
        inverse: bool,
    ) -> Result<()>;

    /// Attention forward on token rows. `q: [sq, hq, d]`, `k, v: [sk, hkv, d]` with
    /// `hq % hkv == 0` (query head `h` uses kv head `h / (hq/hkv)`); writes
    /// `o: [sq, hq, d]` and `lse: [sq, hq]` (natural log). Row `i` sees the
    /// keys `mask` allows (`mask.visible_keys(i, sk)`; a causal mask needs
    /// `sq == sk`, [`AttnMask::check_shape`]).
    fn attention_fwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        mask: &AttnMask,
        o: RowsMut<'_, Self>,
        lse: RowsMut<'_, Self>,
    ) -> Result<()>;
    /// Attention backward given the final `o` and `lse` of the full row (also when
    /// this call covers only one key block of it). Adds into or overwrites
    /// `dq` and `dk`, `dv` as `writes` says.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        o: Rows<'_, Self>,
        d_o: Rows<'_, Self>,
        lse: Rows<'_, Self>,
        mask: &AttnMask,
        dq: RowsMut<'_, Self>,
        dk: RowsMut<'_, Self>,
        dv: RowsMut<'_, Self>,
        writes: AttnGradWrites,
    ) -> Result<()>;
    /// Whether [`attention_bwd`](Backend::attention_bwd) under `mask` of
    /// `[s, hq, d]` queries over `[s, hkv, d]` keys, all in the compute
    /// dtype, writes an overwritten compute-dtype gradient in place, with no
    /// F32 scratch: then a caller whose one call makes a gradient whole keeps
    /// it in the compute dtype for free. True where the compute dtype is F32.
    fn attention_bwd_in_place(
        &self,
        _s: usize,
        _hq: usize,
        _hkv: usize,
        _d: usize,
        _mask: &AttnMask,
    ) -> bool {
        self.compute_dtype() == DType::F32
    }
    /// Merges a partial attention result into a running one by log-sum-exp:
    /// `o_acc, lse_acc <- merge((o_acc, lse_acc), (o_blk, lse_blk))`.
    fn lse_merge(
        &self,
        o_acc: RowsMut<'_, Self>,
        lse_acc: RowsMut<'_, Self>,
        o_blk: Rows<'_, Self>,
        lse_blk: Rows<'_, Self>,
    ) -> Result<()>;

    /// `out = silu(gate) * up`.
    fn swiglu_fwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()>;
    /// Writes `dgate`, `dup` from `dout`.
    fn swiglu_bwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()>;
    /// `out[i] = table[ids[i]]`; table `[vocab, hidden]`, out `[n, hidden]`.
    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        out: &mut Tensor<Self>,
    ) -> Result<()>;
    /// Accumulates `dtable[ids[i]] += dout[i]`.
    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
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
    /// One AdamW update of elements `elems` of `param` (f32) with `grad`,
    /// moments `m`, `v` (f32): four tensors of one length, of which only
    /// that range is read and written (a flat FSDP shard holds parameters
    /// with different weight decay side by side).
    fn adamw(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        elems: std::ops::Range<usize>,
        hp: AdamWStep,
    ) -> Result<()>;
    /// [`adamw`](Backend::adamw) of every piece of `slots` in one op (a
    /// launch per 32 pieces on a GPU), each piece its elements and
    /// hyper-parameters; for a slot with `narrow`, each updated element of
    /// its `target` also written there in its dtype (as
    /// [`copy`](Backend::copy) rounds). Bit-identical to a call per piece
    /// followed by that copy of the pieces' elements. Each slot's pieces
    /// ascending and disjoint ([`adamw_multi::check_adamw_slot`]).
    fn adamw_multi(&self, slots: &mut [AdamWSlot<'_, Self>]) -> Result<()>;
}

/// Checks that every token id indexes a `vocab`-row embedding table.
/// A host-resident tensor's elements ([`Backend::host_values`]).
#[derive(Debug, Clone, Copy)]
pub enum HostValues<'t> {
    F32(&'t [f32]),
    /// BF16 bits: each value is `f32::from_bits((bits as u32) << 16)`.
    Bf16(&'t [u16]),
}

pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= vocab) {
        Some(id) => Err(crate::Error::Config(format!(
            "token id {id} is outside the vocabulary of {vocab}; check the tokenizer matches the model"
        ))),
        None => Ok(()),
    }
}

/// A copy started by [`Backend::copy_start`]: later device work is ordered
/// after it ([`Backend::copy_wait`], no host wait) or the host waits for it
/// ([`Backend::copy_finish`]); `None`: the copy is done.
pub struct CopyDone(Option<Box<dyn InFlight>>);

/// A point in a device's order of queued work ([`Backend::compute_point`]):
/// the device's own marker (a CUDA event), or none on the CPU.
pub struct ComputePoint(Option<Box<dyn std::any::Any + Send>>);

impl ComputePoint {
    /// No work in flight to follow.
    pub fn none() -> Self {
        ComputePoint(None)
    }
    /// A device's marker.
    pub fn marker(m: Box<dyn std::any::Any + Send>) -> Self {
        ComputePoint(Some(m))
    }
    /// The device's marker, if it is a `T`.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.0.as_ref().and_then(|m| m.downcast_ref::<T>())
    }
}

/// What a device's copy in flight can be asked.
pub trait InFlight: Send {
    /// Makes later work on the device wait for the copy.
    fn join(self: Box<Self>) -> Result<()> {
        self.order()
    }
    /// [`join`](InFlight::join), keeping the copy to wait for later.
    fn order(&self) -> Result<()>;
    /// Blocks the host until the copy is done.
    fn finish(self: Box<Self>) -> Result<()>;
}

impl CopyDone {
    /// A copy that has already finished.
    pub fn finished() -> Self {
        CopyDone(None)
    }
    /// A copy in flight.
    pub fn in_flight(copy: Box<dyn InFlight>) -> Self {
        CopyDone(Some(copy))
    }
    fn join(self) -> Result<()> {
        self.0.map_or(Ok(()), |c| c.join())
    }
    fn order(&self) -> Result<()> {
        self.0.as_ref().map_or(Ok(()), |c| c.order())
    }
    fn finish(self) -> Result<()> {
        self.0.map_or(Ok(()), |c| c.finish())
    }
}

/// Checks that `elems` lies inside a tensor of `numel` elements (`op` names the caller).
pub fn check_elems(elems: &std::ops::Range<usize>, numel: usize, op: &str) -> Result<()> {
    if elems.start > elems.end || elems.end > numel {
        return Err(crate::Error::Backend(format!(
            "{op}: elements {elems:?} are outside a tensor of {numel}"
        )));
    }
    Ok(())
}

/// Checks that `a` and `b` hold as many elements (`op` names the caller).
pub fn check_same_numel<B: Backend>(a: &Tensor<B>, b: &Tensor<B>, op: &str) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(crate::Error::Backend(format!(
            "{op}: element counts differ ({:?} vs {:?})",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

/// The query heads, kv heads and head dim of an attention call of `q`
/// `[sq, hq, d]` over `k` `[sk, hkv, d]` under `mask`: a GQA pair (hq a
/// multiple of hkv, one head dim) of lengths the mask allows.
pub fn attention_heads<B: Backend>(
    q: &Rows<'_, B>,
    k: &Rows<'_, B>,
    mask: &AttnMask,
) -> Result<(usize, usize, usize)> {
    let (hq, hkv, d) = (q.heads(), k.heads(), q.head_dim());
    if hkv == 0 || !hq.is_multiple_of(hkv) || k.head_dim() != d {
        return Err(crate::Error::Backend(format!(
            "attention: q {:?} and k {:?} do not form a GQA pair",
            q.t.shape(),
            k.t.shape()
        )));
    }
    if let Err(why) = mask.check_shape(q.len(), k.len()) {
        return Err(crate::Error::Backend(format!("attention: {why}")));
    }
    Ok((hq, hkv, d))
}

/// The error of an allocation of `requested` bytes that `device` could not
/// make, with the bytes its ledger holds by category.
pub fn out_of_memory(device: &str, ledger: &MemoryLedger, requested: usize) -> crate::Error {
    let s = ledger.stats();
    let by = s
        .current_by_category
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(c, b)| format!("{}: {}", c.name(), Bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ");
    crate::Error::OutOfMemory {
        device: device.to_string(),
        requested,
        in_use: s.current,
        by_category: by,
    }
}

/// Target id that contributes no loss (e.g. the last token of a sequence).
pub const IGNORE: u32 = u32::MAX;

/// `t` in `dtype`: borrowed when it already is, else a converted copy (category `Workspace`).
pub fn cast_ref<'a, B: Backend>(b: &B, t: &'a Tensor<B>, dtype: DType) -> Result<TensorRef<'a, B>> {
    if t.dtype() == dtype {
        return Ok(TensorRef::Borrowed(t));
    }
    Ok(TensorRef::Owned(cast(b, t, dtype, Category::Workspace)?))
}

/// A converted copy of `t` in `dtype`.
pub fn cast<B: Backend>(b: &B, t: &Tensor<B>, dtype: DType, cat: Category) -> Result<Tensor<B>> {
    // the copy writes every element: nothing to zero first
    let mut out = b.empty(t.shape(), dtype, cat)?;
    b.copy(out.mat_mut(), t.mat())?;
    Ok(out)
}

/// Checks the views of [`Backend::add_bias_rows`] / [`Backend::bias_grad`]:
/// `bias` one untransposed row as wide as `x`, `x` untransposed.
pub fn check_bias_views(x: &MatLayout, bias: &MatLayout, op: &str) -> Result<()> {
    if bias.rows != 1 || bias.cols != x.cols || bias.trans || x.trans {
        return Err(crate::Error::Backend(format!(
            "{op}: a bias row {bias:?} for the rows of {x:?}"
        )));
    }
    Ok(())
}
