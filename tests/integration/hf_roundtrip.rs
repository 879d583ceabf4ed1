//! The Hugging Face round trip: a BF16 model loaded with `--init-from` and
//! saved untrained comes back bit for bit, with its `config.json` (every
//! field, unknown ones too) and its tokenizer files; `--save-dtype` picks
//! the stored dtype; checkpoints spread over files as HF spreads them and
//! resume exactly from their F32 masters; the owner's files are never
//! replaced.

use half::bf16;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::checkpoint::{HostTensor, SaveDtype, load_hf_model, save_hf_model};
use upipe::model::ModelConfig;
use upipe::optim::AdamWConfig;
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, train_cpu};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-hfrt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A small Llama's `config.json` as `transformers` writes one, with token
/// ids, Llama-3 rope scaling and fields upipe does not know.
fn source_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 250,
        "eos_token_id": [251, 252],
        "pad_token_id": null,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 512,
            "rope_type": "llama3"
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
        "dtype": "bfloat16",
        "transformers_version": "5.17.0",
        "use_cache": true,
        "vocab_size": 256,
        "a_field_upipe_does_not_know": {"nested": [1, 2, 3]}
    })
}

/// A small Qwen2's `config.json` as `transformers` writes one: tied
/// embeddings, YaRN rope scaling, the sliding-window fields Qwen2.5 ships.
fn qwen2_config() -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 250,
        "eos_token_id": 251,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 128,
        "max_window_layers": 2,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32, "type": "yarn"},
        "rope_theta": 1000000.0,
        "sliding_window": 128,
        "tie_word_embeddings": true,
        "dtype": "bfloat16",
        "transformers_version": "5.17.0",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": 256
    })
}

/// Writes a BF16 model of [`source_config`] with random weights, a
/// tokenizer and generation defaults into `dir`.
fn source_model(dir: &Path) -> ModelConfig {
    source_model_of(dir, source_config())
}

/// [`source_model`] of the `config.json` `config`.
fn source_model_of(dir: &Path, config: Value) -> ModelConfig {
    let cfg = ModelConfig::from_hf_json(&config.to_string()).unwrap();
    let mut rng = Rng::new(7);
    let tensors: BTreeMap<String, HostTensor> = cfg
        .hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let v = (0..n)
                .map(|_| (rng.below(2001) as f32 - 1000.0) * 1e-4)
                .collect();
            (name, HostTensor::new(shape, v).unwrap())
        })
        .collect();
    save_hf_model(dir, &cfg, &tensors, SaveDtype::BF16).unwrap();
    let text = serde_json::to_string_pretty(&config).unwrap();
    std::fs::write(dir.join("config.json"), text).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"version": "1.0", "model": {}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 250}"#,
    )
    .unwrap();
    cfg
}

fn upipe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

/// `upipe train` from `src` into `dst` for `steps` steps at `lr`, with `more` flags.
fn train(src: &Path, dst: &Path, steps: &str, lr: &str, more: &[&str]) -> std::process::Output {
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let mut args = vec![
        "train",
        "--device",
        "cpu",
        "--attn",
        "local",
        "--seq",
        "32",
        "--init-from", // and no --model: the model is --init-from's
        s,
        // its tokenizer.json is a file to carry, not one to tokenize with
        "--tokenizer",
        "byte",
        // a second run into `dst` replaces the checkpoint there
        "--overwrite",
        "--steps",
        steps,
        "--lr",
        lr,
        "--save-dir",
        d,
    ];
    args.extend_from_slice(more);
    upipe(&args)
}

fn ok(out: std::process::Output) {
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe failed: {log}");
}

/// Each tensor of a safetensors file: dtype and raw bytes.
fn raw(path: &Path) -> BTreeMap<String, (Dtype, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(n, v)| (n.to_string(), (v.dtype(), v.data().to_vec())))
        .collect()
}

