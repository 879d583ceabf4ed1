//! cuDNN fused attention (SDPA) through the backend (graph) API.
//!
//! - [`desc`]: owned backend descriptors and typed attribute setters;
//! - [`graph`]: operation-graph builder (tensors, pointwise, reduction, matmul, reshape);
//! - [`sdpa_graph`]: the forward and backward SDPA graphs cuDNN fuses into flash kernels;
//! - [`plan`]: heuristics → execution plan, workspace size, execution;
//! - [`ragged`]: several documents in one call (cuDNN's ragged layout);
//! - [`select`]: `--attn-kernel auto|cudnn|native` and the "auto" decision;
//! - [`workspace`]: what a call keeps in the workspace, and where.
//!
//! [`CudnnSdpa`] is the function-level interface: one per [`CudaBackend`]
//! (same stream), plans cached per [`SdpaShape`], one workspace from the
//! backend pool (`Category::Workspace`) grown to the largest plan and reused.
//! I/O is bf16 with f32 compute; LSE is f32 natural log of the scaled scores
//! (`max + ln Σ exp(scale·q·k − max)`, the same convention as `CpuBackend`).

pub mod desc;
pub mod graph;
pub mod plan;
pub mod ragged;
pub mod sdpa_graph;
pub mod select;
pub mod workspace;

pub use sdpa_graph::SdpaShape;
pub use select::{
    AttentionKernel, AttnKernel, Choice, KernelDecision, KernelFacts, decide, decide_run_kernel,
    shape_supported,
};
pub use workspace::{
    FWD_PLAN_RESERVE, RAGGED_PLAN_RESERVE, bwd_workspace_bytes, estimated_bwd_plan_workspace,
    fwd_workspace_bytes, kept_workspace_bytes, own_workspace,
};

use self::desc::check;
use self::plan::Plan;
use self::workspace::{align, bwd_layout};
use super::CudaBackend;
use super::libs::{self, Lib};
use super::tuning::fastest;
use crate::backend::{AttnGradWrites, AttnMask, Backend, Category, DType, GradWrite, Tensor};
use crate::error::{Error, Result};
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Operands of one forward: device addresses of the first row of each view.
#[derive(Debug, Clone)]
pub struct SdpaFwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub shape: SdpaShape,
    /// A ragged call's documents' row counts (`ragged::call_pieces`; empty
    /// for the others).
    pub docs: Vec<usize>,
}

/// Operands of one backward. `dq` (`[sq, hq·d]`, of `dq_dt`), `dk`, `dv`
/// (`[sk, hkv·d]`, of `dkv_dt`) are dense rows of F32 or BF16, added into or
/// overwritten as the call's `AttnGradWrites` say.
#[derive(Debug, Clone)]
pub struct SdpaBwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dq_dt: DType,
    pub dkv_dt: DType,
    pub shape: SdpaShape,
    /// As [`SdpaFwd::docs`].
    pub docs: Vec<usize>,
}

/// One plan build, for reports.
#[derive(Debug, Clone)]
pub struct PlanBuild {
    pub bwd: bool,
    pub shape: SdpaShape,
    pub build_ms: f64,
    pub workspace: usize,
    /// Which heuristic candidate runs, of how many.
    pub candidate: (usize, usize),
    /// Its engine and knobs (`Plan::engine`).
    pub engine: String,
    /// Under `UPIPE_CUDNN_PLAN=fastest`: each timed candidate's index,
    /// engine and time of one call in ms (empty otherwise).
    pub timings: Vec<(usize, String, f64)>,
}

/// Which of the heuristics' engine configurations a shape's plan uses
/// (`UPIPE_CUDNN_PLAN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanPick {
    /// The heuristics' first choice that finalizes (default).
    First,
    /// Time every candidate that needs no more workspace than the first, on
    /// the shape's first call with its real operands, and keep the fastest.
    Fastest,
    /// The candidate at this heuristic index (for experiments).
    Index(usize),
}

impl std::str::FromStr for PlanPick {
    type Err = Error;
    fn from_str(v: &str) -> Result<PlanPick> {
        match v.trim() {
            "" | "first" => Ok(PlanPick::First),
            "fastest" => Ok(PlanPick::Fastest),
            n => n.parse().map(PlanPick::Index).map_err(|_| {
                Error::Config(format!(
                    "UPIPE_CUDNN_PLAN={v}: use `first`, `fastest` or a candidate index such as 1"
                ))
            }),
        }
    }
}

