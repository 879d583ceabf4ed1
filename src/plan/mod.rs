//! The memory planner: peak bytes per rank of a training step, by ledger
//! [`Category`], before anything runs, and the longest context that fits.
//!
//! One source of truth: the engine. Every prediction (`train`'s preflight,
//! `--rehearse`, `upipe plan`, every `auto` choice and the longest-context
//! search) is the engine's own step ([`engine`]: the trainer's rehearsal on
//! a counting backend and counting process groups, `backend::counting`,
//! `comm::counting`), its ledger read with
//! [`MemoryLedger`](crate::backend::MemoryLedger)'s peak rule. Nothing in
//! this folder restates what the engine allocates: a change to the
//! engine's allocations changes the plan and touches no file here. On the
//! CPU backend the prediction equals the measured ledger peak
//! (`tests/integration/plan.rs`), on a GPU the measured one
//! (`tests/integration/gpu_plan.rs`).
//!
//! What is here: the searches over lengths and choices ([`search`],
//! [`resolve`], [`checkpoint_every`], [`offload`], [`offload_optim`], [`save_attention`],
//! [`stage_width`]), the device a plan is for ([`DeviceKind`], the cuDNN
//! version it routes by), the mesh fit and the preflight.

pub mod checkpoint_every;
mod cudnn_version;
mod device;
pub mod engine;
pub mod mesh;
pub mod offload;
pub mod offload_optim;
pub mod preflight;
pub mod resolve;
mod save_attention;
mod search;
pub mod shapes;
pub mod stage_width;

use crate::attention::{AttnDims, CpPlan, Strategy};
use crate::backend::Category;
use crate::error::Result;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::train::config::TrainConfig;
pub use checkpoint_every::CheckpointEvery;
pub use cudnn_version::{CudnnVersion, PLANNED_CUDNN_VERSION};
pub use device::DeviceKind;
pub use engine::{EvalForward, EvalSpec};
pub use offload::OffloadBlocks;
pub use offload_optim::OptimizerOffload;
pub use resolve::{
    Depth, EveryBudget, FsdpMode, MemoryChoices, RankBudget, ResolvedRun, RunRequest, StageChoices,
    checkpoint_every_auto, resolve_checkpoint_every, resolve_run,
};
pub use save_attention::{SaveAttention, save_attention_auto};
pub use search::{Budget, Fit, Limit, longest_context};

const F32: usize = 4;

/// Device bytes per GPU outside the ledger that a run leaves free by
/// default (`upipe plan --reserve`'s default, `--save-attention auto`).
pub const GPU_RESERVE_BYTES: usize = 1 << 30;

/// One training step of one rank, as `train::trainer` runs it.
#[derive(Debug, Clone)]
pub struct StepSpec {
    pub model: ModelConfig,
    pub plan: CpPlan,
    /// Data-parallel degree (FSDP shards over `data × context` ranks).
    pub data: usize,
    pub policy: MemoryPolicy,
    /// Shard parameters, gradients and optimizer state over every rank (FSDP).
    pub fsdp: bool,
    /// HSDP: shard groups of `world / fsdp_replicas` ranks (1: the world).
    pub fsdp_replicas: usize,
    /// Sequences per optimizer step (`--grad-accum`).
    pub grad_accum: usize,
    pub device: DeviceKind,
    /// Include AdamW state (a training step) or not (`loss_and_grads_cpu`).
    pub optimizer: bool,
    /// How AdamW keeps its state (`--optim-state`, `--master-weights`).
    pub state: crate::optim::StateFormat,
    /// The parameters not trained (`--freeze`): no gradients, no optimizer state.
    pub freeze: crate::model::Freeze,
    /// LoRA adapters trained beside the frozen base (`--lora-rank`; `freeze`
    /// is then the whole base): their weights, F32 gradients and optimizer
    /// state, and the transient buffers of each application.
    pub lora: Option<crate::model::lora::LoraConfig>,
}

