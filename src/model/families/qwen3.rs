//! Qwen3 (`model_type` `qwen3`, `Qwen3ForCausalLM`): the Llama decoder with
//! a per-head RMSNorm of q and k before RoPE (`self_attn.q_norm`,
//! `self_attn.k_norm`, [`Family::qk_norm`]); its presets are the published
//! models' own `config.json` (`presets.rs`).

use super::{BlockSpec, Family, hf};
use crate::error::Result;
use crate::model::ModelConfig;
use serde_json::{Map, Value};

/// The Llama block with QK-norm.
pub(super) const SPEC: BlockSpec = BlockSpec {
    qk_norm: true,
    ..BlockSpec::LLAMA
};

/// A Qwen3 `config.json` object as a config (not yet validated).
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    hf::refuse_unimplemented(obj)?;
    hf::decoder_fields(obj, Family::Qwen3)
}

/// The Qwen3 preset called `name`, if there is one (the published Qwen3
/// models are presets of their own `config.json`: `presets.rs`).
pub(super) fn preset(_name: &str) -> Option<ModelConfig> {
    None
}
