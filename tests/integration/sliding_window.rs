//! Sliding-window attention (Mistral's `sliding_window`) as a bounded mask:
//! the CPU reference equals attention under the explicit mask of
//! transformers' definition; every strategy under a window (alone or with
//! packed documents; shorter than a ring chunk, longer than the sequence)
//! equals `local` for the layer and for a whole tiny Mistral (loss and every
//! gradient, f32 ≤ 1e-5); the planner's collapsed step equals the engine's whole step to the
//! byte and both the CPU ledger; a Mistral directory round-trips through
//! `upipe train` with its `sliding_window`.

use std::collections::BTreeMap;
use std::sync::Arc;
use upipe::attention::trial::{TrialInputs, TrialResult, rel_err, run_trial_masked};
use upipe::attention::{AttnDims, AttnMask, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::{AttentionFwd, Backend, BoundedMask, Category, DType, IGNORE};
use upipe::data::PackedWindow;
use upipe::model::decoder::attn_dims;
use upipe::model::{Family, MemoryPolicy, ModelConfig, ModelWeights};
use upipe::optim::AdamWConfig;
use upipe::plan::engine::{engine_step_rank, engine_step_rank_uncollapsed};
use upipe::plan::{DeviceKind, StepSpec, predict_step};
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu_packed, train_cpu};

use crate::common;

/// Documents starting at `starts` in `seq` tokens, each query seeing at most
/// `window` keys of its document.
fn windowed(starts: &[u32], seq: usize, window: usize) -> AttnMask {
    let m = BoundedMask::documents(starts, seq).unwrap();
    AttnMask::Bounded(m.with_window(window).unwrap())
}

/// Documents that start mid-chunk, of length 1, and across ring ranks.
const STARTS: [u32; 8] = [0, 3, 5, 6, 7, 13, 30, 47];

/// transformers' sliding-window causal mask over documents, by definition.
fn allowed(starts: &[u32], window: usize, i: usize, j: usize) -> bool {
    let doc = |p: usize| starts.iter().rposition(|&s| s as usize <= p).unwrap();
    doc(i) == doc(j) && j <= i && i - j < window
}

/// The CPU reference's attention under a window is softmax attention with
/// every pair outside the window masked out (f64, explicit mask).
#[test]
fn windowed_attention_equals_explicit_masking() {
    let b = CpuBackend::new();
    let (s, hq, hkv, d) = (29, 4, 2, 8);
    let mut rng = Rng::new(34);
    let mut t = |shape: &[usize]| {
        let n = shape.iter().product();
        let v = rng.normal_vec(n, 1.0);
        let t = b.from_host(&v, shape, DType::F32, Category::Workspace);
        (t.unwrap(), v)
    };
    let ((q, qh), (k, kh), (v, vh)) = (t(&[s, hq, d]), t(&[s, hkv, d]), t(&[s, hkv, d]));
    for (starts, window) in [
        (&[0u32][..], 5usize),
        (&[0, 4, 17][..], 6),
        (&[0, 9][..], 1),
    ] {
        let mask = windowed(starts, s, window);
        let mut o = b
            .zeros(&[s, hq, d], DType::F32, Category::Workspace)
            .unwrap();
        let mut lse = b.zeros(&[s, hq], DType::F32, Category::Workspace).unwrap();
        let (qr, kr, vr) = (q.all_rows(), k.all_rows(), v.all_rows());
        b.attention_fwd(AttentionFwd {
            q: qr,
            k: kr,
            v: vr,
            mask: &mask,
            scale: 1.0 / (d as f32).sqrt(),
            o: o.all_rows_mut(),
            lse: lse.all_rows_mut(),
        })
        .unwrap();
        let got = b.to_host(&o).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let mut want = vec![0.0f32; s * hq * d];
        for i in 0..s {
            for h in 0..hq {
                let kvh = h / (hq / hkv);
                let score = |j: usize| -> f64 {
                    let dot: f64 = (0..d)
                        .map(|x| {
                            qh[(i * hq + h) * d + x] as f64 * kh[(j * hkv + kvh) * d + x] as f64
                        })
                        .sum();
                    match allowed(starts, window, i, j) {
                        true => dot * scale,
                        false => f64::NEG_INFINITY,
                    }
                };
                let scores: Vec<f64> = (0..s).map(score).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for x in 0..d {
                    let acc: f64 = (0..s)
                        .map(|j| weights[j] * vh[(j * hkv + kvh) * d + x] as f64)
                        .sum();
                    want[(i * hq + h) * d + x] = (acc / sum) as f32;
                }
            }
        }
        let err = rel_err(&got, &want);
        assert!(
            err <= 1e-5,
            "starts {starts:?} window {window}: rel err {err:e}"
        );
    }
}

