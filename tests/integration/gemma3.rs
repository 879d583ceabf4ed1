//! Gemma 3's block on the CPU — sandwich norms scaling by `1 + w`, GeGLU,
//! QK-norm, a scaled and tied embedding, sliding local layers (their own
//! RoPE base, unscaled) between global ones (linear RoPE scaling): the
//! decoder's loss equals an independent f64 forward of the same model, its
//! gradients equal that forward's central differences, and every strategy
//! and memory policy equals the single-rank reference.

use std::collections::{BTreeMap, HashMap};
use upipe::attention::rope::RopeScaling;
use upipe::attention::trial::rel_err;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::Backend;
use upipe::backend::cpu::CpuBackend;
use upipe::model::decoder::attn_dims;
use upipe::model::families::LayerType;
use upipe::model::{Family, MemoryPolicy, ModelConfig, ModelWeights};
use upipe::rng::Rng;
use upipe::train::trainer::loss_and_grads_cpu;

use crate::common;
use common::random_window as data;

type LossGrads = (f64, BTreeMap<String, Vec<f32>>);

/// A tiny Gemma 3: 8 query heads over 2 kv heads of dim 8, hidden 32, ffn
/// 48, three layers (sliding, sliding, global), a window of 8 keys, local
/// RoPE base 100, global base 10 000 scaled linearly by 4, scores scaled by
/// `12^-½`, tied embeddings.
fn tiny_gemma() -> ModelConfig {
    let mut c = common::tiny(true);
    c.family = Family::Gemma3;
    c.layers = 3;
    c.layer_types = vec![LayerType::Sliding, LayerType::Sliding, LayerType::Full];
    c.sliding_window = Some(8);
    c.local_rope_theta = Some(100.0);
    c.rope_scaling = Some(RopeScaling::Linear(4.0));
    c.query_pre_attn_scalar = Some(QUERY_SCALAR);
    c.tie_embeddings = true;
    c.rms_norm_eps = 1e-6;
    c.validate().unwrap();
    c
}

const QUERY_SCALAR: f32 = 12.0;

/// Random weights with every norm weight drawn around zero too, so the
/// `1 + w` offsets and the norms' gradients all matter.
fn weights(b: &CpuBackend, cfg: &ModelConfig) -> upipe::Result<ModelWeights<CpuBackend>> {
    let mut w = ModelWeights::random(b, cfg, 5)?;
    let mut rng = Rng::new(17);
    for (name, t) in w.named_mut() {
        let v = b.host_f32_mut(t)?;
        if name.ends_with("norm.weight") {
            v.iter_mut().for_each(|x| *x = rng.normal() as f32 * 0.3);
        } else {
            // larger than the 0.02 init, so attention is far from uniform
            v.iter_mut().for_each(|x| *x *= 10.0);
        }
    }
    Ok(w)
}

fn host_weights(cfg: &ModelConfig) -> HashMap<String, Vec<f64>> {
    let b = CpuBackend::new();
    let w = weights(&b, cfg).unwrap();
    w.named()
        .into_iter()
        .map(|(n, t)| (n, b.to_host(t).unwrap().iter().map(|&x| x as f64).collect()))
        .collect()
}

fn run(
    cfg: &ModelConfig,
    s: Strategy,
    mesh: (usize, usize, Option<usize>),
    policy: MemoryPolicy,
    seq: usize,
) -> LossGrads {
    let (pu, pr, u) = mesh;
    let plan = CpPlan::new(s, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let (ids, tg) = data(seq, cfg.vocab);
    let init = |b: &CpuBackend| weights(b, cfg);
    loss_and_grads_cpu(cfg, &plan, policy, &ids, &tg, &init).unwrap()
}

// ---- an independent f64 forward of the Gemma 3 text model ----

/// `x / rms(x) · (1 + w)` over each row of `dim`.
fn norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let dim = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * r * (1.0 + g)));
    }
    out
}

/// `x [s, k] · Wᵀ` with `W [n, k]`.
fn linear(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
    let n = w.len() / k;
    let mut out = Vec::with_capacity(x.len() / k * n);
    for row in x.chunks(k) {
        for col in w.chunks(k) {
            out.push(row.iter().zip(col).map(|(a, b)| a * b).sum());
        }
    }
    out
}

fn add(x: &mut [f64], y: &[f64]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn gelu_tanh(g: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh())
}