impl StepSpec {
    /// The lowest block whose backward runs (`Freeze::backward_floor`): the
    /// blocks below it keep nothing for a backward, so neither kept
    /// attention nor an offloaded checkpoint means anything there.
    pub fn backward_floor(&self) -> usize {
        self.freeze
            .backward_floor(&self.model, self.lora.is_some())
            .min(self.model.layers)
    }

    /// The step of the training run `cfg` under `plan` on `device`.
    pub fn of_run(cfg: &TrainConfig, plan: &CpPlan, device: DeviceKind) -> Self {
        StepSpec {
            model: cfg.model.clone(),
            plan: plan.clone(),
            data: cfg.data_parallel,
            policy: cfg.policy,
            fsdp: cfg.fsdp,
            fsdp_replicas: cfg.fsdp_replicas,
            grad_accum: cfg.grad_accum,
            device,
            optimizer: true,
            state: cfg.optim.state,
            freeze: cfg.freeze.clone(),
            lora: cfg.lora.as_ref().map(|l| l.config.clone()),
        }
    }
}

/// A predicted peak.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Device bytes at the peak.
    pub peak: usize,
    /// Bytes of each category at the device peak.
    pub at_peak: Vec<(Category, usize)>,
    /// Highest host (offload) bytes.
    pub host_peak: usize,
    /// The part of the step where the device peak happens.
    pub peak_at: &'static str,
}

impl Prediction {
    /// Bytes of `cat` at the device peak (`offload_host`: the host peak).
    pub fn at(&self, cat: Category) -> usize {
        if cat == Category::Offload {
            return self.host_peak;
        }
        self.at_peak
            .iter()
            .find(|(c, _)| *c == cat)
            .map_or(0, |x| x.1)
    }
    /// The bytes a rank needs of its memory: the device peak, and on the
    /// CPU the offloaded (host) bytes too, which share that memory.
    pub fn rank_bytes(&self, device: DeviceKind) -> usize {
        if device.is_cuda() {
            self.peak
        } else {
            self.peak + self.host_peak
        }
    }
    /// The device category holding the most bytes at the peak.
    pub fn largest_category(&self) -> Category {
        self.at_peak
            .iter()
            .filter(|(c, _)| c.on_device())
            .max_by_key(|(_, b)| *b)
            .map_or(Category::Activations, |x| x.0)
    }
}

/// About the bytes of the whole model's states on one rank without FSDP, for
/// `--fsdp auto`'s rule of thumb (the plan itself counts every byte):
/// parameters in the compute dtype, and for the parameters `frozen` leaves
/// trained their gradients, AdamW moments and (on GPUs) master weights as
/// `state` keeps them.
pub fn trained_state_bytes(
    cfg: &ModelConfig,
    gpu: bool,
    frozen: &crate::model::Freeze,
    state: crate::optim::StateFormat,
) -> usize {
    let (frozen_elems, _) = frozen.frozen_elements(cfg);
    let params = cfg.param_count();
    let weight = if gpu { 2 } else { 4 };
    let master = match (gpu, state.master) {
        (true, crate::optim::MasterWeights::F32) => 4,
        _ => 0,
    };
    let trained = state.grads.dtype().size() + 2 * state.moments.dtype().size() + master;
    params * weight + (params - frozen_elems) * trained
}

/// The longest sequence the planner plans (`plan`, and `train`'s
/// preflight): 16 times the default `--max-seq` and far beyond any context
/// trained. A prediction's time no longer grows with the length (the
/// engine's alike loops collapse on the counting backend); what bounds it
/// is the host memory of the per-token vectors a step still builds (a
/// rank's window of zeros, its positions: 4-8 bytes a token).
pub const MAX_PLANNED_SEQ: usize = 1 << 32;

/// Bytes of one training checkpoint of `cfg` on disk: F32 weights and both
/// AdamW moments (and the F32 masters, which a sharded run in a lower
/// precision keeps beside them: `masters`), and a MiB for the JSON and TOML
/// files.
pub fn checkpoint_bytes(cfg: &ModelConfig, masters: bool) -> u64 {
    let per_param = if masters { 16 } else { 12 };
    cfg.param_count() as u64 * per_param + (1 << 20)
}

