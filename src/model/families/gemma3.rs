//! Gemma 3 text models (`model_type` `gemma3_text`, `Gemma3ForCausalLM`;
//! and the `text_config` of a multimodal `gemma3` checkpoint,
//! `Gemma3ForConditionalGeneration`): layers that slide over a local window
//! (RoPE base `rope_local_base_freq`, unscaled) between global ones (RoPE
//! `rope_theta` with linear scaling on the larger sizes) as `layer_types`
//! (or the older `sliding_window_pattern`) says; QK-norm; four norms per
//! block, each scaling by `1 + w`; GeGLU (`gelu_pytorch_tanh`); embeddings
//! scaled by `√hidden`; scores scaled by `query_pre_attn_scalar^-½`; tied
//! embeddings. Its presets are the published models' own `config.json`
//! (`presets.rs`).

use super::hf;
use super::{BlockSpec, Family, LayerType, WindowRule};
use crate::backend::GatedAct;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use serde_json::{Map, Value, json};

/// The Gemma 3 block.
pub(super) const SPEC: BlockSpec = BlockSpec {
    norm_weight_offset: 1.0,
    activation: GatedAct::GeluTanh,
    qkv_bias: false,
    qk_norm: true,
    post_norms: true,
    scaled_embedding: true,
    window: WindowRule::PerLayer,
    skipped_prefixes: MULTIMODAL_OTHER_PARTS,
};

/// A multimodal checkpoint's vision tower and projector, at the top level
/// (`transformers` 4) or under `model.` (5).
const MULTIMODAL_OTHER_PARTS: &[&str] = &[
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
];

/// `Gemma3TextConfig`'s defaults, which the published multimodal
/// checkpoints leave out of their `text_config`.
fn defaults() -> Map<String, Value> {
    let v = json!({
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    });
    match v {
        Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// A Gemma 3 `config.json` object as a config (not yet validated): a
/// `gemma3_text` config, or a `gemma3` one's `text_config`.
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    let text = text_config(obj)?;
    refuse_unsupported(text)?;
    let mut merged = defaults();
    for (k, v) in text.iter().filter(|(_, v)| !v.is_null()) {
        merged.insert(k.clone(), v.clone());
    }
    if let Some(name) = obj.get("_name_or_path") {
        merged.entry("_name_or_path").or_insert(name.clone());
    }
    // the per-layer-type `rope_parameters` of newer transformers
    let (global, local) = split_rope_parameters(&merged)?;
    if let Some(g) = global {
        merged.insert("rope_theta".into(), json!(hf::req_f32(&g, "rope_theta")?));
        merged.insert("rope_scaling".into(), Value::Object(g));
    }
    let cfg = hf::decoder_fields(&merged, Family::Gemma3)?;
    let local_theta = match local {
        Some(l) => hf::req_f32(&l, "rope_theta")?,
        None => hf::req_f32(&merged, "rope_local_base_freq")?,
    };
    Ok(ModelConfig {
        sliding_window: Some(positive(&merged, "sliding_window")?),
        layer_types: layer_types(&merged, cfg.layers)?,
        local_rope_theta: Some(local_theta),
        query_pre_attn_scalar: Some(hf::req_f32(&merged, "query_pre_attn_scalar")?),
        ..cfg
    })
}

/// The text model's config: `obj` itself, or a `gemma3` config's
/// `text_config`.
fn text_config(obj: &Map<String, Value>) -> Result<&Map<String, Value>> {
    if obj.get("model_type").and_then(Value::as_str) != Some("gemma3") {
        return Ok(obj);
    }
    obj.get("text_config")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            Error::Config(
                "a gemma3 config.json without a text_config object; upipe trains the text model \
                 of a Gemma 3 checkpoint and reads its dimensions there"
                    .into(),
            )
        })
}

/// Refuses what upipe's Gemma 3 block does not compute: biases, logit
/// soft-capping (Gemma 2's), another activation.
fn refuse_unsupported(text: &Map<String, Value>) -> Result<()> {
    hf::refuse_unimplemented(text)?;
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(v) = text.get(key).filter(|v| !v.is_null()) {
            return Err(Error::Config(format!(
                "{key} is {v}; Gemma 3 has no logit soft-capping and upipe's decoder computes \
                 none: set it to null"
            )));
        }
    }
    let act = text
        .get("hidden_activation")
        .or_else(|| text.get("hidden_act"))
        .and_then(Value::as_str);
    match act {
        None | Some("gelu_pytorch_tanh") => Ok(()),
        Some(other) => Err(Error::Config(format!(
            "hidden_activation '{other}' in a Gemma 3 config; upipe's Gemma 3 MLP is GeGLU with \
             'gelu_pytorch_tanh'"
        ))),
    }
}

