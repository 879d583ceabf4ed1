//! Round trips and refusals of checkpoint files.

use super::*;
use crate::backend::tensor::DType;
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use half::{bf16, f16};
use hf::{INDEX_FILE, SINGLE_FILE};
use safetensors::tensor::Dtype as StDtype;
use saved_state::load_train_state;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use train_state::{OPTIMIZER_FILE, STATE_FILE};

/// A fresh empty directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("upipe-ckpt-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random values in [-2, 2) that are not bf16-exact.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 4.0 - 2.0
        })
        .collect()
}

fn random_model(cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
    cfg.hf_param_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            (name, HostTensor::new(shape, values(n, i as u32)).unwrap())
        })
        .collect()
}

fn small_qwen() -> ModelConfig {
    ModelConfig {
        name: "small-qwen".into(),
        family: crate::model::Family::Qwen3,
        tie_embeddings: true,
        ..ModelConfig::preset("tiny").unwrap()
    }
}

fn checkpoint_error<T>(r: Result<T>) -> String {
    match r {
        Err(Error::Checkpoint(m)) => m,
        Err(e) => panic!("expected a checkpoint error, got {e}"),
        Ok(_) => panic!("expected a checkpoint error, got Ok"),
    }
}

#[test]
fn host_tensor_checks_its_length() {
    assert!(HostTensor::new(vec![2, 3], vec![0.0; 6]).is_ok());
    assert!(HostTensor::new(vec![2, 3], vec![0.0; 5]).is_err());
    assert_eq!(HostTensor::zeros(vec![4, 5]).numel(), 20);
}

#[test]
fn safetensors_f32_round_trip_is_exact() {
    let dir = TempDir::new("f32");
    let a = HostTensor::new(vec![3, 5], values(15, 1)).unwrap();
    let b = HostTensor::new(vec![7], values(7, 2)).unwrap();
    let scalar = HostTensor::new(vec![], vec![1.5]).unwrap();
    let path = dir.0.join("t.safetensors");
    let list = [
        ("a".to_string(), &a),
        ("b".to_string(), &b),
        ("s".to_string(), &scalar),
    ];
    save_safetensors(&path, &list, DType::F32).unwrap();
    let back = load_safetensors(&path).unwrap();
    assert_eq!(back.len(), 3);
    assert_eq!(back["a"], a);
    assert_eq!(back["b"], b);
    assert_eq!(back["s"], scalar);
    let leftovers: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "no temporary file may remain");
}

#[test]
fn safetensors_bf16_round_trip_is_within_rounding() {
    let dir = TempDir::new("bf16");
    let a = HostTensor::new(vec![64, 33], values(64 * 33, 3)).unwrap();
    let path = dir.0.join("t.safetensors");
    save_safetensors(&path, &[("a".to_string(), &a)], DType::BF16).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len() as usize % 2, 0);
    let back = load_safetensors(&path).unwrap().remove("a").unwrap();
    assert_eq!(back.shape, a.shape);
    let mut changed = 0;
    for (x, y) in a.data.iter().zip(&back.data) {
        // bf16 keeps 8 significant bits: round-to-nearest error ≤ 2^-8 relative.
        assert!((x - y).abs() <= x.abs() / 256.0, "{x} vs {y}");
        assert_eq!(*y, bf16::from_f32(*x).to_f32());
        changed += usize::from(x != y);
    }
    assert!(changed > 0, "values were chosen not to be bf16-exact");
}

#[test]
fn f16_files_are_read() {
    let dir = TempDir::new("f16");
    let vals = [0.5f32, -1.25, 3.0];
    let bytes: Vec<u8> = vals
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let view = safetensors::tensor::TensorView::new(StDtype::F16, vec![3], &bytes).unwrap();
    let path = dir.0.join("h.safetensors");
    safetensors::serialize_to_file([("h", view)], None, &path).unwrap();
    assert_eq!(load_safetensors(&path).unwrap()["h"].data, vals);
}