/// The highest of `f(ring_rank)` over the ring ranks (they differ only in
/// which ring blocks their backward runs, which matters on the CUDA flash
/// path), the first of equals: run on [`distinct_ring_ranks`] only.
fn max_over_ring_ranks(pr: usize, f: impl Fn(usize) -> Result<Prediction>) -> Result<Prediction> {
    let mut best: Option<Prediction> = None;
    for i in distinct_ring_ranks(pr) {
        let p = f(i)?;
        if best.as_ref().is_none_or(|b| p.peak > b.peak) {
            best = Some(p);
        }
    }
    Ok(best.expect("at least one ring rank"))
}

/// The ring ranks whose steps can differ, one of each kind (the first):
/// after step 0, ring rank i's steps `1..=i` take a block of the full
/// queries and half the keys (`ring::ring_block`), and the rest `p - 1 - i`
/// half the queries and all keys; a ring step repeats one of the kind
/// before it exactly (its kept buffers already grown), so only which kind
/// comes first and last, and whether the last is the first of its kind,
/// tell the ranks apart: 0, 1 (standing for `1..p-2`), p - 2 and p - 1.
/// Running these instead of all p keeps a prediction linear in the ring
/// degree (`ring_rank_tests` holds it to every rank).
fn distinct_ring_ranks(pr: usize) -> Vec<usize> {
    let mut ranks: Vec<usize> = [0, 1, pr.saturating_sub(2), pr.saturating_sub(1)]
        .into_iter()
        .filter(|&i| i < pr.max(1))
        .collect();
    ranks.dedup();
    ranks
}

/// Predicts the peak of one training step (`train_threads` /
/// `loss_and_grads_cpu`) on the rank that needs the most: the engine's own
/// step on each distinct ring rank ([`engine::engine_step_rank`]). The
/// planner's searches (the longest context, the `auto` choices) call this
/// many times; it costs the same at any length (`plan::engine`).
pub fn predict_step(spec: &StepSpec) -> Result<Prediction> {
    max_over_ring_ranks(spec.plan.layout.pr, |i| engine::engine_step_rank(spec, i))
}

/// Predicts the peak of one training step on ring rank `ring_rank` (the
/// trainer reports ring rank 0's ledger) by running the engine's own step
/// ([`engine::engine_step_rank`]): what `train`'s preflight and
/// `--rehearse` hold a run against, at the run's own length.
pub fn predict_step_rank(spec: &StepSpec, ring_rank: usize) -> Result<Prediction> {
    engine::engine_step_rank(spec, ring_rank)
}

/// Predicts the peak of one evaluation (`upipe eval`'s loss, or an
/// `upipe eval --task` trial) on the rank that needs the most: the
/// evaluation's own forward on each distinct ring rank
/// ([`engine::engine_eval_rank`]).
pub fn predict_eval(spec: &engine::EvalSpec) -> Result<Prediction> {
    let pr = spec.cfg.plan(spec.length)?.layout.pr;
    max_over_ring_ranks(pr, |i| engine::engine_eval_rank(spec, i))
}

/// Predicts what `attention::trial::run_trial` measures (the highest rank):
/// the ledger peak of one layer's forward+backward with the trial's resident
/// tensors (x, dy, weights, f32 gradients, RoPE tables), over `passes`
/// passes (`run_trial`: 1; `bench attn --device cuda`: warm-up + timed), by
/// running the trial itself on the counting backend
/// ([`engine::engine_attention_trial_rank`]).
pub fn predict_attention_trial(
    plan: &CpPlan,
    dims: &AttnDims,
    device: DeviceKind,
    passes: usize,
) -> Result<Prediction> {
    dims.validate()?;
    max_over_ring_ranks(plan.layout.pr, |i| {
        engine::engine_attention_trial_rank(plan, dims, device, i, passes)
    })
}

