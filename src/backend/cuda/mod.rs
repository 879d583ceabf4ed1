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
//! Every op is queued on the backend's stream; `to_host`, `sum_squares` and
//! `synchronize` wait for it.

pub mod attention;
pub mod cudnn;
pub mod device;
pub mod flash;
pub mod gemm;
pub mod host_pool;
pub mod kernels;
pub mod libs;
pub mod nvrtc;
pub mod pinned;
pub mod pool;
pub mod profile;

pub use self::attention::AttentionKernels;
use self::attention::{AttnBwd, AttnFwd, AttnPath, dt_flag};
use self::device::drv;
use self::gemm::{Gemm, GemmPtrs};
use self::kernels::{Args, Kernels, grid_for, launch};
use self::pool::{AllocError, CudaStorage, Pool, PoolStats};
use super::{
    AdamWStep, AttnGradWrites, Backend, Category, ComputePoint, CopyDone, DType, GradWrite, IGNORE,
    Mat, MatMut, MemoryLedger, Rows, RowsMut, Tensor,
};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

pub use pool::CudaStorage as Storage;

const BLOCK: u32 = 256;
/// Row-striding blocks of the RMSNorm backward (each adds its dw once).
const RMS_BWD_MAX_BLOCKS: usize = 1024;

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
    /// cuDNN SDPA, created on first use; `Err` holds why it is unavailable.
    cudnn: OnceLock<std::result::Result<cudnn::CudnnSdpa, String>>,
    /// GPU time by op when `UPIPE_PROFILE` is set.
    profile: profile::OpProfile,
    /// The first fatal communication error on this GPU (set by the NCCL
    /// watchdog, `comm::nccl`); every later synchronisation returns it.
    comm_fault: Arc<OnceLock<String>>,
    /// Every op allocates as it would and launches nothing
    /// (`Backend::set_rehearse`): the gate sits right before each launch,
    /// copy and memset, after the op's allocations and checks.
    rehearse: AtomicBool,
}

/// How many attention calls of a backend ran on which kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionCalls {
    pub flash_fwd: u64,
    pub flash_bwd: u64,
    pub naive_fwd: u64,
    pub naive_bwd: u64,
    pub cudnn_fwd: u64,
    pub cudnn_bwd: u64,
}