#[test]
fn malformed_and_unsupported_files_are_refused() {
    let dir = TempDir::new("bad");
    let path = dir.0.join("junk.safetensors");
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let m = checkpoint_error(load_safetensors(&path));
    assert!(
        m.contains("junk.safetensors") && m.contains("not a valid safetensors"),
        "{m}"
    );
    let ints = [1i32, 2];
    let bytes: Vec<u8> = ints.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(StDtype::I32, vec![2], &bytes).unwrap();
    safetensors::serialize_to_file([("ids", view)], None, &path).unwrap();
    let m = checkpoint_error(load_safetensors(&path));
    assert!(m.contains("'ids'") && m.contains("I32"), "{m}");
    let t = HostTensor::zeros(vec![2]);
    let dup = [("x".to_string(), &t), ("x".to_string(), &t)];
    assert!(checkpoint_error(save_safetensors(&path, &dup, DType::F32)).contains("twice"));
}

#[test]
fn hf_model_round_trip_is_exact() {
    for cfg in [ModelConfig::preset("tiny").unwrap(), small_qwen()] {
        let dir = TempDir::new("hf");
        let weights = random_model(&cfg);
        save_hf_model(&dir.0, &cfg, &weights, DType::F32).unwrap();
        let cfg_back = ModelConfig::resolve(dir.0.to_str().unwrap()).unwrap();
        assert_eq!(cfg_back, cfg);
        let text = std::fs::read_to_string(dir.0.join("config.json")).unwrap();
        assert!(text.contains("\"torch_dtype\": \"float32\""));
        assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), weights);
    }
}

#[test]
fn hf_model_bf16_save_loads_rounded() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("hf-bf16");
    let weights = random_model(&cfg);
    save_hf_model(&dir.0, &cfg, &weights, DType::BF16).unwrap();
    let back = load_hf_model(&dir.0, &cfg).unwrap();
    let w = &weights["model.layers.1.mlp.down_proj.weight"].data;
    let b = &back["model.layers.1.mlp.down_proj.weight"].data;
    assert!(
        w.iter()
            .zip(b)
            .all(|(x, y)| *y == bf16::from_f32(*x).to_f32())
    );
}

#[test]
fn hf_load_refuses_wrong_shapes_and_missing_tensors() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("hf-wrong");
    let mut weights = random_model(&cfg);
    let name = "model.layers.1.self_attn.k_proj.weight";
    weights.insert(name.into(), HostTensor::zeros(vec![64, 64]));
    let list: Vec<(String, &HostTensor)> = weights.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
    let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
    assert!(
        m.contains(name) && m.contains("[32, 64]") && m.contains("[64, 64]"),
        "{m}"
    );

    weights.remove(name);
    let list: Vec<(String, &HostTensor)> = weights.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
    let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
    assert!(
        m.contains(name) && m.contains("missing") && m.contains("[32, 64]"),
        "{m}"
    );

    let m = checkpoint_error(save_hf_model(&dir.0, &cfg, &weights, DType::F32));
    assert!(m.contains(name), "{m}");

    let empty = TempDir::new("hf-empty");
    let m = checkpoint_error(load_hf_model(&empty.0, &cfg));
    assert!(m.contains(INDEX_FILE), "{m}");
}

#[test]
fn hf_load_refuses_extras_unless_allowed_but_not_parameterless_tensors() {
    let cfg = small_qwen();
    let dir = TempDir::new("hf-extra");
    let mut weights = random_model(&cfg);
    let inv_freq = HostTensor::zeros(vec![8]);
    let head = HostTensor::zeros(vec![256, 64]);
    let mut list: Vec<(String, &HostTensor)> =
        weights.iter().map(|(n, t)| (n.clone(), t)).collect();
    list.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        &inv_freq,
    ));
    list.push(("lm_head.weight".into(), &head));
    save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
    // written by transformers, no parameter: accepted silently
    assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), weights);

    // biases upipe has no parameter for: named, counted, the fix said
    let bias = HostTensor::zeros(vec![64]);
    let biases: Vec<String> = (0..7)
        .map(|l| format!("model.layers.{l}.self_attn.q_proj.bias"))
        .collect();
    list.extend(biases.iter().map(|n| (n.clone(), &bias)));
    save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
    let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
    assert!(
        m.contains("7 tensors")
            && m.contains(&biases[0])
            && m.contains("and 2 more")
            && m.contains("--allow-extra-tensors"),
        "{m}"
    );
    let ignored = load_hf_model_with(&dir.0, &cfg, ExtraTensors::Ignore).unwrap();
    assert_eq!(ignored, weights);

    let untied = ModelConfig {
        tie_embeddings: false,
        ..cfg.clone()
    };
    weights.insert("lm_head.weight".into(), head.clone());
    let loaded = load_hf_model_with(&dir.0, &untied, ExtraTensors::Ignore).unwrap();
    assert_eq!(loaded, weights);
}

