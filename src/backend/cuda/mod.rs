//! The CUDA backend: one GPU, one stream, bf16 compute.
//!
//! - [`libs`]: finds and loads the CUDA libraries (never panics when one is missing);
//! - [`device`]: driver queries (`upipe info`);
//! - [`pool`]: the stream-ordered pool allocator behind every tensor;
//! - [`nvrtc`] + [`kernels`]: our CUDA C kernels, compiled at run time to a
//!   cubin for the device's arch and cached on disk;
//! - [`gemm`]: cuBLASLt GEMM on row-major views;
//! - [`attention`] + [`flash`]: attention; the native FlashAttention-2 kernels
//!   (compiled on first use, through the same disk cache) for bf16 with head
//!   dim 64/128 on sm_90+, the naive kernels for everything else.
//!
//! Here: [`CudaBackend`] (opening the device, streams, synchronisation) and
//! its one `impl Backend`, which hands each heavy op to the file of its family:
//! `memory_ops.rs` (allocation, uploads/downloads, copies), `attention_ops.rs`
//! (attention routing, `lse_merge`), `elementwise_ops.rs` (fill, axpy, norms,
//! RoPE, SwiGLU, embedding, loss, AdamW) and [`gemm`] (`gemm`).
//!
//! Every op is queued on the backend's stream; `to_host`, `sum_squares` and
//! `synchronize` wait for it.

mod adamw_compact;
mod adamw_multi;
pub mod attention;
mod attention_ops;
pub mod counted;
pub mod cudnn;
pub mod device;
mod elementwise_ops;
pub mod flash;
pub mod gemm;
pub mod host_pool;
pub mod kernels;
pub mod libs;
mod memory_ops;
pub mod nvrtc;
pub mod op_buffers;
pub mod pinned;
pub mod pool;
pub mod profile;
mod rehearsal;
pub mod tuning;

pub use self::attention::AttentionKernels;
use self::attention::dt_flag;
pub use self::attention_ops::AttentionCalls;
use self::device::drv;
use self::gemm::Gemm;
use self::kernels::{Args, Kernels, grid_for, launch};
use self::pool::{CudaStorage, Pool, PoolStats};
use super::{
    AdamWSlot, AdamWStep, AttnGradWrites, AttnMask, Backend, Category, ComputePoint, CopyDone,
    DType, HostValues, Mat, MatMut, MemoryLedger, Rows, RowsMut, Tensor, TensorDevice,
};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, result};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

pub use pool::CudaStorage as Storage;

const BLOCK: u32 = 256;

/// The CUDA backend of one GPU.
pub struct CudaBackend {
    name: String,
    arch: String,
    ledger: Arc<MemoryLedger>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Arc<Pool>,
    /// Device-host copies (`copy_start`), beside compute.
    copy_stream: Arc<CudaStream>,
    /// Pinned host memory of `Category::Offload` tensors.
    host_pool: Arc<host_pool::HostPool>,
    kernels: Kernels,
    gemm: Gemm,
    /// cuBLASLt workspace, allocated on first GEMM (Workspace category).
    gemm_ws: OnceLock<Tensor<CudaBackend>>,
    /// Which attention kernels to use.
    attn_kernels: AttentionKernels,
    /// Compute capability major (the flash kernels need 9+).
    cc_major: i32,
    /// The flash kernels, compiled (or read from the disk cache) and loaded on
    /// first use; `Ok(None)` where they do not apply (pre-sm_90 or Naive).
    flash: OnceLock<std::result::Result<Option<flash::FlashFunctions>, String>>,
    /// Attention calls by path: flash fwd, flash bwd, naive fwd, naive bwd.
    attn_calls: [AtomicU64; 6],
    /// cuDNN SDPA vs our own kernels (`UPIPE_ATTN_KERNEL=auto|cudnn|native`).
    attn_kernel: cudnn::AttnKernel,
    /// The kernel the run decided on (`set_attention_kernel`): every call is
    /// served by it or fails; `None`: `attn_kernel` decides per call.
    run_kernel: Option<cudnn::AttentionKernel>,
    /// The per-row key bounds of the last documents-masked attention call
    /// (`attention_ops.rs` `mask_bounds`): the bounds and their device copy.
    mask_bounds: std::sync::Mutex<Option<(Vec<u32>, Tensor<CudaBackend>)>>,
    /// cuDNN SDPA, created on first use; `Err` holds why it is unavailable.
    cudnn: OnceLock<std::result::Result<cudnn::CudnnSdpa, String>>,
    /// GPU time by op when `UPIPE_PROFILE` is set.
    profile: profile::OpProfile,
    /// The first fatal communication error on this GPU (set by the NCCL
    /// watchdog, `comm::nccl`); every later synchronisation returns it.
    comm_fault: Arc<OnceLock<String>>,
}

