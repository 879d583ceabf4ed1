//! [`CudaBackend`]: the struct of one GPU's backend (its context, streams,
//! pool, kernels, libraries' handles and kept workspaces), opening the
//! device, its accessors and synchronisation, and the helpers every op file
//! uses (`need`, `ptr`, `ptr_at`, `dt`). The ops are in the files of their
//! families (`ops.rs` holds the `Backend` impl that hands each to its file).

use super::attention::{AttentionKernels, dt_flag};
use super::device::{self, drv};
use super::gemm::Gemm;
use super::kernels::{self, Args, Kernels, ProgramModule, grid_for, launch};
use super::pool::{CudaStorage, Pool, PoolStats};
use super::{cudnn, flash, host_pool, nvrtc, profile, tuning};
use crate::backend::{Backend, DType, MemoryLedger, Tensor, TensorDevice};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, result};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

/// Threads per block of the one-dimensional launches.
pub(super) const BLOCK: u32 = 256;

/// The CUDA backend of one GPU.
pub struct CudaBackend {
    pub(super) name: String,
    pub(super) arch: String,
    pub(super) ledger: Arc<MemoryLedger>,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) pool: Arc<Pool>,
    /// Device-host copies (`copy_start`), beside compute.
    pub(super) copy_stream: Arc<CudaStream>,
    /// Pinned host memory of `Category::Offload` tensors.
    pub(super) host_pool: Arc<host_pool::HostPool>,
    pub(super) kernels: Kernels,
    /// The optimizers' update programs (`fused_update.rs`), compiled and
    /// loaded on first use, by program name.
    pub(super) programs: std::sync::Mutex<HashMap<&'static str, Arc<ProgramModule>>>,
    pub(super) gemm: Gemm,
    /// cuBLASLt workspace, allocated on first GEMM (Workspace category).
    pub(super) gemm_ws: OnceLock<Tensor<CudaBackend>>,
    /// Which attention kernels to use.
    pub(super) attn_kernels: AttentionKernels,
    /// Compute capability major (the flash kernels need 9+).
    pub(super) cc_major: i32,
    /// The flash kernels, compiled (or read from the disk cache) and loaded on
    /// first use; `Ok(None)` where they do not apply (pre-sm_90 or Naive).
    pub(super) flash: OnceLock<std::result::Result<Option<flash::FlashFunctions>, String>>,
    /// Attention calls by path: flash fwd, flash bwd, naive fwd, naive bwd.
    pub(super) attn_calls: [AtomicU64; 6],
    /// cuDNN SDPA vs our own kernels (`UPIPE_ATTN_KERNEL=auto|cudnn|native`).
    pub(super) attn_kernel: cudnn::AttnKernel,
    /// The kernel the run decided on (`set_attention_kernel`): every call is
    /// served by it or fails; `None`: `attn_kernel` decides per call.
    pub(super) run_kernel: Option<cudnn::AttentionKernel>,
    /// Which passes of the attention calls cuDNN takes run its FP8 graphs
    /// (`set_attention_fp8`).
    pub(super) attn_fp8: crate::backend::fp8::Fp8Passes,
    /// The per-row key bounds of the last documents-masked attention call
    /// (`attention_ops.rs` `mask_bounds`): the bounds and their device copy.
    pub(super) mask_bounds: std::sync::Mutex<Option<(Vec<u32>, Tensor<CudaBackend>)>>,
    /// cuDNN SDPA, created on first use; `Err` holds why it is unavailable.
    pub(super) cudnn: OnceLock<std::result::Result<cudnn::CudnnSdpa, String>>,
    /// cuDNN SDPA's execution workspace (`cudnn/calls.rs`), kept between
    /// calls and grown to the largest; cuDNN executes plans only under its
    /// lock. Declared after `cudnn`: freed after the handle is destroyed.
    pub(super) cudnn_ws: std::sync::Mutex<Option<Tensor<CudaBackend>>>,
    /// GPU time by op when `UPIPE_PROFILE` is set.
    pub(super) profile: profile::OpProfile,
    /// The first fatal communication error on this GPU (set by the NCCL
    /// watchdog, `comm::nccl`); every later synchronisation returns it.
    pub(super) comm_fault: Arc<OnceLock<String>>,
}

pub(super) fn need(t: &Tensor<CudaBackend>, d: DType, op: &str, what: &str) -> Result<()> {
    if t.dtype() != d {
        return Err(Error::Backend(format!(
            "{op}: {what} must be {d:?}, got {:?} (see the Backend dtype contract)",
            t.dtype()
        )));
    }
    Ok(())
}

/// Device address of a tensor.
pub(super) fn ptr(t: &Tensor<CudaBackend>) -> u64 {
    t.storage().ptr()
}

/// Device address of element `elem` of `t`.
pub(super) fn ptr_at(t: &Tensor<CudaBackend>, elem: usize) -> u64 {
    ptr(t) + (elem * t.dtype().size()) as u64
}

pub(super) fn dt(t: &Tensor<CudaBackend>) -> i32 {
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
            programs: std::sync::Mutex::new(HashMap::new()),
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
            attn_fp8: crate::backend::fp8::Fp8Passes::default(),
            mask_bounds: std::sync::Mutex::new(None),
            cudnn: OnceLock::new(),
            cudnn_ws: std::sync::Mutex::new(None),
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
    pub(super) fn wait_idle(&self) -> Result<()> {
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

    pub(super) fn bind(&self) -> Result<()> {
        drv(self.ctx.bind_to_thread(), "bind context")
    }

    pub(super) fn launch1d(&self, f: kernels::Func, n: usize, args: Args) -> Result<()> {
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