fn run(d: &AttnDims, inputs: &TrialInputs, plan: &CpPlan, mask: &AttnMask) -> TrialResult {
    run_trial_masked(plan, d, inputs, mask.clone(), CpuBackend::new)
        .unwrap_or_else(|e| panic!("{} under {mask}: {e}", plan.strategy))
}

/// Every strategy of the attention layer (GQA with Hkv < Pu, UPipe with
/// U < H, zigzag rings of 2, 3 and 4) equals `local` under windows shorter than
/// a ring chunk (5 < 6), between chunk and sequence (13) and longer than the
/// sequence (100), alone and composed with documents; and the window is
/// honoured (it differs from the documents mask alone).
#[test]
fn every_strategy_equals_local_under_a_window() {
    let seq = 48;
    for (heads, kv_heads, qk_norm) in [(8, 2, true), (8, 8, false)] {
        let d = common::tiny_attn_dims(heads, kv_heads, qk_norm);
        let inputs = TrialInputs::random(&d, seq, 17);
        let local = CpPlan::new(Strategy::Local, &d, seq, 1, 1, None).unwrap();
        for starts in [&[0u32][..], &STARTS[..]] {
            for window in [5, 13, 100] {
                let mask = windowed(starts, seq, window);
                let reference = run(&d, &inputs, &local, &mask);
                for (strategy, pu, pr, u) in [
                    (Strategy::Ulysses, 4, 1, None),
                    (Strategy::Ring, 1, 2, None),
                    (Strategy::Ring, 1, 3, None),
                    (Strategy::Ring, 1, 4, None),
                    (Strategy::Usp, 2, 2, None),
                    (Strategy::Upipe, 4, 1, Some(4)),
                    (Strategy::Upipe, 2, 2, Some(2)),
                    (Strategy::Upipe, 4, 2, Some(4)),
                ] {
                    let plan = CpPlan::new(strategy, &d, seq, pu, pr, u).unwrap();
                    for (name, err) in run(&d, &inputs, &plan, &mask).errors_against(&reference) {
                        assert!(
                            err <= 1e-5,
                            "{strategy} {pu}x{pr} U={u:?} Hkv={kv_heads} window {window} \
                             starts {starts:?}: {name} rel err {err:e}"
                        );
                    }
                }
                let docs = AttnMask::Bounded(BoundedMask::documents(starts, seq).unwrap());
                let unwindowed = run(&d, &inputs, &local, &docs);
                let differs = reference
                    .errors_against(&unwindowed)
                    .iter()
                    .any(|(_, e)| *e > 1e-3);
                assert_eq!(differs, window < seq, "window {window} starts {starts:?}");
            }
        }
    }
}

/// A tiny Mistral: the shared tiny model with a sliding window.
fn tiny_mistral(window: Option<usize>) -> ModelConfig {
    let mut c = common::tiny(false);
    c.family = Family::Mistral;
    c.sliding_window = window;
    c.validate().unwrap();
    c
}

use common::LossGrads;

fn packed_window(seq: usize, vocab: usize, starts: &[u32]) -> PackedWindow {
    let mut rng = Rng::new(21);
    let inputs: Vec<u32> = (0..seq).map(|_| rng.below(vocab as u64) as u32).collect();
    let mut targets: Vec<u32> = (0..seq).map(|_| rng.below(vocab as u64) as u32).collect();
    for &s in &starts[1..] {
        targets[s as usize - 1] = IGNORE;
    }
    targets[seq - 1] = IGNORE;
    PackedWindow {
        inputs,
        targets,
        doc_starts: starts.to_vec(),
    }
}

