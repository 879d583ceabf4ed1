//! Qwen2 / Qwen2.5 (`model_type` `qwen2`, `Qwen2ForCausalLM`): the Llama
//! decoder with biases on the q/k/v projections (`self_attn.{q,k,v}_proj.bias`,
//! none on `o_proj`: [`Family::qkv_bias`]), tied or untied embeddings
//! (`tie_word_embeddings`), and RoPE with YaRN scaling or none. Its presets
//! are the published Qwen2.5 models' own `config.json` (`presets.rs`).
//!
//! `use_sliding_window: true` (a window on the upper layers) is refused:
//! every published Qwen2.5 model ships it false.

use super::{BlockSpec, Family, hf};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use serde_json::{Map, Value};

/// The Llama block with q/k/v biases.
pub(super) const SPEC: BlockSpec = BlockSpec {
    qkv_bias: true,
    ..BlockSpec::LLAMA
};

/// A Qwen2 `config.json` object as a config (not yet validated).
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    if obj.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Config(
            "use_sliding_window is true; upipe's Qwen2 decoder uses full causal attention on \
             every layer (the published Qwen2.5 models ship it false): set \
             \"use_sliding_window\": false in config.json"
                .to_string(),
        ));
    }
    if obj.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err(Error::Config(
            "mlp_bias is true; Qwen2's MLP has no biases: set \"mlp_bias\": false in config.json"
                .to_string(),
        ));
    }
    hf::decoder_fields(obj, Family::Qwen2)
}

/// The Qwen2 preset called `name`, if there is one (the published Qwen2.5
/// models are presets of their own `config.json`: `presets.rs`).
pub(super) fn preset(_name: &str) -> Option<ModelConfig> {
    None
}

#[cfg(test)]
mod tests {
    use crate::model::{Family, ModelConfig};

    fn config(extra: &str) -> String {
        format!(
            r#"{{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "vocab_size": 256, "max_position_embeddings": 128, "rope_theta": 10000.0
            {extra}}}"#
        )
    }

    #[test]
    fn reads_biases_and_yarn() {
        let yarn = r#", "tie_word_embeddings": true, "use_sliding_window": false,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}"#;
        let cfg = ModelConfig::from_hf_json(&config(yarn)).unwrap();
        assert_eq!(cfg.family, Family::Qwen2);
        assert!(cfg.tie_embeddings && cfg.qkv_bias() && !cfg.qk_norm());
        let shapes: std::collections::BTreeMap<_, _> = cfg.hf_param_shapes().into_iter().collect();
        assert_eq!(shapes["model.layers.1.self_attn.q_proj.bias"], vec![64]);
        assert_eq!(shapes["model.layers.1.self_attn.k_proj.bias"], vec![32]);
        assert_eq!(shapes["model.layers.1.self_attn.v_proj.bias"], vec![32]);
        assert!(!shapes.contains_key("model.layers.1.self_attn.o_proj.bias"));
        let Some(crate::attention::rope::RopeScaling::Yarn(y)) = cfg.rope_scaling else {
            panic!("yarn scaling expected: {:?}", cfg.rope_scaling);
        };
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 32));
        // no factor: the ratio of max_position_embeddings to the original
        let implicit =
            r#", "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}"#;
        let cfg = ModelConfig::from_hf_json(&config(implicit)).unwrap();
        assert_eq!(cfg.rope_scaling.map(|s| s.factor()), Some(2.0));
    }

    #[test]
    fn refuses_a_sliding_window_and_unknown_rope_types() {
        let e = ModelConfig::from_hf_json(&config(r#", "use_sliding_window": true"#))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("use_sliding_window") && e.contains("false"),
            "{e}"
        );
        let bad = r#", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}"#;
        let e = ModelConfig::from_hf_json(&config(bad))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'longrope'") && e.contains("'llama3'") && e.contains("'yarn'"),
            "{e}"
        );
        let negative = r#", "rope_scaling": {"rope_type": "yarn", "factor": -4.0}"#;
        let e = ModelConfig::from_hf_json(&config(negative))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rope_scaling.factor is -4"), "{e}");
    }
}
