//! Model families: one file per family of Hugging Face checkpoints upipe
//! reads (`llama.rs`, `qwen2.rs`, `qwen3.rs`, `mistral.rs`), behind one interface, [`Family`], that
//! the config, the decoder, the weights and checkpoint I/O ask:
//!
//! - its `config.json`: the `model_type` it answers to
//!   ([`Family::from_model_type`]), its parsing ([`Family::parse_hf`],
//!   through the keys every Llama-like family shares in `hf.rs`) and what
//!   [`ModelConfig::to_hf_json`] writes (`model_type`, `architectures`);
//! - its parameters: which a block has ([`Family::block_params`]) and their
//!   HF names ([`Family::hf_name`]), the names `model/weights.rs` and the
//!   checkpoint files use;
//! - its quirks, as methods the decoder asks: [`Family::qk_norm`],
//!   [`Family::qkv_bias`], [`Family::has_sliding_window`] (the window
//!   itself, and tied embeddings, are a checkpoint's `sliding_window` and
//!   `tie_word_embeddings`, read into [`ModelConfig::sliding_window`] and
//!   [`ModelConfig::tie_embeddings`] with the family's default);
//! - its presets ([`Family::preset`]).
//!
//! A new family (as `qwen2` came with q/k/v biases and YaRN, and `mistral`
//! with a sliding window) is a file here with its parse and presets, a variant of
//! [`Family`] (the compiler then names every match to extend), and the code
//! of its quirks: new [`BlockParam`]s for biases, a rope-scaling type in
//! `hf.rs`, a mask for the window.

mod hf;
mod llama;
mod mistral;
pub(in crate::model) mod presets;
mod qwen2;
mod qwen3;

use super::ModelConfig;
use super::unit::Unit;
use crate::error::{Error, Result};
use serde_json::{Map, Value};

pub(in crate::model) use hf::to_hf_json;

/// A family of decoders sharing a `config.json` schema, parameter names
/// and quirks.
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
}

/// Every family upipe reads, in the order messages list them.
pub const FAMILIES: &[Family] = &[Family::Llama, Family::Qwen3, Family::Qwen2, Family::Mistral];

/// `model_type`s of related families upipe does not read yet, with what
/// their decoder needs that upipe's lacks.
const NOT_YET: &[(&str, &str)] = &[];

impl Family {
    /// The family's name in messages: `Llama`, `Qwen3`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen3 => "Qwen3",
            Family::Qwen2 => "Qwen2",
            Family::Mistral => "Mistral",
        }
    }

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => llama::MODEL_TYPE,
            Family::Qwen3 => qwen3::MODEL_TYPE,
            Family::Qwen2 => qwen2::MODEL_TYPE,
            Family::Mistral => mistral::MODEL_TYPE,
        }
    }

    /// The `architectures` entry `transformers` loads it as.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => llama::ARCHITECTURE,
            Family::Qwen3 => qwen3::ARCHITECTURE,
            Family::Qwen2 => qwen2::ARCHITECTURE,
            Family::Mistral => mistral::ARCHITECTURE,
        }
    }

    /// The family of a `config.json`'s `model_type`; an unsupported one is
    /// an error listing the supported ones.
    pub fn from_model_type(model_type: &str) -> Result<Family> {
        if let Some(f) = FAMILIES.iter().find(|f| f.model_type() == model_type) {
            return Ok(*f);
        }
        let names: Vec<&str> = FAMILIES.iter().map(|f| f.name()).collect();
        if let Some((_, why)) = NOT_YET.iter().find(|(t, _)| *t == model_type) {
            return Err(Error::Config(format!(
                "model_type '{model_type}' {why}; use a {} checkpoint",
                names.join(" or ")
            )));
        }
        let listed: Vec<String> = FAMILIES
            .iter()
            .map(|f| format!("{} ('{}')", f.name(), f.model_type()))
            .collect();
        let listed = match listed.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => String::new(),
        };
        Err(Error::Config(format!(
            "unsupported model_type '{model_type}'; upipe reads {listed} configs"
        )))
    }

    /// Builds a config from the fields of a `config.json` object of this
    /// family (not yet validated).
    pub fn parse_hf(self, obj: &Map<String, Value>) -> Result<ModelConfig> {
        match self {
            Family::Llama => llama::parse_hf(obj),
            Family::Qwen3 => qwen3::parse_hf(obj),
            Family::Qwen2 => qwen2::parse_hf(obj),
            Family::Mistral => mistral::parse_hf(obj),
        }
    }

    /// The family's built-in preset called `name`, if it has one.
    pub fn preset(self, name: &str) -> Option<ModelConfig> {
        match self {
            Family::Llama => llama::preset(name),
            Family::Qwen3 => qwen3::preset(name),
            Family::Qwen2 => qwen2::preset(name),
            Family::Mistral => mistral::preset(name),
        }
    }

    /// Whether q and k are RMS-normalised per head before RoPE.
    pub fn qk_norm(self) -> bool {
        match self {
            Family::Llama | Family::Qwen2 | Family::Mistral => false,
            Family::Qwen3 => true,
        }
    }

    /// Whether its attention may slide (`sliding_window` in its
    /// `config.json`); a family without one refuses a window there.
    pub fn has_sliding_window(self) -> bool {
        match self {
            Family::Llama | Family::Qwen3 | Family::Qwen2 => false,
            Family::Mistral => true,
        }
    }

    /// Whether the q/k/v projections carry biases (`o_proj` never does).
    pub fn qkv_bias(self) -> bool {
        match self {
            Family::Llama | Family::Qwen3 | Family::Mistral => false,
            Family::Qwen2 => true,
        }
    }

    /// A block's parameters in HF order.
    pub fn block_params(self) -> &'static [BlockParam] {
        use BlockParam::*;
        match self {
            Family::Llama | Family::Mistral => &[AttnNorm, Wq, Wk, Wv, Wo, MlpNorm, Gate, Up, Down],
            Family::Qwen3 => &[
                AttnNorm, Wq, Wk, Wv, Wo, QNorm, KNorm, MlpNorm, Gate, Up, Down,
            ],
            Family::Qwen2 => &[
                AttnNorm, Wq, Bq, Wk, Bk, Wv, Bv, Wo, MlpNorm, Gate, Up, Down,
            ],
        }
    }

    /// The HF name of parameter `p` (`model.layers.3.mlp.up_proj.weight`).
    /// Every family so far names its parameters as `transformers`' Llama
    /// does; one that differs gets its own arm.
    pub fn hf_name(self, p: Param) -> String {
        match self {
            Family::Llama | Family::Qwen3 | Family::Qwen2 | Family::Mistral => hf::llama_name(p),
        }
    }

    /// Whether a tensor `transformers` writes under `name` is a buffer, not a
    /// parameter (older versions saved each layer's RoPE frequencies).
    pub fn is_buffer(self, name: &str) -> bool {
        match self {
            Family::Llama | Family::Qwen3 | Family::Qwen2 | Family::Mistral => {
                name.ends_with(".rotary_emb.inv_freq")
            }
        }
    }
}