fn same_numel(a: &Tensor<CudaBackend>, b: &Tensor<CudaBackend>, op: &str) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(Error::Backend(format!(
            "{op}: element counts differ ({:?} vs {:?})",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
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
/// A copy on the copy stream, finished when `done` fires.
struct CopyEvent {
    done: cudarc::driver::CudaEvent,
    compute: Arc<CudaStream>,
}

impl crate::backend::InFlight for CopyEvent {
    fn order(&self) -> Result<()> {
        drv(self.compute.wait(&self.done), "stream wait")
    }
    fn finish(self: Box<Self>) -> Result<()> {
        drv(self.done.synchronize(), "event synchronize")
    }
}

impl CudaBackend {
    /// Queues `dst = src` on the copy stream after `ready` (an event of the
    /// compute stream).
    fn copy_after(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        ready: &cudarc::driver::CudaEvent,
    ) -> Result<CopyDone> {
        drv(self.copy_stream.wait(ready), "stream wait")?;
        let span = self.profile.span("copy_start", &self.copy_stream)?;
        // SAFETY: both tensors hold `bytes` bytes (`check_copy`) and stay
        // alive until `copy_wait` (the caller's contract); unified addressing
        // lets cuMemcpyAsync take pinned host and device addresses alike.
        let rc = unsafe {
            cudarc::driver::sys::cuMemcpyAsync(
                ptr(dst),
                ptr(src),
                src.bytes(),
                self.copy_stream.cu_stream(),
            )
        };
        drv(rc.result(), "cuMemcpyAsync (copy stream)")?;
        drop(span);
        let done = drv(self.copy_stream.record_event(None), "record event")?;
        Ok(CopyDone::in_flight(Box::new(CopyEvent {
            done,
            compute: self.stream.clone(),
        })))
    }
}

/// A copy takes whole tensors of one shape and dtype.
fn check_copy(dst: &Tensor<CudaBackend>, src: &Tensor<CudaBackend>) -> Result<()> {
    if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
        return Err(Error::Backend(format!(
            "copy_start: {:?} {:?} <- {:?} {:?} (whole tensors of one shape and dtype)",
            dst.shape(),
            dst.dtype(),
            src.shape(),
            src.dtype()
        )));
    }
    Ok(())
}

/// Checks that `t` is an F32 tensor in pinned host memory.
fn host_resident(t: &Tensor<CudaBackend>) -> Result<()> {
    if t.category() != Category::Offload || t.dtype() != DType::F32 {
        return Err(Error::Backend(format!(
            "host access to a {:?} {} tensor: only F32 host-resident (offload) tensors",
            t.dtype(),
            t.category().name()
        )));
    }
    Ok(())
}

fn ptr(t: &Tensor<CudaBackend>) -> u64 {
    t.storage().ptr()
}

/// A copy (or cast) of rows of `cols` contiguous elements between two
/// byte-strided places.
#[derive(Debug, Clone, Copy)]
struct RowCopy {
    dst: u64,
    dst_row: usize,
    src: u64,
    src_row: usize,
    cols: usize,
}

impl RowCopy {
    /// Whether every row on both sides starts on a 16-byte boundary, so the
    /// copy can move whole 16-byte vectors (`copy_rows16`, `cast_rows8`).
    fn aligned(&self) -> bool {
        self.dst.is_multiple_of(16)
            && self.src.is_multiple_of(16)
            && self.dst_row.is_multiple_of(16)
            && self.src_row.is_multiple_of(16)
    }

    /// Whether rows are whole groups of `per` elements (and not empty).
    fn whole_vectors(&self, per: usize) -> bool {
        self.cols > 0 && self.cols.is_multiple_of(per)
    }
}

/// Device address of element `elem` of `t`.
fn ptr_at(t: &Tensor<CudaBackend>, elem: usize) -> u64 {
    ptr(t) + (elem * t.dtype().size()) as u64
}

/// Whether an elementwise kernel over `ts` may move 8 elements per load and
/// store: every tensor bf16 and 16-byte aligned, the count a multiple of 8.
fn vec8(ts: &[&Tensor<CudaBackend>]) -> bool {
    ts.iter().all(|t| vec8_part(t.dtype(), ptr(t), t.numel()))
}

/// [`vec8`] of one operand of `n` elements of `dtype` at device address `p`.
fn vec8_part(dtype: DType, p: u64, n: usize) -> bool {
    dtype == DType::BF16 && n.is_multiple_of(8) && p.is_multiple_of(16)
}

fn dt(t: &Tensor<CudaBackend>) -> i32 {
    dt_flag(t.dtype())
}

fn u32_grid(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Backend(format!("{what}: {n} rows exceed one launch")))
}

/// Geometry of one attention call (mirrors the CPU checks).
struct AttnGeom {
    hq: usize,
    hkv: usize,
    d: usize,
}

fn attn_geom(
    q: &Rows<'_, CudaBackend>,
    k: &Rows<'_, CudaBackend>,
    v: &Rows<'_, CudaBackend>,
    causal: bool,
) -> Result<AttnGeom> {
    let (hq, hkv, d) = (q.heads(), k.heads(), q.head_dim());
    if hkv == 0
        || hq % hkv != 0
        || k.head_dim() != d
        || v.heads() != hkv
        || v.head_dim() != d
        || v.len() != k.len()
    {
        return Err(Error::Backend(format!(
            "attention: q {:?}, k {:?}, v {:?} do not form a GQA triple",
            q.t.shape(),
            k.t.shape(),
            v.t.shape()
        )));
    }
    if causal && q.len() != k.len() {
        return Err(Error::Backend(format!(
            "attention: a causal block needs as many queries as keys ({} vs {})",
            q.len(),
            k.len()
        )));
    }
    if d > kernels::ATT_MAX_D {
        return Err(Error::Backend(format!(
            "attention: head dim {d} exceeds {} supported by the CUDA kernels",
            kernels::ATT_MAX_D
        )));
    }
    if q.t.dtype() != k.t.dtype() || q.t.dtype() != v.t.dtype() {
        return Err(Error::Backend(
            "attention: q, k and v must share a dtype".into(),
        ));
    }
    Ok(AttnGeom { hq, hkv, d })
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
            cudnn: OnceLock::new(),
            profile,
            comm_fault: Arc::new(OnceLock::new()),
            rehearse: AtomicBool::new(false),
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

    /// Returns the attention kernels' kept workspace (cuDNN's, grown to its
    /// largest call) to the pool, so a following workload's peak is its own.
    pub fn release_attention_workspace(&self) -> Result<()> {
        match self.cudnn.get() {
            Some(Ok(sdpa)) => sdpa.release_workspace(),
            _ => Ok(()),
        }
    }

    /// Counts of attention calls (non-empty ones) by the kernels they ran on.
    pub fn attention_calls(&self) -> AttentionCalls {
        let c = |i: usize| self.attn_calls[i].load(Ordering::Relaxed);
        AttentionCalls {
            flash_fwd: c(0),
            flash_bwd: c(1),
            naive_fwd: c(2),
            naive_bwd: c(3),
            cudnn_fwd: c(4),
            cudnn_bwd: c(5),
        }
    }

    fn count_attn(&self, path: AttnPath, bwd: bool) {
        let i = match path {
            AttnPath::Flash => 0,
            AttnPath::Naive => 2,
            AttnPath::Cudnn => 4,
        } + bwd as usize;
        self.attn_calls[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Chooses the backend's kernel for the attention selection
    /// (`UPIPE_ATTN_KERNEL`), overriding the environment.
    pub fn set_attn_kernel(&mut self, k: cudnn::AttnKernel) {
        self.attn_kernel = k;
    }

    /// cuDNN SDPA of this backend, created on first use.
    pub fn cudnn_sdpa(&self) -> std::result::Result<&cudnn::CudnnSdpa, String> {
        self.cudnn
            .get_or_init(|| cudnn::CudnnSdpa::new(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| e.clone())
    }

    /// Whether this call goes to cuDNN: `Ok(Some)` to use it, `Ok(None)` for
    /// our kernels (the reason logged once per shape), `Err` when cuDNN was
    /// demanded and cannot serve.
    fn cudnn_for(&self, shape: &cudnn::SdpaShape, bwd: bool) -> Result<Option<&cudnn::CudnnSdpa>> {
        use cudnn::select::{Choice, decide};
        if self.attn_kernel == cudnn::AttnKernel::Native {
            return Ok(None);
        }
        let sdpa = self.cudnn_sdpa();
        let available = sdpa.as_ref().map(|c| c.version()).map_err(|e| e.clone());
        let why = match decide(self.attn_kernel, available, shape, bwd)? {
            Choice::Cudnn => match sdpa.as_ref().map(|c| (c, c.supports(shape, bwd))) {
                Ok((c, Ok(()))) => return Ok(Some(c)),
                Ok((_, Err(r))) => r,
                Err(e) => e.clone(),
            },
            Choice::Native(why) => why,
        };
        if self.attn_kernel == cudnn::AttnKernel::Cudnn {
            return Err(Error::Backend(format!("--attn-kernel cudnn: {why}")));
        }
        tracing::debug!("attention: native kernels for {shape:?} (bwd={bwd}): {why}");
        Ok(None)
    }

    /// The attention kernels this backend was opened with.
    pub fn attention_kernels(&self) -> AttentionKernels {
        self.attn_kernels
    }

    /// The flash kernels, compiling (or reading from the disk cache) and
    /// loading them on the first call; `None` where they are not used
    /// (compute capability below 9.0, or [`AttentionKernels::Naive`]).
    /// Call it once up front to keep the compile out of a timed region.
    pub fn flash_functions(&self) -> Result<Option<&flash::FlashFunctions>> {
        let r = self.flash.get_or_init(|| {
            if self.attn_kernels == AttentionKernels::Naive {
                tracing::debug!("attention: naive kernels requested; flash kernels not loaded");
                return Ok(None);
            }
            if self.cc_major < 9 {
                tracing::debug!(
                    "attention: {} is {}, flash kernels need sm_90+; using the naive kernels",
                    self.name,
                    self.arch
                );
                return Ok(None);
            }
            self.load_flash().map(Some).map_err(|e| {
                format!(
                    "{e} (set UPIPE_ATTENTION=naive to use the slow attention kernels meanwhile)"
                )
            })
        });
        match r {
            Ok(f) => Ok(f.as_ref()),
            Err(m) => Err(Error::Backend(m.clone())),
        }
    }

    fn load_flash(&self) -> Result<flash::FlashFunctions> {
        self.bind()?;
        let t = std::time::Instant::now();
        let (name, src) = flash::FLASH_SOURCES
            .first()
            .ok_or_else(|| Error::Backend("flash attention: no kernel source".into()))?;
        let (cubin, from) = nvrtc::compile_cached_with(src, &self.arch, flash::NVRTC_OPTIONS)?;
        let module = drv(
            self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
            "load the flash attention module",
        )
        .map_err(|e| {
            Error::Backend(format!(
                "{e}; delete the kernel cache ({:?}) if it is stale",
                nvrtc::cache_dir()
            ))
        })?;
        let mut f = flash::FlashFunctions::load(&module)?;
        tracing::debug!(
            "attention: flash module {name} for {} {} in {:.2} s",
            self.arch,
            if from == nvrtc::CubinSource::DiskCache {
                "read from the disk cache"
            } else {
                "compiled"
            },
            t.elapsed().as_secs_f64()
        );
        // The wgmma kernels: compute capability 9.0 exactly (sm_90a code runs
        // nowhere else), unless UPIPE_FLASH_FWD / UPIPE_FLASH_BWD is `mma`;
        // with `auto` a kernel that fails to load falls back to mma.sync.
        let hopper = self.arch == "sm_90" || self.arch == "sm_90a";
        let fwd = flash::fwd_kernel_from_env()?;
        f.set_fwd_kernel(fwd);
        if fwd != flash::FlashKernel::Mma && hopper {
            let loaded = self
                .load_flash_module(flash::FLASH_WGMMA_SOURCE, "wgmma flash attention")
                .and_then(|m| f.clone().with_wgmma(&m));
            f = Self::or_mma(f, loaded, fwd, "forward")?;
        }
        let bwd = flash::bwd_kernel_from_env()?;
        f.set_bwd_kernel(bwd);
        if bwd != flash::FlashKernel::Mma && hopper {
            let loaded = self
                .load_flash_module(flash::FLASH_WGMMA_BWD_SOURCE, "wgmma flash backward")
                .and_then(|m| f.clone().with_wgmma_bwd(&m));
            f = Self::or_mma(f, loaded, bwd, "backward")?;
        }
        Ok(f)
    }

    /// The functions with a wgmma kernel `loaded`, or (`auto`) without it
    /// and a warning; asked for explicitly (`wgmma`), a failure is an error.
    fn or_mma(
        without: flash::FlashFunctions,
        loaded: Result<flash::FlashFunctions>,
        choice: flash::FlashKernel,
        pass: &str,
    ) -> Result<flash::FlashFunctions> {
        match loaded {
            Ok(with) => Ok(with),
            Err(e) if choice == flash::FlashKernel::Wgmma => Err(e),
            Err(e) => {
                tracing::warn!(
                    "attention: wgmma {pass} unavailable, using the mma.sync {pass}: {e}"
                );
                Ok(without)
            }
        }
    }

    /// Compiles (or reads from the disk cache) an `sm_90a` flash module and loads it.
    fn load_flash_module(&self, src: &str, what: &str) -> Result<Arc<cudarc::driver::CudaModule>> {
        let arch = flash::WGMMA_NVRTC_ARCH;
        let (cubin, _) = nvrtc::compile_cached_with(src, arch, flash::NVRTC_OPTIONS)?;
        drv(
            self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
            &format!("load the {what} module"),
        )
    }

    /// The kernels a forward with these operands runs on (and why not flash).
    fn fwd_path(&self, a: &AttnFwd) -> Result<(AttnPath, String)> {
        if a.sq == 0 || a.hq == 0 {
            return Ok((AttnPath::Naive, "empty".into()));
        }
        if self.flash_functions()?.is_none() {
            return Ok((AttnPath::Naive, "flash kernels not in use".into()));
        }
        Ok(match attention::flash_fwd_unsupported(a) {
            None => (AttnPath::Flash, String::new()),
            Some(why) => (AttnPath::Naive, why),
        })
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

    /// Limits the pinned host memory offloaded tensors may take (`None`: no limit).
    pub fn set_host_budget(&self, bytes: Option<usize>) {
        self.host_pool.set_budget(bytes);
    }

    /// Pinned host bytes held for offloaded tensors.
    pub fn host_pinned(&self) -> usize {
        self.host_pool.pinned()
    }

    /// An uninitialised tensor; `Category::Offload` tensors live in pinned
    /// host memory (only `copy_start` may touch them).
    pub fn alloc(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        if cat == Category::Offload {
            let p = self.host_pool.alloc(bytes)?;
            let owner: Arc<dyn pool::BlockOwner> = self.host_pool.clone();
            return self.adopt(p, bytes, owner, shape, dtype, cat);
        }
        match self.pool.alloc(bytes) {
            Ok(p) => Ok(Tensor::from_parts(
                CudaStorage::new(p, bytes, self.pool.clone()),
                shape,
                dtype,
                cat,
                self.ledger.clone(),
            )),
            Err(AllocError::OutOfMemory) => {
                Err(super::out_of_memory(&self.name, &self.ledger, bytes))
            }
            Err(AllocError::Other(e)) => Err(e),
        }
    }

    /// A tensor over `bytes` of device memory that `owner` lends (an
    /// exchange window); counted by the ledger like any tensor of `cat`.
    pub fn adopt(
        &self,
        ptr: u64,
        bytes: usize,
        owner: Arc<dyn pool::BlockOwner>,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        let need = shape.iter().product::<usize>() * dtype.size();
        if need != bytes {
            return Err(Error::Backend(format!(
                "adopt: {shape:?} {dtype:?} needs {need} bytes, the block has {bytes}"
            )));
        }
        Ok(Tensor::from_parts(
            CudaStorage::borrowed(ptr, bytes, owner),
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    /// Uploads 32-bit ids into a workspace tensor (stored as 4-byte elements).
    fn upload_ids(&self, ids: &[u32]) -> Result<Tensor<Self>> {
        let t = self.alloc(&[ids.len()], DType::F32, Category::Workspace)?;
        if !ids.is_empty() && !self.rehearsing() {
            // SAFETY: `t` holds ids.len() 4-byte elements; the pageable source is
            // staged before the call returns.
            drv(
                unsafe { result::memcpy_htod_async(ptr(&t), ids, self.stream.cu_stream()) },
                "upload ids",
            )?;
        }
        Ok(t)
    }

    fn launch1d(&self, f: kernels::Func, n: usize, args: Args) -> Result<()> {
        if n == 0 || self.rehearsing() {
            return Ok(());
        }
        launch(&self.stream, f, grid_for(n, BLOCK), BLOCK, 0, args)
    }

    /// Zeroes `bytes` bytes at a raw device address, queued on the stream.
    pub fn zero_raw(&self, p: u64, bytes: usize) -> Result<()> {
        let _span = self.span("memset")?;
        self.bind()?;
        if bytes == 0 || self.rehearsing() {
            return Ok(());
        }
        // SAFETY: callers pass an address inside a live allocation of this
        // backend with `bytes` bytes after it, ordered on this stream.
        drv(
            unsafe { result::memset_d8_async(p, 0, bytes, self.stream.cu_stream()) },
            "memset",
        )
    }

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

    fn workspace_ptr(&self) -> Result<u64> {
        if let Some(t) = self.gemm_ws.get() {
            return Ok(ptr(t));
        }
        let t = self.alloc(
            &[gemm::WORKSPACE_BYTES / 4],
            DType::F32,
            Category::Workspace,
        )?;
        let p = ptr(&t);
        match self.gemm_ws.set(t) {
            Ok(()) => Ok(p),
            // Another thread won the race; use its workspace (ours is freed).
            Err(_) => Ok(ptr(self.gemm_ws.get().expect("set by the winner"))),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
    }
}

impl Backend for CudaBackend {
    type Storage = CudaStorage;

    fn name(&self) -> String {
        self.name.clone()
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn compute_dtype(&self) -> DType {
        DType::BF16
    }
    fn set_rehearse(&self, on: bool) {
        self.rehearse.store(on, Ordering::Relaxed);
    }
    fn rehearsing(&self) -> bool {
        self.rehearse.load(Ordering::Relaxed)
    }
    fn reserved_peak(&self) -> Result<Option<usize>> {
        Ok(Some(self.pool_stats()?.reserved_high as usize))
    }

    fn copy_start(&self, dst: &mut Tensor<Self>, src: &Tensor<Self>) -> Result<CopyDone> {
        check_copy(dst, src)?;
        if src.bytes() == 0 || self.rehearsing() {
            return Ok(CopyDone::finished());
        }
        self.bind()?;
        // the copy runs after the compute queued so far, on the copy stream
        let ready = drv(self.stream.record_event(None), "record event")?;
        self.copy_after(dst, src, &ready)
    }

    fn compute_point(&self) -> Result<ComputePoint> {
        if self.rehearsing() {
            return Ok(ComputePoint::none());
        }
        self.bind()?;
        let now = drv(self.stream.record_event(None), "record event")?;
        Ok(ComputePoint::marker(Box::new(now)))
    }

    fn copy_start_from(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        since: &ComputePoint,
    ) -> Result<CopyDone> {
        let Some(point) = since.get::<cudarc::driver::CudaEvent>() else {
            return self.copy_start(dst, src);
        };
        check_copy(dst, src)?;
        if src.bytes() == 0 || self.rehearsing() {
            return Ok(CopyDone::finished());
        }
        self.bind()?;
        self.copy_after(dst, src, point)
    }

    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        host_resident(t)?;
        if t.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: an Offload tensor is `numel` f32 of pinned host memory
        // (checked above) that lives as long as `t`; the caller has waited
        // for the copies into it.
        Ok(unsafe { std::slice::from_raw_parts(ptr(t) as *const f32, t.numel()) })
    }

    fn host_bf16_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [u16]> {
        if t.category() != Category::Offload || t.dtype() != DType::BF16 {
            return Err(Error::Backend(format!(
                "host bf16 access to a {:?} {} tensor: only BF16 host-resident (offload) tensors",
                t.dtype(),
                t.category().name()
            )));
        }
        if t.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: a BF16 Offload tensor is `numel` u16 of pinned host memory
        // that lives as long as `t`, borrowed mutably here; no copy out of
        // it is in flight (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr(t) as *mut u16, t.numel()) })
    }

    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        host_resident(t)?;
        if t.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `host_f32`; `t` is borrowed mutably, so this is the
        // only view, and no copy out of it is in flight (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr(t) as *mut f32, t.numel()) })
    }

    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let _span = self.span("memset")?;
        self.bind()?;
        let t = self.alloc(shape, dtype, cat)?;
        if t.bytes() > 0 && !self.rehearsing() {
            // SAFETY: `t` owns `bytes` bytes, ordered on this stream.
            drv(
                unsafe { result::memset_d8_async(ptr(&t), 0, t.bytes(), self.stream.cu_stream()) },
                "memset",
            )?;
        }
        Ok(t)
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
        if data.len() != shape.iter().product::<usize>() {
            return Err(Error::Backend(format!(
                "from_host: {} values for shape {shape:?}",
                data.len()
            )));
        }
        self.bind()?;
        let mut t = self.alloc(shape, dtype, cat)?;
        self.upload(&mut t, data)?;
        Ok(t)
    }

    fn upload(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()> {
        if data.len() != t.numel() {
            return Err(Error::Backend(format!(
                "upload: {} values into a tensor of shape {:?}",
                data.len(),
                t.shape()
            )));
        }
        if data.is_empty() || self.rehearsing() {
            return Ok(());
        }
        self.bind()?;
        let _span = self.span("upload")?;
        if t.category() == Category::Offload {
            // host memory: written here once no copy out of it is in flight
            self.synchronize()?;
            drv(self.copy_stream.synchronize(), "copy stream synchronize")?;
            self.host_f32_mut(t)?.copy_from_slice(data);
            return Ok(());
        }
        let s = self.stream.cu_stream();
        // SAFETY: `t` holds exactly data.len() elements of its dtype; pageable
        // sources are staged before the copy call returns.
        match t.dtype() {
            DType::F32 => drv(
                unsafe { result::memcpy_htod_async(ptr(t), data, s) },
                "upload",
            ),
            DType::BF16 => {
                use rayon::prelude::*;
                let h: Vec<u16> = data
                    .par_iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                drv(
                    unsafe { result::memcpy_htod_async(ptr(t), &h, s) },
                    "upload",
                )
            }
        }
    }

    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        self.bind()?;
        let n = t.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        if self.rehearsing() {
            return Ok(vec![0.0; n]);
        }
        if t.category() == Category::Offload {
            // host memory already: once the copies into it are done
            self.synchronize()?;
            drv(self.copy_stream.synchronize(), "copy stream synchronize")?;
            return Ok(self.host_f32(t)?.to_vec());
        }
        // the copy into pageable memory blocks inside the driver until the
        // stream reaches it: let queued work (maybe a collective) finish first
        self.wait_idle()?;
        let _span = self.span("download")?;
        let s = self.stream.cu_stream();
        let out = match t.dtype() {
            DType::F32 => {
                let mut v = vec![0f32; n];
                // SAFETY: `t` holds n f32 values; we wait for the stream below.
                drv(
                    unsafe { result::memcpy_dtoh_async(&mut v, ptr(t), s) },
                    "download",
                )?;
                self.synchronize()?;
                v
            }
            DType::BF16 => {
                let mut v = vec![0u16; n];
                // SAFETY: `t` holds n bf16 values; we wait for the stream below.
                drv(
                    unsafe { result::memcpy_dtoh_async(&mut v, ptr(t), s) },
                    "download",
                )?;
                self.synchronize()?;
                v.into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect()
            }
        };
        Ok(out)
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
        let p = gemm::map_problem(&c.l, &a.l, &b.l)?;
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
        if self.rehearsing() {
            return Ok(());
        }
        self.gemm.run(&self.stream, &p, ab, cd, &ptrs, alpha, beta)
    }

    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        let _span = self.span_shaped("copy", || {
            format!(
                "{}x{} {:?}->{:?} strides {:?}->{:?}",
                src.l.rows,
                src.l.cols,
                src.t.dtype(),
                dst.t.dtype(),
                src.l.strides(),
                dst.l.strides()
            )
        })?;
        if dst.l.rows != src.l.rows || dst.l.cols != src.l.cols {
            return Err(Error::Backend(format!(
                "copy shapes: {:?} <- {:?}",
                dst.l, src.l
            )));
        }
        self.bind()?;
        let (drs, dcs) = dst.l.strides();
        let (srs, scs) = src.l.strides();
        let (sdt, ddt) = (src.t.dtype(), dst.t.dtype());
        let (d0, s0) = (ptr_at(dst.t, dst.l.offset), ptr_at(src.t, src.l.offset));
        let rows = RowCopy {
            dst: d0,
            dst_row: drs * ddt.size(),
            src: s0,
            src_row: srs * sdt.size(),
            cols: src.l.cols,
        };
        if dcs == 1 && scs == 1 && rows.aligned() {
            if sdt == ddt && rows.whole_vectors(16 / sdt.size()) {
                let vecs = rows.cols * sdt.size() / 16;
                let args = Args::new()
                    .ptr(d0)
                    .usize(rows.dst_row)
                    .ptr(s0)
                    .usize(rows.src_row)
                    .usize(src.l.rows)
                    .usize(vecs);
                return self.launch1d(self.kernels.copy_rows16, src.l.rows * vecs, args);
            }
            if sdt != ddt && rows.whole_vectors(8) {
                let groups = rows.cols / 8;
                let args = Args::new()
                    .ptr(d0)
                    .i32(dt_flag(ddt))
                    .usize(rows.dst_row)
                    .ptr(s0)
                    .i32(dt_flag(sdt))
                    .usize(rows.src_row)
                    .usize(src.l.rows)
                    .usize(groups);
                return self.launch1d(self.kernels.cast_rows8, src.l.rows * groups, args);
            }
        }
        let args = Args::new()
            .ptr(ptr(dst.t))
            .i32(dt(dst.t))
            .usize(dst.l.offset)
            .usize(drs)
            .usize(dcs)
            .ptr(ptr(src.t))
            .i32(dt(src.t))
            .usize(src.l.offset)
            .usize(srs)
            .usize(scs)
            .usize(src.l.rows)
            .usize(src.l.cols);
        self.launch1d(self.kernels.copy2d, src.l.rows * src.l.cols, args)
    }

    fn fill(&self, t: &mut Tensor<Self>, value: f32) -> Result<()> {
        let _span = self.span("fill")?;
        self.bind()?;
        let args = Args::new()
            .ptr(ptr(t))
            .i32(dt(t))
            .usize(t.numel())
            .f32(value);
        self.launch1d(self.kernels.fill, t.numel(), args)
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f32, x: &Tensor<Self>) -> Result<()> {
        let _span = self.span("axpy")?;
        same_numel(y, x, "axpy")?;
        if y.dtype() != DType::F32 && y.dtype() != x.dtype() {
            return Err(Error::Backend(
                "axpy: y must be F32 or the dtype of x".into(),
            ));
        }
        self.bind()?;
        self.axpy_raw(ptr(y), y.dtype(), ptr(x), x.dtype(), x.numel(), alpha)
    }

    fn sum_squares(&self, t: &Tensor<Self>) -> Result<f64> {
        self.bind()?;
        let span = self.span("sum_squares")?;
        let acc = self.zeros(&[2], DType::F32, Category::Workspace)?; // one f64
        if self.rehearsing() {
            return Ok(0.0);
        }
        let n = t.numel();
        let blocks = grid_for(n, BLOCK).0.min(1024);
        if n > 0 {
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

    fn rms_norm_fwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        eps: f32,
        y: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("rms_norm")?;
        same_numel(x, y, "rms_norm_fwd")?;
        let dim = w.numel();
        if dim == 0 || !x.numel().is_multiple_of(dim) {
            return Err(Error::Backend(format!(
                "rms_norm_fwd: x {:?} is not rows of w's {dim}",
                x.shape()
            )));
        }
        self.bind()?;
        let rows = x.numel() / dim;
        if rows == 0 || self.rehearsing() {
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
            .f32(eps)
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

    fn rms_norm_bwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        eps: f32,
        dx: &mut Tensor<Self>,
        dw: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("rms_norm_bwd")?;
        same_numel(x, dy, "rms_norm_bwd")?;
        same_numel(x, dx, "rms_norm_bwd")?;
        same_numel(w, dw, "rms_norm_bwd")?;
        need(dw, DType::F32, "rms_norm_bwd", "dw")?;
        let dim = w.numel();
        if dim == 0 || !x.numel().is_multiple_of(dim) {
            return Err(Error::Backend(format!(
                "rms_norm_bwd: x {:?} is not rows of w's {dim}",
                x.shape()
            )));
        }
        self.bind()?;
        let rows = x.numel() / dim;
        if rows == 0 || self.rehearsing() {
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
            .ptr(ptr(dw))
            .usize(rows)
            .usize(dim)
            .f32(eps);
        // dw is summed per block in shared memory when it fits the default 48 KiB.
        let smem_dw = dim * 4 <= 40 << 10;
        let args = args.i32(smem_dw as i32).i32(vec8(&[x, w, dy, dx]) as i32);
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

    fn rope(
        &self,
        x: &mut Tensor<Self>,
        cos: &Tensor<Self>,
        sin: &Tensor<Self>,
        inverse: bool,
    ) -> Result<()> {
        let _span = self.span("rope")?;
        let (s, d) = (x.rows(), x.shape().get(2).copied().unwrap_or(0));
        let heads = x.shape().get(1).copied().unwrap_or(0);
        let half = d / 2;
        if d % 2 != 0 || cos.numel() != s * half || sin.numel() != s * half {
            return Err(Error::Backend(format!(
                "rope: x {:?} needs cos/sin of [{s}, {half}], got {:?}",
                x.shape(),
                cos.shape()
            )));
        }
        need(cos, DType::F32, "rope", "cos")?;
        need(sin, DType::F32, "rope", "sin")?;
        self.bind()?;
        let args = Args::new()
            .ptr(ptr(x))
            .i32(dt(x))
            .ptr(ptr(cos))
            .ptr(ptr(sin))
            .usize(s)
            .usize(heads)
            .usize(d)
            .f32(if inverse { -1.0 } else { 1.0 });
        self.launch1d(self.kernels.rope, s * heads * half, args)
    }

    fn attention_fwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        causal: bool,
        o: RowsMut<'_, Self>,
        lse: RowsMut<'_, Self>,
    ) -> Result<()> {
        let _span = self.span_shaped("attention_fwd", || {
            format!("q {}x{} k {}x{}", q.len(), q.heads(), k.len(), k.heads())
        })?;
        let g = attn_geom(&q, &k, &v, causal)?;
        need(lse.t, DType::F32, "attention_fwd", "lse")?;
        if o.len() != q.len()
            || o.heads() != g.hq
            || o.head_dim() != g.d
            || lse.len() != q.len()
            || lse.t.row_len() != g.hq
        {
            return Err(Error::Backend(format!(
                "attention_fwd: o {:?} / lse {:?} do not match q {:?}",
                o.t.shape(),
                lse.t.shape(),
                q.t.shape()
            )));
        }
        self.bind()?;
        let (qrs, krs) = (g.hq * g.d, g.hkv * g.d);
        let a = AttnFwd {
            q: ptr_at(q.t, q.range.start * qrs),
            k: ptr_at(k.t, k.range.start * krs),
            v: ptr_at(v.t, v.range.start * krs),
            dt: q.t.dtype(),
            o: ptr_at(o.t, o.range.start * qrs),
            o_dt: o.t.dtype(),
            lse: ptr_at(lse.t, lse.range.start * g.hq),
            q_rs: qrs,
            k_rs: krs,
            v_rs: krs,
            o_rs: qrs,
            lse_rs: g.hq,
            sq: q.len(),
            sk: k.len(),
            hq: g.hq,
            hkv: g.hkv,
            d: g.d,
            causal,
        };
        if a.dt == DType::BF16 && a.o_dt == DType::BF16 && a.sq > 0 && a.hq > 0 {
            let shape = cudnn::dense_shape(a.sq, a.sk, a.hq, a.hkv, a.d, causal);
            if let Some(c) = self.cudnn_for(&shape, false)? {
                self.count_attn(AttnPath::Cudnn, false);
                let f = cudnn::SdpaFwd {
                    q: a.q,
                    k: a.k,
                    v: a.v,
                    o: a.o,
                    lse: a.lse,
                    shape,
                };
                return c.fwd(self, &f);
            }
        }
        let (path, why) = self.fwd_path(&a)?;
        tracing::debug!(
            "attention_fwd {path:?} sq={} sk={} hq={} hkv={} d={} causal={causal} {:?}{}",
            a.sq,
            a.sk,
            a.hq,
            a.hkv,
            a.d,
            a.dt,
            if why.is_empty() {
                String::new()
            } else {
                format!(" ({why})")
            }
        );
        if a.sq > 0 && a.hq > 0 {
            self.count_attn(path, false);
        }
        let flash_fns = self.flash_functions()?;
        if self.rehearsing() {
            return Ok(());
        }
        match (path, flash_fns) {
            (AttnPath::Flash, Some(f)) => attention::fwd_flash(&self.stream, f, &a),
            _ => attention::fwd_naive(&self.kernels, &self.stream, &a),
        }
    }

    fn attention_bwd_in_place(&self, s: usize, hq: usize, hkv: usize, d: usize) -> bool {
        // cuDNN writes bf16 gradients itself; our kernels add into F32
        let shape = cudnn::dense_shape(s, s, hq, hkv, d, true);
        s > 0 && hq > 0 && matches!(self.cudnn_for(&shape, true), Ok(Some(_)))
    }

    fn attention_bwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        o: Rows<'_, Self>,
        d_o: Rows<'_, Self>,
        lse: Rows<'_, Self>,
        causal: bool,
        dq: RowsMut<'_, Self>,
        dk: RowsMut<'_, Self>,
        dv: RowsMut<'_, Self>,
        writes: AttnGradWrites,
    ) -> Result<()> {
        let _span = self.span_shaped("attention_bwd", || {
            format!("q {}x{} k {}x{}", q.len(), q.heads(), k.len(), k.heads())
        })?;
        let g = attn_geom(&q, &k, &v, causal)?;
        need(lse.t, DType::F32, "attention_bwd", "lse")?;
        let (sq, sk) = (q.len(), k.len());
        let shapes_ok = o.len() == sq
            && d_o.len() == sq
            && lse.len() == sq
            && dq.len() == sq
            && dk.len() == sk
            && dv.len() == sk
            && o.t.row_len() == g.hq * g.d
            && d_o.t.row_len() == g.hq * g.d
            && lse.t.row_len() == g.hq
            && dq.t.row_len() == g.hq * g.d
            && dk.t.row_len() == g.hkv * g.d
            && dv.t.row_len() == g.hkv * g.d;
        if !shapes_ok {
            return Err(Error::Backend(format!(
                "attention_bwd: shapes do not match q {:?} / k {:?}",
                q.t.shape(),
                k.t.shape()
            )));
        }
        self.bind()?;
        let (qrs, krs) = (g.hq * g.d, g.hkv * g.d);
        let bf16_in = [q.t.dtype(), o.t.dtype(), d_o.t.dtype()] == [DType::BF16; 3];
        let one_kv_grad_dt = dk.t.dtype() == dv.t.dtype();
        if bf16_in && one_kv_grad_dt && sq > 0 && sk > 0 && g.hq > 0 {
            let shape = cudnn::dense_shape(sq, sk, g.hq, g.hkv, g.d, causal);
            if let Some(c) = self.cudnn_for(&shape, true)? {
                self.count_attn(AttnPath::Cudnn, true);
                let b = cudnn::SdpaBwd {
                    q: ptr_at(q.t, q.range.start * qrs),
                    k: ptr_at(k.t, k.range.start * krs),
                    v: ptr_at(v.t, v.range.start * krs),
                    o: ptr_at(o.t, o.range.start * qrs),
                    d_o: ptr_at(d_o.t, d_o.range.start * qrs),
                    lse: ptr_at(lse.t, lse.range.start * g.hq),
                    dq: ptr_at(dq.t, dq.range.start * qrs),
                    dk: ptr_at(dk.t, dk.range.start * krs),
                    dv: ptr_at(dv.t, dv.range.start * krs),
                    dq_dt: dq.t.dtype(),
                    dkv_dt: dk.t.dtype(),
                    shape,
                };
                return c.bwd(self, &b, writes);
            }
        }
        // The kernels below add into their gradients: an overwritten one
        // is zeroed first (its rows are contiguous in the dense tensor).
        for (w, t, rows, rs) in [
            (writes.dq, &dq, &dq.range, qrs),
            (writes.dkv, &dk, &dk.range, krs),
            (writes.dkv, &dv, &dv.range, krs),
        ] {
            if w == GradWrite::Overwrite {
                let el = t.t.dtype().size();
                self.zero_raw(ptr_at(t.t, rows.start * rs), rows.len() * rs * el)?;
            }
        }
        // The kernels accumulate in f32: gradients of another dtype go through
        // f32 scratch that is added in afterwards.
        let scratch = |rows: usize, rs: usize, t: &Tensor<Self>| -> Result<Option<Tensor<Self>>> {
            if t.dtype() == DType::F32 {
                Ok(None)
            } else {
                self.zeros(&[rows, rs], DType::F32, Category::Workspace)
                    .map(Some)
            }
        };
        let (sdq, sdk, sdv) = (
            scratch(sq, qrs, dq.t)?,
            scratch(sk, krs, dk.t)?,
            scratch(sk, krs, dv.t)?,
        );
        let target = |s: &Option<Tensor<Self>>, t: &Tensor<Self>, start: usize, rs: usize| match s {
            Some(s) => ptr(s),
            None => ptr_at(t, start * rs),
        };
        let a = AttnBwd {
            q: ptr_at(q.t, q.range.start * qrs),
            k: ptr_at(k.t, k.range.start * krs),
            v: ptr_at(v.t, v.range.start * krs),
            dt: q.t.dtype(),
            o: ptr_at(o.t, o.range.start * qrs),
            o_dt: o.t.dtype(),
            d_o: ptr_at(d_o.t, d_o.range.start * qrs),
            d_o_dt: d_o.t.dtype(),
            lse: ptr_at(lse.t, lse.range.start * g.hq),
            dq: target(&sdq, dq.t, dq.range.start, qrs),
            dk: target(&sdk, dk.t, dk.range.start, krs),
            dv: target(&sdv, dv.t, dv.range.start, krs),
            q_rs: qrs,
            k_rs: krs,
            v_rs: krs,
            o_rs: qrs,
            d_o_rs: qrs,
            lse_rs: g.hq,
            dq_rs: qrs,
            dk_rs: krs,
            dv_rs: krs,
            sq,
            sk,
            hq: g.hq,
            hkv: g.hkv,
            d: g.d,
            causal,
        };
        let flash_fns = if sq == 0 || sk == 0 || g.hq == 0 {
            None
        } else {
            self.flash_functions()?
        };
        let why = match flash_fns {
            None => Some("flash kernels not in use".to_string()),
            Some(_) => attention::flash_bwd_unsupported(&a),
        };
        tracing::debug!(
            "attention_bwd {:?} sq={sq} sk={sk} hq={} hkv={} d={} causal={causal} {:?}{}",
            if why.is_none() {
                AttnPath::Flash
            } else {
                AttnPath::Naive
            },
            g.hq,
            g.hkv,
            g.d,
            a.dt,
            why.as_deref()
                .map(|w| format!(" ({w})"))
                .unwrap_or_default()
        );
        if sq > 0 && g.hq > 0 {
            self.count_attn(
                if why.is_none() {
                    AttnPath::Flash
                } else {
                    AttnPath::Naive
                },
                true,
            );
        }
        match (flash_fns, why) {
            (Some(f), None) => {
                // delta = rowsum(dO * O) per query row and head, freed (stream-ordered) on return.
                let bytes = flash::flash_bwd_workspace_bytes(sq, g.hq);
                let ws = self.alloc(&[bytes / 4], DType::F32, Category::Workspace)?;
                if !self.rehearsing() {
                    attention::bwd_flash(&self.stream, f, &a, ptr(&ws))?;
                }
            }
            _ if self.rehearsing() => {}
            _ => attention::bwd_naive(&self.kernels, &self.stream, &a)?,
        }
        for (s, t, start, rows, rs) in [
            (&sdq, &*dq.t, dq.range.start, sq, qrs),
            (&sdk, &*dk.t, dk.range.start, sk, krs),
            (&sdv, &*dv.t, dv.range.start, sk, krs),
        ] {
            if let Some(s) = s {
                self.axpy_raw(
                    ptr_at(t, start * rs),
                    t.dtype(),
                    ptr(s),
                    DType::F32,
                    rows * rs,
                    1.0,
                )?;
            }
        }
        Ok(())
    }

    fn lse_merge(
        &self,
        o_acc: RowsMut<'_, Self>,
        lse_acc: RowsMut<'_, Self>,
        o_blk: Rows<'_, Self>,
        lse_blk: Rows<'_, Self>,
    ) -> Result<()> {
        let _span = self.span("lse_merge")?;
        let (h, d) = (o_acc.heads(), o_acc.head_dim());
        if o_acc.len() != o_blk.len()
            || o_blk.heads() != h
            || o_blk.head_dim() != d
            || lse_acc.len() != o_acc.len()
            || lse_blk.len() != o_acc.len()
            || lse_acc.t.row_len() != h
            || lse_blk.t.row_len() != h
        {
            return Err(Error::Backend("lse_merge: block shapes differ".into()));
        }
        need(lse_acc.t, DType::F32, "lse_merge", "lse_acc")?;
        need(lse_blk.t, DType::F32, "lse_merge", "lse_blk")?;
        self.bind()?;
        let rows = o_acc.len();
        let args = Args::new()
            .ptr(ptr_at(o_acc.t, o_acc.range.start * h * d))
            .i32(dt(o_acc.t))
            .ptr(ptr_at(lse_acc.t, lse_acc.range.start * h))
            .ptr(ptr_at(o_blk.t, o_blk.range.start * h * d))
            .i32(dt(o_blk.t))
            .ptr(ptr_at(lse_blk.t, lse_blk.range.start * h))
            .usize(rows)
            .usize(h)
            .usize(d);
        self.launch1d(self.kernels.lse_merge, rows * h, args)
    }

    fn swiglu_fwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("swiglu")?;
        same_numel(gate, up, "swiglu_fwd")?;
        same_numel(gate, out, "swiglu_fwd")?;
        self.bind()?;
        let args = Args::new()
            .ptr(ptr(gate))
            .i32(dt(gate))
            .ptr(ptr(up))
            .i32(dt(up))
            .ptr(ptr(out))
            .i32(dt(out))
            .usize(gate.numel());
        let vec = vec8(&[gate, up, out]);
        let threads = if vec { gate.numel() / 8 } else { gate.numel() };
        self.launch1d(self.kernels.swiglu_fwd, threads, args.i32(vec as i32))
    }

    fn swiglu_bwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.span("swiglu_bwd")?;
        same_numel(gate, up, "swiglu_bwd")?;
        same_numel(gate, dout, "swiglu_bwd")?;
        same_numel(gate, dgate, "swiglu_bwd")?;
        same_numel(gate, dup, "swiglu_bwd")?;
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
            .usize(gate.numel());
        let vec = vec8(&[gate, up, dout, dgate, dup]);
        let threads = if vec { gate.numel() / 8 } else { gate.numel() };
        self.launch1d(self.kernels.swiglu_bwd, threads, args.i32(vec as i32))
    }

    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
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
            .usize(h);
        self.launch1d(self.kernels.embedding_fwd, ids.len() * h, args)
    }

    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
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
            .usize(h);
        self.launch1d(self.kernels.embedding_bwd, ids.len() * h, args)
    }

    fn cross_entropy(
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
        if self.rehearsing() {
            return Ok(());
        }
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

    fn adamw(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        elems: std::ops::Range<usize>,
        hp: AdamWStep,
    ) -> Result<()> {
        let _span = self.span("adamw")?;
        same_numel(param, grad, "adamw")?;
        same_numel(param, m, "adamw")?;
        same_numel(param, v, "adamw")?;
        crate::backend::check_elems(&elems, param.numel(), "adamw")?;
        for (t, what) in [(&*param, "param"), (&*m, "m"), (&*v, "v")] {
            need(t, DType::F32, "adamw", what)?;
        }
        let n = elems.len();
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
        let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
        // byte offsets of the range: f32 state, grad in its own dtype
        let (f32_off, g_off) = (
            (elems.start * 4) as u64,
            (elems.start * grad.dtype().size()) as u64,
        );
        let args = Args::new()
            .ptr(ptr(param) + f32_off)
            .ptr(ptr(grad) + g_off)
            .i32(dt(grad))
            .ptr(ptr(m) + f32_off)
            .ptr(ptr(v) + f32_off)
            .usize(n)
            .f32(hp.lr)
            .f32(hp.beta1)
            .f32(hp.beta2)
            .f32(hp.eps)
            .f32(hp.weight_decay)
            .f32(bc1)
            .f32(bc2)
            .f32(hp.grad_scale);
        self.launch1d(self.kernels.adamw, n, args)
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

    #[test]
    fn row_copies_vectorize_only_on_whole_aligned_16_byte_rows() {
        // a bf16 head block: 128 columns out of a 4096-wide row
        let head = RowCopy {
            dst: 1 << 20,
            dst_row: 256,
            src: (1 << 20) + 256,
            src_row: 8192,
            cols: 128,
        };
        assert!(head.aligned() && head.whole_vectors(8));
        assert!(!RowCopy { cols: 12, ..head }.whole_vectors(8));
        assert!(!RowCopy { cols: 0, ..head }.whole_vectors(8));
        for odd in [
            RowCopy {
                src: head.src + 2,
                ..head
            },
            RowCopy {
                dst: head.dst + 8,
                ..head
            },
            RowCopy {
                src_row: 8194,
                ..head
            },
            RowCopy {
                dst_row: 264,
                ..head
            },
        ] {
            assert!(!odd.aligned(), "{odd:?}");
        }
    }
}