fn need(t: &Tensor<CudaBackend>, d: DType, op: &str, what: &str) -> Result<()> {
    if t.dtype() != d {
        return Err(Error::Backend(format!(
            "{op}: {what} must be {d:?}, got {:?} (see the Backend dtype contract)",
            t.dtype()
        )));
    }
    Ok(())
}

/// Device address of a tensor.
fn ptr(t: &Tensor<CudaBackend>) -> u64 {
    t.storage().ptr()
}

/// Device address of element `elem` of `t`.
fn ptr_at(t: &Tensor<CudaBackend>, elem: usize) -> u64 {
    ptr(t) + (elem * t.dtype().size()) as u64
}

fn dt(t: &Tensor<CudaBackend>) -> i32 {
    dt_flag(t.dtype())
}

impl CudaBackend {
    /// Opens GPU `ordinal`: loads the libraries, creates the context, stream and
    /// pool, and compiles (or loads cached) kernels. Errors (never panics) when
    /// the driver, a library or the device is missing.
    ///
    /// Attention uses the flash kernels where they apply unless
    /// `UPIPE_ATTENTION=naive` (see [`CudaBackend::with_attention`]).
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        Self::with_attention(ordinal, AttentionKernels::from_env()?)
    }

    /// As [`CudaBackend::new`] with an explicit choice of attention kernels.
    pub fn with_attention(ordinal: usize, attn_kernels: AttentionKernels) -> Result<CudaBackend> {
        device::init_driver()?;
        let count = drv(result::device::get_count(), "cuDeviceGetCount")?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Backend(format!(
                "no CUDA device {ordinal}: the driver sees {count}; check CUDA_VISIBLE_DEVICES"
            )));
        }
        let ctx = drv(CudaContext::new(ordinal), "create context")?;
        let stream = drv(ctx.new_stream(), "create stream")?;
        let (maj, min) = drv(ctx.compute_capability(), "compute capability")?;
        let arch = std::env::var("UPIPE_CUDA_ARCH").unwrap_or_else(|_| format!("sm_{maj}{min}"));
        let gpu_name = drv(ctx.name(), "device name")?;
        let pool = Pool::new(ctx.clone(), stream.clone())?;
        let copy_stream = drv(ctx.new_stream(), "create copy stream")?;
        let profile = profile::OpProfile::from_env()
            .with_idle_of(&stream)
            .with_copy_stream(&copy_stream);
        let host_pool = host_pool::HostPool::new(ctx.clone(), copy_stream.clone());
        let kernels = Kernels::load(&arch)?;
        let gemm = Gemm::new()?;
        Ok(CudaBackend {
            name: format!("cuda:{ordinal} ({gpu_name})"),
            arch,
            ledger: Arc::new(MemoryLedger::new()),
            ctx,
            stream,
            pool,
            copy_stream,
            host_pool,
            kernels,
            gemm,
            gemm_ws: OnceLock::new(),
            attn_kernels,
            cc_major: maj,
            flash: OnceLock::new(),
            attn_calls: Default::default(),
            // forcing the naive kernels means our own kernels, not cuDNN
            attn_kernel: match (attn_kernels, std::env::var("UPIPE_ATTN_KERNEL")) {
                (AttentionKernels::Naive, _) => cudnn::AttnKernel::Native,
                (_, Ok(v)) => v.parse()?,
                (_, Err(_)) => cudnn::AttnKernel::Auto,
            },
            run_kernel: None,
            mask_bounds: std::sync::Mutex::new(None),
            cudnn: OnceLock::new(),
            profile,
            comm_fault: Arc::new(OnceLock::new()),
        })
    }

    /// Times the op about to be queued on the backend's stream (when
    /// profiling is on); the span ends when the returned guard drops.
    pub fn span(&self, kind: &'static str) -> Result<Option<profile::Span<'_>>> {
        self.profile.span(kind, &self.stream)
    }

    /// As [`Self::span`], with the op's shape for `UPIPE_PROFILE=shapes`.
    pub fn span_shaped(
        &self,
        kind: &'static str,
        shape: impl FnOnce() -> String,
    ) -> Result<Option<profile::Span<'_>>> {
        self.profile.span_shaped(kind, &self.stream, shape)
    }

    /// The op profile (`UPIPE_PROFILE=1`), for spans on other streams and totals.
    pub fn profile(&self) -> &profile::OpProfile {
        &self.profile
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Waits until the stream's queued work is done by polling an event, not
    /// by blocking inside the driver: a thread blocked in a CUDA call can hold
    /// locks the NCCL watchdog's event queries need (2×H200, NCCL 2.28.3: a
    /// download waiting on a collective whose peer had left stalled the
    /// watchdog thread until the process was killed). Returns the
    /// communication fault as soon as the watchdog records one.
    fn wait_idle(&self) -> Result<()> {
        let done = drv(
            self.stream.record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            )),
            "record event",
        )?;
        let start = std::time::Instant::now();
        loop {
            if drv(done.try_is_complete(), "query event")? {
                return Ok(());
            }
            if let Some(m) = self.comm_fault.get() {
                return Err(Error::Comm(m.clone()));
            }
            if start.elapsed() < std::time::Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Where a fatal communication error is recorded (once): after it is set,
    /// [`Backend::synchronize`] (and so every download) returns it as
    /// [`Error::Comm`], since data received since then is not to be trusted.
    pub fn comm_fault(&self) -> &Arc<OnceLock<String>> {
        &self.comm_fault
    }
    /// The arch kernels were compiled for (e.g. `sm_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// Whether the kernels' cubin came from the disk cache.
    pub fn kernels_from_cache(&self) -> bool {
        self.kernels.source == nvrtc::CubinSource::DiskCache
    }
    /// Number of cached cuBLASLt plans.
    pub fn gemm_plans(&self) -> usize {
        self.gemm.cached_plans()
    }
    /// Number of cuBLASLt plans whose algorithm was picked by timing.
    pub fn gemm_tuned_plans(&self) -> usize {
        self.gemm.tuned_plans()
    }
    /// How cuBLASLt algorithms are picked.
    pub fn gemm_pick(&self) -> tuning::GemmPick {
        self.gemm.pick()
    }
    /// Picks cuBLASLt algorithms by `pick` from now on (`UPIPE_GEMM_ALGO`
    /// otherwise).
    pub fn set_gemm_pick(&mut self, pick: tuning::GemmPick) {
        self.gemm.set_pick(pick);
    }
    /// Device address of a tensor (for kernels launched outside the backend, e.g. flash).
    pub fn device_ptr(&self, t: &Tensor<Self>) -> u64 {
        ptr(t)
    }
    /// The pool's own counters (used / reserved, current and high-water), to
    /// cross-check the ledger: after a sync, `used_high >= ledger.peak()`.
    pub fn pool_stats(&self) -> Result<PoolStats> {
        self.synchronize()?;
        self.pool.stats()
    }
    /// Resets the pool's high-water marks (pair with `ledger().reset_peak()`).
    pub fn reset_pool_peak(&self) -> Result<()> {
        self.synchronize()?;
        self.pool.reset_high()
    }

    fn bind(&self) -> Result<()> {
        drv(self.ctx.bind_to_thread(), "bind context")
    }

    fn launch1d(&self, f: kernels::Func, n: usize, args: Args) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        launch(&self.stream, f, grid_for(n, BLOCK), BLOCK, 0, args)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
    }
}

