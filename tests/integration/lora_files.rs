//! LoRA adapters without the decoder: config validation, PEFT's
//! initialisation, the math (forward, backward, merge, head ranges) against
//! f64 and finite differences, and PEFT adapter directories (round trip,
//! PEFT-written names, refusals with their messages).

use std::collections::BTreeMap;
use std::path::PathBuf;
use upipe::checkpoint::lora_merge::merge_adapter;
use upipe::checkpoint::peft::{ADAPTER_WEIGHTS, Factor, read_adapter, tensor_name, write_adapter};
use upipe::checkpoint::peft_config::ADAPTER_CONFIG;
use upipe::checkpoint::{HostTensor, SaveDtype, save_safetensors};
use upipe::model::lora::{
    LoraConfig, LoraDims, LoraFactors, LoraTarget, LoraWeights, parse_targets,
};
use upipe::model::lora_math::{
    HeadSlice, head_slice, lora_backward, lora_backward_heads, lora_forward, lora_forward_heads,
    merge,
};
use upipe::model::{ModelConfig, Param};
use upipe::rng::Rng;

/// Llama `tiny`: hidden 64, 4 heads of 16, 2 kv heads, ffn 172, 2 layers.
fn tiny() -> ModelConfig {
    ModelConfig::resolve("tiny").unwrap()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-lora-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn lora(rank: usize, alpha: f64, targets: &str) -> LoraConfig {
    LoraConfig::new(rank, alpha, false, parse_targets(targets).unwrap()).unwrap()
}

/// Factors with every value random (B non-zero, so a wrong B shows).
fn random_factors(dims: LoraDims, seed: u64) -> LoraFactors {
    let mut rng = Rng::new(seed);
    LoraFactors {
        dims,
        a: rng.normal_vec(dims.rank * dims.in_features, 0.5),
        b: rng.normal_vec(dims.out_features * dims.rank, 0.5),
    }
}

/// `init`'s adapters with B made random too.
fn random_weights(cfg: &ModelConfig, config: &LoraConfig, seed: u64) -> LoraWeights {
    let mut w = LoraWeights::init(cfg, config, seed).unwrap();
    let mut rng = Rng::new(seed + 1);
    for f in w.layers.iter_mut().flatten() {
        f.b = rng.normal_vec(f.b.len(), 0.1);
    }
    w
}

fn err<T: std::fmt::Debug>(r: upipe::error::Result<T>) -> String {
    r.unwrap_err().to_string()
}

fn assert_has(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "'{e}' lacks '{p}'");
    }
}

#[test]
fn targets_and_configs_are_validated_with_the_fix_named() {
    use LoraTarget::*;
    assert_eq!(parse_targets("v_proj, q_proj,q_proj").unwrap(), vec![Q, V]);
    assert_eq!(
        parse_targets("all-linear").unwrap(),
        LoraTarget::ALL.to_vec()
    );
    let e = err(parse_targets("q_proj,qproj"));
    assert_has(
        &e,
        &[
            "unknown target module 'qproj'",
            "gate_proj",
            "down_proj",
            "all-linear",
        ],
    );
    assert_has(
        &err(parse_targets("q_proj,")),
        &["empty target module name"],
    );
    assert_has(
        &err(LoraConfig::new(0, 8.0, false, vec![Q])),
        &["--lora-rank", "rank 0"],
    );
    assert_has(
        &err(LoraConfig::new(4, 0.0, false, vec![Q])),
        &["--lora-alpha"],
    );
    assert_has(
        &err(LoraConfig::new(4, 8.0, false, vec![])),
        &["--lora-targets"],
    );

    // k_proj of tiny is [32, 64] (GQA: 2 kv heads of 16): the limit is 32
    let cfg = tiny();
    assert!(lora(32, 8.0, "q_proj,k_proj").validate(&cfg).is_ok());
    let e = err(lora(33, 8.0, "q_proj,k_proj").validate(&cfg));
    assert_has(
        &e,
        &[
            "--lora-rank",
            "above 32",
            "k_proj is [32, 64]",
            "--lora-rank 32",
        ],
    );
    assert!(lora(64, 8.0, "q_proj").validate(&cfg).is_ok());
    assert!(LoraWeights::init(&cfg, &lora(65, 8.0, "q_proj"), 1).is_err());

    assert_eq!(lora(8, 16.0, "q_proj").scale(), 2.0);
    let rs = LoraConfig::new(16, 8.0, true, vec![Q]).unwrap();
    assert_eq!(rs.scale(), 2.0);

    // r·(in + out) per target: q 64+64, k/v 64+32, o 64+64, gate/up 64+172, down 172+64
    let all = lora(4, 8.0, "all-linear");
    let per_block = 4 * (128 + 96 + 96 + 128 + 3 * 236);
    assert_eq!(all.params_per_block(&cfg), per_block);
    assert_eq!(all.bytes_per_block(&cfg, 2), 2 * per_block);
    assert_eq!(all.param_count(&cfg), 2 * per_block);
    assert_eq!(all.factor_shapes(&cfg, V), [[4, 64], [32, 4]]);
    // docs/lora.md's sizes for Llama 3.1 8B
    let big = ModelConfig::resolve("llama3.1-8b").unwrap();
    assert_eq!(
        lora(16, 32.0, "all-linear").params_per_block(&big),
        1_310_720
    );
    assert_eq!(lora(16, 32.0, "all-linear").param_count(&big), 41_943_040);
    assert_eq!(lora(16, 32.0, "q_proj,v_proj").param_count(&big), 6_815_744);
    assert!(lora(1024, 1.0, "k_proj").validate(&big).is_ok());
    assert!(lora(1025, 1.0, "k_proj").validate(&big).is_err());
    assert_eq!(all.factor_shapes(&cfg, Down), [[4, 172], [64, 4]]);
}