/// `rope_parameters` keyed by layer type (`full_attention`,
/// `sliding_attention`), as newer `transformers` write it: the global
/// layers' and the local layers' parameters; `(None, None)` otherwise.
type RopeParts = (Option<Map<String, Value>>, Option<Map<String, Value>>);

fn split_rope_parameters(obj: &Map<String, Value>) -> Result<RopeParts> {
    let Some(params) = obj.get("rope_parameters").and_then(Value::as_object) else {
        return Ok((None, None));
    };
    let part = |key: &str| params.get(key).and_then(Value::as_object).cloned();
    match (part("full_attention"), part("sliding_attention")) {
        (None, None) => Ok((None, None)),
        (Some(g), Some(l)) => {
            let local_type = l.get("rope_type").and_then(Value::as_str);
            if local_type.is_some_and(|t| t != "default") {
                return Err(Error::Config(format!(
                    "rope_parameters.sliding_attention has rope_type '{}'; Gemma 3's local \
                     layers take unscaled RoPE ('default')",
                    local_type.unwrap_or_default()
                )));
            }
            Ok((Some(g), Some(l)))
        }
        _ => Err(Error::Config(
            "rope_parameters gives only one of full_attention and sliding_attention; a Gemma 3 \
             config gives both"
                .into(),
        )),
    }
}

/// Each layer's type: `layer_types`, or every `sliding_window_pattern`-th
/// layer global and the rest sliding (the older configs' form).
fn layer_types(obj: &Map<String, Value>, layers: usize) -> Result<Vec<LayerType>> {
    if let Some(list) = obj.get("layer_types").and_then(Value::as_array) {
        return list.iter().map(layer_type).collect();
    }
    let pattern = positive(obj, "sliding_window_pattern")?;
    Ok((0..layers)
        .map(|i| match (i + 1) % pattern {
            0 => LayerType::Full,
            _ => LayerType::Sliding,
        })
        .collect())
}

fn layer_type(v: &Value) -> Result<LayerType> {
    match v.as_str() {
        Some("full_attention") => Ok(LayerType::Full),
        Some("sliding_attention") => Ok(LayerType::Sliding),
        _ => Err(Error::Config(format!(
            "layer_types holds {v}; each entry is \"full_attention\" or \"sliding_attention\""
        ))),
    }
}

fn positive(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    match hf::req_usize(obj, key)? {
        0 => Err(Error::Config(format!("{key} is 0; it must be at least 1"))),
        n => Ok(n),
    }
}

/// The keys a Gemma 3 `config.json` adds to the Llama ones.
pub(super) fn hf_json_extra(cfg: &ModelConfig, out: &mut Map<String, Value>) {
    let types: Vec<&str> = cfg.layer_types.iter().map(|t| t.hf_name()).collect();
    out.insert("layer_types".into(), json!(types));
    out.insert("sliding_window".into(), json!(cfg.sliding_window));
    let local = cfg.local_rope_theta.unwrap_or(cfg.rope_theta);
    out.insert("rope_local_base_freq".into(), json!(hf::clean_f32(local)));
    let q = cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim as f32);
    out.insert("query_pre_attn_scalar".into(), json!(hf::clean_f32(q)));
    out.insert("attn_logit_softcapping".into(), Value::Null);
    out.insert("final_logit_softcapping".into(), Value::Null);
}

#[cfg(test)]
mod tests {
    use super::super::presets::hf_preset;
    use crate::attention::rope::RopeScaling;
    use crate::model::families::LayerType;
    use crate::model::{Family, ModelConfig};
    use serde_json::Value;

