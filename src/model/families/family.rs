//! The [`Family`] of a decoder and what it says without reading a
//! `config.json`: its names (`model_type`, `architectures`), its quirks and
//! its parameters' HF names.

use super::names;
use super::params::{BlockParam, Param};
use super::spec::WindowRule;

/// A family of decoders sharing a `config.json` schema, parameter names
/// and a block ([`BlockSpec`], declared in the family's file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Llama 3.x (`model_type` `llama`): RoPE with Llama-3 scaling.
    Llama,
    /// Qwen3 (`model_type` `qwen3`): per-head RMSNorm of q and k.
    Qwen3,
    /// Qwen2 / Qwen2.5 (`model_type` `qwen2`): biases on the q/k/v
    /// projections, YaRN RoPE scaling.
    Qwen2,
    /// Mistral (`model_type` `mistral`): the Llama decoder with an optional
    /// sliding window (`sliding_window`).
    Mistral,
    /// Gemma 3 text (`model_type` `gemma3_text`, or the text part of a
    /// `gemma3` checkpoint): sliding and global layers, sandwich norms,
    /// GeGLU, a scaled embedding.
    Gemma3,
}

/// Every family upipe reads, in the order messages list them.
pub const FAMILIES: &[Family] = &[
    Family::Llama,
    Family::Qwen3,
    Family::Qwen2,
    Family::Mistral,
    Family::Gemma3,
];

