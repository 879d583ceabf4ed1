//! Mistral (`model_type` `mistral`, `MistralForCausalLM`): the Llama
//! decoder (same parameter names, an explicit `head_dim` allowed, as
//! Mistral-Nemo's 128 beside a hidden size of 5120) whose attention may
//! slide: `sliding_window` (an integer, or null for full causal attention)
//! bounds each query to the last `sliding_window` keys, itself included
//! (`ModelConfig::sliding_window`, the mask `model::window_mask`). Its
//! presets are the published models' own `config.json` (`presets.rs`).

use super::{BlockSpec, Family, WindowRule, hf};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use serde_json::{Map, Value};

/// The Llama block, with one optional window for every layer.
pub(super) const SPEC: BlockSpec = BlockSpec {
    window: WindowRule::Uniform,
    ..BlockSpec::LLAMA
};

/// A Mistral `config.json` object as a config (not yet validated).
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    hf::refuse_unimplemented(obj)?;
    Ok(ModelConfig {
        sliding_window: sliding_window(obj)?,
        ..hf::decoder_fields(obj, Family::Mistral)?
    })
}

/// `sliding_window`: absent or null for none, else a positive integer.
fn sliding_window(obj: &Map<String, Value>) -> Result<Option<usize>> {
    let bad = |v: &Value| {
        Error::Config(format!(
            "sliding_window must be a positive integer (keys each query sees, itself included) \
             or null for full attention, got {v}"
        ))
    };
    match obj.get("sliding_window") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(0) | None => Err(bad(v)),
            Some(w) => Ok(Some(w)),
        },
    }
}

/// The Mistral preset called `name`, if there is one (the published
/// Mistral models are presets of their own `config.json`: `presets.rs`).
pub(super) fn preset(_name: &str) -> Option<ModelConfig> {
    None
}

#[cfg(test)]
mod tests {
    use super::super::presets::hf_preset;
    use crate::error::Error;
    use crate::model::{Family, ModelConfig};
    use serde_json::Value;

    fn config_error(json: &str) -> String {
        match ModelConfig::from_hf_json(json) {
            Err(Error::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn presets_are_the_published_models() {
        let count = |n: &str| ModelConfig::preset(n).unwrap().param_count();
        assert_eq!(count("mistral-7b"), 7_241_732_096);
        assert_eq!(count("mistral-7b-v0.3"), 7_248_023_552);
        assert_eq!(count("mistral-nemo-12b"), 12_247_782_400);
        let v01 = ModelConfig::preset("mistral-7b").unwrap();
        assert_eq!(
            (v01.family, v01.sliding_window),
            (Family::Mistral, Some(4096))
        );
        assert_eq!(v01.head_dim, 128);
        let v03 = ModelConfig::preset("mistral-7b-v0.3").unwrap();
        assert_eq!(v03.sliding_window, None);
        // Nemo's head_dim is its own: 32 heads of 128 beside a hidden size of 5120
        let nemo = ModelConfig::preset("mistral-nemo-12b").unwrap();
        assert_eq!((nemo.hidden, nemo.heads, nemo.head_dim), (5120, 32, 128));
        let json: Value = serde_json::from_str(&v01.to_hf_json()).unwrap();
        assert_eq!(json["sliding_window"], 4096);
        assert_eq!(json["architectures"][0], "MistralForCausalLM");
        let json: Value = serde_json::from_str(&v03.to_hf_json()).unwrap();
        assert_eq!(json["sliding_window"], Value::Null);
        let tiny = ModelConfig::preset("tiny").unwrap().to_hf_json();
        let llama: Value = serde_json::from_str(&tiny).unwrap();
        assert!(llama.get("sliding_window").is_none());
    }

    #[test]
    fn bad_sliding_windows_are_refused() {
        let mistral = hf_preset("mistral-7b").unwrap();
        let with = |v: &str| {
            mistral.replace(
                "\"sliding_window\": 4096",
                &format!("\"sliding_window\": {v}"),
            )
        };
        for bad in ["0", "-4096", "\"4096\"", "4096.5"] {
            let m = config_error(&with(bad));
            assert!(
                m.contains("sliding_window must be a positive integer"),
                "{bad}: {m}"
            );
        }
        assert_eq!(
            ModelConfig::from_hf_json(&with("null"))
                .unwrap()
                .sliding_window,
            None
        );
        // a family whose attention does not slide refuses a window, never ignores it
        let llama = mistral.replace("\"mistral\"", "\"llama\"");
        let m = config_error(&llama);
        assert!(
            m.contains("sliding_window is 4096") && m.contains("'mistral'"),
            "{m}"
        );
        let llama_null = with("null").replace("\"mistral\"", "\"llama\"");
        assert!(ModelConfig::from_hf_json(&llama_null).is_ok());
        let base = ModelConfig::preset("tiny").unwrap();
        let on_llama = ModelConfig {
            sliding_window: Some(8),
            ..base.clone()
        };
        let m = on_llama.validate().unwrap_err().to_string();
        assert!(m.contains("does not slide"), "{m}");
        let zero = ModelConfig {
            family: Family::Mistral,
            sliding_window: Some(0),
            ..base
        };
        let m = zero.validate().unwrap_err().to_string();
        assert!(m.contains("sliding_window is 0"), "{m}");
    }
}
