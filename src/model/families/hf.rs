//! The `config.json` keys every Llama-like family shares: reading them into
//! a [`ModelConfig`] (defaults as `transformers` has them), the rope-scaling
//! types, and writing them back.

use super::family::Family;
use super::spec::WindowRule;
use crate::attention::rope::{Llama3Scaling, RopeScaling, YarnScaling};
use crate::backend::GatedAct;
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use serde_json::{Map, Value, json};

/// Keys whose `true` asks for what no family's decoder implements yet.
const UNIMPLEMENTED_FLAGS: [&str; 3] = ["attention_bias", "mlp_bias", "use_sliding_window"];

/// Refuses a `config.json` whose `attention_bias`, `mlp_bias` or
/// `use_sliding_window` is true (a family that implements one checks the
/// others only).
pub(super) fn refuse_unimplemented(obj: &Map<String, Value>) -> Result<()> {
    for key in UNIMPLEMENTED_FLAGS {
        if obj.get(key).and_then(Value::as_bool) == Some(true) {
            return config_err_str(&format!(
                "{key} is true; upipe's decoder has no projection biases and uses full causal attention"
            ));
        }
    }
    Ok(())
}

/// The decoder fields of a `config.json` object of `family` (not yet
/// validated), with `transformers`' defaults for the optional ones.
pub(super) fn decoder_fields(obj: &Map<String, Value>, family: Family) -> Result<ModelConfig> {
    let hidden = req_usize(obj, "hidden_size")?;
    let heads = req_usize(obj, "num_attention_heads")?;
    let head_dim = match obj.get("head_dim") {
        None | Some(Value::Null) => hidden.checked_div(heads).unwrap_or(0),
        Some(_) => req_usize(obj, "head_dim")?,
    };
    // Newer transformers move rope_theta into a `rope_parameters` object.
    let rope_params = obj
        .get("rope_parameters")
        .and_then(Value::as_object)
        .filter(|r| r.contains_key("rope_theta"));
    let rope_theta = match (opt_f32(obj, "rope_theta")?, rope_params) {
        (Some(theta), _) => theta,
        (None, Some(r)) => req_f32(r, "rope_theta")?,
        (None, None) => 10_000.0,
    };
    // a null `rope_scaling` beside `rope_parameters` defers to the latter
    let max_position = opt_usize(obj, "max_position_embeddings")?.unwrap_or(2048);
    let scaling_value = obj
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| obj.get("rope_parameters"));
    Ok(ModelConfig {
        name: obj
            .get("_name_or_path")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or(family.model_type())
            .to_string(),
        family,
        hidden,
        layers: req_usize(obj, "num_hidden_layers")?,
        heads,
        kv_heads: opt_usize(obj, "num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        ffn: req_usize(obj, "intermediate_size")?,
        vocab: req_usize(obj, "vocab_size")?,
        rope_theta,
        rope_scaling: parse_rope_scaling(scaling_value, max_position)?,
        rms_norm_eps: opt_f32(obj, "rms_norm_eps")?.unwrap_or(1e-6),
        tie_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
        max_position,
        sliding_window: None,
        layer_types: Vec::new(),
        local_rope_theta: None,
        query_pre_attn_scalar: None,
    })
}

/// Parses `rope_scaling` (or `rope_parameters`): absent, null and `"default"`
/// mean none; `"llama3"` is Llama 3's, `"yarn"` YaRN (Qwen2.5's long
/// context; `original_max_position_embeddings` defaults to the model's
/// `max_position`, as `transformers` has it).
fn parse_rope_scaling(value: Option<&Value>, max_position: usize) -> Result<Option<RopeScaling>> {
    let obj = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return config_err_str(&format!(
                "rope_scaling must be an object or null, got {other}"
            ));
        }
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => llama3_from_hf(obj).map(|s| Some(RopeScaling::Llama3(s))),
        "yarn" => yarn_from_hf(obj, max_position).map(|s| Some(RopeScaling::Yarn(s))),
        "linear" => Ok(Some(RopeScaling::Linear(req_f32(obj, "factor")?))),
        other => config_err_str(&format!(
            "rope_scaling type '{other}' is not supported; upipe implements 'llama3', 'yarn' and \
             'linear' scaling (or none: remove rope_scaling)"
        )),
    }
}

/// The fields of a `rope_scaling` object of type `llama3`.
fn llama3_from_hf(obj: &Map<String, Value>) -> Result<Llama3Scaling> {
    Ok(Llama3Scaling {
        factor: req_f32(obj, "factor")?,
        low_freq_factor: req_f32(obj, "low_freq_factor")?,
        high_freq_factor: req_f32(obj, "high_freq_factor")?,
        original_max_position_embeddings: req_usize(obj, "original_max_position_embeddings")?,
    })
}

/// `s` as the `rope_scaling` object of a `config.json` (type `llama3`).
fn llama3_json(s: &Llama3Scaling) -> Value {
    json!({
        "rope_type": "llama3",
        "factor": clean_f32(s.factor),
        "low_freq_factor": clean_f32(s.low_freq_factor),
        "high_freq_factor": clean_f32(s.high_freq_factor),
        "original_max_position_embeddings": s.original_max_position_embeddings,
    })
}

