//! `CudaBackend`'s attention ops: `attention_fwd` / `attention_bwd` (the
//! kernels' head-dim limit, row offsets, f32 scratch for other-dtype
//! gradients, and the route: cuDNN SDPA, then our flash kernels, then the
//! naive ones), `lse_merge`, loading the flash modules and counting calls
//! by path. The launches on raw device
//! operands are in [`super::attention`], [`super::flash`] and [`super::cudnn`].

use super::attention::{self, AttentionKernels, AttnBwd, AttnFwd, AttnPath};
use super::attention_fp8::{Fp8Bwd, Fp8Fwd, RowsAt};
use super::backend::{CudaBackend, dt, ptr, ptr_at};
use super::device::drv;
use super::kernels::{self, Args};
use super::{cudnn, flash, nvrtc};
use crate::backend::{
    AttentionBwd, AttentionFwd, AttnMask, AttnShape, Backend, Category, DType, GradWrite, LseMerge,
};
use crate::backend::{Rows, RowsMut};
use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::Ordering;

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

/// Checks what the CUDA kernels add to a call's own checks
/// ([`AttentionFwd::check`]): a head dim they take.
fn check_head_dim(g: &AttnShape) -> Result<()> {
    if g.d > kernels::ATT_MAX_D {
        return Err(Error::Backend(format!(
            "attention: head dim {} exceeds {} supported by the CUDA kernels",
            g.d,
            kernels::ATT_MAX_D
        )));
    }
    Ok(())
}

/// The cuDNN shape of a dense backward call of geometry `g` under `mask`.
fn bwd_sdpa_shape(g: &AttnShape, mask: &AttnMask) -> cudnn::SdpaShape {
    cudnn::dense_shape(g.sq, g.sk, g.hq, g.hkv, g.d, mask.clone())
}

impl CudaBackend {
    /// The key rows each query row of a documents mask sees, on the device
    /// for the flash and naive kernels (`[2·sq]` int32 as 4-byte elements);
    /// its address, or 0 for the masks the kernels take as a flag. The
    /// bounds of the last call are kept (`Category::Workspace`, in the
    /// ledger): a call whose bounds equal them (every stage and layer of a
    /// window) uploads nothing; other bounds replace them (the old freed
    /// first, stream-ordered). Released with cuDNN's workspace
    /// (`release_attention_workspace`). cuDNN's ragged calls take their
    /// documents as tables in its workspace instead (`cudnn::ragged`).
    fn mask_bounds(&self, mask: &AttnMask, sq: usize) -> Result<u64> {
        match mask {
            AttnMask::Full | AttnMask::Causal => Ok(0),
            AttnMask::Bounded(_) if sq == 0 => Ok(0),
            AttnMask::Bounded(m) => self.kept_bounds(m.row_bounds()),
        }
    }

    /// The device address of `bounds`: the kept copy when it holds the
    /// same, else `bounds` uploaded in its place.
    fn kept_bounds(&self, bounds: Vec<u32>) -> Result<u64> {
        let mut kept = self
            .mask_bounds
            .lock()
            .map_err(|_| Error::Backend("attention mask bounds lock poisoned".into()))?;
        if let Some((b, t)) = kept.as_ref()
            && *b == bounds
        {
            return Ok(ptr(t));
        }
        *kept = None;
        let t = self.upload_ids(&bounds)?;
        let at = ptr(&t);
        *kept = Some((bounds, t));
        Ok(at)
    }