/// `plan` with its forward in the widest stages ([`valid_fwd_chunks`]) whose
/// `peak` is no higher than with forward stages equal to the backward's:
/// fewer, larger attention calls at no memory cost (`--fwd-chunk-heads
/// auto`). `peak` is the planner's prediction for the run at hand (the
/// attention trial, or a training step under its policy). Plans other than
/// UPipe come back unchanged.
///
/// [`valid_fwd_chunks`]: crate::attention::schedule::valid_fwd_chunks
pub fn widest_free_forward(
    plan: CpPlan,
    peak: impl Fn(&CpPlan) -> Result<usize>,
) -> Result<CpPlan> {
    if plan.strategy != Strategy::Upipe {
        return Ok(plan);
    }
    let chunk = plan.schedule.chunk;
    let plan = plan.with_fwd_chunk(Some(chunk))?;
    let base = peak(&plan)?;
    for c in crate::attention::schedule::valid_fwd_chunks(&plan.schedule)
        .into_iter()
        .rev()
        .filter(|&c| c != plan.schedule.chunk)
    {
        let wide = plan.clone().with_fwd_chunk(Some(c))?;
        if peak(&wide)? <= base {
            return Ok(wide);
        }
    }
    Ok(plan)
}

/// The widest UPipe backward stage U, a multiple of `pu` from `heads` down
/// to `pu`, for which `fits` gives a plan (`Ok(None)`: that width does not
/// fit, or is not a valid stage; `--chunk-heads auto`): `(U, plan)`, or
/// `None` when no width does.
pub fn widest_fitting<T>(
    heads: usize,
    pu: usize,
    mut fits: impl FnMut(usize) -> Result<Option<T>>,
) -> Result<Option<(usize, T)>> {
    let pu = pu.max(1);
    for u in (pu..=heads).rev().filter(|u| u.is_multiple_of(pu)) {
        if let Some(plan) = fits(u)? {
            return Ok(Some((u, plan)));
        }
    }
    Ok(None)
}

/// Resolves `strategy` on `gpus` GPUs: `(plan, data degree)`. Without an
/// explicit mesh, all GPUs form the context group (ulysses/ring/upipe), and
/// usp takes the largest Ulysses degree ≤ 8 (one node) that divides the heads.
#[allow(clippy::too_many_arguments)]
pub fn resolve_plan(
    strategy: Strategy,
    dims: &AttnDims,
    seq: usize,
    gpus: usize,
    ulysses: Option<usize>,
    ring: Option<usize>,
    chunk_heads: Option<usize>,
) -> Result<(CpPlan, usize)> {
    if gpus == 0 {
        return crate::config_err!("--gpus must be at least 1");
    }
    let (pu, pr) = match (strategy, ulysses, ring) {
        (Strategy::Local, _, _) => (1, 1),
        (_, Some(u), Some(r)) => (u, r),
        (_, Some(u), None) => (u, 1),
        (_, None, Some(r)) => (1, r),
        (Strategy::Usp, None, None) => {
            let pu = (1..=gpus.min(8))
                .rev()
                .find(|&p| gpus.is_multiple_of(p) && dims.heads.is_multiple_of(p))
                .unwrap_or(1);
            (pu, gpus / pu)
        }
        (Strategy::Ring, None, None) => (1, gpus),
        (_, None, None) => (gpus, 1),
    };
    let c = pu * pr;
    if c == 0 || !gpus.is_multiple_of(c) {
        return crate::config_err!(
            "{gpus} GPUs are not a multiple of the context mesh {pu} (ulysses) x {pr} (ring) = {c}; \
             use --gpus {} or a mesh whose product divides {gpus}",
            c.max(1) * (gpus / c.max(1)).max(1)
        );
    }
    let chunk = if strategy == Strategy::Upipe {
        chunk_heads
    } else {
        None
    };
    let plan = CpPlan::new(strategy, dims, seq, pu, pr, chunk)
        .map_err(|e| crate::Error::Config(format!("{strategy}: {}", strip(&e))))?;
    Ok((plan, gpus / c))
}