fn json_file(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn an_untrained_bf16_model_comes_back_bit_for_bit_with_its_config_and_tokenizer() {
    let (src, dst) = (temp("src"), temp("dst"));
    source_model(&src);
    ok(train(&src, &dst, "1", "0", &[]));
    // weights: the source's bytes, in the source's dtype (auto)
    assert_eq!(
        raw(&dst.join("model.safetensors")),
        raw(&src.join("model.safetensors"))
    );
    // config.json: every field the source had, unchanged
    assert_eq!(json_file(&dst.join("config.json")), source_config());
    for f in ["tokenizer.json", "generation_config.json"] {
        assert_eq!(
            std::fs::read(dst.join(f)).unwrap(),
            std::fs::read(src.join(f)).unwrap(),
            "{f}"
        );
    }
    // what the source lacks is not made up
    for f in ["tokenizer_config.json", "special_tokens_map.json"] {
        assert!(!dst.join(f).exists(), "{f}");
    }
    // resume state stays F32, with the masters a resume continues from
    let opt = raw(&dst.join("optimizer.safetensors"));
    assert!(opt.values().all(|(d, _)| *d == Dtype::F32));
    assert!(opt.keys().any(|k| k.starts_with("master.")));
    // and it resumes
    ok(upipe(&[
        "train",
        "--device",
        "cpu",
        "--attn",
        "local",
        "--seq",
        "32",
        "--model",
        src.to_str().unwrap(),
        "--tokenizer",
        "byte",
        "--steps",
        "2",
        "--lr",
        "0",
        "--save-dir",
        dst.to_str().unwrap(),
        "--resume",
    ]));
    assert_eq!(
        raw(&dst.join("model.safetensors")),
        raw(&src.join("model.safetensors"))
    );
    assert!(
        dst.join("tokenizer.json").exists(),
        "carried on by the resumed run"
    );
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&dst));
}

/// A Qwen2 directory (q/k/v biases, tied embeddings, YaRN) trained at lr 0
/// on a staged mesh comes back bit for bit, biases included, with its
/// `config.json` unchanged.
#[test]
fn a_qwen2_with_biases_and_yarn_comes_back_bit_for_bit() {
    let (src, dst) = (temp("q2src"), temp("q2dst"));
    let cfg = source_model_of(&src, qwen2_config());
    assert!(cfg.qkv_bias() && cfg.tie_embeddings);
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    ok(upipe(&[
        "train",
        "--device",
        "cpu",
        "--attn",
        "upipe",
        "--ulysses",
        "2",
        "--fsdp",
        "on",
        "--seq",
        "32",
        "--model",
        s,
        "--init-from",
        s,
        "--tokenizer",
        "byte",
        "--steps",
        "1",
        "--lr",
        "0",
        "--save-dir",
        d,
    ]));
    let (got, want) = (
        raw(&dst.join("model.safetensors")),
        raw(&src.join("model.safetensors")),
    );
    assert_eq!(got, want);
    for name in ["q", "k", "v"].map(|p| format!("model.layers.1.self_attn.{p}_proj.bias")) {
        assert_eq!(got[&name].0, Dtype::BF16, "{name}");
    }
    assert!(
        !got.contains_key("lm_head.weight"),
        "tied: no head of its own"
    );
    assert_eq!(json_file(&dst.join("config.json")), qwen2_config());
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&dst));
}

#[test]
fn save_dtype_picks_the_stored_dtype_and_names_its_values() {
    let (src, dst) = (temp("dt-src"), temp("dt-dst"));
    source_model(&src);
    ok(train(&src, &dst, "1", "0", &["--save-dtype", "f32"]));
    let wide = raw(&dst.join("model.safetensors"));
    let narrow = raw(&src.join("model.safetensors"));
    for (name, (dtype, bytes)) in &wide {
        assert_eq!(*dtype, Dtype::F32, "{name}");
        let from_bf16: Vec<u8> = narrow[name]
            .1
            .chunks_exact(2)
            .flat_map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes())
            .collect();
        assert_eq!(*bytes, from_bf16, "{name}: the same values, widened");
    }
    let config = json_file(&dst.join("config.json"));
    assert_eq!(config["dtype"], "float32");
    ok(train(&src, &dst, "1", "0", &["--save-dtype", "fp16"]));
    assert!(
        raw(&dst.join("model.safetensors"))
            .values()
            .all(|(d, _)| *d == Dtype::F16)
    );
    assert_eq!(json_file(&dst.join("config.json"))["dtype"], "float16");
    let out = train(&src, &dst, "1", "0", &["--save-dtype", "int8"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        log.contains("--save-dtype int8") && log.contains("f32, bf16 or fp16"),
        "{log}"
    );
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&dst));
}

#[test]
fn the_owners_files_are_never_replaced_and_upipes_go_with_its_checkpoint() {
    let (src, dst) = (temp("own-src"), temp("own-dst"));
    source_model(&src);
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("tokenizer.json"), "mine").unwrap();
    std::fs::write(dst.join("notes.txt"), "mine too").unwrap();
    ok(train(&src, &dst, "1", "0", &[]));
    assert_eq!(
        std::fs::read_to_string(dst.join("tokenizer.json")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(dst.join("notes.txt")).unwrap(),
        "mine too"
    );
    assert!(dst.join("generation_config.json").exists());
    // a later run from no source: upipe's copy goes, the owner's stay
    ok(upipe(&[
        "train",
        "--device",
        "cpu",
        "--attn",
        "local",
        "--seq",
        "32",
        "--model",
        src.to_str().unwrap(),
        "--tokenizer",
        "byte",
        "--steps",
        "1",
        "--save-dir",
        dst.to_str().unwrap(),
        "--overwrite",
    ]));
    assert!(!dst.join("generation_config.json").exists());
    assert_eq!(
        std::fs::read_to_string(dst.join("tokenizer.json")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(dst.join("notes.txt")).unwrap(),
        "mine too"
    );
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&dst));
}

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..4096)
        .map(|_| rng.below(vocab as u64) as u32)
        .collect::<Vec<_>>()
        .into()
}