#[test]
fn initialisation_is_peft_s_and_seeded() {
    let cfg = tiny();
    let config = lora(16, 32.0, "all-linear");
    let w = LoraWeights::init(&cfg, &config, 7).unwrap();
    assert_eq!(w.layers.len(), cfg.layers);
    let mut all_a = Vec::new();
    for (factors, l) in w.layers.iter().zip(0..) {
        for (&t, f) in config.targets.iter().zip(factors) {
            let bound = 1.0 / (f.dims.in_features as f32).sqrt();
            assert!(f.b.iter().all(|&v| v == 0.0), "B of {t:?} starts at zero");
            assert!(f.a.iter().all(|v| v.abs() < bound), "{t:?} layer {l}");
            let max = f.a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(
                max > 0.9 * bound,
                "A of {t:?} spans its range: {max} of {bound}"
            );
            all_a.extend(f.a.iter().map(|v| v / bound)); // uniform(-1, 1)
        }
    }
    let n = all_a.len() as f64;
    let mean = all_a.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = all_a.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n;
    assert!(
        mean.abs() < 0.01 && (var - 1.0 / 3.0).abs() < 0.01,
        "{mean} {var}"
    );

    assert_eq!(w, LoraWeights::init(&cfg, &config, 7).unwrap());
    assert_ne!(w, LoraWeights::init(&cfg, &config, 8).unwrap());
    assert_ne!(
        w.layers[0][0].a, w.layers[1][0].a,
        "layers draw their own values"
    );
    // an adapter's values depend on (seed, layer, target) alone
    let v_only = LoraWeights::init(&cfg, &lora(16, 32.0, "v_proj"), 7).unwrap();
    assert_eq!(v_only.get(1, LoraTarget::V), w.get(1, LoraTarget::V));
    assert_eq!(w.get(1, LoraTarget::V).unwrap().dims.out_features, 32);
    assert!(v_only.get(1, LoraTarget::Q).is_none());
}

/// `Σ dy ⊙ (scale · x·Aᵀ·Bᵀ)` in f64.
fn loss64(x: &[f64], a: &[f64], b: &[f64], dy: &[f64], d: LoraDims, scale: f64) -> f64 {
    let (r, n_in, n_out) = (d.rank, d.in_features, d.out_features);
    let s = x.len() / n_in;
    let mut total = 0.0;
    for i in 0..s {
        for o in 0..n_out {
            let mut y = 0.0;
            for j in 0..r {
                let h: f64 = (0..n_in).map(|c| x[i * n_in + c] * a[j * n_in + c]).sum();
                y += h * b[o * r + j];
            }
            total += dy[i * n_out + o] * scale * y;
        }
    }
    total
}

