//! The parameter names of `transformers`' Llama layout, which every family
//! so far uses.

use super::params::{BlockParam, Param};

/// A block parameter's name inside a block of `transformers`' Llama layout.
pub(super) fn llama_block_name(p: BlockParam) -> &'static str {
    match p {
        BlockParam::AttnNorm => "input_layernorm.weight",
        BlockParam::Wq => "self_attn.q_proj.weight",
        BlockParam::Wk => "self_attn.k_proj.weight",
        BlockParam::Wv => "self_attn.v_proj.weight",
        BlockParam::Bq => "self_attn.q_proj.bias",
        BlockParam::Bk => "self_attn.k_proj.bias",
        BlockParam::Bv => "self_attn.v_proj.bias",
        BlockParam::Wo => "self_attn.o_proj.weight",
        BlockParam::QNorm => "self_attn.q_norm.weight",
        BlockParam::KNorm => "self_attn.k_norm.weight",
        BlockParam::MlpNorm => "post_attention_layernorm.weight",
        BlockParam::PostAttnNorm | BlockParam::PostMlpNorm => {
            unreachable!("a Llama-layout block has no post-norms")
        }
        BlockParam::Gate => "mlp.gate_proj.weight",
        BlockParam::Up => "mlp.up_proj.weight",
        BlockParam::Down => "mlp.down_proj.weight",
    }
}

/// A parameter's name in `transformers`' Llama layout (a block's is
/// `model.layers.{l}.` and its [`llama_block_name`]).
pub(super) fn llama_name(p: Param) -> String {
    match p {
        Param::Embed => "model.embed_tokens.weight".into(),
        Param::Block(l, bp) => format!("model.layers.{l}.{}", llama_block_name(bp)),
        Param::FinalNorm => "model.norm.weight".into(),
        Param::LmHead => "lm_head.weight".into(),
    }
}

/// A block parameter's name in `transformers`' Gemma 3 layout: Llama's,
/// except that its four norms are `input_layernorm`,
/// `post_attention_layernorm` (after the attention), `pre_feedforward_layernorm`
/// and `post_feedforward_layernorm`.
fn gemma_block_name(p: BlockParam) -> &'static str {
    match p {
        BlockParam::PostAttnNorm => "post_attention_layernorm.weight",
        BlockParam::MlpNorm => "pre_feedforward_layernorm.weight",
        BlockParam::PostMlpNorm => "post_feedforward_layernorm.weight",
        other => llama_block_name(other),
    }
}

/// A parameter's name in `transformers`' Gemma 3 text layout
/// (`Gemma3ForCausalLM`).
pub(super) fn gemma_name(p: Param) -> String {
    match p {
        Param::Block(l, bp) => format!("model.layers.{l}.{}", gemma_block_name(bp)),
        other => llama_name(other),
    }
}

/// The names a multimodal Gemma 3 checkpoint stores the text model's
/// parameter `hf_name` under: `language_model.model.…` (`transformers` 4)
/// and `model.language_model.…` (5); its LM head, `language_model.lm_head`.
pub(super) fn gemma_multimodal_names(hf_name: &str) -> Vec<String> {
    match hf_name.strip_prefix("model.") {
        Some(rest) => vec![
            format!("language_model.model.{rest}"),
            format!("model.language_model.{rest}"),
        ],
        None => vec![format!("language_model.{hf_name}")],
    }
}
