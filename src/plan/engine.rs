//! The engine as the planner's source of truth: a step's per-rank peak
//! ledger predicted by running the trainer's own rehearsal
//! ([`rehearse_rank`]: the decoder, the parameter store and the optimizer
//! step as `train` runs them, two steps) on a
//! [`CountingBackend`] (shapes and allocations, no memory, no kernels) and a
//! counting mesh (`comm::counting`: one rank alone), for one representative
//! rank per distinct ring role. Nothing here restates what the engine
//! allocates, so an engine change cannot drift from this prediction.
//!
//! The hand-written walk ([`super::walk`]) stays the planner's fast path:
//! `tests/integration/plan_engine.rs` holds the two equal to the byte, and
//! `predict_step`'s doc says why the walk is still the one searches use.

use super::{DeviceKind, Prediction, StepSpec, distinct_ring_ranks};
use crate::backend::counting::{CountedDevice, CountingBackend};
use crate::backend::{Category, MemoryStats};
use crate::comm::counting::counting_mesh;
use crate::comm::mesh::Coords;
use crate::error::Result;
use crate::optim::AdamWConfig;
use crate::train::config::TrainConfig;
use crate::train::lora_run::LoraRun;
use crate::train::trainer::rehearse_rank;

/// The counting device standing for `device`: its dtypes, and on CUDA the
/// attention routing of the cuDNN version the device plans
/// ([`DeviceKind::cudnn`]; none: our kernels only).
pub fn counted_device(device: DeviceKind) -> CountedDevice {
    match device {
        DeviceKind::Cpu => CountedDevice::Cpu,
        cuda => CountedDevice::Cuda {
            cudnn: cuda.cudnn(),
        },
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
        documents: spec.device.documents(),
        rehearse: true,
        ..TrainConfig::new(
            spec.model.clone(),
            p.layout.seq,
            2,
            AdamWConfig::schedule(1e-3, 1e-4, 0, 2),
        )
    }
}

/// The engine's peak of one training step on ring rank `ring_rank`
/// (Ulysses rank 0 of data replica 0), as [`super::predict_step_rank`].
pub fn engine_step_rank(spec: &StepSpec, ring_rank: usize) -> Result<Prediction> {
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
    let b = CountingBackend::new(counted_device(spec.device));
    let mesh = counting_mesh(shape, rank);
    let memory = rehearse_rank(&cfg, &spec.plan, &b, &mesh)?;
    Ok(prediction(&memory))
}

/// The engine's peak of one training step on the rank that needs the most,
/// as [`super::predict_step`] (the distinct ring ranks only).
pub fn engine_step(spec: &StepSpec) -> Result<Prediction> {
    let mut best: Option<Prediction> = None;
    for i in distinct_ring_ranks(spec.plan.layout.pr) {
        let p = engine_step_rank(spec, i)?;
        if best.as_ref().is_none_or(|b| p.peak > b.peak) {
            best = Some(p);
        }
    }
    Ok(best.expect("at least one ring rank"))
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