    /// The presets are the published models' text configs, with their
    /// published parameter counts (the text model's: embedding, 26/34/48/62
    /// blocks of four norms, QK-norm, q/k/v/o and the MLP, the final norm).
    #[test]
    fn presets_are_the_published_text_models() {
        let count = |n: &str| ModelConfig::preset(n).unwrap().param_count();
        assert_eq!(count("gemma3-1b"), 999_885_952);
        assert_eq!(count("gemma3-4b"), 3_880_263_168);
        let g12 = ModelConfig::preset("gemma3-12b").unwrap();
        assert_eq!(
            (g12.hidden, g12.heads, g12.kv_heads, g12.head_dim),
            (3840, 16, 8, 256)
        );
        let g27 = ModelConfig::preset("gemma3-27b").unwrap();
        assert_eq!(
            (g27.head_dim, g27.query_pre_attn_scalar),
            (128, Some(168.0))
        );
        assert_eq!(g27.softmax_scale(), 1.0 / 168f32.sqrt());
        let g1 = ModelConfig::preset("gemma3-1b").unwrap();
        assert_eq!(g1.family, Family::Gemma3);
        assert!(g1.tie_embeddings && g1.qk_norm());
        assert_eq!(
            (g1.vocab, g1.sliding_window, g1.max_position),
            (262_144, Some(512), 32_768)
        );
        // five sliding layers, then a global one
        let full: Vec<usize> = (0..g1.layers)
            .filter(|&l| g1.layer_types[l] == LayerType::Full)
            .collect();
        assert_eq!(full, [5, 11, 17, 23]);
        let (local, global) = (g1.layer_attention(0), g1.layer_attention(5));
        assert_eq!((local.window, local.rope.theta), (Some(512), 10_000.0));
        assert_eq!((global.window, global.rope.theta), (None, 1_000_000.0));
        let g4 = ModelConfig::preset("gemma3-4b").unwrap();
        assert_eq!(g4.rope_scaling, Some(RopeScaling::Linear(8.0)));
        assert_eq!(
            g4.layer_attention(0).rope.scaling,
            None,
            "local layers are unscaled"
        );
        assert_eq!(
            g4.layer_attention(5).rope.scaling,
            Some(RopeScaling::Linear(8.0))
        );
        assert_eq!(g4.norm().weight_offset, 1.0);
        assert_eq!(
            g4.embed_scale(crate::backend::DType::F32),
            Some(2560f32.sqrt())
        );
        // √1152 = 33.94..., 34 in bf16 as transformers holds it
        assert_eq!(g1.embed_scale(crate::backend::DType::BF16), Some(34.0));
    }

    /// What upipe writes reads back to the same config, and names the
    /// architecture `transformers` loads as `Gemma3ForCausalLM`.
    #[test]
    fn configs_round_trip_through_config_json() {
        for name in ["gemma3-1b", "gemma3-4b", "gemma3-27b"] {
            let cfg = ModelConfig::preset(name).unwrap();
            let json = cfg.to_hf_json();
            let back = ModelConfig::from_hf_json(&json).unwrap();
            assert_eq!(
                ModelConfig {
                    name: cfg.name.clone(),
                    ..back
                },
                cfg,
                "{name}"
            );
            let v: Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["architectures"][0], "Gemma3ForCausalLM");
            assert_eq!(v["model_type"], "gemma3_text");
            assert_eq!(v["hidden_activation"], "gelu_pytorch_tanh");
            assert_eq!(v["layer_types"].as_array().unwrap().len(), cfg.layers);
        }
    }

    /// Newer `transformers` write `rope_parameters` per layer type; it reads
    /// as the older keys do.
    #[test]
    fn rope_parameters_by_layer_type_read_as_the_older_keys() {
        let old = ModelConfig::preset("gemma3-4b").unwrap();
        let mut v: Value = serde_json::from_str(&old.to_hf_json()).unwrap();
        let o = v.as_object_mut().unwrap();
        for k in ["rope_theta", "rope_scaling", "rope_local_base_freq"] {
            o.remove(k);
        }
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }),
        );
        let new = ModelConfig::from_hf_json(&v.to_string()).unwrap();
        assert_eq!(new, old);
    }

    /// What the block cannot compute is refused, naming the key.
    #[test]
    fn soft_capping_and_other_activations_are_refused() {
        let base: Value = serde_json::from_str(hf_preset("gemma3-1b").unwrap()).unwrap();
        for (key, value, says) in [
            (
                "final_logit_softcapping",
                serde_json::json!(30.0),
                "soft-capping",
            ),
            ("hidden_activation", serde_json::json!("silu"), "GeGLU"),
            (
                "layer_types",
                serde_json::json!(["full_attention"]),
                "lists 1 layers",
            ),
            ("sliding_window", serde_json::json!(0), "at least 1"),
        ] {
            let mut v = base.clone();
            v[key] = value;
            let e = ModelConfig::from_hf_json(&v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
    }
}