#[test]
fn extras_listed_only_by_a_sharded_index_are_refused_too() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("hf-extra-index");
    let weights = random_model(&cfg);
    let list: Vec<(String, &HostTensor)> = weights.iter().map(|(n, t)| (n.clone(), t)).collect();
    let file = "model-00001-of-00002.safetensors";
    save_safetensors(&dir.0.join(file), &list, DType::F32).unwrap();
    let extra = HostTensor::zeros(vec![64]);
    let other = "model-00002-of-00002.safetensors";
    save_safetensors(&dir.0.join(other), &[("x.bias".into(), &extra)], DType::F32).unwrap();
    let mut map: serde_json::Map<String, Value> =
        weights.keys().map(|n| (n.clone(), json!(file))).collect();
    map.insert("x.bias".into(), json!(other));
    let index = json!({ "weight_map": map });
    std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
    let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
    assert!(m.contains("1 tensor ") && m.contains("x.bias"), "{m}");
    let loaded = load_hf_model_with(&dir.0, &cfg, ExtraTensors::Ignore).unwrap();
    assert_eq!(loaded, weights);
}

#[test]
fn non_finite_weights_and_moments_are_refused_naming_tensor_file_and_index() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("nan");
    let params = random_model(&cfg);
    let name = "model.layers.1.mlp.up_proj.weight";
    for bad in [f32::NAN, f32::INFINITY] {
        let mut broken = params.clone();
        broken.get_mut(name).unwrap().data[77] = bad;
        save_hf_model(&dir.0, &cfg, &broken, DType::BF16).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(
            m.contains(name) && m.contains(SINGLE_FILE) && m.contains("element 77"),
            "{m}"
        );
        let f = crate::checkpoint::ranged::RangedFile::open(&dir.0.join(SINGLE_FILE)).unwrap();
        let m = checkpoint_error(f.read(name, 50..100));
        assert!(m.contains(name) && m.contains("element 77"), "{m}");
        assert!(f.read(name, 0..77).is_ok(), "the finite part reads");
    }
    let mut v = params.clone();
    v.get_mut("model.norm.weight").unwrap().data[3] = f32::NAN;
    save_train_state(&dir.0, 1, &params, &params, &v, &json!(null)).unwrap();
    let m = checkpoint_error(load_train_state(&dir.0));
    assert!(
        m.contains("exp_avg_sq.model.norm.weight")
            && m.contains(OPTIMIZER_FILE)
            && m.contains("element 3"),
        "{m}"
    );
}

#[test]
fn sharded_index_is_followed() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("sharded");
    let weights = random_model(&cfg);
    let names: Vec<&String> = weights.keys().collect();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let list: Vec<(String, &HostTensor)> =
            part.iter().map(|n| ((*n).clone(), &weights[*n])).collect();
        save_safetensors(&dir.0.join(file), &list, DType::BF16).unwrap();
        for n in part {
            map.insert((*n).clone(), json!(file));
        }
    }
    let index = json!({ "metadata": { "total_size": 0 }, "weight_map": map });
    std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
    let back = load_hf_model(&dir.0, &cfg).unwrap();
    assert_eq!(back.len(), weights.len());
    for (name, t) in &weights {
        let rounded: Vec<f32> = t.data.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        assert_eq!(back[name].data, rounded, "{name}");
    }

    let missing_name = second[0].clone();
    map.remove(&missing_name);
    let index = json!({ "weight_map": map });
    std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
    assert!(checkpoint_error(load_hf_model(&dir.0, &cfg)).contains(&missing_name));

    std::fs::write(
        dir.0.join(INDEX_FILE),
        "{\"weight_map\": {\"x\": \"../evil\"}}",
    )
    .unwrap();
    let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
    assert!(m.contains(INDEX_FILE) && m.contains("'x'"), "{m}");
    std::fs::write(dir.0.join(INDEX_FILE), "[]").unwrap();
    assert!(checkpoint_error(load_hf_model(&dir.0, &cfg)).contains("weight_map"));
}