impl PlanPick {
    /// From `UPIPE_CUDNN_PLAN` (unset: `first`).
    pub fn from_env() -> Result<PlanPick> {
        std::env::var("UPIPE_CUDNN_PLAN")
            .unwrap_or_default()
            .parse()
    }
}

/// A cached plan; `tuned` once `PlanPick::Fastest` has timed its candidates.
#[derive(Clone)]
struct Entry {
    plan: Arc<Plan>,
    tuned: bool,
}

type Key = (bool, SdpaShape);

struct Handle(sys::cudnnHandle_t);
// SAFETY: the handle is only used under `CudnnSdpa::exec`'s lock.
unsafe impl Send for Handle {}
// SAFETY: see above.
unsafe impl Sync for Handle {}

/// cuDNN SDPA bound to one backend's stream.
pub struct CudnnSdpa {
    handle: Handle,
    version: usize,
    lib: String,
    pick: PlanPick,
    plans: Mutex<HashMap<Key, std::result::Result<Entry, String>>>,
    builds: Mutex<Vec<PlanBuild>>,
    exec: Mutex<Option<Tensor<CudaBackend>>>,
}

impl Drop for CudnnSdpa {
    fn drop(&mut self) {
        // SAFETY: created by cudnnCreate, destroyed once.
        unsafe {
            sys::cudnnDestroy(self.handle.0);
        }
    }
}

/// Whether cuDNN's backward writes a gradient straight into the caller's
/// buffer: an overwritten bf16 one. Any other goes through bf16 scratch.
pub fn bwd_writes_in_place(w: GradWrite, dt: DType) -> bool {
    w == GradWrite::Overwrite && dt == DType::BF16
}

/// Elements of the bf16 dQ and of each of dK, dV that a backward writes to
/// scratch before adding them into the caller's gradients (cuDNN overwrites).
pub fn bwd_scratch_elems(s: &SdpaShape) -> (usize, usize) {
    (s.sq * s.hq * s.d, s.sk * s.hkv * s.d)
}

/// The shape of a call on dense `[s, heads, d]` rows and `[sq, hq]` LSE (the
/// layout our attention operands have). A `Bounded` mask that is plain
/// causal attention, or a causal band, over the call's rows
/// (`BoundedMask::causal_band`: a sliding window over one document) is
/// given as `Causal` with its window, the form the graphs take; one of
/// several documents over the call's rows without a window
/// (`ragged::call_pieces`) as `Causal` over their ragged geometry.
pub fn dense_shape(
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    mask: AttnMask,
) -> SdpaShape {
    let (mask, window, ragged) = match &mask {
        AttnMask::Bounded(m) => match (m.causal_band(), ragged::call_pieces(&mask)) {
            (Some(window), _) => (AttnMask::Causal, window, None),
            (None, Some(docs)) => (AttnMask::Causal, None, Some(ragged::dims(&docs))),
            (None, None) => (mask, None, None),
        },
        _ => (mask, None, None),
    };
    SdpaShape {
        sq,
        sk,
        hq,
        hkv,
        d,
        mask,
        window,
        q_rs: hq * d,
        k_rs: hkv * d,
        v_rs: hkv * d,
        o_rs: hq * d,
        lse_rs: hq,
        lse_hs: 1,
        head_major: false,
        ragged,
    }
}

/// Loads cuDNN (see [`libs`]; `UPIPE_CUDNN_LIB` picks a file) and checks
/// that it can be used: the copy cudarc binds is the one opened, of version
/// 9.0 or newer. Its version (e.g. 91400 for 9.14.0) and where it came from;
/// the error says why not. Needs no device: a run decides its attention
/// kernel from it before anything is allocated.
pub fn probe() -> Result<(usize, String)> {
    let loaded = libs::load(Lib::Cudnn)?;
    // SAFETY: the library is loaded and bound (checked by `load`).
    let version = unsafe { sys::cudnnGetVersion() };
    // cudarc binds cuDNN by name (its first candidate is the unversioned
    // `libcudnn.so`); when that name resolves to another installation than
    // the file we opened (e.g. `UPIPE_CUDNN_LIB` names a pip wheel without
    // an unversioned link while the system has one), the two copies' sub-
    // libraries clash later. Refuse that mix here with a clear reason.
    let bound = select::version_text(version);
    if let Some(opened) = &loaded.api_version
        && *opened != bound
    {
        return Err(Error::LibraryMissing(format!(
            "cuDNN {opened} was opened from {} but cudarc bound cuDNN {bound} ({}): \
             put a folder holding `libcudnn.so -> {}` first on LD_LIBRARY_PATH",
            loaded.path.display(),
            loaded
                .bound_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "unknown file".into()),
            loaded.path.display()
        )));
    }
    if version < 90000 {
        return Err(Error::LibraryMissing(format!(
            "cuDNN {version} at {} is older than 9.0",
            loaded.path.display()
        )));
    }
    Ok((version, loaded.describe()))
}