/// HF rotate-half RoPE of `x [s, heads, d]` with base `theta`, frequencies
/// divided by `factor`.
fn rope(x: &mut [f64], heads: usize, d: usize, theta: f64, factor: f64) {
    let half = d / 2;
    for (t, pos) in x.chunks_mut(heads * d).enumerate() {
        for head in pos.chunks_mut(d) {
            for i in 0..half {
                let f = theta.powf(-(2.0 * i as f64) / d as f64) / factor;
                let (c, s) = ((t as f64 * f).cos(), (t as f64 * f).sin());
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }
}

/// Causal attention with GQA, scores scaled by `scale`, each query seeing
/// at most `window` keys (itself included).
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    s: usize,
    h: usize,
    hkv: usize,
    d: usize,
    scale: f64,
    window: Option<usize>,
) -> Vec<f64> {
    let mut o = vec![0.0; s * h * d];
    for t in 0..s {
        for hh in 0..h {
            let kh = hh / (h / hkv);
            let first = window.map_or(0, |w| (t + 1).saturating_sub(w));
            let qv = &q[(t * h + hh) * d..][..d];
            let scores: Vec<f64> = (first..=t)
                .map(|j| {
                    scale
                        * qv.iter()
                            .zip(&k[(j * hkv + kh) * d..][..d])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
            for (idx, j) in (first..=t).enumerate() {
                let p = (scores[idx] - m).exp() / z;
                for e in 0..d {
                    o[(t * h + hh) * d + e] += p * v[(j * hkv + kh) * d + e];
                }
            }
        }
    }
    o
}

/// The mean next-token loss of `ids` against `targets` by Gemma 3's
/// forward, written from its definition in f64.
fn reference_loss(
    cfg: &ModelConfig,
    w: &HashMap<String, Vec<f64>>,
    ids: &[u32],
    targets: &[u32],
) -> f64 {
    let (s, hid, h, hkv, d) = (ids.len(), cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps as f64;
    let p = |name: &str| &w[name];
    let embed = p("model.embed_tokens.weight");
    let mut x: Vec<f64> = ids
        .iter()
        .flat_map(|&i| {
            embed[i as usize * hid..][..hid]
                .iter()
                .map(|v| v * (hid as f64).sqrt())
        })
        .collect();
    for l in 0..cfg.layers {
        let b = |n: &str| p(&format!("model.layers.{l}.{n}"));
        let global = cfg.layer_types[l] == LayerType::Full;
        let a = norm(&x, b("input_layernorm.weight"), eps);
        let mut q = norm(
            &linear(&a, b("self_attn.q_proj.weight"), hid),
            b("self_attn.q_norm.weight"),
            eps,
        );
        let mut k = norm(
            &linear(&a, b("self_attn.k_proj.weight"), hid),
            b("self_attn.k_norm.weight"),
            eps,
        );
        let v = linear(&a, b("self_attn.v_proj.weight"), hid);
        let (theta, factor, window) = match global {
            true => (cfg.rope_theta as f64, 4.0, None),
            false => (
                cfg.local_rope_theta.unwrap() as f64,
                1.0,
                cfg.sliding_window,
            ),
        };
        rope(&mut q, h, d, theta, factor);
        rope(&mut k, hkv, d, theta, factor);
        let scale = 1.0 / (QUERY_SCALAR as f64).sqrt();
        let o = attend(&q, &k, &v, s, h, hkv, d, scale, window);
        let y = linear(&o, b("self_attn.o_proj.weight"), h * d);
        add(&mut x, &norm(&y, b("post_attention_layernorm.weight"), eps));
        let m = norm(&x, b("pre_feedforward_layernorm.weight"), eps);
        let g = linear(&m, b("mlp.gate_proj.weight"), hid);
        let u = linear(&m, b("mlp.up_proj.weight"), hid);
        let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| gelu_tanh(*g) * u).collect();
        let z = linear(&act, b("mlp.down_proj.weight"), cfg.ffn);
        add(
            &mut x,
            &norm(&z, b("post_feedforward_layernorm.weight"), eps),
        );
    }
    let hn = norm(&x, p("model.norm.weight"), eps);
    let logits = linear(&hn, embed, hid);
    let v = cfg.vocab;
    let total: f64 = logits
        .chunks(v)
        .zip(targets)
        .map(|(row, &t)| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - row[t as usize]
        })
        .sum();
    total / s as f64
}

/// The decoder's loss equals the independent forward's, and its gradient
/// of every kind of tensor (each norm, the embedding, QK-norms, the
/// projections of a sliding and the global layer) equals that forward's
/// central differences.
#[test]
fn gemma3_loss_and_gradients_equal_an_independent_forward() {
    let cfg = tiny_gemma();
    let seq = 24;
    let (ids, tg) = data(seq, cfg.vocab);
    let ours = run(
        &cfg,
        Strategy::Local,
        (1, 1, None),
        MemoryPolicy::default(),
        seq,
    );
    let mut w = host_weights(&cfg);
    let want = reference_loss(&cfg, &w, &ids, &tg);
    let rel = ((ours.0 - want) / want).abs();
    assert!(
        rel <= 1e-5,
        "loss {} vs the independent forward's {want} (rel {rel:e})",
        ours.0
    );
    let names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.pre_feedforward_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.2.self_attn.k_norm.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",
        "model.layers.2.mlp.gate_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ];
    let mut rng = Rng::new(23);
    for name in names {
        let g = &ours.1[name];
        let scale = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{name} has a gradient");
        let argmax = g.iter().position(|x| x.abs() == scale).unwrap();
        // the largest element and four others
        let mut picks = vec![argmax];
        picks.extend((0..4).map(|_| rng.below(g.len() as u64) as usize));
        for idx in picks {
            let eps = 1e-4;
            let orig = w[name][idx];
            w.get_mut(name).unwrap()[idx] = orig + eps;
            let up = reference_loss(&cfg, &w, &ids, &tg);
            w.get_mut(name).unwrap()[idx] = orig - eps;
            let down = reference_loss(&cfg, &w, &ids, &tg);
            w.get_mut(name).unwrap()[idx] = orig;
            let fd = (up - down) / (2.0 * eps);
            let err = (fd - g[idx] as f64).abs();
            assert!(
                err <= 2e-5 * scale as f64 + 1e-8,
                "{name}[{idx}]: finite difference {fd:e} vs analytic {:e} (largest {scale:e})",
                g[idx]
            );
        }
    }
}

fn assert_close(a: &LossGrads, r: &LossGrads, tol: f64, what: &str) {
    assert!(
        ((a.0 - r.0) / r.0).abs() <= tol,
        "{what}: loss {} vs {}",
        a.0,
        r.0
    );
    assert_eq!(a.1.len(), r.1.len(), "{what}");
    for (name, g) in &a.1 {
        let e = rel_err(g, &r.1[name]);
        assert!(e <= tol, "{what}: gradient of {name} rel err {e:e}");
    }
}

/// Every strategy and mesh, and every memory policy (checkpointing, kept
/// attention, segments, tiled MLP, offload), equals the single rank.
#[test]
fn gemma3_under_every_strategy_and_policy_equals_one_rank() {
    let cfg = tiny_gemma();
    let seq = 64;
    let base = MemoryPolicy::default();
    let reference = run(&cfg, Strategy::Local, (1, 1, None), base, seq);
    let post = "model.layers.2.post_feedforward_layernorm.weight";
    assert!(reference.1.contains_key(post), "post-norms take gradients");
    for (s, mesh) in [
        (Strategy::Ulysses, (2, 1, None)),
        (Strategy::Ring, (1, 4, None)),
        (Strategy::Usp, (2, 2, None)),
        (Strategy::Upipe, (2, 2, None)),
        (Strategy::Upipe, (2, 1, Some(4))),
    ] {
        let got = run(&cfg, s, mesh, base, seq);
        assert_close(&got, &reference, 1e-5, &format!("{s} {mesh:?}"));
    }
    for policy in [
        MemoryPolicy {
            checkpoint: true,
            ..base
        },
        MemoryPolicy {
            checkpoint: true,
            save_attention: 2,
            ..base
        },
        MemoryPolicy {
            checkpoint: true,
            checkpoint_every: 2,
            ..base
        },
        MemoryPolicy {
            tiled_mlp: true,
            ..base
        },
        MemoryPolicy {
            checkpoint: true,
            tiled_mlp: true,
            offload: 3,
            loss_chunk: 7,
            ..base
        },
    ] {
        let got = run(&cfg, Strategy::Local, (1, 1, None), policy, seq);
        assert_close(&got, &reference, 1e-6, &format!("{policy:?}"));
        let got = run(&cfg, Strategy::Upipe, (2, 2, None), policy, seq);
        assert_close(&got, &reference, 1e-5, &format!("upipe 2x2 {policy:?}"));
    }
}
