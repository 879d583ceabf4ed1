//! Evaluation planned by the engine: the planner's prediction of an
//! evaluation's peak (`plan::predict_eval`: `upipe eval`'s own forward on
//! the counting backend and a counting mesh) equals the ledger peak a real
//! evaluation measures on the CPU, to the byte, for the loss and for a
//! retrieval trial, under every strategy, on thread ranks, with and
//! without a LoRA adapter.

use std::collections::BTreeMap;
use upipe::attention::Strategy;
use upipe::backend::cpu::CpuBackend;
use upipe::checkpoint::HostTensor;
use upipe::comm::local::run_ranks;
use upipe::data::retrieval::{Grid, Trial, TrialAt};
use upipe::data::{Dataset, Tokens};
use upipe::model::ModelConfig;
use upipe::model::lora::{LoraConfig, LoraWeights, parse_targets};
use upipe::plan::{DeviceKind, EvalForward, EvalSpec, predict_eval};
use upipe::rng::Rng;
use upipe::train::eval::{EvalConfig, eval_on_mesh};
use upipe::train::retrieval::{RetrievalRun, retrieval_on_mesh};

/// `(strategy, data replicas, ulysses, ring)`.
const MESHES: [(Strategy, usize, usize, usize); 5] = [
    (Strategy::Local, 1, 1, 1),
    (Strategy::Upipe, 1, 1, 1),
    (Strategy::Upipe, 1, 2, 1),
    (Strategy::Ring, 1, 1, 2),
    (Strategy::Usp, 2, 2, 2),
];

fn random_weights(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(seed);
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            (
                name,
                HostTensor::new(shape, rng.normal_vec(n, 0.1)).unwrap(),
            )
        })
        .collect()
}

fn eval_config(
    model: &ModelConfig,
    (s, dp, pu, pr): (Strategy, usize, usize, usize),
    lora: bool,
) -> EvalConfig {
    let lora = lora.then(|| {
        let targets = parse_targets("q_proj,v_proj,down_proj").unwrap();
        let config = LoraConfig::new(4, 8.0, false, targets).unwrap();
        LoraWeights::init(model, &config, 3).unwrap()
    });
    EvalConfig {
        strategy: s,
        data_parallel: dp,
        ulysses: pu,
        ring: pr,
        loss_chunk: 96,
        lora,
        ..EvalConfig::new(model.clone())
    }
}

fn random_trial(at: &TrialAt, vocab: u64) -> upipe::error::Result<Trial> {
    let mut rng = Rng::new(at.seed);
    // a trial up to a few ids shorter than its length, as kv's may be
    let len = at.length - at.index % 3;
    Ok(Trial {
        ids: (0..len).map(|_| rng.below(vocab) as u32).collect(),
        answer: len - 4..len,
        needle_at: 0,
        placed_depth: 0.0,
        key: String::new(),
        expected: String::new(),
    })
}

fn predicted(cfg: &EvalConfig, length: usize, forward: EvalForward) -> usize {
    let spec = EvalSpec {
        cfg,
        length,
        device: DeviceKind::Cpu,
        forward,
    };
    predict_eval(&spec).unwrap().peak
}

/// Every rank's measured peak of each length of a retrieval grid (already
/// the highest of any rank) equals the prediction for that length.
#[test]
fn a_retrieval_trials_predicted_peak_is_its_measured_peak() {
    let model = ModelConfig::resolve("tiny").unwrap();
    let host = random_weights(&model, 1);
    for mesh in MESHES {
        for lora in [false, true] {
            let cfg = eval_config(&model, mesh, lora);
            let grid = Grid {
                lengths: vec![200, 1000, 512],
                depths: vec![0.5],
                trials: 3,
                seed: 5,
            };
            let vocab = model.vocab as u64;
            let make = |at: &TrialAt| random_trial(at, vocab);
            let run = RetrievalRun {
                cfg: &cfg,
                grid: &grid,
                make: &make,
            };
            let shape = cfg.mesh_shape(&cfg.plan(1000).unwrap());
            let ranks = run_ranks(shape, CpuBackend::new, |_, b, m| {
                retrieval_on_mesh(&run, &host, b.as_ref(), &m)
            })
            .unwrap();
            for (li, &length) in grid.lengths.iter().enumerate() {
                let want = predicted(&cfg, length, EvalForward::Trial);
                for r in &ranks {
                    let got = &r.lengths[li];
                    assert_eq!(got.length, length);
                    assert!(got.seconds_per_trial > 0.0);
                    assert_eq!(
                        got.peak_bytes, want,
                        "{mesh:?} lora {lora} length {length}: measured vs predicted"
                    );
                }
            }
        }
    }
}

/// The loss evaluation's highest rank peak equals the prediction.
#[test]
fn a_loss_evaluations_predicted_peak_is_its_measured_peak() {
    let model = ModelConfig::resolve("tiny").unwrap();
    let host = random_weights(&model, 2);
    let mut rng = Rng::new(9);
    let ids: Vec<u32> = (0..2049)
        .map(|_| rng.below(model.vocab as u64) as u32)
        .collect();
    let data = Dataset::from(Tokens::from_ids(ids, "ids"));
    for mesh in MESHES {
        for (lora, seq, buckets) in [(false, 512, 1), (true, 1000, 1), (false, 256, 4)] {
            let cfg = EvalConfig {
                seq: Some(seq),
                buckets,
                ..eval_config(&model, mesh, lora)
            };
            let shape = cfg.mesh_shape(&cfg.plan(seq).unwrap());
            let reports = run_ranks(shape, CpuBackend::new, |_, b, m| {
                eval_on_mesh(&cfg, &data, &host, b.as_ref(), &m)
            })
            .unwrap();
            let got = reports.iter().map(|r| r.peak_bytes).max().unwrap();
            assert_eq!(
                got,
                predicted(&cfg, seq, EvalForward::Loss),
                "{mesh:?} lora {lora} seq {seq} buckets {buckets}"
            );
        }
    }
}
