//! A family's block, declared: [`BlockSpec`]. Each family file states its
//! spec as a constant, and the decoder, the evaluation forward, the
//! weights, gradients, FLOPs, checkpoints and the planner read it (through
//! [`Family::spec`](super::Family::spec) and `ModelConfig`), never the
//! family's name.

use super::params::BlockParam;
use crate::backend::GatedAct;

/// How a family's attention may slide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowRule {
    /// Every layer attends causally over the whole window (Llama, Qwen).
    Never,
    /// One optional `sliding_window` for every layer (Mistral).
    Uniform,
    /// A `sliding_window` for the layers `layer_types` marks
    /// `sliding_attention`, each with the local RoPE base, the rest full
    /// (Gemma 3).
    PerLayer,
}

/// How one layer of a per-layer family attends (`layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// `full_attention`: causal over the whole window, the global RoPE.
    Full,
    /// `sliding_attention`: the model's `sliding_window`, the local RoPE.
    Sliding,
}

impl LayerType {
    /// Its name in a `config.json`'s `layer_types`.
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

/// What a family's decoder block is made of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockSpec {
    /// Added to every RMSNorm weight before it scales (`RmsNorm::weight_offset`:
    /// Gemma's `1 + w`).
    pub norm_weight_offset: f32,
    /// The gated MLP's activation.
    pub activation: GatedAct,
    /// Biases on the q/k/v projections (`o_proj` never has one).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
    /// An RMSNorm of each branch's output before its residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`: Gemma's
    /// sandwich), beside the norms of each branch's input.
    pub post_norms: bool,
    /// The embedding's rows scaled by `√hidden` (rounded to the compute
    /// dtype, as `transformers` stores the scale).
    pub scaled_embedding: bool,
    /// How its attention may slide.
    pub window: WindowRule,
    /// Name prefixes of tensors its checkpoints may hold that belong to no
    /// part of the text model upipe trains (a multimodal checkpoint's
    /// vision tower and projector): skipped on load, never refused.
    pub skipped_prefixes: &'static [&'static str],
}

impl BlockSpec {
    /// The plain Llama block: RMSNorm `w`, SwiGLU, no biases, no QK-norm,
    /// pre-norms only, unscaled embedding, full attention.
    pub const LLAMA: BlockSpec = BlockSpec {
        norm_weight_offset: 0.0,
        activation: GatedAct::Silu,
        qkv_bias: false,
        qk_norm: false,
        post_norms: false,
        scaled_embedding: false,
        window: WindowRule::Never,
        skipped_prefixes: &[],
    };

    /// Whether a checkpoint's tensor `name` belongs to another part of the
    /// checkpoint than the text model ([`skipped_prefixes`](Self::skipped_prefixes)).
    pub fn skips(&self, name: &str) -> bool {
        self.skipped_prefixes.iter().any(|p| name.starts_with(p))
    }

    /// A block's parameters in the order its checkpoints list them.
    pub fn block_params(&self) -> Vec<BlockParam> {
        use BlockParam::*;
        let mut v = vec![AttnNorm, Wq];
        if self.qkv_bias {
            v.push(Bq);
        }
        v.push(Wk);
        if self.qkv_bias {
            v.push(Bk);
        }
        v.push(Wv);
        if self.qkv_bias {
            v.push(Bv);
        }
        v.push(Wo);
        if self.qk_norm {
            v.extend([QNorm, KNorm]);
        }
        if self.post_norms {
            v.push(PostAttnNorm);
        }
        v.extend([MlpNorm, Gate, Up, Down]);
        if self.post_norms {
            v.push(PostMlpNorm);
        }
        v
    }
}
