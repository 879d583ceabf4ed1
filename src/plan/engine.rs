//! The engine as the planner's source of truth: a step's per-rank peak
//! ledger predicted by running the trainer's own rehearsal
//! ([`rehearse_rank`]: the decoder, the parameter store and the optimizer
//! step as `train` runs them, two steps) on a
//! [`CountingBackend`] (shapes and allocations, no memory, no kernels) and a
//! counting mesh (`comm::counting`: one rank alone), for one representative
//! rank per distinct ring role. Nothing here restates what the engine
//! allocates, so an engine change cannot drift from this prediction.
//!
//! Fast by construction, not by a second description: the loops whose
//! iterations allocate alike (MLP tiles, loss chunks) run on a rehearsal
//! only as far as they can allocate differently
//! ([`for_each_chunk`](crate::model::chunk_loop::for_each_chunk)), and a
//! rehearsal reads no token data, so a step's prediction costs the same at
//! 4K tokens and at 4G.

use super::{DeviceKind, Prediction, StepSpec};
use crate::attention::trial::{RankInputs, RankOptions, run_rank};
use crate::attention::{AttnDims, CpPlan};
use crate::backend::OpBuffers;
use crate::backend::counting::CountingBackend;
use crate::backend::cuda::counted::CountedCuda;
use crate::backend::fp8::Precision;
use crate::backend::op_buffers::ReferenceBuffers;
use crate::backend::{Backend, Category, MemoryStats};
use crate::comm::counting::counting_mesh;
use crate::comm::mesh::Coords;
use crate::error::Result;
use crate::optim::AdamWConfig;
use crate::train::config::TrainConfig;
use crate::train::eval::{EvalConfig, rehearse_eval_on_mesh};
use crate::train::lora_run::LoraRun;
use crate::train::retrieval::rehearse_retrieval_on_mesh;
use crate::train::trainer::rehearse_rank;
use std::sync::Arc;

/// The rules of the device a counting backend stands for: the CPU
/// reference's, or a CUDA device's with the attention routing of the cuDNN
/// version it plans ([`DeviceKind::cudnn`]; none: our kernels only), on
/// cuDNN's FP8 graphs where `precision` says.
pub fn counted_device(device: DeviceKind, precision: Precision) -> Arc<dyn OpBuffers> {
    match device {
        DeviceKind::Cpu => Arc::new(ReferenceBuffers),
        cuda => Arc::new(CountedCuda {
            cudnn: cuda.cudnn(),
            fp8_attention: precision.fp8_attention(),
        }),
    }
}

/// The training run a [`StepSpec`] describes (two rehearsed steps).
fn train_config(spec: &StepSpec) -> TrainConfig {
    let p = &spec.plan;
    TrainConfig {
        data_parallel: spec.data,
        strategy: p.strategy,
        ulysses: p.layout.pu,
        ring: p.layout.pr,
        policy: spec.policy,
        freeze: spec.freeze.clone(),
        lora: spec
            .lora
            .clone()
            .map(|config| LoraRun { config, from: None }),
        fsdp: spec.fsdp,
        fsdp_replicas: spec.fsdp_replicas,
        grad_accum: spec.grad_accum.max(1),
        precision: spec.precision,
        documents: spec.device.documents(),
        rehearse: true,
        ..TrainConfig::new(
            spec.model.clone(),
            p.layout.seq,
            2,
            AdamWConfig {
                state: spec.state,
                ..AdamWConfig::schedule(1e-3, 1e-4, 0, 2)
            },
        )
    }
}

/// The engine's peak of one training step on ring rank `ring_rank`
/// (Ulysses rank 0 of data replica 0), as [`super::predict_step_rank`].
pub fn engine_step_rank(spec: &StepSpec, ring_rank: usize) -> Result<Prediction> {
    step_rank_on(
        spec,
        ring_rank,
        CountingBackend::new(counted_device(spec.device, spec.precision)),
    )
}

/// [`engine_step_rank`] with every iteration of every loop run (none
/// collapsed): what tests hold the collapsed prediction to.
pub fn engine_step_rank_uncollapsed(spec: &StepSpec, ring_rank: usize) -> Result<Prediction> {
    let b = CountingBackend::new(counted_device(spec.device, spec.precision)).every_iteration();
    step_rank_on(spec, ring_rank, b)
}