impl CudnnSdpa {
    /// Loads cuDNN (see [`probe`]) and creates a handle on `be`'s stream.
    pub fn new(be: &CudaBackend) -> Result<CudnnSdpa> {
        let pick = PlanPick::from_env()?;
        let (version, lib) = probe()?;
        be.context()
            .bind_to_thread()
            .map_err(|e| Error::Backend(format!("bind context: {e}")))?;
        let mut h: sys::cudnnHandle_t = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; the context is current.
        check(unsafe { sys::cudnnCreate(&mut h) }, "create handle")?;
        let handle = Handle(h);
        let stream = be.stream().cu_stream() as sys::cudaStream_t;
        // SAFETY: the stream belongs to the current context and outlives the handle
        // (the backend owns both; `CudnnSdpa` is dropped before it).
        check(unsafe { sys::cudnnSetStream(h, stream) }, "set stream")?;
        Ok(CudnnSdpa {
            handle,
            version,
            lib,
            pick,
            plans: Mutex::new(HashMap::new()),
            builds: Mutex::new(Vec::new()),
            exec: Mutex::new(None),
        })
    }

    /// `cudnnGetVersion()`, e.g. 91400 for 9.14.0.
    pub fn version(&self) -> usize {
        self.version
    }

    /// Which engine configuration plans use (`UPIPE_CUDNN_PLAN`).
    pub fn plan_pick(&self) -> PlanPick {
        self.pick
    }

    /// Where the library came from.
    pub fn library(&self) -> &str {
        &self.lib
    }

    /// Every plan built so far (first-call costs).
    pub fn plan_builds(&self) -> Vec<PlanBuild> {
        self.builds.lock().map(|b| b.clone()).unwrap_or_default()
    }

    /// `Ok` when this shape can run here (static rules, then a cached plan
    /// build); `Err(reason)` otherwise. Never panics.
    pub fn supports(&self, s: &SdpaShape, bwd: bool) -> std::result::Result<(), String> {
        shape_supported(self.version, s, bwd)?;
        self.plan(s, bwd).map(|_| ()).map_err(|e| e.to_string())
    }

    fn graph(s: &SdpaShape, bwd: bool) -> Result<graph::Graph> {
        if bwd {
            sdpa_graph::backward(s)
        } else {
            sdpa_graph::forward(s)
        }
    }