    /// Returns the attention kernels' kept workspace (cuDNN's, grown to its
    /// largest call) to the pool, so a following workload's peak is its own.
    pub fn release_attention_workspace(&self) -> Result<()> {
        if let Ok(mut kept) = self.mask_bounds.lock() {
            *kept = None;
        }
        match self.cudnn.get() {
            Some(Ok(sdpa)) => sdpa.release_workspace(self),
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
    /// (`UPIPE_ATTN_KERNEL`), overriding the environment, decided per call
    /// (a run's decided kernel, `set_attention_kernel`, no longer holds).
    pub fn set_attn_kernel(&mut self, k: cudnn::AttnKernel) {
        self.attn_kernel = k;
        self.run_kernel = None;
    }

    /// cuDNN SDPA of this backend, created on first use.
    pub fn cudnn_sdpa(&self) -> std::result::Result<&cudnn::CudnnSdpa, String> {
        self.cudnn
            .get_or_init(|| cudnn::CudnnSdpa::new(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| e.clone())
    }

    /// Serves every attention call with the kernel a run decided on before
    /// it planned (`cudnn::decide_run_kernel`): on cuDNN the calls
    /// [`cudnn::AttentionKernel::takes_on_cudnn`] says (the planner's rule),
    /// a cuDNN that then cannot serve one being an error, never a fallback.
    pub fn set_attention_kernel(&mut self, k: cudnn::AttentionKernel) {
        self.run_kernel = Some(k);
        self.attn_kernel = match k {
            cudnn::AttentionKernel::Cudnn { .. } => cudnn::AttnKernel::Cudnn,
            cudnn::AttentionKernel::Flash | cudnn::AttentionKernel::Naive => {
                cudnn::AttnKernel::Native
            }
        };
    }

    /// Runs the `passes` of every attention call cuDNN takes on its FP8
    /// graphs (`--precision fp8-attention`, `fp8-attention-bwd`;
    /// [`super::attention_fp8`]); a call of those passes that cuDNN's FP8
    /// graphs cannot take is then an error, never a BF16 fallback.
    pub fn set_attention_fp8(&mut self, passes: crate::backend::fp8::Fp8Passes) {
        self.attn_fp8 = passes;
    }

    /// Under FP8 attention, an error for a call of an FP8 pass cuDNN does
    /// not take (it would run in BF16 on our kernels: never silently).
    fn refuse_bf16_under_fp8(&self, g: &AttnShape, bwd: bool) -> Result<()> {
        if !self.attn_fp8.runs(bwd) || !g.nonempty() {
            return Ok(());
        }
        Err(Error::Backend(format!(
            "FP8 attention (--precision): cuDNN does not take an attention {} of sq {} sk {} hq \
             {} hkv {} d {} (mask {}), which would run in BF16; use --precision fp8",
            if bwd { "backward" } else { "forward" },
            g.sq,
            g.sk,
            g.hq,
            g.hkv,
            g.d,
            g.mask
        )))
    }

    /// The kernel the run decided on, if it did (`set_attention_kernel`).
    pub fn run_attention_kernel(&self) -> Option<cudnn::AttentionKernel> {
        self.run_kernel
    }

    /// What GPU `ordinal` and this process offer a run's kernel decision:
    /// the loadable cuDNN ([`cudnn::probe`]) and whether the flash kernels
    /// run (sm_90, `UPIPE_ATTENTION` not `naive`). Opens no context and
    /// allocates nothing.
    pub fn kernel_facts(
        ordinal: usize,
        head_dim: usize,
        documents: bool,
    ) -> Result<cudnn::KernelFacts> {
        let gpus = super::device::gpus()?;
        let gpu = gpus.get(ordinal).ok_or_else(|| {
            Error::Backend(format!(
                "no CUDA device {ordinal}: the driver sees {}; check CUDA_VISIBLE_DEVICES",
                gpus.len()
            ))
        })?;
        let naive = AttentionKernels::from_env()? == AttentionKernels::Naive;
        Ok(cudnn::KernelFacts {
            cudnn: cudnn::probe().map(|(v, _)| v).map_err(|e| e.to_string()),
            flash: gpu.compute_capability.0 >= 9 && !naive,
            head_dim,
            documents,
        })
    }

    /// On a run's decided kernel: cuDNN for the calls it takes, an error
    /// naming the cause where the decided cuDNN cannot serve one.
    fn decided_cudnn(
        &self,
        k: cudnn::AttentionKernel,
        shape: &cudnn::SdpaShape,
        bwd: bool,
    ) -> Result<Option<&cudnn::CudnnSdpa>> {
        if !k.takes_on_cudnn(shape, bwd) {
            return Ok(None);
        }
        let fail = |why: String| {
            Error::Backend(format!(
                "attention: the run decided on {k} but it cannot serve a call of \
                 sq {} sk {} hq {} hkv {} d {} (bwd {bwd}): {why}; run with --attn-kernel native",
                shape.sq, shape.sk, shape.hq, shape.hkv, shape.d
            ))
        };
        let c = self.cudnn_sdpa().map_err(fail)?;
        c.supports(shape, bwd).map_err(fail)?;
        Ok(Some(c))
    }

    /// Whether this call goes to cuDNN: `Ok(Some)` to use it, `Ok(None)` for
    /// our kernels (the reason logged once per shape), `Err` when cuDNN was
    /// demanded and cannot serve. A run's decided kernel routes alone.
    pub(super) fn cudnn_for(
        &self,
        shape: &cudnn::SdpaShape,
        bwd: bool,
    ) -> Result<Option<&cudnn::CudnnSdpa>> {
        use cudnn::select::{Choice, decide};
        if let Some(k) = self.run_kernel {
            return self.decided_cudnn(k, shape, bwd);
        }
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

    /// The attention forward: cuDNN where it takes the call, else the flash
    /// kernels, else the naive ones.
    pub(super) fn attention_fwd_impl(
        &self,
        g: &AttnShape,
        call: AttentionFwd<'_, Self>,
    ) -> Result<()> {
        let AttentionFwd {
            q,
            k,
            v,
            mask,
            scale,
            o,
            lse,
        } = call;
        let _span = self.span_shaped("attention_fwd", || {
            format!("q {}x{} k {}x{}", q.len(), q.heads(), k.len(), k.heads())
        })?;
        check_head_dim(g)?;
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
            mask: mask.clone(),
            bounds: 0,
            scale,
        };
        if a.dt == DType::BF16 && a.o_dt == DType::BF16 && a.sq > 0 && a.hq > 0 {
            let shape = cudnn::dense_shape(a.sq, a.sk, a.hq, a.hkv, a.d, mask.clone());
            if let Some(c) = self.cudnn_for(&shape, false)? {
                self.count_attn(AttnPath::Cudnn, false);
                if self.attn_fp8.forward {
                    let rows = RowsAt::of;
                    let f = Fp8Fwd {
                        q: rows(&q, qrs),
                        k: rows(&k, krs),
                        v: rows(&v, krs),
                        o: (a.o, a.o_dt),
                        lse: a.lse,
                        shape,
                        scale,
                    };
                    return self.attention_fwd_fp8(c, f);
                }
                let f = cudnn::SdpaFwd {
                    q: a.q,
                    k: a.k,
                    v: a.v,
                    o: a.o,
                    lse: a.lse,
                    shape,
                    docs: cudnn::ragged::call_pieces(mask).unwrap_or_default(),
                    scale,
                };
                return c.fwd(self, &f);
            }
        }
        self.refuse_bf16_under_fp8(g, false)?;
        let a = AttnFwd {
            bounds: self.mask_bounds(mask, a.sq)?,
            ..a
        };
        self.fwd_native_launch(&a)
    }

    /// Logs the native path of an attention call (and why not the flash
    /// kernels, where `why` says) and counts a non-empty one.
    fn note_native(
        &self,
        bwd: bool,
        (path, why): (AttnPath, &str),
        (sq, sk, hq, hkv, d): (usize, usize, usize, usize, usize),
        (mask, dt): (&AttnMask, DType),
    ) {
        let op = if bwd {
            "attention_bwd"
        } else {
            "attention_fwd"
        };
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(" ({why})")
        };
        tracing::debug!(
            "{op} {path:?} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} mask={mask} {dt:?}{why}"
        );
        if sq > 0 && hq > 0 {
            self.count_attn(path, bwd);
        }
    }

    /// Runs `a` on the flash kernels where they take it, else on the naive
    /// ones, logging and counting the path.
    fn fwd_native_launch(&self, a: &AttnFwd) -> Result<()> {
        let (path, why) = self.fwd_path(a)?;
        let geometry = (a.sq, a.sk, a.hq, a.hkv, a.d);
        self.note_native(false, (path, &why), geometry, (&a.mask, a.dt));
        match (path, self.flash_functions()?) {
            (AttnPath::Flash, Some(f)) => flash::flash_fwd(&self.stream, f, a),
            _ => attention::fwd_naive(&self.kernels, &self.stream, a),
        }
    }

    pub(super) fn attention_bwd_in_place_impl(&self, g: &AttnShape) -> bool {
        // cuDNN writes bf16 gradients itself; our kernels add into F32
        let shape = super::op_buffers::sdpa_shape(g);
        g.nonempty() && matches!(self.cudnn_for(&shape, true), Ok(Some(_)))
    }

    /// The attention backward: cuDNN where it takes the call, else the
    /// flash kernels, else the naive ones.
    pub(super) fn attention_bwd_impl(
        &self,
        g: &AttnShape,
        call: AttentionBwd<'_, Self>,
    ) -> Result<()> {
        let (q, k) = (&call.q, &call.k);
        let _span = self.span_shaped("attention_bwd", || {
            format!("q {}x{} k {}x{}", q.len(), q.heads(), k.len(), k.heads())
        })?;
        check_head_dim(g)?;
        self.bind()?;
        if let Some(c) = self.cudnn_bwd_for(g, &call)? {
            self.count_attn(AttnPath::Cudnn, true);
            return self.attention_bwd_cudnn(c, g, call);
        }
        self.refuse_bf16_under_fp8(g, true)?;
        self.attention_bwd_native(g, call)
    }

    /// cuDNN's SDPA where it takes this backward: BF16 Q, O and dO, one
    /// dtype for dK and dV, and a shape the selection routes to it.
    fn cudnn_bwd_for(
        &self,
        g: &AttnShape,
        call: &AttentionBwd<'_, Self>,
    ) -> Result<Option<&cudnn::CudnnSdpa>> {
        let bf16_in = [call.q.t.dtype(), call.o.t.dtype(), call.d_o.t.dtype()] == [DType::BF16; 3];
        let one_kv_grad_dt = call.dk.t.dtype() == call.dv.t.dtype();
        if !(bf16_in && one_kv_grad_dt && g.sq > 0 && g.sk > 0 && g.hq > 0) {
            return Ok(None);
        }
        self.cudnn_for(&bwd_sdpa_shape(g, call.mask), true)
    }

    /// The backward on cuDNN: its FP8 graph under FP8 attention, else BF16.
    fn attention_bwd_cudnn(
        &self,
        c: &cudnn::CudnnSdpa,
        g: &AttnShape,
        call: AttentionBwd<'_, Self>,
    ) -> Result<()> {
        let AttentionBwd {
            q,
            k,
            v,
            o,
            d_o,
            lse,
            mask,
            scale,
            dq,
            dk,
            dv,
            writes,
        } = call;
        let (qrs, krs) = (g.hq * g.d, g.hkv * g.d);
        let shape = bwd_sdpa_shape(g, mask);
        let lse = ptr_at(lse.t, lse.range.start * g.hq);
        if self.attn_fp8.backward {
            let rows = RowsAt::of;
            let grad = |r: &RowsMut<'_, Self>, cols, w| {
                (ptr_at(r.t, r.range.start * cols), r.t.dtype(), w)
            };
            let f = Fp8Bwd {
                q: rows(&q, qrs),
                k: rows(&k, krs),
                v: rows(&v, krs),
                o: rows(&o, qrs),
                d_o: rows(&d_o, qrs),
                lse,
                grads: [
                    grad(&dq, qrs, writes.dq),
                    grad(&dk, krs, writes.dkv),
                    grad(&dv, krs, writes.dkv),
                ],
                shape,
                scale,
            };
            return self.attention_bwd_fp8(c, f);
        }
        let b = cudnn::SdpaBwd {
            q: ptr_at(q.t, q.range.start * qrs),
            k: ptr_at(k.t, k.range.start * krs),
            v: ptr_at(v.t, v.range.start * krs),
            o: ptr_at(o.t, o.range.start * qrs),
            d_o: ptr_at(d_o.t, d_o.range.start * qrs),
            lse,
            dq: ptr_at(dq.t, dq.range.start * qrs),
            dk: ptr_at(dk.t, dk.range.start * krs),
            dv: ptr_at(dv.t, dv.range.start * krs),
            dq_dt: dq.t.dtype(),
            dkv_dt: dk.t.dtype(),
            shape,
            docs: cudnn::ragged::call_pieces(mask).unwrap_or_default(),
            scale,
        };
        c.bwd(self, &b, writes)
    }

    /// The backward on our kernels (flash, else naive), which add into
    /// their gradients in F32: an overwritten gradient is zeroed first, one
    /// of another dtype goes through F32 scratch added in afterwards.
    fn attention_bwd_native(&self, g: &AttnShape, call: AttentionBwd<'_, Self>) -> Result<()> {
        let (qrs, krs) = (g.hq * g.d, g.hkv * g.d);
        let writes = call.writes;
        // [rows, row stride] of dQ, dK, dV
        let grads = [
            (call.dq, writes.dq, qrs),
            (call.dk, writes.dkv, krs),
            (call.dv, writes.dkv, krs),
        ];
        let mut scratch = Vec::with_capacity(3);
        let mut target = [0u64; 3];
        for (i, (t, w, rs)) in grads.iter().enumerate() {
            let at = ptr_at(t.t, t.range.start * rs);
            if *w == GradWrite::Overwrite {
                // its rows are contiguous in the dense tensor
                self.zero_raw(at, t.len() * rs * t.t.dtype().size())?;
            }
            let s = match t.t.dtype() {
                DType::F32 => None,
                _ => Some(self.zeros(&[t.len(), *rs], DType::F32, Category::Workspace)?),
            };
            target[i] = s.as_ref().map_or(at, ptr);
            scratch.push(s);
        }
        let rows = |r: &Rows<'_, Self>, rs: usize| ptr_at(r.t, r.range.start * rs);
        let a = AttnBwd {
            q: rows(&call.q, qrs),
            k: rows(&call.k, krs),
            v: rows(&call.v, krs),
            dt: call.q.t.dtype(),
            o: rows(&call.o, qrs),
            o_dt: call.o.t.dtype(),
            d_o: rows(&call.d_o, qrs),
            d_o_dt: call.d_o.t.dtype(),
            lse: rows(&call.lse, g.hq),
            dq: target[0],
            dk: target[1],
            dv: target[2],
            q_rs: qrs,
            k_rs: krs,
            v_rs: krs,
            o_rs: qrs,
            d_o_rs: qrs,
            lse_rs: g.hq,
            dq_rs: qrs,
            dk_rs: krs,
            dv_rs: krs,
            sq: g.sq,
            sk: g.sk,
            hq: g.hq,
            hkv: g.hkv,
            d: g.d,
            mask: call.mask.clone(),
            bounds: self.mask_bounds(call.mask, g.sq)?,
            scale: call.scale,
        };
        self.bwd_native_launch(&a)?;
        for ((t, _, rs), s) in grads.iter().zip(&scratch) {
            if let Some(s) = s {
                let at = ptr_at(t.t, t.range.start * rs);
                self.axpy_raw(at, t.t.dtype(), ptr(s), DType::F32, t.len() * rs, 1.0)?;
            }
        }
        Ok(())
    }

    /// Runs `a` on the flash kernels where they take it, else on the naive
    /// ones, logging and counting the path.
    fn bwd_native_launch(&self, a: &AttnBwd) -> Result<()> {
        let flash_fns = if a.sq == 0 || a.sk == 0 || a.hq == 0 {
            None
        } else {
            self.flash_functions()?
        };
        let why = match flash_fns {
            None => Some("flash kernels not in use".to_string()),
            Some(_) => attention::flash_bwd_unsupported(a),
        };
        let path = match why {
            None => AttnPath::Flash,
            Some(_) => AttnPath::Naive,
        };
        let geometry = (a.sq, a.sk, a.hq, a.hkv, a.d);
        let reason = why.as_deref().unwrap_or_default();
        self.note_native(true, (path, reason), geometry, (&a.mask, a.dt));
        match (flash_fns, why) {
            (Some(f), None) => {
                // delta = rowsum(dO * O) per query row and head, freed (stream-ordered) on return.
                let bytes = flash::flash_bwd_workspace_bytes(a.sq, a.hq);
                let ws = self.alloc(&[bytes / 4], DType::F32, Category::Workspace)?;
                flash::flash_bwd(&self.stream, f, a, ptr(&ws))
            }
            _ => attention::bwd_naive(&self.kernels, &self.stream, a),
        }
    }

    pub(super) fn lse_merge_impl(&self, call: LseMerge<'_, Self>) -> Result<()> {
        let LseMerge {
            o_acc,
            lse_acc,
            o_blk,
            lse_blk,
        } = call;
        let _span = self.span("lse_merge")?;
        let (h, d) = (o_acc.heads(), o_acc.head_dim());
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
}
