//! The evaluation's forward during training (`--eval-data --eval-every`)
//! stays inside the run's predicted peak: a run evaluating after every
//! step measures, on the CPU ledger, exactly the peak the planner predicts
//! for the training step alone (predicted == ledger, to the byte), with
//! the parameters replicated and sharded (FSDP: each unit gathered for the
//! forward as the training forward gathers it), under the memory policies
//! that change what a step keeps.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::data::Dataset;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::{DeviceKind, StepSpec, predict_step};
use upipe::rng::Rng;
use upipe::train::eval::EvalDuring;
use upipe::train::trainer::{TrainConfig, train_cpu};

use crate::common;
use common::tiny;

fn train_cfg(
    model: &ModelConfig,
    s: Strategy,
    pu: usize,
    pr: usize,
    policy: MemoryPolicy,
) -> TrainConfig {
    TrainConfig {
        strategy: s,
        ulysses: pu,
        ring: pr,
        policy,
        ..TrainConfig::new(
            model.clone(),
            128,
            2,
            AdamWConfig {
                weight_decay: 0.0,
                ..AdamWConfig::schedule(1e-3, 1e-4, 0, 2)
            },
        )
    }
}

#[test]
fn the_eval_forward_during_training_stays_within_the_predicted_peak() {
    let mut rng = Rng::new(11);
    let tokens: Arc<[u32]> = (0..2048).map(|_| rng.below(256) as u32).collect();
    let heldout: Vec<u32> = (0..700).map(|_| rng.below(256) as u32).collect();
    let layers = tiny(false).layers;
    let policies = [
        MemoryPolicy::default(),
        MemoryPolicy {
            checkpoint: true,
            ..MemoryPolicy::default()
        },
        MemoryPolicy {
            checkpoint: true,
            offload: layers,
            tiled_mlp: true,
            loss_chunk: 7,
            ..MemoryPolicy::default()
        },
    ];
    for (s, pu, pr) in [
        (Strategy::Upipe, 2, 2),
        (Strategy::Ring, 1, 4),
        (Strategy::Local, 1, 1),
    ] {
        for policy in policies {
            for fsdp in [false, true] {
                if fsdp && pu * pr == 1 {
                    continue; // one rank: nothing to shard
                }
                let mut model = tiny(true);
                model.tie_embeddings = fsdp;
                let mut cfg = train_cfg(&model, s, pu, pr, policy);
                cfg.fsdp = fsdp;
                let plain = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap();
                cfg.eval = Some(EvalDuring {
                    data: Dataset::from(heldout.clone()),
                    every: 1,
                    buckets: 2,
                });
                let evaluated = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap();
                let what = format!("{s} {pu}x{pr} fsdp={fsdp} {policy:?}");
                assert!(
                    evaluated.reports.iter().all(|r| r.eval.is_some()),
                    "{what}: every step evaluates"
                );
                let spec = StepSpec {
                    model: model.clone(),
                    plan: cfg.plan().unwrap(),
                    data: 1,
                    policy,
                    fsdp,
                    fsdp_replicas: 1,
                    grad_accum: 1,
                    device: DeviceKind::Cpu,
                    optimizer: true,
                    state: Default::default(),
                    precision: Default::default(),
                    freeze: Default::default(),
                    lora: None,
                };
                let predicted = predict_step(&spec).unwrap();
                assert_eq!(predicted.peak, plain.memory.peak, "{what}: without eval");
                assert_eq!(
                    predicted.peak, evaluated.memory.peak,
                    "{what}: the evaluation's forward went past the predicted peak"
                );
                assert_eq!(
                    predicted.host_peak, evaluated.memory.host_peak,
                    "{what}: host"
                );
            }
        }
    }
}