#[test]
fn train_state_round_trips() {
    let cfg = small_qwen();
    let dir = TempDir::new("train");
    let params = random_model(&cfg);
    let shift = |d: u32| -> BTreeMap<String, HostTensor> {
        params
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    HostTensor::new(t.shape.clone(), values(t.numel(), d)).unwrap(),
                )
            })
            .collect()
    };
    let (m, v) = (shift(100), shift(200));
    let extra = json!({ "rng": [1, 2, 3], "lr": 3e-4, "sampler": { "epoch": 2, "cursor": 5 } });
    save_train_state(&dir.0, 42, &params, &m, &v, &extra).unwrap();
    let state = load_train_state(&dir.0).unwrap();
    assert_eq!(state.step, 42);
    assert_eq!(state.params, params);
    assert_eq!(state.adam_m, m);
    assert_eq!(state.adam_v, v);
    assert_eq!(state.extra, extra);
    // The weights file is also a valid HF weights file for the model.
    assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), params);

    save_train_state(&dir.0, 43, &params, &v, &m, &json!(null)).unwrap();
    let state = load_train_state(&dir.0).unwrap();
    assert_eq!((state.step, state.adam_m == v), (43, true));
}

#[test]
fn train_state_refuses_mismatched_moments() {
    let cfg = ModelConfig::preset("tiny").unwrap();
    let dir = TempDir::new("train-bad");
    let params = random_model(&cfg);
    let mut m = params.clone();
    m.insert("model.norm.weight".into(), HostTensor::zeros(vec![3]));
    let m_err = checkpoint_error(save_train_state(
        &dir.0,
        1,
        &params,
        &m,
        &params,
        &json!({}),
    ));
    assert!(
        m_err.contains("model.norm.weight") && m_err.contains("[3]"),
        "{m_err}"
    );
    assert!(!dir.0.join(STATE_FILE).exists());
    let err = load_train_state(&dir.0).unwrap_err().to_string();
    assert!(err.contains("state.json"), "{err}");
    std::fs::write(dir.0.join(STATE_FILE), "{\"version\": 99, \"step\": 1}").unwrap();
    assert!(checkpoint_error(load_train_state(&dir.0)).contains("version 99"));
}

/// A tiny Gemma 3 text model (two sliding layers and a global one).
fn small_gemma() -> ModelConfig {
    use crate::model::families::LayerType;
    let base = ModelConfig::preset("tiny").unwrap();
    let cfg = ModelConfig {
        name: "small-gemma".into(),
        family: crate::model::Family::Gemma3,
        layers: 3,
        layer_types: vec![LayerType::Sliding, LayerType::Sliding, LayerType::Full],
        sliding_window: Some(8),
        local_rope_theta: Some(100.0),
        query_pre_attn_scalar: Some(base.head_dim as f32),
        tie_embeddings: true,
        ..base
    };
    cfg.validate().unwrap();
    cfg
}

/// A multimodal checkpoint's text model loads under the names either
/// `transformers` writes it, its vision tower and projector skipped (the
/// family's spec names them), with no extra-tensor flag; a family whose
/// spec skips nothing refuses the same vision tensors.
#[test]
fn multimodal_checkpoints_skip_the_spec_prefixes() {
    let cfg = small_gemma();
    let weights = random_model(&cfg);
    let vision = HostTensor::zeros(vec![4, 4]);
    let other_parts = [
        "vision_tower.vision_model.embeddings.patch_embedding.weight",
        "multi_modal_projector.mm_input_projection_weight",
    ];
    for (layout, text_prefix, part_prefix) in [
        ("v4", "language_model.model.", ""),
        ("v5", "model.language_model.", "model."),
    ] {
        let dir = TempDir::new(&format!("multimodal-{layout}"));
        let renamed: Vec<(String, &HostTensor)> = weights
            .iter()
            .map(|(n, t)| (n.replacen("model.", text_prefix, 1), t))
            .collect();
        let mut list = renamed.clone();
        list.extend(other_parts.map(|p| (format!("{part_prefix}{p}"), &vision)));
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), weights, "{layout}");

        let llama = ModelConfig {
            family: crate::model::Family::Llama,
            ..small_qwen()
        };
        let llama_weights = random_model(&llama);
        let mut list: Vec<(String, &HostTensor)> =
            llama_weights.iter().map(|(n, t)| (n.clone(), t)).collect();
        list.push((format!("{part_prefix}{}", other_parts[0]), &vision));
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &llama));
        assert!(m.contains(other_parts[0]), "{layout}: {m}");
    }
}
