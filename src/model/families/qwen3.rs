//! Qwen3 (`model_type` `qwen3`, `Qwen3ForCausalLM`): the Llama decoder with
//! a per-head RMSNorm of q and k before RoPE (`self_attn.q_norm`,
//! `self_attn.k_norm`, [`Family::qk_norm`]); preset `qwen3-32b`.

use super::{Family, hf};
use crate::error::Result;
use crate::model::ModelConfig;
use serde_json::{Map, Value};

/// Its `config.json`'s `model_type`.
pub(super) const MODEL_TYPE: &str = "qwen3";
/// The class `transformers` loads it as.
pub(super) const ARCHITECTURE: &str = "Qwen3ForCausalLM";

/// A Qwen3 `config.json` object as a config (not yet validated).
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    hf::refuse_unimplemented(obj)?;
    hf::decoder_fields(obj, Family::Qwen3)
}

/// The Qwen3 preset called `name`, if there is one.
pub(super) fn preset(name: &str) -> Option<ModelConfig> {
    let cfg = match name {
        "qwen3-32b" => ModelConfig {
            name: name.to_string(),
            family: Family::Qwen3,
            hidden: 5120,
            layers: 64,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            ffn: 25_600,
            vocab: 151_936,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_embeddings: false,
            max_position: 40_960,
        },
        _ => return None,
    };
    Some(cfg)
}