    /// The plan of `s` without running it: the cached one, else the first
    /// candidate (or the `PlanPick::Index` one). Tuning waits for a call.
    fn plan(&self, s: &SdpaShape, bwd: bool) -> Result<Arc<Plan>> {
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("cuDNN plan cache poisoned".into()))?;
        if let Some(e) = plans.get(&(bwd, s.clone())) {
            return e.clone().map(|e| e.plan).map_err(Error::Backend);
        }
        let built = (|| {
            let g = Self::graph(s, bwd)?;
            match self.pick {
                PlanPick::Index(k) => {
                    let all = Plan::build_candidates(self.handle.0, g, usize::MAX)?;
                    let n = all.len();
                    all.into_iter().find(|p| p.candidate.0 == k).ok_or_else(|| {
                        Error::Backend(format!(
                            "UPIPE_CUDNN_PLAN={k}: candidate {k} does not finalize for this \
                             shape ({n} do; unset UPIPE_CUDNN_PLAN for the first)"
                        ))
                    })
                }
                _ => Plan::build(self.handle.0, g),
            }
        })();
        let entry = built
            .map(|p| Entry {
                plan: Arc::new(p),
                tuned: false,
            })
            .map_err(|e| e.to_string());
        if let Ok(e) = &entry {
            self.record(bwd, s, &e.plan, Vec::new());
        }
        plans.insert((bwd, s.clone()), entry.clone());
        entry.map(|e| e.plan).map_err(Error::Backend)
    }

    fn record(&self, bwd: bool, s: &SdpaShape, p: &Plan, timings: Vec<(usize, String, f64)>) {
        if let Ok(mut b) = self.builds.lock() {
            b.push(PlanBuild {
                bwd,
                shape: s.clone(),
                build_ms: p.build_ms,
                workspace: p.workspace,
                candidate: p.candidate,
                engine: p.engine.clone(),
                timings,
            });
        }
    }

    /// The workspace bytes of the plan a first call of `s` builds (what a
    /// rehearsal, which times no candidate, grows the kept workspace to:
    /// tuning never picks a plan that needs more).
    pub fn plan_workspace(&self, s: &SdpaShape, bwd: bool) -> Result<usize> {
        shape_supported(self.version, s, bwd).map_err(Error::Backend)?;
        own_workspace(s, self.plan(s, bwd)?.workspace)
    }

    /// The plan a call of `s` runs. Under `PlanPick::Fastest` the shape's
    /// first call times every candidate through `exec` (the call itself, so
    /// on its real operands: one warm-up and one timed run each) and caches
    /// the fastest; candidates needing more workspace than the first are
    /// skipped, so tuning never raises the memory the planner predicts.
    fn plan_for_call(
        &self,
        be: &CudaBackend,
        s: &SdpaShape,
        bwd: bool,
        exec: &dyn Fn(&Plan) -> Result<()>,
    ) -> Result<Arc<Plan>> {
        let first = self.plan(s, bwd)?;
        if self.pick != PlanPick::Fastest {
            return Ok(first);
        }
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("cuDNN plan cache poisoned".into()))?;
        if let Some(Ok(e)) = plans.get(&(bwd, s.clone()))
            && e.tuned
        {
            return Ok(e.plan.clone());
        }
        let candidates = Plan::build_candidates(self.handle.0, Self::graph(s, bwd)?, usize::MAX)?;
        let candidates: Vec<Plan> = candidates
            .into_iter()
            .filter(|p| p.workspace <= first.workspace)
            .collect();
        // a candidate that fails to run is left out (the first one ran before)
        let time = |p: &Plan| -> Result<f64> {
            exec(p)?;
            be.synchronize()?;
            let t0 = std::time::Instant::now();
            exec(p)?;
            be.synchronize()?;
            Ok(t0.elapsed().as_secs_f64() * 1e3)
        };
        let mut timed: Vec<(Plan, f64)> = Vec::with_capacity(candidates.len());
        for p in candidates {
            match time(&p) {
                Ok(ms) => timed.push((p, ms)),
                Err(e) => tracing::debug!("cuDNN candidate #{} ({}): {e}", p.candidate.0, p.engine),
            }
        }
        let timings: Vec<(usize, String, f64)> = timed
            .iter()
            .map(|(p, ms)| (p.candidate.0, p.engine.clone(), *ms))
            .collect();
        let times: Vec<f64> = timed.iter().map(|t| t.1).collect();
        let best = match fastest(&times) {
            Some(i) => Arc::new(timed.swap_remove(i).0),
            None => first,
        };
        self.record(bwd, s, &best, timings);
        plans.insert(
            (bwd, s.clone()),
            Ok(Entry {
                plan: best.clone(),
                tuned: true,
            }),
        );
        Ok(best)
    }

    /// Returns the execution workspace to the pool (it is kept between calls
    /// and grows to the largest; the next call allocates what it needs).
    pub fn release_workspace(&self) -> Result<()> {
        let mut ws = self
            .exec
            .lock()
            .map_err(|_| Error::Backend("cuDNN workspace lock poisoned".into()))?;
        *ws = None;
        Ok(())
    }

    /// Runs `plan` with a workspace of at least `bytes` (grown from the pool).
    fn run(
        &self,
        be: &CudaBackend,
        plan: &Plan,
        bytes: usize,
        bind: impl FnOnce(u64) -> Result<Vec<(i64, *mut c_void)>>,
    ) -> Result<()> {
        let mut ws = self
            .exec
            .lock()
            .map_err(|_| Error::Backend("cuDNN workspace lock poisoned".into()))?;
        let have = ws.as_ref().map(|t| t.bytes()).unwrap_or(0);
        if have < bytes.max(1) {
            // Drop the old one first (stream-ordered free), then take a larger one.
            *ws = None;
            *ws = Some(be.alloc(
                &[kept_workspace_bytes(bytes) / 4],
                DType::F32,
                Category::Workspace,
            )?);
        }
        let base = be.device_ptr(ws.as_ref().expect("allocated above"));
        let bindings = bind(base)?;
        // SAFETY: the plan was built with this handle; the callers bind the
        // operands of the graph they asked for (device buffers owned by the
        // caller on the backend's stream, host scalars living on their stack
        // until this returns) and the workspace holds `bytes` bytes.
        unsafe { plan.execute(self.handle.0, &bindings, base as *mut c_void) }
    }

    /// Uploads a ragged call's tables (`docs`: its documents' rows) to
    /// device address `at` inside the workspace, queued on the backend's
    /// stream before the execution that reads them, and returns their
    /// bindings; none for the other calls.
    fn ragged_tables(
        be: &CudaBackend,
        s: &SdpaShape,
        docs: &[usize],
        at: u64,
    ) -> Result<Vec<(i64, *mut c_void)>> {
        if s.ragged.is_none() {
            return Ok(Vec::new());
        }
        if s.ragged != Some(ragged::dims(docs)) || docs.iter().sum::<usize>() != s.sq {
            return Err(Error::Backend(format!(
                "cuDNN ragged SDPA: documents of {docs:?} rows do not form the call's {:?}                  over {} rows",
                s.ragged, s.sq
            )));
        }
        let t = ragged::Tables::new(docs, [s.q_rs, s.k_rs, s.lse_rs])?;
        // SAFETY: `at` starts the tables' region of the kept workspace
        // (`table_bytes(s)` bytes, at least the tables of documents that
        // tile `s.sq` rows); the pageable source is staged before the call
        // returns, and the stream orders the copy before the execution.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(at, &t.entries, be.stream().cu_stream())
        }
        .map_err(|e| Error::Backend(format!("cuDNN ragged SDPA: upload the tables: {e}")))?;
        use ragged::Table;
        let p = |table: Table| (at + t.byte_offset(table) as u64) as *mut c_void;
        use sdpa_graph::uid;
        Ok(vec![
            (uid::Q_OFFSETS, p(Table::QOffsets)),
            (uid::KV_OFFSETS, p(Table::KvOffsets)),
            (uid::STATS_OFFSETS, p(Table::StatsOffsets)),
            (uid::SEQ_LEN_Q, p(Table::SeqLen)),
            (uid::SEQ_LEN_KV, p(Table::SeqLen)),
        ])
    }

    /// Checks that cuDNN takes the call (`backward` or forward), binds the
    /// backend's context to this thread, and returns the softmax scale.
    fn prepare(&self, be: &CudaBackend, s: &SdpaShape, backward: bool) -> Result<f32> {
        shape_supported(self.version, s, backward).map_err(Error::Backend)?;
        be.context()
            .bind_to_thread()
            .map_err(|e| Error::Backend(format!("bind context: {e}")))?;
        Ok(1.0 / (s.d as f32).sqrt())
    }

    /// Forward: writes `o` (bf16) and `lse` (f32, natural log).
    pub fn fwd(&self, be: &CudaBackend, a: &SdpaFwd) -> Result<()> {
        let s = &a.shape;
        let scale = self.prepare(be, s, false)?;
        let neg_inf = f32::NEG_INFINITY;
        let window = s.window.unwrap_or(0) as f32;
        let p = |x: u64| x as *mut c_void;
        use sdpa_graph::uid;
        let exec = |plan: &Plan| {
            let own = own_workspace(s, plan.workspace)?;
            let need = fwd_workspace_bytes(s, own);
            self.run(be, plan, need, |base| {
                let at = base + align(own) as u64;
                let mut b = Self::ragged_tables(be, s, &a.docs, at)?;
                b.extend([
                    (uid::Q, p(a.q)),
                    (uid::K, p(a.k)),
                    (uid::V, p(a.v)),
                    (uid::O, p(a.o)),
                    (uid::STATS, p(a.lse)),
                    (uid::SCALE, (&scale as *const f32).cast_mut().cast()),
                ]);
                if sdpa_graph::reads_neg_inf(&s.mask) {
                    b.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
                }
                if s.window.is_some() {
                    b.push((uid::WINDOW, (&window as *const f32).cast_mut().cast()));
                    b.push((
                        uid::NEG_INF_WINDOW,
                        (&neg_inf as *const f32).cast_mut().cast(),
                    ));
                }
                if s.ragged.is_some() {
                    let neg = (&neg_inf as *const f32).cast_mut().cast();
                    b.push((uid::NEG_INF_PADDING, neg));
                }
                Ok(b)
            })
        };
        let plan = self.plan_for_call(be, s, false, &exec)?;
        exec(&plan)
    }

    /// Backward into bf16 buffers (overwritten): `dq [sq, hq·d]`, `dk, dv [sk, hkv·d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn bwd_overwrite(
        &self,
        be: &CudaBackend,
        a: &SdpaBwd,
        dq: u64,
        dk: u64,
        dv: u64,
    ) -> Result<()> {
        let s = &a.shape;
        let scale = self.prepare(be, s, true)?;
        let neg_inf = f32::NEG_INFINITY;
        let window = s.window.unwrap_or(0) as f32;
        let one = 1.0f32;
        let p = |x: u64| x as *mut c_void;
        use sdpa_graph::uid;
        let exec = |plan: &Plan| {
            let own = own_workspace(s, plan.workspace)?;
            let [acc_off, sum_off, dk_full, dv_full, tables, total] = bwd_layout(s, own);
            self.run(be, plan, total, |base| {
                let mut b = Self::ragged_tables(be, s, &a.docs, base + tables as u64)?;
                if sdpa_graph::backward_full_head_bytes(s) > 0 {
                    b.push((uid::DK_FULL, p(base + dk_full as u64)));
                    b.push((uid::DV_FULL, p(base + dv_full as u64)));
                }
                b.extend([
                    (uid::Q, p(a.q)),
                    (uid::K, p(a.k)),
                    (uid::V, p(a.v)),
                    (uid::O, p(a.o)),
                    (uid::D_O, p(a.d_o)),
                    (uid::STATS, p(a.lse)),
                    (uid::DQ, p(dq)),
                    (uid::DK, p(dk)),
                    (uid::DV, p(dv)),
                    (uid::SCALE, (&scale as *const f32).cast_mut().cast()),
                    (uid::ONE, (&one as *const f32).cast_mut().cast()),
                    (uid::DQ_ACCUM, p(base + acc_off as u64)),
                    (uid::SOFTMAX_SUM, p(base + sum_off as u64)),
                ]);
                if sdpa_graph::reads_neg_inf(&s.mask) {
                    b.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
                }
                if s.window.is_some() {
                    b.push((uid::WINDOW, (&window as *const f32).cast_mut().cast()));
                    b.push((
                        uid::NEG_INF_WINDOW,
                        (&neg_inf as *const f32).cast_mut().cast(),
                    ));
                }
                if s.ragged.is_some() {
                    let neg = (&neg_inf as *const f32).cast_mut().cast();
                    b.push((uid::NEG_INF_PADDING, neg));
                }
                Ok(b)
            })
        };
        let plan = self.plan_for_call(be, s, true, &exec)?;
        exec(&plan)
    }

    /// Backward with the backend's semantics. cuDNN overwrites bf16 buffers,
    /// so an overwritten bf16 gradient is written in place; every other one
    /// goes through bf16 scratch that is then added in (an overwritten F32
    /// gradient is zeroed first).
    pub fn bwd(&self, be: &CudaBackend, a: &SdpaBwd, writes: AttnGradWrites) -> Result<()> {
        let s = &a.shape;
        let (nq, nk) = bwd_scratch_elems(s);
        let grads = [
            (a.dq, a.dq_dt, writes.dq, nq),
            (a.dk, a.dkv_dt, writes.dkv, nk),
            (a.dv, a.dkv_dt, writes.dkv, nk),
        ];
        let scratch = grads
            .iter()
            .map(|&(_, dt, w, n)| {
                if bwd_writes_in_place(w, dt) {
                    Ok(None)
                } else {
                    be.alloc(&[n], DType::BF16, Category::Workspace).map(Some)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let target = |i: usize| match &scratch[i] {
            Some(t) => be.device_ptr(t),
            None => grads[i].0,
        };
        self.bwd_overwrite(be, a, target(0), target(1), target(2))?;
        for (&(dst, dt, w, n), s) in grads.iter().zip(&scratch) {
            if let Some(s) = s {
                if w == GradWrite::Overwrite {
                    be.zero_raw(dst, n * dt.size())?;
                }
                be.axpy_raw(dst, dt, be.device_ptr(s), DType::BF16, n, 1.0)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_pick_parses_and_names_the_fix() {
        assert_eq!("".parse::<PlanPick>().unwrap(), PlanPick::First);
        assert_eq!("first".parse::<PlanPick>().unwrap(), PlanPick::First);
        assert_eq!(" fastest ".parse::<PlanPick>().unwrap(), PlanPick::Fastest);
        assert_eq!("1".parse::<PlanPick>().unwrap(), PlanPick::Index(1));
        let e = "quickest".parse::<PlanPick>().unwrap_err().to_string();
        assert!(
            e.contains("UPIPE_CUDNN_PLAN=quickest") && e.contains("fastest"),
            "{e}"
        );
    }
}