/// BF16 checkpoints in files of at most 20 kB: HF's index, every value
/// bf16, read back by the HF loader; resumed from their F32 masters, the
/// run continues bit for bit as if never stopped (sharded and not).
#[test]
fn bf16_checkpoints_over_several_files_resume_exactly() {
    let m = ModelConfig::from_hf_json(&source_config().to_string()).unwrap();
    for fsdp in [false, true] {
        let config = |steps: u32| TrainConfig {
            strategy: Strategy::Upipe,
            ulysses: 2,
            seed: 5,
            fsdp,
            save_dtype: SaveDtype::BF16,
            max_file_bytes: 20_000,
            ..TrainConfig::new(
                m.clone(),
                32,
                steps,
                AdamWConfig::schedule(3e-3, 3e-4, 1, 6),
            )
        };
        let full = train_cpu(&config(6), tokens(m.vocab), &|_| {}).unwrap();
        let dir = temp(&format!("files-{fsdp}"));
        let first = TrainConfig {
            save_dir: Some(dir.clone()),
            ..config(3)
        };
        train_cpu(&first, tokens(m.vocab), &|_| {}).unwrap();
        let index = json_file(&dir.join("model.safetensors.index.json"));
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), m.hf_param_shapes().len());
        let mut files: Vec<&str> = map.values().map(|f| f.as_str().unwrap()).collect();
        files.sort_unstable();
        files.dedup();
        assert!(files.len() > 1, "{files:?}");
        let mut stored = 0;
        for f in &files {
            assert!(
                f.starts_with("model-")
                    && f.ends_with(&format!("-of-{:05}.safetensors", files.len()))
            );
            for (_, (dtype, bytes)) in raw(&dir.join(f)) {
                assert_eq!(dtype, Dtype::BF16);
                stored += bytes.len();
            }
        }
        assert_eq!(index["metadata"]["total_size"], json!(stored));
        assert_eq!(stored, 2 * m.param_count());
        let loaded = load_hf_model(&dir, &m).unwrap();
        assert_eq!(loaded.len(), map.len());
        let again = TrainConfig {
            save_dir: Some(dir.clone()),
            resume: true,
            ..config(6)
        };
        let rest = train_cpu(&again, tokens(m.vocab), &|_| {}).unwrap();
        assert_eq!(rest.reports.first().unwrap().step, 4);
        for (x, y) in rest.reports.iter().zip(&full.reports[3..]) {
            assert_eq!(x.loss, y.loss, "fsdp {fsdp} step {}", x.step);
            assert_eq!(x.grad_norm, y.grad_norm, "fsdp {fsdp} step {}", x.step);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `--max-shard-size` splits the weight files as `save_pretrained` does,
/// with the index, and gives back every tensor; a size it cannot read is
/// an error naming the flag.
#[test]
fn max_shard_size_splits_the_weight_files() {
    let (src, dst) = (temp("shard-src"), temp("shard-dst"));
    source_model(&src);
    ok(train(&src, &dst, "1", "0", &["--max-shard-size", "20KB"]));
    let index = json_file(&dst.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let files: std::collections::BTreeSet<&str> =
        map.values().map(|f| f.as_str().unwrap()).collect();
    assert!(files.len() > 1, "{files:?}");
    let mut back = BTreeMap::new();
    for f in &files {
        let path = dst.join(f);
        let size = std::fs::metadata(&path).unwrap().len();
        let tensors = raw(&path);
        // a file over the limit holds one tensor larger than the limit
        assert!(
            size <= 20_000 + 4096 || tensors.len() == 1,
            "{f}: {size} bytes"
        );
        back.extend(tensors);
    }
    assert_eq!(back, raw(&src.join("model.safetensors")));
    let bad = train(
        &src,
        &temp("shard-bad"),
        "1",
        "0",
        &["--max-shard-size", "5 TX"],
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--max-shard-size"));
    let _ = (std::fs::remove_dir_all(&src), std::fs::remove_dir_all(&dst));
}