impl Family {
    /// The family's name in messages: `Llama`, `Qwen3`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen3 => "Qwen3",
            Family::Qwen2 => "Qwen2",
            Family::Mistral => "Mistral",
            Family::Gemma3 => "Gemma3",
        }
    }

    /// The `model_type` of the `config.json` upipe writes for it.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
            Family::Qwen2 => "qwen2",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// Every `model_type` it reads: its own, and a multimodal wrapper's
    /// whose `text_config` it is (`gemma3`).
    pub fn model_types(self) -> &'static [&'static str] {
        match self {
            Family::Llama => &["llama"],
            Family::Qwen3 => &["qwen3"],
            Family::Qwen2 => &["qwen2"],
            Family::Mistral => &["mistral"],
            Family::Gemma3 => &["gemma3_text", "gemma3"],
        }
    }

    /// The `architectures` entry `transformers` loads it as.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// Whether q and k are RMS-normalised per head before RoPE.
    pub fn qk_norm(self) -> bool {
        self.spec().qk_norm
    }

    /// Whether its attention may slide (`sliding_window` in its
    /// `config.json`); a family without one refuses a window there.
    pub fn has_sliding_window(self) -> bool {
        self.spec().window != WindowRule::Never
    }

    /// Whether the q/k/v projections carry biases (`o_proj` never does).
    pub fn qkv_bias(self) -> bool {
        self.spec().qkv_bias
    }

    /// A block's parameters in HF order.
    pub fn block_params(self) -> Vec<BlockParam> {
        self.spec().block_params()
    }

    /// The HF name of parameter `p` (`model.layers.3.mlp.up_proj.weight`).
    pub fn hf_name(self, p: Param) -> String {
        match self {
            Family::Gemma3 => names::gemma_name(p),
            Family::Llama | Family::Qwen3 | Family::Qwen2 | Family::Mistral => names::llama_name(p),
        }
    }

    /// Whether a tensor `transformers` writes under `name` is a buffer, not a
    /// parameter (older versions saved each layer's RoPE frequencies), or
    /// belongs to another part of a multimodal checkpoint whose text model
    /// upipe trains (the spec's `skipped_prefixes`).
    pub fn is_buffer(self, name: &str) -> bool {
        name.ends_with(".rotary_emb.inv_freq") || self.spec().skips(name)
    }

    /// The other names a checkpoint may store parameter `hf_name` under:
    /// a multimodal Gemma 3's text model (`language_model.model.…` as
    /// `transformers` 4 writes it, `model.language_model.…` as 5 does).
    pub fn stored_aliases(self, hf_name: &str) -> Vec<String> {
        match self {
            Family::Gemma3 => names::gemma_multimodal_names(hf_name),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_name_their_families() {
        for f in FAMILIES {
            assert_eq!(Family::from_model_type(f.model_type()).unwrap(), *f);
        }
        let e = Family::from_model_type("gpt2").unwrap_err().to_string();
        assert!(e.contains("unsupported model_type 'gpt2'"), "{e}");
        for f in FAMILIES {
            let listed = format!("{} ('{}')", f.name(), f.model_type());
            assert!(e.contains(&listed), "{e} lacks {listed}");
        }
        assert_eq!(Family::from_model_type("qwen2").unwrap(), Family::Qwen2);
    }

    #[test]
    fn names_follow_transformers_layout() {
        let f = Family::Qwen3;
        assert_eq!(f.hf_name(Param::Embed), "model.embed_tokens.weight");
        assert_eq!(f.hf_name(Param::FinalNorm), "model.norm.weight");
        assert_eq!(f.hf_name(Param::LmHead), "lm_head.weight");
        let q_norm = Param::Block(7, BlockParam::QNorm);
        assert_eq!(f.hf_name(q_norm), "model.layers.7.self_attn.q_norm.weight");
        let up = Param::Block(0, BlockParam::Up);
        assert_eq!(
            Family::Llama.hf_name(up),
            "model.layers.0.mlp.up_proj.weight"
        );
        assert!(!Family::Llama.block_params().contains(&BlockParam::QNorm));
        assert!(f.is_buffer("model.layers.0.self_attn.rotary_emb.inv_freq"));
        assert!(!f.is_buffer("model.norm.weight"));
    }

    /// A multimodal checkpoint's other parts, as its family's spec names
    /// them: skipped for Gemma 3 (both layouts), never for a family whose
    /// spec names none, and never a text parameter.
    #[test]
    fn skipped_prefixes_come_from_the_spec() {
        let vision = [
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "multi_modal_projector.mm_input_projection_weight",
            "model.vision_tower.vision_model.post_layernorm.bias",
            "model.multi_modal_projector.mm_soft_emb_norm.weight",
        ];
        for name in vision {
            assert!(Family::Gemma3.is_buffer(name), "{name}");
            assert!(!Family::Llama.is_buffer(name), "{name}");
        }
        for f in FAMILIES {
            assert_eq!(f.spec().skipped_prefixes.is_empty(), *f != Family::Gemma3);
        }
        let g = Family::Gemma3;
        for p in g.block_params() {
            let name = g.hf_name(Param::Block(0, p));
            assert!(!g.is_buffer(&name), "{name}");
            for alias in g.stored_aliases(&name) {
                assert!(!g.is_buffer(&alias), "{alias}");
            }
        }
        assert!(!g.is_buffer("model.language_model.embed_tokens.weight"));
    }

    #[test]
    fn only_qwen2_has_projection_biases() {
        let f = Family::Qwen2;
        let bq = Param::Block(3, BlockParam::Bq);
        assert_eq!(f.hf_name(bq), "model.layers.3.self_attn.q_proj.bias");
        let bv = Param::Block(0, BlockParam::Bv);
        assert_eq!(f.hf_name(bv), "model.layers.0.self_attn.v_proj.bias");
        for f in FAMILIES {
            let has = f.block_params().contains(&BlockParam::Bk);
            assert_eq!(has, f.qkv_bias(), "{f:?}");
        }
    }

    #[test]
    fn only_qwen3_normalises_q_and_k() {
        assert!(Family::Qwen3.qk_norm() && !Family::Llama.qk_norm());
        for f in FAMILIES {
            let has = f.block_params().contains(&BlockParam::QNorm);
            assert_eq!(has, f.qk_norm(), "{f:?}");
        }
    }
}