fn step_rank_on(spec: &StepSpec, ring_rank: usize, b: CountingBackend) -> Result<Prediction> {
    spec.model.validate()?;
    spec.policy.validate_for(spec.model.layers)?;
    if spec.data == 0 {
        return crate::config_err!("the data-parallel degree must be at least 1");
    }
    if !spec.optimizer {
        return crate::config_err!(
            "the engine path predicts training steps (optimizer included) only"
        );
    }
    let cfg = train_config(spec);
    let shape = cfg.mesh_shape(&spec.plan);
    let rank = shape.rank_of(Coords {
        data: 0,
        ring: ring_rank,
        ulysses: 0,
    });
    let mesh = counting_mesh(shape, rank);
    let memory = rehearse_rank(&cfg, &spec.plan, &b, &mesh)?;
    Ok(prediction(&memory))
}

/// The engine's peak of one attention layer's forward+backward on ring rank
/// `ring_rank` (Ulysses rank 0), as `attention::trial::run_rank` measures
/// it over `passes` passes (its highest pass): the layer's resident
/// tensors, then the layer itself, on the counting backend.
pub fn engine_attention_trial_rank(
    plan: &CpPlan,
    dims: &AttnDims,
    device: DeviceKind,
    ring_rank: usize,
    passes: usize,
) -> Result<Prediction> {
    let shape = plan.mesh_shape();
    let rank = shape.rank_of(Coords {
        data: 0,
        ring: ring_rank,
        ulysses: 0,
    });
    let b = CountingBackend::new(counted_device(device, dims.precision));
    let mesh = counting_mesh(shape, rank);
    let opts = RankOptions {
        warmup: passes.max(1) - 1,
        iters: 1,
        keep_outputs: false,
    };
    let run = run_rank(plan, dims, RankInputs::NONE, &b, &mesh, &opts)?;
    let stats = run.peak_stats.unwrap_or_else(|| b.ledger().stats());
    Ok(prediction(&stats))
}

/// Which evaluation forward an [`EvalSpec`] plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalForward {
    /// `upipe eval`: the loss over windows of the length.
    Loss,
    /// `upipe eval --task`: a retrieval trial of the length.
    Trial,
}

/// An evaluation of one length, as `upipe eval` (or `--task`) runs it.
#[derive(Debug, Clone)]
pub struct EvalSpec<'a> {
    pub cfg: &'a EvalConfig,
    /// Inputs per window (the loss) or the trial's length.
    pub length: usize,
    pub device: DeviceKind,
    pub forward: EvalForward,
}

/// The engine's peak of one evaluation forward on ring rank `ring_rank`
/// (Ulysses rank 0 of data replica 0): `upipe eval`'s own code
/// ([`rehearse_eval_on_mesh`], [`rehearse_retrieval_on_mesh`]: the weights,
/// the adapter, the decoder and the forward) on the counting backend and a
/// counting mesh, as the rank's ledger measures it.
pub fn engine_eval_rank(spec: &EvalSpec, ring_rank: usize) -> Result<Prediction> {
    let cfg = spec.cfg;
    let plan = cfg.plan(spec.length)?;
    let shape = cfg.mesh_shape(&plan);
    let rank = shape.rank_of(Coords {
        data: 0,
        ring: ring_rank,
        ulysses: 0,
    });
    let b = CountingBackend::new(counted_device(spec.device, Precision::Bf16));
    let mesh = counting_mesh(shape, rank);
    match spec.forward {
        EvalForward::Loss => drop(rehearse_eval_on_mesh(cfg, spec.length, &b, &mesh)?),
        EvalForward::Trial => drop(rehearse_retrieval_on_mesh(cfg, spec.length, &b, &mesh)?),
    }
    Ok(prediction(&b.ledger().stats()))
}

/// A ledger's peaks as a prediction.
fn prediction(m: &MemoryStats) -> Prediction {
    Prediction {
        peak: m.peak,
        at_peak: Category::ALL.iter().map(|&c| (c, m.at_peak(c))).collect(),
        host_peak: m.host_peak,
        peak_at: m.peak_at,
    }
}