/// The fields of a `rope_scaling` object of type `yarn` (those left out
/// keep `transformers`' defaults).
fn yarn_from_hf(obj: &Map<String, Value>, max_position: usize) -> Result<YarnScaling> {
    let original = opt_usize(obj, "original_max_position_embeddings")?;
    // without a factor, transformers takes the ratio of the two contexts
    let factor = match (opt_f32(obj, "factor")?, original) {
        (Some(f), _) => f,
        (None, Some(o)) if o > 0 => (max_position as f64 / o as f64) as f32,
        (None, _) => return Err(missing("factor")),
    };
    Ok(YarnScaling {
        factor,
        original_max_position_embeddings: original.unwrap_or(max_position),
        original_given: original.is_some(),
        beta_fast: opt_f32(obj, "beta_fast")?,
        beta_slow: opt_f32(obj, "beta_slow")?,
        attention_factor: opt_f32(obj, "attention_factor")?,
        mscale: opt_f32(obj, "mscale")?,
        mscale_all_dim: opt_f32(obj, "mscale_all_dim")?,
        truncate: opt_bool(obj, "truncate")?,
    })
}

/// `s` as the `rope_scaling` object of a `config.json` (type `yarn`): the
/// fields the source gave.
fn yarn_json(s: &YarnScaling) -> Value {
    let mut m = Map::new();
    m.insert("rope_type".into(), json!("yarn"));
    m.insert("factor".into(), json!(clean_f32(s.factor)));
    if s.original_given {
        let orig = s.original_max_position_embeddings;
        m.insert("original_max_position_embeddings".into(), json!(orig));
    }
    for (key, v) in [
        ("beta_fast", s.beta_fast),
        ("beta_slow", s.beta_slow),
        ("attention_factor", s.attention_factor),
        ("mscale", s.mscale),
        ("mscale_all_dim", s.mscale_all_dim),
    ] {
        if let Some(v) = v {
            m.insert(key.into(), json!(clean_f32(v)));
        }
    }
    if let Some(t) = s.truncate {
        m.insert("truncate".into(), json!(t));
    }
    Value::Object(m)
}

/// `cfg` as a Hugging Face `config.json` that [`decoder_fields`] reads back
/// to an equal config and `transformers` loads as its family's architecture.
pub(crate) fn to_hf_json(cfg: &ModelConfig) -> String {
    let rope_scaling = match &cfg.rope_scaling {
        None => Value::Null,
        Some(RopeScaling::Llama3(s)) => llama3_json(s),
        Some(RopeScaling::Yarn(s)) => yarn_json(s),
        Some(RopeScaling::Linear(f)) => json!({"rope_type": "linear", "factor": clean_f32(*f)}),
    };
    let act = cfg.spec().activation;
    let mut value = json!({
        "_name_or_path": cfg.name,
        "architectures": [cfg.family.architecture()],
        "model_type": cfg.family.model_type(),
        "hidden_act": act.hf_name(),
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab,
        "rope_theta": clean_f32(cfg.rope_theta),
        "rope_scaling": rope_scaling,
        "rms_norm_eps": clean_f32(cfg.rms_norm_eps),
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position,
        "attention_bias": cfg.family.qkv_bias(),
        "mlp_bias": false,
    });
    let obj = value.as_object_mut().expect("a JSON object literal");
    match cfg.spec().window {
        WindowRule::Never => {}
        WindowRule::Uniform => {
            obj.insert("sliding_window".into(), json!(cfg.sliding_window));
        }
        WindowRule::PerLayer => cfg.family.hf_json_extra(cfg, obj),
    }
    if act != GatedAct::Silu {
        obj.insert("hidden_activation".into(), json!(act.hf_name()));
    }
    serde_json::to_string_pretty(&value).expect("a JSON value always serialises")
}

fn config_err_str<T>(msg: &str) -> Result<T> {
    Err(Error::Config(msg.to_string()))
}

fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{key} must be a non-negative integer, got {v}"))),
    }
}

/// The non-negative integer under `key`, which must be there.
pub(super) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    opt_usize(obj, key)?.ok_or_else(|| missing(key))
}

fn opt_f32(obj: &Map<String, Value>, key: &str) -> Result<Option<f32>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| Error::Config(format!("{key} must be a number, got {v}"))),
    }
}

/// The number under `key`, which must be there.
pub(super) fn req_f32(obj: &Map<String, Value>, key: &str) -> Result<f32> {
    opt_f32(obj, key)?.ok_or_else(|| missing(key))
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{key} must be true or false, got {v}"))),
    }
}

fn missing(key: &str) -> Error {
    Error::Config(format!("config.json lacks the required key '{key}'"))
}

/// An f32 as the f64 with the same shortest decimal form, so JSON shows `1e-5`, not `9.99999974e-6`.
pub(super) fn clean_f32(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