/// A parameter of a decoder, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    /// The token embedding `[vocab, hidden]` (also the LM head when tied).
    Embed,
    /// Parameter `.1` of block `.0`.
    Block(usize, BlockParam),
    /// The final RMSNorm `[hidden]`.
    FinalNorm,
    /// The LM head `[vocab, hidden]` (absent when tied).
    LmHead,
}

impl Param {
    /// The [`Unit`] that holds it.
    pub fn unit(self) -> Unit {
        match self {
            Param::Embed => Unit::Embed,
            Param::Block(l, _) => Unit::Block(l),
            Param::FinalNorm | Param::LmHead => Unit::Head,
        }
    }
}

/// A parameter of one decoder block, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockParam {
    /// RMSNorm before attention `[hidden]`.
    AttnNorm,
    /// `[H·d, hidden]`.
    Wq,
    /// `[Hkv·d, hidden]`.
    Wk,
    /// `[Hkv·d, hidden]`.
    Wv,
    /// The q projection's bias `[H·d]` (Qwen2).
    Bq,
    /// The k projection's bias `[Hkv·d]` (Qwen2).
    Bk,
    /// The v projection's bias `[Hkv·d]` (Qwen2).
    Bv,
    /// `[hidden, H·d]`.
    Wo,
    /// Per-head RMSNorm of q `[d]` (QK-norm families).
    QNorm,
    /// Per-head RMSNorm of k `[d]` (QK-norm families).
    KNorm,
    /// RMSNorm before the MLP `[hidden]`.
    MlpNorm,
    /// `[ffn, hidden]`.
    Gate,
    /// `[ffn, hidden]`.
    Up,
    /// `[hidden, ffn]`.
    Down,
}

impl BlockParam {
    /// Its shape in a model of `cfg`'s dimensions.
    pub fn shape(self, cfg: &ModelConfig) -> Vec<usize> {
        let (h, hd, ffn) = (cfg.hidden, cfg.head_dim, cfg.ffn);
        let (q, kv) = (cfg.heads * hd, cfg.kv_heads * hd);
        match self {
            BlockParam::AttnNorm | BlockParam::MlpNorm => vec![h],
            BlockParam::Wq => vec![q, h],
            BlockParam::Wk | BlockParam::Wv => vec![kv, h],
            BlockParam::Bq => vec![q],
            BlockParam::Bk | BlockParam::Bv => vec![kv],
            BlockParam::Wo => vec![h, q],
            BlockParam::QNorm | BlockParam::KNorm => vec![hd],
            BlockParam::Gate | BlockParam::Up => vec![ffn, h],
            BlockParam::Down => vec![h, ffn],
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