fn to64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Central differences of `loss64` in each element of `which` (0: x, 1: A,
/// 2: B); exact up to rounding, as the loss is linear in each.
fn numeric_grad(vals: &[Vec<f64>; 4], which: usize, d: LoraDims, scale: f64) -> Vec<f64> {
    let mut v = vals.clone();
    (0..v[which].len())
        .map(|k| {
            let orig = v[which][k];
            v[which][k] = orig + 0.5;
            let up = loss64(&v[0], &v[1], &v[2], &v[3], d, scale);
            v[which][k] = orig - 0.5;
            let down = loss64(&v[0], &v[1], &v[2], &v[3], d, scale);
            v[which][k] = orig;
            up - down
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
    let diff = got
        .iter()
        .zip(want)
        .map(|(&g, w)| (g as f64 - w).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(diff / norm < tol, "{what}: relative error {}", diff / norm);
}

#[test]
fn forward_and_backward_match_f64_and_finite_differences() {
    let d = LoraDims {
        rank: 3,
        in_features: 7,
        out_features: 5,
    };
    let (s, scale) = (4, 1.75f32);
    let f = random_factors(d, 3);
    let mut rng = Rng::new(11);
    let x = rng.normal_vec(s * d.in_features, 1.0);
    let dy = rng.normal_vec(s * d.out_features, 1.0);

    // forward: each output is the loss with a one-hot dy
    let y = lora_forward(&x, &f, scale);
    let want: Vec<f64> = (0..s * d.out_features)
        .map(|k| {
            let mut e = vec![0.0; s * d.out_features];
            e[k] = 1.0;
            loss64(&to64(&x), &to64(&f.a), &to64(&f.b), &e, d, scale as f64)
        })
        .collect();
    assert_close(&y, &want, 1e-6, "forward");

    let g = lora_backward(&x, &dy, &f, scale);
    let vals = [to64(&x), to64(&f.a), to64(&f.b), to64(&dy)];
    assert_close(&g.dx, &numeric_grad(&vals, 0, d, scale as f64), 1e-6, "dx");
    assert_close(&g.da, &numeric_grad(&vals, 1, d, scale as f64), 1e-6, "dA");
    assert_close(&g.db, &numeric_grad(&vals, 2, d, scale as f64), 1e-6, "dB");
    // a zero B (PEFT's start) still trains B, and passes nothing to A or x
    let start = LoraFactors {
        b: vec![0.0; f.b.len()],
        ..f.clone()
    };
    let g0 = lora_backward(&x, &dy, &start, scale);
    assert!(g0.da.iter().chain(&g0.dx).all(|&v| v == 0.0));
    assert!(g0.db.iter().any(|&v| v != 0.0));
}

#[test]
fn merge_adds_the_scaled_product_and_equals_the_adapted_layer() {
    let d = LoraDims {
        rank: 4,
        in_features: 6,
        out_features: 9,
    };
    let (f, scale) = (random_factors(d, 5), 0.5f32);
    let w = Rng::new(9).normal_vec(d.out_features * d.in_features, 1.0);
    let merged = merge(&w, &f, scale);
    let want: Vec<f64> = (0..d.out_features * d.in_features)
        .map(|k| {
            let (o, c) = (k / d.in_features, k % d.in_features);
            let ba: f64 = (0..d.rank)
                .map(|j| f.b[o * d.rank + j] as f64 * f.a[j * d.in_features + c] as f64)
                .sum();
            w[k] as f64 + scale as f64 * ba
        })
        .collect();
    assert_close(&merged, &want, 1e-7, "merged weight");
    // x·(W + sBA)ᵀ = x·Wᵀ + the adapter's delta
    let x = Rng::new(2).normal_vec(3 * d.in_features, 1.0);
    let matvec = |w: &[f32]| -> Vec<f64> {
        (0..3 * d.out_features)
            .map(|k| {
                let (i, o) = (k / d.out_features, k % d.out_features);
                (0..d.in_features)
                    .map(|c| x[i * d.in_features + c] as f64 * w[o * d.in_features + c] as f64)
                    .sum()
            })
            .collect()
    };
    let delta = lora_forward(&x, &f, scale);
    let adapted: Vec<f32> = matvec(&w)
        .iter()
        .zip(&delta)
        .map(|(b, d)| (*b + *d as f64) as f32)
        .collect();
    assert_close(&adapted, &matvec(&merged), 1e-6, "merged layer");
}

/// Columns `cols` of `m` `[rows, width]`: `[rows, cols]`.
fn columns(m: &[f32], width: usize, cols: &std::ops::Range<usize>) -> Vec<f32> {
    m.chunks_exact(width)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

/// Adds `part` `[rows, cols]` into columns `cols` of `m` `[rows, width]`.
fn add_columns(m: &mut [f32], width: usize, cols: &std::ops::Range<usize>, part: &[f32]) {
    for (row, p) in m.chunks_exact_mut(width).zip(part.chunks_exact(cols.len())) {
        row[cols.clone()]
            .iter_mut()
            .zip(p)
            .for_each(|(a, b)| *a += b);
    }
}

fn add(m: &mut [f32], part: &[f32]) {
    assert_eq!(m.len(), part.len());
    m.iter_mut().zip(part).for_each(|(a, b)| *a += b);
}

/// What the staged engine will compute per head range, forward and
/// backward, placed (q/k/v output rows; o_proj input columns) and summed,
/// equals the whole adapter's.
#[test]
fn head_ranges_sum_to_the_whole_adapter() {
    let cfg = tiny();
    let config = lora(4, 8.0, "all-linear");
    let w = random_weights(&cfg, &config, 3);
    let (s, hd, r) = (3, cfg.head_dim, 4);
    let scale = config.scale();
    for target in [LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O] {
        let f = w.get(1, target).unwrap();
        let (n_in, n_out) = (f.dims.in_features, f.dims.out_features);
        let x = Rng::new(4).normal_vec(s * n_in, 1.0);
        let dy = Rng::new(5).normal_vec(s * n_out, 1.0);
        let (whole, grads) = (lora_forward(&x, f, scale), lora_backward(&x, &dy, f, scale));
        let heads = if matches!(target, LoraTarget::K | LoraTarget::V) {
            vec![0..1, 1..2]
        } else {
            vec![0..1, 1..3, 3..4]
        };
        let mut y = vec![0.0f32; s * n_out];
        let (mut da, mut db, mut dx) = (
            vec![0.0; r * n_in],
            vec![0.0; n_out * r],
            vec![0.0; s * n_in],
        );
        for h in heads {
            let slice = head_slice(target, hd, h.clone()).unwrap();
            match &slice {
                HeadSlice::BRows(rows) => {
                    assert_eq!(*rows, h.start * hd..h.end * hd);
                    let part = lora_forward_heads(&x, f, scale, &slice); // [s, rows]
                    add_columns(&mut y, n_out, rows, &part);
                    let dy_rows = columns(&dy, n_out, rows);
                    let g = lora_backward_heads(&x, &dy_rows, f, scale, &slice);
                    add(&mut db[rows.start * r..rows.end * r], &g.db);
                    add(&mut da, &g.da);
                    add(&mut dx, &g.dx);
                }
                HeadSlice::AColumns(cols) => {
                    assert_eq!(target, LoraTarget::O);
                    let x_cols = columns(&x, n_in, cols);
                    let part = lora_forward_heads(&x_cols, f, scale, &slice); // [s, out]
                    add(&mut y, &part);
                    let g = lora_backward_heads(&x_cols, &dy, f, scale, &slice);
                    add(&mut db, &g.db);
                    add_columns(&mut da, n_in, cols, &g.da);
                    add_columns(&mut dx, n_in, cols, &g.dx);
                }
            }
        }
        let what = format!("{target:?}");
        assert_close(&y, &to64(&whole), 1e-6, &format!("{what} forward"));
        assert_close(&da, &to64(&grads.da), 1e-6, &format!("{what} dA"));
        assert_close(&db, &to64(&grads.db), 1e-6, &format!("{what} dB"));
        assert_close(&dx, &to64(&grads.dx), 1e-6, &format!("{what} dx"));
    }
    assert!(head_slice(LoraTarget::Up, hd, 0..1).is_none());
}

#[test]
fn adapter_directories_round_trip_in_f32_and_bf16() {
    let cfg = tiny();
    let config = LoraConfig::new(
        4,
        8.0,
        true,
        parse_targets("q_proj,v_proj,down_proj").unwrap(),
    )
    .unwrap();
    let w = random_weights(&cfg, &config, 21);
    let dir = temp("roundtrip");
    write_adapter(&dir, &w, "meta-llama/tiny", SaveDtype::F32).unwrap();
    let back = read_adapter(&dir, &cfg).unwrap();
    assert_eq!(back.weights, w);
    assert_eq!(back.config.base_model.as_deref(), Some("meta-llama/tiny"));
    assert_eq!(back.config.dropout, 0.0);

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap()).unwrap();
    let want = serde_json::json!({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
        "use_rslora": true, "task_type": "CAUSAL_LM", "fan_in_fan_out": false,
        "init_lora_weights": true, "inference_mode": true, "modules_to_save": null,
        "layers_to_transform": null, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": false,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "base_model_name_or_path": "meta-llama/tiny",
    });
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&json[k], v, "{k}");
    }
    let st = upipe::checkpoint::load_safetensors(&dir.join(ADAPTER_WEIGHTS)).unwrap();
    let name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
    assert_eq!(st[name].shape, vec![64, 4]);
    assert_eq!(st.len(), 2 * 3 * 2);

    // BF16: the values come back rounded to bf16, nothing else changes
    let dir16 = temp("roundtrip16");
    write_adapter(&dir16, &w, "meta-llama/tiny", SaveDtype::BF16).unwrap();
    let back16 = read_adapter(&dir16, &cfg).unwrap().weights;
    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    for (a, b) in back16
        .layers
        .iter()
        .flatten()
        .zip(w.layers.iter().flatten())
    {
        assert_eq!(a.a, round(&b.a));
        assert_eq!(a.b, round(&b.b));
    }
    // rewriting its own adapter is fine only where upipe's manifest lists it;
    // an owner's file of that name is never replaced
    let e = err(write_adapter(&dir, &w, "x", SaveDtype::F32));
    assert_has(
        &e,
        &[
            "adapter_config.json already exists",
            "upipe did not write it",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir16);
}

/// An adapter directory as PEFT writes one for `tiny` with `q_proj` and
/// `v_proj` at rank 2: its config fields as `save_pretrained` writes them
/// (`extra` merged in) and its tensors under names written out literally;
/// `.default` in the name of layer 1's factors, as some tools keep it.
fn peft_style_dir(name: &str, extra: serde_json::Value, a_in: usize) -> (PathBuf, Vec<f32>) {
    let dir = temp(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = serde_json::json!({
        "alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": "tiny",
        "bias": "none", "corda_config": null, "eva_config": null, "exclude_modules": null,
        "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true,
        "layer_replication": null, "layers_pattern": null, "layers_to_transform": null,
        "loftq_config": {}, "lora_alpha": 16.0, "lora_bias": false, "lora_dropout": 0.05,
        "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null,
        "peft_type": "LORA", "peft_version": "0.17.1", "qalora_group_size": 16, "r": 2,
        "rank_pattern": {}, "revision": null, "target_modules": ["v_proj", "q_proj"],
        "target_parameters": null, "task_type": "CAUSAL_LM", "trainable_token_indices": null,
        "use_dora": false, "use_qalora": false, "use_rslora": false
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let mut rng = Rng::new(5);
    let mut tensors: Vec<(String, HostTensor)> = Vec::new();
    for (layer, adapter) in [(0, ""), (1, ".default")] {
        for (module, out) in [("q_proj", 64), ("v_proj", 32)] {
            let path = format!("base_model.model.model.layers.{layer}.self_attn.{module}");
            let a = HostTensor::new(vec![2, a_in], rng.normal_vec(2 * a_in, 0.1)).unwrap();
            let b = HostTensor::new(vec![out, 2], rng.normal_vec(2 * out, 0.1)).unwrap();
            tensors.push((format!("{path}.lora_A{adapter}.weight"), a));
            tensors.push((format!("{path}.lora_B{adapter}.weight"), b));
        }
    }
    let refs: Vec<(String, &HostTensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(
        &dir.join("adapter_model.safetensors"),
        &refs,
        SaveDtype::F32,
    )
    .unwrap();
    (dir, tensors[2].1.data.clone()) // layer 0's v_proj.lora_A
}

#[test]
fn peft_written_directories_are_read() {
    let cfg = tiny();
    let (dir, v_a) = peft_style_dir("peft", serde_json::json!({}), 64);
    let got = read_adapter(&dir, &cfg).unwrap();
    let w = &got.weights;
    assert_eq!(w.config.targets, vec![LoraTarget::Q, LoraTarget::V]);
    assert_eq!((w.config.rank, w.config.scale()), (2, 8.0));
    assert_eq!(got.config.dropout, 0.05);
    assert_eq!(w.get(0, LoraTarget::V).unwrap().a, v_a);
    assert_eq!(w.get(1, LoraTarget::V).unwrap().dims.out_features, 32);
    assert_eq!(
        tensor_name(1, LoraTarget::V, Factor::B),
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adapters_upipe_cannot_apply_are_refused_naming_the_field() {
    let cfg = tiny();
    let (dir, _) = peft_style_dir("shape", serde_json::json!({}), 48);
    let e = err(read_adapter(&dir, &cfg));
    assert_has(
        &e,
        &["q_proj.lora_A of layer 0 is [2, 48], model 'tiny' needs [2, 64]"],
    );
    let cases = [
        (serde_json::json!({"bias": "all"}), "bias is \"all\""),
        (serde_json::json!({"use_dora": true}), "use_dora is true"),
        (
            serde_json::json!({"rank_pattern": {"q_proj": 4}}),
            "rank_pattern is",
        ),
        (
            serde_json::json!({"alpha_pattern": {"v_proj": 4}}),
            "alpha_pattern is",
        ),
        (
            serde_json::json!({"layers_to_transform": [0]}),
            "layers_to_transform is [0]",
        ),
        (
            serde_json::json!({"modules_to_save": ["lm_head"]}),
            "modules_to_save is",
        ),
        (
            serde_json::json!({"peft_type": "IA3"}),
            "peft_type is \"IA3\"",
        ),
        (
            serde_json::json!({"target_modules": ["q_proj", "lm_head"]}),
            "unknown target module 'lm_head'",
        ),
        (
            serde_json::json!({"target_modules": ".*proj"}),
            "target_modules is the pattern",
        ),
        (
            serde_json::json!({"target_modules": ["q_proj"]}),
            "v_proj.lora_A.weight' is outside the adapter",
        ),
        (
            serde_json::json!({"target_modules": ["q_proj", "v_proj", "k_proj"]}),
            "k_proj.lora_A of layer 0 ('base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight') is missing",
        ),
        (serde_json::json!({"r": 3}), "needs [3, 64]"),
        (serde_json::json!({"r": 0}), "rank 0"),
        (
            serde_json::json!({"alora_invocation_tokens": [5, 6]}),
            "alora_invocation_tokens is [5,6]",
        ),
        (
            serde_json::json!({"fan_in_fan_out": true}),
            "fan_in_fan_out is true",
        ),
        (
            serde_json::json!({"exclude_modules": ["q_proj"]}),
            "exclude_modules is",
        ),
    ];
    for (i, (extra, want)) in cases.into_iter().enumerate() {
        let (dir, _) = peft_style_dir(&format!("refuse{i}"), extra.clone(), 64);
        let e = err(read_adapter(&dir, &cfg));
        assert_has(&e, &[want, "adapter_"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
    // a rank above the model's limit, and DoRA's magnitude tensor
    let (dir, _) = peft_style_dir("rank", serde_json::json!({"r": 40}), 64);
    assert_has(
        &err(read_adapter(&dir, &cfg)),
        &["above 32", "v_proj is [32, 64]"],
    );
    let (dir2, _) = peft_style_dir("dora", serde_json::json!({}), 64);
    let mut st = upipe::checkpoint::load_safetensors(&dir2.join(ADAPTER_WEIGHTS)).unwrap();
    let magnitude = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
    st.insert(magnitude.into(), HostTensor::zeros(vec![64]));
    let refs: Vec<(String, &HostTensor)> = st.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir2.join(ADAPTER_WEIGHTS), &refs, SaveDtype::F32).unwrap();
    assert_has(
        &err(read_adapter(&dir2, &cfg)),
        &[magnitude, "not a LoRA factor"],
    );
    let (dir3, _) = peft_style_dir("bin", serde_json::json!({}), 64);
    std::fs::rename(dir3.join(ADAPTER_WEIGHTS), dir3.join("adapter_model.bin")).unwrap();
    assert_has(
        &err(read_adapter(&dir3, &cfg)),
        &["adapter_model.bin", "save_pretrained"],
    );
    for d in [dir, dir2, dir3] {
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Every parameter of `cfg`'s model, random, by HF name.
fn random_model(cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(13);
    let shapes = cfg.hf_param_shapes().into_iter();
    shapes
        .map(|(n, s)| {
            let numel = s.iter().product();
            (n, HostTensor::new(s, rng.normal_vec(numel, 0.02)).unwrap())
        })
        .collect()
}

#[test]
fn merging_changes_exactly_the_adapted_weights() {
    let cfg = tiny();
    let config = lora(4, 8.0, "k_proj,o_proj,up_proj");
    let w = random_weights(&cfg, &config, 17);
    let base = random_model(&cfg);
    let mut merged = base.clone();
    merge_adapter(&mut merged, &cfg, &w).unwrap();
    let mut adapted = Vec::new();
    for l in 0..cfg.layers {
        for &t in &config.targets {
            adapted.push((l, t, cfg.hf_name(Param::Block(l, t.base_param()))));
        }
    }
    let mut changed = 0;
    for (name, t) in &merged {
        match adapted.iter().find(|(_, _, n)| n == name) {
            Some(&(l, target, _)) => {
                let want = merge(&base[name].data, w.get(l, target).unwrap(), config.scale());
                assert_eq!(t.data, want, "{name}");
                assert_ne!(t.data, base[name].data, "{name}");
                changed += 1;
            }
            None => assert_eq!(t, &base[name], "{name} is not adapted"),
        }
    }
    assert_eq!(changed, cfg.layers * 3);
    let mut wrong = base.clone();
    let name = "model.layers.1.self_attn.o_proj.weight";
    wrong.insert(name.into(), HostTensor::zeros(vec![64, 32]));
    assert_has(
        &err(merge_adapter(&mut wrong, &cfg, &w)),
        &[name, "[64, 32]", "[64, 64]"],
    );
}

/// The Rust half of the check against PEFT: for each model of a fixture
/// that `scripts/check_peft.py --make DIR` made (on a machine with torch and
/// peft), reads PEFT's adapter, writes it back as upipe writes adapters
/// (`upipe-adapter`, F32) and merges it into the base model
/// (`upipe-merged`, F32, with the base's config.json); `check_peft.py
/// --check-fixture DIR` then checks both with PEFT and transformers.
#[test]
#[ignore = "needs UPIPE_PEFT_FIXTURE=DIR, made by scripts/check_peft.py --make DIR"]
fn peft_fixture_is_read_rewritten_and_merged() {
    use upipe::checkpoint::hf_config::checkpoint_config;
    use upipe::checkpoint::model_files::{ModelFiles, write_model_files};
    let root = PathBuf::from(std::env::var("UPIPE_PEFT_FIXTURE").expect("UPIPE_PEFT_FIXTURE"));
    for kind in ["llama", "qwen2"] {
        let dir = root.join(kind);
        let base = dir.join("base");
        let cfg = ModelConfig::resolve(base.to_str().unwrap()).unwrap();
        let adapter = read_adapter(&dir.join("adapter"), &cfg).unwrap();
        let out = dir.join("upipe-adapter");
        let _ = std::fs::remove_dir_all(&out);
        let name = adapter.config.base_model.clone().unwrap_or_default();
        write_adapter(&out, &adapter.weights, &name, SaveDtype::F32).unwrap();
        assert_eq!(read_adapter(&out, &cfg).unwrap().weights, adapter.weights);

        let mut tensors = upipe::checkpoint::load_hf_model(&base, &cfg).unwrap();
        merge_adapter(&mut tensors, &cfg, &adapter.weights).unwrap();
        let merged = dir.join("upipe-merged");
        let _ = std::fs::remove_dir_all(&merged);
        std::fs::create_dir_all(&merged).unwrap();
        let order = cfg.hf_param_shapes();
        let list: Vec<(String, &HostTensor)> = order
            .iter()
            .map(|(n, _)| (n.clone(), &tensors[n]))
            .collect();
        write_model_files(&merged, &list, ModelFiles::f32()).unwrap();
        let text = std::fs::read_to_string(base.join("config.json")).unwrap();
        let source: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&text).unwrap();
        let config = checkpoint_config(Some(&source), &cfg, SaveDtype::F32);
        std::fs::write(merged.join("config.json"), config).unwrap();
    }
}