impl TensorDevice for CudaBackend {
    type Storage = CudaStorage;
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn compute_dtype(&self) -> DType {
        DType::BF16
    }
    fn reserved_peak(&self) -> Result<Option<usize>> {
        Ok(Some(self.pool_stats()?.reserved_high as usize))
    }

    fn copy_start(&self, dst: &mut Tensor<Self>, src: &Tensor<Self>) -> Result<CopyDone> {
        self.copy_start_impl(dst, src)
    }

    fn compute_point(&self) -> Result<ComputePoint> {
        self.compute_point_impl()
    }

    fn copy_start_from(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        since: &ComputePoint,
    ) -> Result<CopyDone> {
        self.copy_start_from_impl(dst, src, since)
    }

    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        self.host_f32_impl(t)
    }

    fn host_values<'t>(&self, t: &'t Tensor<Self>) -> Result<HostValues<'t>> {
        self.host_values_impl(t)
    }

    fn host_bf16_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [u16]> {
        self.host_bf16_mut_impl(t)
    }

    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        self.host_f32_mut_impl(t)
    }

    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.zeros_impl(shape, dtype, cat)
    }

    fn empty(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.bind()?;
        self.alloc(shape, dtype, cat)
    }

    fn from_host(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        self.tensor_from_host_impl(data, shape, dtype, cat)
    }

    fn upload(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()> {
        self.upload_impl(t, data)
    }

    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        self.to_host_impl(t)
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.wait_idle()?;
        match self.comm_fault.get() {
            Some(m) => Err(Error::Comm(m.clone())),
            None => Ok(()),
        }
    }

    fn enable_profile(&self) {
        self.profile.enable();
    }
    fn set_phase(&self, phase: crate::backend::profile::Phase) {
        self.profile.set_phase(phase);
    }
    fn take_profile(&self) -> Result<Option<crate::backend::profile::StepProfile>> {
        if !self.profile.enabled() {
            return Ok(None);
        }
        self.bind()?;
        self.profile.take_step()
    }

    fn gemm(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        self.gemm_impl(c, a, b, alpha, beta)
    }

    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        self.copy_impl(dst, src)
    }

    fn fill(&self, t: &mut Tensor<Self>, value: f32) -> Result<()> {
        self.fill_impl(t, value)
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f32, x: &Tensor<Self>) -> Result<()> {
        self.axpy_impl(y, alpha, x)
    }

    fn sum_squares(&self, t: &Tensor<Self>) -> Result<f64> {
        self.sum_squares_impl(&[t])
    }
    fn sum_squares_all(&self, ts: &[&Tensor<Self>]) -> Result<f64> {
        self.sum_squares_impl(ts)
    }

    fn add_bias_rows(&self, x: MatMut<'_, Self>, bias: Mat<'_, Self>) -> Result<()> {
        self.add_bias_rows_impl(x, bias)
    }

    fn bias_grad(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()> {
        self.bias_grad_impl(dbias, dy)
    }

    fn rms_norm_fwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        y: &mut Tensor<Self>,
    ) -> Result<()> {
        self.rms_norm_fwd_impl(x, w, eps, y)
    }

    fn rms_norm_bwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        eps: f32,
        dx: &mut Tensor<Self>,
        dw: Option<&mut Tensor<Self>>,
    ) -> Result<()> {
        self.rms_norm_bwd_impl(x, w, dy, eps, dx, dw, false)
    }

    fn add_rms_norm_fwd(
        &self,
        x: &mut Tensor<Self>,
        y: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        self.add_rms_norm_fwd_impl(x, y, w, eps, out)
    }

    fn rms_norm_bwd_add(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        eps: f32,
        dx: &mut Tensor<Self>,
        dw: Option<&mut Tensor<Self>>,
    ) -> Result<()> {
        self.rms_norm_bwd_impl(x, w, dy, eps, dx, dw, true)
    }

    fn rope(
        &self,
        x: &mut Tensor<Self>,
        cos: &Tensor<Self>,
        sin: &Tensor<Self>,
        inverse: bool,
    ) -> Result<()> {
        self.rope_impl(x, cos, sin, inverse)
    }

    fn attention_fwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        mask: &AttnMask,
        o: RowsMut<'_, Self>,
        lse: RowsMut<'_, Self>,
    ) -> Result<()> {
        self.attention_fwd_impl(q, k, v, mask, o, lse)
    }

    fn attention_bwd_in_place(
        &self,
        s: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        mask: &AttnMask,
    ) -> bool {
        self.attention_bwd_in_place_impl(s, hq, hkv, d, mask)
    }

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
    ) -> Result<()> {
        self.attention_bwd_impl(q, k, v, o, d_o, lse, mask, dq, dk, dv, writes)
    }

    fn lse_merge(
        &self,
        o_acc: RowsMut<'_, Self>,
        lse_acc: RowsMut<'_, Self>,
        o_blk: Rows<'_, Self>,
        lse_blk: Rows<'_, Self>,
    ) -> Result<()> {
        self.lse_merge_impl(o_acc, lse_acc, o_blk, lse_blk)
    }

    fn swiglu_fwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        self.swiglu_fwd_impl(gate, up, out)
    }

    fn swiglu_bwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        self.swiglu_bwd_impl(gate, up, dout, dgate, dup)
    }

    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        self.embedding_fwd_impl(table, ids, out)
    }

    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        self.embedding_bwd_impl(dout, ids, dtable)
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()> {
        self.cross_entropy_impl(logits, targets, grad_scale, loss_sum)
    }

    fn adamw(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        elems: std::ops::Range<usize>,
        hp: AdamWStep,
    ) -> Result<()> {
        self.adamw_impl(param, grad, m, v, elems, hp)
    }

    fn adamw_multi(&self, slots: &mut [AdamWSlot<'_, Self>]) -> Result<()> {
        self.adamw_multi_impl(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_cuda_is_an_error_not_a_panic() {
        // On machines without a driver this must be LibraryMissing / Backend, never a panic;
        // on GPU machines it must open device 0.
        match CudaBackend::new(0) {
            Ok(b) => assert!(b.name().starts_with("cuda:0")),
            Err(Error::LibraryMissing(m)) => assert!(m.contains("searched"), "{m}"),
            Err(Error::Backend(m)) => assert!(!m.is_empty()),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
}
