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
/// the highest of any rank) equals the prediction for that length. The
/// vocabulary is wide enough that an answer's row of logits makes the peak
/// at the shorter lengths.
#[test]
fn a_retrieval_trials_predicted_peak_is_its_measured_peak() {
    let mut model = ModelConfig::resolve("tiny").unwrap();
    model.vocab = 200_000;
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

fn upipe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("upipe-eval-plan-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `eval --task`'s summary gives each length's predicted and measured
/// peak, equal on the CPU, and its seconds per trial; `eval --metrics`
/// gives the loss evaluation's predicted peak beside the measured one.
#[test]
fn eval_reports_the_predicted_peak_beside_the_measured_one() {
    let dir = temp_dir("report");
    let cfg = ModelConfig::resolve("tiny").unwrap();
    let model = dir.join("model");
    let host = random_weights(&cfg, 4);
    upipe::checkpoint::save_hf_model(&model, &cfg, &host, upipe::backend::DType::F32).unwrap();
    let (m, out) = (model.to_str().unwrap(), dir.join("out"));
    let o = upipe(&[
        "eval",
        "--task",
        "passkey",
        "--model-dir",
        m,
        "--lengths",
        "300,1K",
        "--depths",
        "1",
        "--trials",
        "2",
        "--device",
        "cpu",
        "--ulysses",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("predicted peak") && stdout.contains("s/trial"),
        "{stdout}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let by_length = summary["by_length"].as_array().unwrap();
    assert_eq!(by_length.len(), 2);
    for (l, want) in by_length.iter().zip([300, 1024]) {
        assert_eq!(l["length"], want);
        let measured = l["measured_peak_bytes"].as_u64().unwrap();
        assert!(measured > 0);
        assert_eq!(l["predicted_peak_bytes"].as_u64().unwrap(), measured, "{l}");
        assert!(l["seconds_per_trial"].as_f64().unwrap() > 0.0);
    }
    let mut rng = Rng::new(3);
    let ids: Vec<u8> = (0..2049u32)
        .flat_map(|_| (rng.below(256) as u32).to_le_bytes())
        .collect();
    let (tokens, metrics) = (dir.join("ids.u32"), dir.join("m.jsonl"));
    std::fs::write(&tokens, ids).unwrap();
    let o = upipe(&[
        "eval",
        "--model-dir",
        m,
        "--tokens",
        tokens.to_str().unwrap(),
        "--seq",
        "512",
        "--device",
        "cpu",
        "--ulysses",
        "2",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&metrics).unwrap().trim()).unwrap();
    assert!(line["peak_bytes"].as_u64().unwrap() > 0);
    assert_eq!(line["predicted_peak_bytes"], line["peak_bytes"], "{line}");
    assert!(
        line["predicted_by_category"]["weights"].as_u64().unwrap() > 0,
        "{line}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An evaluation the planner says cannot fit the host's memory (Llama 3.1
/// 70B in f32 on the CPU) is refused before any weight loads: its
/// directory holds no weights at all, and the error names what to change.
#[test]
fn an_evaluation_that_cannot_fit_is_refused_before_weights_load() {
    let dir = temp_dir("refuse");
    let config = ModelConfig::hf_source("llama3.1-70b").unwrap().unwrap();
    let config = serde_json::Value::Object(config).to_string();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let tokens = dir.join("ids.u32");
    let ids: Vec<u8> = (0..4097u32).flat_map(|i| (i % 200).to_le_bytes()).collect();
    std::fs::write(&tokens, ids).unwrap();
    let d = dir.to_str().unwrap();
    let task = [
        "eval",
        "--task",
        "passkey",
        "--model-dir",
        d,
        "--tokenizer",
        "byte",
        "--lengths",
        "1K,4K",
        "--device",
        "cpu",
    ];
    let loss = [
        "eval",
        "--model-dir",
        d,
        "--tokens",
        tokens.to_str().unwrap(),
        "--seq",
        "4096",
        "--device",
        "cpu",
    ];
    for (args, flag) in [(&task[..], "--lengths 1024"), (&loss[..], "--seq 4096")] {
        let o = upipe(args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("{flag} cannot fit, so no weight was loaded")),
            "{stderr}"
        );
        assert!(
            stderr.contains("weights") && stderr.contains("more GPUs"),
            "{stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
