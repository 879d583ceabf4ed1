//! The whole decoder under every strategy and memory policy equals the
//! single-rank reference; training learns; checkpoints round-trip.

use upipe::attention::trial::rel_err;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::model::decoder::attn_dims;
use upipe::model::{MemoryPolicy, ModelConfig, ModelWeights};
use upipe::train::trainer::loss_and_grads_cpu;

use crate::common;
use common::random_window as data;
use common::{tiny, tiny_qwen2};

fn run(
    cfg: &ModelConfig,
    s: Strategy,
    pu: usize,
    pr: usize,
    u: Option<usize>,
    policy: MemoryPolicy,
    seq: usize,
) -> (f64, std::collections::BTreeMap<String, Vec<f32>>) {
    let plan = CpPlan::new(s, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let (ids, tg) = data(seq, cfg.vocab);
    let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
    loss_and_grads_cpu(cfg, &plan, policy, &ids, &tg, &init).unwrap()
}

fn assert_close(
    a: &(f64, std::collections::BTreeMap<String, Vec<f32>>),
    r: &(f64, std::collections::BTreeMap<String, Vec<f32>>),
    tol: f64,
    what: &str,
) {
    assert!(
        ((a.0 - r.0) / r.0).abs() <= tol,
        "{what}: loss {} vs {}",
        a.0,
        r.0
    );
    assert_eq!(a.1.len(), r.1.len());
    for (name, g) in &a.1 {
        let e = rel_err(g, &r.1[name]);
        assert!(e <= tol, "{what}: gradient of {name} rel err {e:e}");
    }
}

#[test]
fn every_strategy_and_mesh_equals_one_rank() {
    for qk in [false, true] {
        let cfg = tiny(qk);
        let seq = 32;
        let reference = run(
            &cfg,
            Strategy::Local,
            1,
            1,
            None,
            MemoryPolicy::default(),
            seq,
        );
        for (s, pu, pr, u) in [
            (Strategy::Ulysses, 4, 1, None),
            (Strategy::Ulysses, 8, 1, None),
            (Strategy::Ring, 1, 4, None),
            (Strategy::Usp, 2, 2, None),
            (Strategy::Upipe, 2, 2, None),
            (Strategy::Upipe, 4, 2, Some(4)),
            (Strategy::Upipe, 2, 1, Some(4)),
        ] {
            let got = run(&cfg, s, pu, pr, u, MemoryPolicy::default(), seq);
            assert_close(
                &got,
                &reference,
                1e-5,
                &format!("{s} {pu}x{pr} U={u:?} qk_norm={qk}"),
            );
        }
    }
}

/// Qwen2's q/k/v biases under every strategy: each stage adds its heads'
/// bias rows and sums their gradients, so loss and every gradient (the
/// biases' included) equal the single-rank reference, with and without
/// checkpointing.
#[test]
fn qwen2_biases_under_every_strategy_equal_one_rank() {
    let cfg = tiny_qwen2();
    let seq = 32;
    let policy = MemoryPolicy::default();
    let reference = run(&cfg, Strategy::Local, 1, 1, None, policy, seq);
    for layer in 0..cfg.layers {
        for p in ["q", "k", "v"] {
            let name = format!("model.layers.{layer}.self_attn.{p}_proj.bias");
            let g = &reference.1[&name];
            assert!(g.iter().any(|&x| x != 0.0), "{name} has a gradient");
        }
    }
    assert!(
        !reference
            .1
            .contains_key("model.layers.0.self_attn.o_proj.bias")
    );
    let checkpointed = MemoryPolicy {
        checkpoint: true,
        ..Default::default()
    };
    for (s, pu, pr, u, policy) in [
        (Strategy::Ulysses, 4, 1, None, policy),
        (Strategy::Ulysses, 8, 1, None, policy),
        (Strategy::Ring, 1, 4, None, policy),
        (Strategy::Usp, 2, 2, None, policy),
        (Strategy::Upipe, 2, 2, None, policy),
        (Strategy::Upipe, 4, 2, Some(4), policy),
        (Strategy::Upipe, 2, 1, Some(4), checkpointed),
        (Strategy::Local, 1, 1, None, checkpointed),
    ] {
        let got = run(&cfg, s, pu, pr, u, policy, seq);
        assert_close(
            &got,
            &reference,
            1e-5,
            &format!("qwen2 {s} {pu}x{pr} U={u:?} {policy:?}"),
        );
    }
    // overlapped stages, and bias gradients taken in per stage or per phase
    use upipe::attention::Settle;
    for (overlap, settle) in [
        (true, Settle::Stages(1)),
        (false, Settle::Phase),
        (true, Settle::Phase),
    ] {
        let plan = CpPlan::new(Strategy::Upipe, &attn_dims(&cfg), seq, 4, 2, Some(4))
            .unwrap()
            .with_overlap(overlap)
            .with_settle(settle);
        let (ids, tg) = data(seq, cfg.vocab);
        let init = |b: &CpuBackend| ModelWeights::random(b, &cfg, 5);
        let got = loss_and_grads_cpu(&cfg, &plan, policy, &ids, &tg, &init).unwrap();
        let what = format!("qwen2 upipe 4x2 U=4 overlap={overlap} settle={settle:?}");
        assert_close(&got, &reference, 1e-5, &what);
    }
}

/// The bias gradients of the reference itself against central finite
/// differences of the loss (each bias's largest-gradient element, in both
/// blocks).
#[test]
fn qwen2_bias_gradients_match_finite_differences() {
    use upipe::backend::Backend;
    let cfg = tiny_qwen2();
    let seq = 32;
    let plan = CpPlan::new(Strategy::Local, &attn_dims(&cfg), seq, 1, 1, None).unwrap();
    let (ids, tg) = data(seq, cfg.vocab);
    let loss = |name: &str, idx: usize, delta: f32| {
        let init = |b: &CpuBackend| {
            let mut w = ModelWeights::random(b, &cfg, 5)?;
            for (n, t) in w.named_mut() {
                if n == name {
                    b.host_f32_mut(t)?[idx] += delta;
                }
            }
            Ok(w)
        };
        let policy = MemoryPolicy::default();
        loss_and_grads_cpu(&cfg, &plan, policy, &ids, &tg, &init).unwrap()
    };
    let (_, grads) = loss("", 0, 0.0);
    for layer in 0..cfg.layers {
        // q and k biases move the loss little: a wider step keeps their
        // differences above the f32 loss's resolution
        for (p, eps) in [("q", 0.1f32), ("k", 0.1), ("v", 1e-2)] {
            let name = format!("model.layers.{layer}.self_attn.{p}_proj.bias");
            let g = &grads[&name];
            let scale = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let idx = g.iter().position(|x| x.abs() == scale).unwrap();
            let fd = (loss(&name, idx, eps).0 - loss(&name, idx, -eps).0) / (2.0 * eps as f64);
            let err = (fd - g[idx] as f64).abs();
            eprintln!(
                "{name}[{idx}]: finite difference {fd:e}, analytic {:e}",
                g[idx]
            );
            assert!(
                err <= 0.02 * scale as f64 + 1e-6,
                "{name}[{idx}]: finite difference {fd} vs analytic {} (largest {scale})",
                g[idx]
            );
        }
    }
}

#[test]
fn memory_policies_leave_gradients_unchanged() {
    let cfg = tiny(true);
    let seq = 128; // 4 MLP tiles of `hidden` rows on one rank
    let base = run(
        &cfg,
        Strategy::Local,
        1,
        1,
        None,
        MemoryPolicy::default(),
        seq,
    );
    for policy in [
        MemoryPolicy {
            checkpoint: true,
            ..Default::default()
        },
        MemoryPolicy {
            checkpoint: true,
            offload: cfg.layers,
            ..Default::default()
        },
        MemoryPolicy {
            tiled_mlp: true,
            ..Default::default()
        },
        MemoryPolicy {
            checkpoint: true,
            offload: 1,
            offload_optimizer: 0,
            tiled_mlp: true,
            loss_chunk: 7,
            save_attention: 0,
            checkpoint_every: 1,
            ..MemoryPolicy::default()
        },
    ] {
        let got = run(&cfg, Strategy::Local, 1, 1, None, policy, seq);
        assert_close(&got, &base, 1e-6, &format!("{policy:?}"));
        let got = run(&cfg, Strategy::Upipe, 2, 2, None, policy, seq);
        assert_close(&got, &base, 1e-5, &format!("upipe 2x2 {policy:?}"));
    }
}

#[test]
fn offload_moves_block_inputs_to_host() {
    use upipe::train::trainer::{TrainConfig, train_cpu};
    // enough blocks that the host holds some while backward fetches others
    let cfg = ModelConfig {
        layers: 4,
        ..tiny(false)
    };
    let mk = |checkpoint: bool, offload: bool| TrainConfig {
        policy: MemoryPolicy {
            checkpoint,
            offload: if offload { cfg.layers } else { 0 },
            // the tiny model's logits would outweigh its activations
            loss_chunk: 8,
            ..Default::default()
        },
        ..TrainConfig::new(
            cfg.clone(),
            64,
            1,
            upipe::optim::AdamWConfig {
                weight_decay: 0.0,
                ..upipe::optim::AdamWConfig::schedule(1e-3, 1e-4, 0, 1)
            },
        )
    };
    let tokens: std::sync::Arc<[u32]> = data(4096, cfg.vocab).0.into();
    let plain = train_cpu(&mk(false, false), tokens.clone(), &|_| {}).unwrap();
    let ckpt = train_cpu(&mk(true, false), tokens.clone(), &|_| {}).unwrap();
    let off = train_cpu(&mk(true, true), tokens, &|_| {}).unwrap();
    assert!(
        ckpt.memory.peak < plain.memory.peak,
        "checkpointing lowers the peak"
    );
    assert!(
        off.memory.peak < ckpt.memory.peak,
        "offload lowers the device peak"
    );
    assert!(off.memory.host_peak > 0, "offloaded bytes are on the host");
}

#[test]
fn data_parallel_replicas_average_their_sequences() {
    use std::sync::Arc;
    use upipe::data::SequenceSampler;
    use upipe::train::trainer::{TrainConfig, train_cpu};
    let cfg = tiny(false);
    let seq = 32;
    let tokens: Arc<[u32]> = data(2048, cfg.vocab).0.into();
    let mk = |strategy: Strategy, ulysses: usize| TrainConfig {
        data_parallel: 2,
        strategy,
        ulysses,
        seed: 3,
        ..TrainConfig::new(
            cfg.clone(),
            seq,
            3,
            upipe::optim::AdamWConfig {
                weight_decay: 0.0,
                ..upipe::optim::AdamWConfig::schedule(1e-3, 1e-3, 0, 3)
            },
        )
    };
    let dp_local = train_cpu(&mk(Strategy::Local, 1), tokens.clone(), &|_| {}).unwrap();
    let dp_upipe = train_cpu(&mk(Strategy::Upipe, 2), tokens.clone(), &|_| {}).unwrap();
    assert_eq!(dp_local.ranks, 2);
    assert_eq!(dp_upipe.ranks, 4);
    for (a, b) in dp_upipe.reports.iter().zip(&dp_local.reports) {
        assert!(
            ((a.loss - b.loss) / b.loss).abs() < 1e-5,
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    // step 1 loss = mean over the two replicas' windows (same initial weights, seed 3)
    let plan = CpPlan::new(Strategy::Local, &attn_dims(&cfg), seq, 1, 1, None).unwrap();
    let mut mean = 0.0;
    for r in 0..2 {
        let mut s = SequenceSampler::sharded(tokens.clone(), seq, 3, r, 2).unwrap();
        let w = s.next_window();
        let init = |b: &CpuBackend| ModelWeights::random(b, &cfg, 3);
        let (loss, _) = loss_and_grads_cpu(
            &cfg,
            &plan,
            MemoryPolicy::default(),
            w.inputs(),
            w.targets(),
            &init,
        )
        .unwrap();
        mean += loss / 2.0;
    }
    let first = dp_local.reports[0].loss;
    assert!(
        ((first - mean) / mean).abs() < 1e-5,
        "data-parallel loss {first} vs mean of replicas {mean}"
    );
}