fn model_run(cfg: &ModelConfig, w: &PackedWindow, s: Strategy, pu: usize, pr: usize) -> LossGrads {
    let plan = CpPlan::new(s, &attn_dims(cfg), w.len(), pu, pr, None).unwrap();
    let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
    loss_and_grads_cpu_packed(cfg, &plan, MemoryPolicy::default(), w, &init).unwrap()
}

use common::assert_loss_grads_close as assert_close;

/// A whole tiny Mistral with a window of 7 (shorter than the sequence and
/// than a ring chunk of 8) trains alike on every strategy, on a stream window
/// and on packed documents; the window changes the loss; a window no
/// shorter than the sequence is full causal attention.
#[test]
fn a_windowed_model_trains_alike_on_every_strategy() {
    let seq = 48;
    let cfg = tiny_mistral(Some(7));
    for starts in [&[0u32][..], &STARTS[..]] {
        let w = packed_window(seq, cfg.vocab, starts);
        let want = model_run(&cfg, &w, Strategy::Local, 1, 1);
        for (s, pu, pr) in [
            (Strategy::Ulysses, 2, 1),
            (Strategy::Ring, 1, 3),
            (Strategy::Usp, 2, 2),
            (Strategy::Upipe, 2, 3),
        ] {
            let what = format!("{s} {pu}x{pr} starts {starts:?}");
            assert_close(&model_run(&cfg, &w, s, pu, pr), &want, &what);
        }
        let unwindowed = model_run(&tiny_mistral(None), &w, Strategy::Local, 1, 1);
        assert!(
            (unwindowed.0 - want.0).abs() > 1e-4,
            "the window changed nothing"
        );
        let long = model_run(&tiny_mistral(Some(seq)), &w, Strategy::Ring, 1, 3);
        assert_close(&long, &unwindowed, "a window of the whole sequence");
    }
}

/// The planner under a window: its step (which skips the ring blocks
/// outside every local query's window and uploads the row bounds on CUDA)
/// equals the engine's own step to the byte on every device, and both the
/// CPU ledger of a real training step.
#[test]
fn the_planner_equals_the_ledger_with_a_window() {
    let mut rng = Rng::new(4);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let seq = 240;
    let model = tiny_mistral(Some(9));
    for (s, pu, pr, u) in [
        (Strategy::Local, 1, 1, None),
        (Strategy::Ring, 1, 4, None),
        (Strategy::Usp, 2, 3, None),
        (Strategy::Upipe, 2, 2, Some(2)),
        (Strategy::Ulysses, 4, 1, None),
    ] {
        for checkpoint in [false, true] {
            let policy = MemoryPolicy {
                checkpoint,
                ..MemoryPolicy::default()
            };
            let cfg = TrainConfig {
                strategy: s,
                ulysses: pu,
                ring: pr,
                chunk_heads: u,
                policy,
                ..TrainConfig::new(
                    model.clone(),
                    seq,
                    2,
                    AdamWConfig::schedule(1e-3, 1e-4, 0, 2),
                )
            };
            let plan = cfg.plan().unwrap();
            let what = format!("{s} {pu}x{pr} checkpoint={checkpoint}");
            for device in [DeviceKind::Cpu, DeviceKind::CUDA, DeviceKind::CudaNative] {
                let spec = StepSpec::of_run(&cfg, &plan, device);
                for r in 0..pr {
                    let whole = engine_step_rank_uncollapsed(&spec, r).unwrap();
                    let engine = engine_step_rank(&spec, r).unwrap();
                    assert_eq!(whole.peak, engine.peak, "{what} {device:?} rank {r}");
                    assert_eq!(whole.peak_at, engine.peak_at, "{what} {device:?} rank {r}");
                }
            }
            let measured = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap().memory;
            let pred = predict_step(&StepSpec::of_run(&cfg, &plan, DeviceKind::Cpu)).unwrap();
            assert_eq!(pred.peak, measured.peak, "{what}: device peak");
            assert_eq!(pred.host_peak, measured.host_peak, "{what}: host peak");
        }
    }
}

