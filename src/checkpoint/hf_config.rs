//! The `config.json` a checkpoint writes: the source model's own (every
//! field kept: token ids, rope settings, fields upipe does not know), with
//! only what the checkpoint changed updated: the dtype its weights are
//! stored in, and the model's fields where the trained model differs from
//! the source's.

use super::save_dtype::SaveDtype;
use crate::model::config::ModelConfig;
use serde_json::{Map, Value, json};

/// The text of the `config.json` for a checkpoint of `cfg` stored in
/// `dtype`, from `source` (the source model's `config.json` object) when
/// there is one, else from [`ModelConfig::to_hf_json`].
pub fn checkpoint_config(
    source: Option<&Map<String, Value>>,
    cfg: &ModelConfig,
    dtype: SaveDtype,
) -> String {
    let ours = upipe_fields(cfg);
    let mut obj = match source {
        // a multimodal checkpoint's text model is saved as a text model
        Some(src) if src.get("text_config").is_some_and(Value::is_object) => text_model(src, ours),
        Some(src) if describes(src, cfg) => src.clone(),
        Some(src) => {
            tracing::warn!(
                "the model trained ('{}') differs from its source's config.json; the \
                 checkpoint's config.json takes the trained model's fields and keeps the others",
                cfg.name
            );
            overlay(src, ours)
        }
        None => ours,
    };
    let keys: Vec<&str> = ["dtype", "torch_dtype"]
        .into_iter()
        .filter(|k| obj.contains_key(*k))
        .collect();
    let keys = if keys.is_empty() {
        vec!["torch_dtype"]
    } else {
        keys
    };
    for k in keys {
        obj.insert(k.to_string(), json!(dtype.hf_name()));
    }
    serde_json::to_string_pretty(&Value::Object(obj)).expect("a JSON value always serialises")
}

/// `cfg`'s own `config.json` fields as an object.
fn upipe_fields(cfg: &ModelConfig) -> Map<String, Value> {
    match serde_json::from_str(&cfg.to_hf_json()) {
        Ok(Value::Object(o)) => o,
        _ => unreachable!("to_hf_json writes a JSON object"),
    }
}

/// Whether `src` parses to `cfg` (its name aside).
fn describes(src: &Map<String, Value>, cfg: &ModelConfig) -> bool {
    let text = Value::Object(src.clone()).to_string();
    ModelConfig::from_hf_json(&text).is_ok_and(|c| {
        ModelConfig {
            name: cfg.name.clone(),
            ..c
        } == *cfg
    })
}

/// The `config.json` of a multimodal source's text model, trained alone:
/// `ours`, with the fields of the source's `text_config` upipe does not
/// write and the source's token ids kept.
fn text_model(src: &Map<String, Value>, ours: Map<String, Value>) -> Map<String, Value> {
    let mut obj = ours;
    if let Some(Value::Object(text)) = src.get("text_config") {
        for (k, v) in text {
            if k != "rope_parameters" && !obj.contains_key(k) {
                obj.insert(k.clone(), v.clone());
            }
        }
    }
    for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let (Some(v), false) = (src.get(k), obj.contains_key(k)) {
            obj.insert(k.to_string(), v.clone());
        }
    }
    obj
}

/// `src` with `ours`' fields written over it (its name kept; a newer
/// `rope_parameters` dropped, since `rope_theta`/`rope_scaling` now say it).
fn overlay(src: &Map<String, Value>, ours: Map<String, Value>) -> Map<String, Value> {
    let mut obj = src.clone();
    obj.remove("rope_parameters");
    for (k, v) in ours {
        if k != "_name_or_path" || !obj.contains_key(&k) {
            obj.insert(k, v);
        }
    }
    obj
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(text: &str) -> Map<String, Value> {
        match serde_json::from_str(text).unwrap() {
            Value::Object(o) => o,
            _ => panic!("not an object"),
        }
    }

    /// A multimodal Gemma 3 source's text model is saved as a
    /// `Gemma3ForCausalLM` of the same text config, its token ids kept.
    #[test]
    fn a_multimodal_source_saves_its_text_model() {
        let cfg = ModelConfig::preset("gemma3-4b").unwrap();
        let src = ModelConfig::hf_source("gemma3-4b").unwrap().unwrap();
        let out = object(&checkpoint_config(Some(&src), &cfg, SaveDtype::BF16));
        assert_eq!(out["model_type"], json!("gemma3_text"));
        assert_eq!(out["architectures"], json!(["Gemma3ForCausalLM"]));
        assert_eq!(out["eos_token_id"], json!([1, 106]));
        assert!(!out.contains_key("vision_config") && !out.contains_key("text_config"));
        let back = ModelConfig::from_hf_json(&Value::Object(out).to_string()).unwrap();
        assert_eq!(
            ModelConfig {
                name: cfg.name.clone(),
                ..back
            },
            cfg
        );
    }

    #[test]
    fn every_source_field_is_kept_and_the_dtype_updated() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let mut src = object(&cfg.to_hf_json());
        src.insert("bos_token_id".into(), json!(1));
        src.insert("eos_token_id".into(), json!([2, 3]));
        src.insert("my_own_field".into(), json!({"a": [1, 2]}));
        src.insert("dtype".into(), json!("bfloat16"));
        let out = object(&checkpoint_config(Some(&src), &cfg, SaveDtype::F32));
        let mut expected = src.clone();
        expected.insert("dtype".into(), json!("float32"));
        assert_eq!(out, expected);
        // a source that is not the trained model: the model's fields win
        let wider = ModelConfig {
            rope_theta: 20_000.0,
            ..cfg.clone()
        };
        let out = object(&checkpoint_config(Some(&src), &wider, SaveDtype::BF16));
        assert_eq!(out["rope_theta"], json!(20000.0));
        assert_eq!(out["my_own_field"], src["my_own_field"]);
        assert_eq!(out["dtype"], json!("bfloat16"));
        // no source: upipe's fields, with torch_dtype
        let out = object(&checkpoint_config(None, &cfg, SaveDtype::F16));
        assert_eq!(out["torch_dtype"], json!("float16"));
        assert_eq!(
            ModelConfig::from_hf_json(&Value::Object(out).to_string()).unwrap(),
            cfg
        );
    }
}
