//! Llama 3.x (`model_type` `llama`, `LlamaForCausalLM`): the plain decoder,
//! RoPE with Meta's `llama3` frequency scaling; presets `tiny` (a small
//! Llama for tests and CPU runs), `llama3-8b`, `llama3-70b` (the published
//! Llama 3.x models are presets of their own `config.json`: `presets.rs`).

use super::{BlockSpec, Family, hf};
use crate::attention::rope::{Llama3Scaling, RopeScaling};
use crate::error::Result;
use crate::model::ModelConfig;
use serde_json::{Map, Value};

/// The Llama block: the plain one.
pub(super) const SPEC: BlockSpec = BlockSpec::LLAMA;

/// A Llama `config.json` object as a config (not yet validated).
pub(super) fn parse_hf(obj: &Map<String, Value>) -> Result<ModelConfig> {
    hf::refuse_unimplemented(obj)?;
    // Llama attends causally over the whole window: a window here would be
    // silently dropped, so it is refused
    if let Some(w) = obj.get("sliding_window").filter(|v| !v.is_null()) {
        return Err(crate::Error::Config(format!(
            "sliding_window is {w} in a Llama config.json; Llama attends over the whole window. \
             For a sliding window use a Mistral config (model_type 'mistral'), or set \
             sliding_window to null"
        )));
    }
    hf::decoder_fields(obj, Family::Llama)
}

/// The RoPE scaling Meta publishes for the Llama 3.1 / 3.2 models.
fn llama31_rope_scaling(factor: f32) -> RopeScaling {
    RopeScaling::Llama3(Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    })
}

/// A Llama 3.x config with the dims that differ between sizes.
fn llama3(name: &str, hidden: usize, layers: usize, heads: usize, ffn: usize) -> ModelConfig {
    ModelConfig {
        name: name.to_string(),
        family: Family::Llama,
        hidden,
        layers,
        heads,
        kv_heads: 8,
        head_dim: hidden / heads,
        ffn,
        vocab: 128_256,
        rope_theta: 500_000.0,
        rope_scaling: Some(llama31_rope_scaling(8.0)),
        rms_norm_eps: 1e-5,
        tie_embeddings: false,
        max_position: 131_072,
        sliding_window: None,
        layer_types: Vec::new(),
        local_rope_theta: None,
        query_pre_attn_scalar: None,
    }
}

/// The Llama preset called `name`, if there is one.
///
/// `llama3-8b` and `llama3-70b` carry the Llama 3.1 RoPE settings (scaling
/// factor 8, 128K context); their weights have the same shapes as Llama 3.0.
pub(super) fn preset(name: &str) -> Option<ModelConfig> {
    let cfg = match name {
        "tiny" => ModelConfig {
            name: "tiny".to_string(),
            family: Family::Llama,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 172,
            vocab: 256,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_embeddings: false,
            max_position: 1 << 20,
            sliding_window: None,
            layer_types: Vec::new(),
            local_rope_theta: None,
            query_pre_attn_scalar: None,
        },
        "llama3-8b" => llama3(name, 4096, 32, 32, 14_336),
        "llama3-70b" => llama3(name, 8192, 80, 64, 28_672),
        _ => return None,
    };
    Some(cfg)
}