/// A Mistral directory as transformers writes one (window 8, shorter than
/// the sequence), saved by `upipe train --lr 0` on a zigzag ring: the same
/// weights, and a `config.json` that keeps `sliding_window` and reads back
/// to the same model; `upipe eval` of it gives one loss on `local`, a ring
/// and USP, which the window changes.
#[test]
fn a_mistral_directory_round_trips_with_its_window() {
    use upipe::checkpoint::{HostTensor, SaveDtype, load_hf_model, save_hf_model};
    let temp = |name: &str| {
        let d = std::env::temp_dir().join(format!("upipe-window-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    };
    let (src, dst) = (temp("src"), temp("dst"));
    let source = serde_json::json!({
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 8,
        "tie_word_embeddings": false,
        "dtype": "bfloat16",
        "use_cache": true,
        "vocab_size": 256
    });
    let cfg = ModelConfig::from_hf_json(&source.to_string()).unwrap();
    assert_eq!((cfg.family, cfg.sliding_window), (Family::Mistral, Some(8)));
    let mut rng = Rng::new(7);
    let tensors: BTreeMap<String, HostTensor> = cfg
        .hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let v = rng.normal_vec(shape.iter().product(), 0.05);
            (name, HostTensor::new(shape, v).unwrap())
        })
        .collect();
    save_hf_model(&src, &cfg, &tensors, SaveDtype::BF16).unwrap();
    std::fs::write(src.join("config.json"), source.to_string()).unwrap();
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args([
            "train", "--device", "cpu", "--attn", "ring", "--ring", "2", "--seq", "32",
        ])
        .args([
            "--model",
            s,
            "--init-from",
            s,
            "--steps",
            "1",
            "--lr",
            "0",
            "--save-dir",
            d,
        ])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe train failed: {log}");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    for key in ["sliding_window", "model_type", "architectures", "head_dim"] {
        assert_eq!(saved[key], source[key], "{key}");
    }
    assert_eq!(
        ModelConfig::resolve(d).unwrap(),
        ModelConfig::resolve(s).unwrap()
    );
    assert_eq!(
        load_hf_model(&dst, &cfg).unwrap(),
        load_hf_model(&src, &cfg).unwrap()
    );
    // `upipe eval` of the saved directory (65 tokens: one sequence of 64)
    let ids: Vec<u8> = (0..65u32)
        .flat_map(|i| ((i * 37 + 11) % 256).to_le_bytes())
        .collect();
    let tokens = dst.join("tokens.u32");
    std::fs::write(&tokens, ids).unwrap();
    let eval = |dir: &str, mesh: &[&str]| -> f64 {
        let metrics = dst.join("eval.jsonl");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_upipe"))
            .args(["eval", "--json", "--device", "cpu", "--model-dir", dir])
            .args(["--tokens", tokens.to_str().unwrap()])
            .args(["--metrics", metrics.to_str().unwrap()])
            .args(mesh)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "upipe eval {mesh:?} failed: {log}");
        let line = std::fs::read_to_string(&metrics).unwrap();
        let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let local = eval(d, &["--attn", "local"]);
    for mesh in [
        &["--attn", "ring", "--ring", "4"][..],
        &["--attn", "usp", "--ulysses", "2", "--ring", "2"][..],
    ] {
        let loss = eval(d, mesh);
        assert!(
            ((loss - local) / local).abs() <= 1e-5,
            "{mesh:?}: {loss} vs {local}"
        );
    }
    // the same weights without the window attend over the whole sequence
    let mut full = saved.clone();
    full["sliding_window"] = serde_json::Value::Null;
    std::fs::write(dst.join("config.json"), full.to_string()).unwrap();
    let unwindowed = eval(d, &["--attn", "local"]);
    assert!(
        (unwindowed - local).abs() > 1e-4,
        "the window changed nothing"
    );
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&dst);
}