fn strip(e: &crate::Error) -> String {
    let s = e.to_string();
    s.strip_prefix("invalid configuration: ")
        .map(str::to_string)
        .unwrap_or(s)
}

/// The sequence-length granularity of a plan's layout (see `SeqLayout::new`).
pub fn seq_unit(pu: usize, pr: usize) -> usize {
    if pr > 1 { 2 * pr * pu } else { pu }
}

#[cfg(test)]
mod widest_tests {
    use super::widest_fitting;
    use proptest::prelude::*;

    proptest! {
        /// The answer is the widest multiple of Pu that fits, or none.
        #[test]
        fn widest_fitting_is_the_widest_multiple_of_pu_that_fits(
            heads in 1usize..64, pu in 1usize..9, limit in 0usize..70,
        ) {
            let got = widest_fitting(heads, pu, |u| Ok((u <= limit).then_some(u))).unwrap();
            let want = (pu..=heads).rev().find(|u| u % pu == 0 && *u <= limit);
            prop_assert_eq!(got.map(|(u, _)| u), want);
            if let Some((u, plan)) = got {
                prop_assert_eq!(u, plan);
            }
        }
    }
}

#[cfg(test)]
mod ring_rank_tests {
    use super::*;
    use crate::model::decoder::attn_dims;

    /// Walking one ring rank of each kind finds the prediction that walking
    /// every ring rank finds (the same rank's, so the same categories).
    #[test]
    fn distinct_ring_ranks_find_the_highest_of_all() {
        for (name, prs) in [("tiny", 1..=9), ("llama3.2-1b", 1..=5)] {
            let model = ModelConfig::preset(name).unwrap();
            check_ring_ranks(&model, prs);
        }
    }

    fn check_ring_ranks(model: &ModelConfig, prs: std::ops::RangeInclusive<usize>) {
        let dims = attn_dims(model);
        for device in [DeviceKind::Cpu, DeviceKind::CUDA, DeviceKind::CudaNative] {
            for (strategy, pu) in [
                (Strategy::Ring, 1),
                (Strategy::Upipe, 2),
                (Strategy::Usp, 2),
            ] {
                for pr in prs.clone() {
                    for seq in [2 * pu * pr * 64, 2 * pu * pr * 200] {
                        let plan = CpPlan::new(strategy, &dims, seq, pu, pr, None).unwrap();
                        let spec = StepSpec {
                            model: model.clone(),
                            plan: plan.clone(),
                            data: 1,
                            policy: MemoryPolicy::default(),
                            fsdp: false,
                            fsdp_replicas: 1,
                            grad_accum: 1,
                            device,
                            optimizer: true,
                            state: Default::default(),
                            freeze: Default::default(),
                            lora: None,
                        };
                        let all = (0..pr)
                            .map(|i| predict_step_rank(&spec, i).unwrap())
                            .fold(None::<Prediction>, |best, p| match best {
                                Some(b) if p.peak <= b.peak => Some(b),
                                _ => Some(p),
                            })
                            .unwrap();
                        let got = predict_step(&spec).unwrap();
                        let why = format!("{device:?} {strategy} pr {pr} seq {seq}");
                        assert_eq!((got.peak, got.peak_at), (all.peak, all.peak_at), "{why}");
                        assert_eq!(got.at_peak, all.at_peak, "{why}");
                        let trial = |i| {
                            engine::engine_attention_trial_rank(&plan, &dims, device, i, 2)
                                .unwrap()
                                .peak
                        };
                        let want = (0..pr).map(trial).max().unwrap();
                        let got = predict_attention_trial(&plan, &dims, device, 2)
                            .unwrap()
                            .peak;
                        assert_eq!(got, want, "trial: {why}");
                    }
                }
            }
        }
    }
}
