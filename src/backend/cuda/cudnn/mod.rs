//! cuDNN fused attention (SDPA) through the backend (graph) API.
//!
//! - [`desc`]: owned backend descriptors and typed attribute setters;
//! - [`graph`]: operation-graph builder (tensors, pointwise, reduction, matmul, reshape);
//! - [`sdpa_graph`]: the forward and backward SDPA graphs cuDNN fuses into flash kernels;
//! - [`sdpa_fp8`]: their FP8 forms (Hopper, head dim 128 for the backward);
//! - [`plan`]: heuristics → execution plan, workspace size, execution;
//! - [`ragged`]: several documents in one call (cuDNN's ragged layout);
//! - [`select`]: `--attn-kernel auto|cudnn|native` and the "auto" decision;
//! - [`workspace`]: what a call keeps in the workspace, and where;
//! - `calls.rs`: [`CudnnSdpa`]'s calls on its backend (creating the handle,
//!   running a plan, the forward and backward).
//!
//! [`CudnnSdpa`] is the function-level interface: one per
//! [`CudaBackend`](super::CudaBackend) (same stream), plans cached per
//! [`SdpaShape`], one workspace from the backend pool (`Category::Workspace`,
//! kept by the backend) grown to the largest plan and reused.
//! I/O is bf16 with f32 compute; LSE is f32 natural log of the scaled scores
//! (`max + ln Σ exp(scale·q·k − max)`, the same convention as `CpuBackend`).

mod calls;
pub mod desc;
pub mod graph;
pub mod plan;
pub mod ragged;
pub mod sdpa_fp8;
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
    estimated_fp8_bwd_plan_workspace, fwd_workspace_bytes, kept_workspace_bytes, own_workspace,
};

use self::plan::Plan;
use super::libs::{self, Lib};
use crate::backend::{AttnMask, DType, GradWrite};
use crate::error::{Error, Result};
use cudarc::cudnn::sys;
use std::collections::HashMap;
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
    /// The softmax scale, passed by value at execution (the graphs and
    /// plans hold none, so the cache keys on the shape alone).
    pub scale: f32,
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
    /// As [`SdpaFwd::scale`].
    pub scale: f32,
}

/// Operands of one FP8 call ([`sdpa_fp8`]): device addresses of dense
/// FP8 rows (`q`, `k`, `v`, `o` in E4M3; `d_o`, `dq`, `dk`, `dv` in E5M2,
/// 0 in a forward), Stats (f32) and the scale array
/// ([`sdpa_fp8::SLOTS`] f32 cells).
#[derive(Debug, Clone)]
pub struct SdpaFp8 {
    pub bwd: bool,
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub scales: u64,
    pub shape: SdpaShape,
    /// As [`SdpaFwd::scale`].
    pub scale: f32,
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
// SAFETY: the handle executes plans only under the lock of the kept
// execution workspace of the backend it was created on (`CudnnSdpa::run`
// in `calls.rs` refuses any other backend: `CudnnSdpa::stream`) and builds
// them under `CudnnSdpa::plans`' lock.
unsafe impl Send for Handle {}
// SAFETY: see above.
unsafe impl Sync for Handle {}

/// cuDNN SDPA bound to one backend's stream.
pub struct CudnnSdpa {
    handle: Handle,
    /// The stream of the backend the handle was created on (its address):
    /// the only backend whose workspace lock may serialize its executions.
    stream: usize,
    version: usize,
    lib: String,
    pick: PlanPick,
    plans: Mutex<HashMap<Key, std::result::Result<Entry, String>>>,
    builds: Mutex<Vec<PlanBuild>>,
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
        fp8: false,
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
        match (s.fp8, bwd) {
            (false, false) => sdpa_graph::forward(s),
            (false, true) => sdpa_graph::backward(s),
            (true, false) => sdpa_fp8::forward(s),
            (true, true) => sdpa_fp8::backward(s),
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
