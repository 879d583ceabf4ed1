//! Decoder parameters in Hugging Face layout and naming. The same struct holds
//! F32 gradients (same shapes).

use super::config::ModelConfig;
use crate::attention::AttentionWeights;
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// One decoder block.
pub struct BlockWeights<B: Backend> {
    /// `input_layernorm [hidden]`.
    pub attn_norm: Tensor<B>,
    pub attn: AttentionWeights<B>,
    /// `post_attention_layernorm [hidden]`.
    pub mlp_norm: Tensor<B>,
    /// `[ffn, hidden]`.
    pub gate: Tensor<B>,
    /// `[ffn, hidden]`.
    pub up: Tensor<B>,
    /// `[hidden, ffn]`.
    pub down: Tensor<B>,
}

/// All parameters (or gradients) of a decoder.
pub struct ModelWeights<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed: Tensor<B>,
    pub blocks: Vec<BlockWeights<B>>,
    /// `model.norm [hidden]`.
    pub final_norm: Tensor<B>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Tensor<B>>,
}

impl<B: Backend> ModelWeights<B> {
    /// Builds every tensor from `init(hf_name, shape)`.
    pub fn build(
        b: &B,
        cfg: &ModelConfig,
        dtype: DType,
        cat: Category,
        mut init: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let (q, kv) = (cfg.heads * hd, cfg.kv_heads * hd);
        let mut t = |name: String, shape: &[usize]| -> Result<Tensor<B>> {
            let v = init(&name, shape)?;
            b.from_host(&v, shape, dtype, cat)
        };
        let embed = t("model.embed_tokens.weight".into(), &[cfg.vocab, h])?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            blocks.push(BlockWeights {
                attn_norm: t(p("input_layernorm.weight"), &[h])?,
                attn: AttentionWeights {
                    wq: t(p("self_attn.q_proj.weight"), &[q, h])?,
                    wk: t(p("self_attn.k_proj.weight"), &[kv, h])?,
                    wv: t(p("self_attn.v_proj.weight"), &[kv, h])?,
                    wo: t(p("self_attn.o_proj.weight"), &[h, q])?,
                    q_norm: if cfg.qk_norm {
                        Some(t(p("self_attn.q_norm.weight"), &[hd])?)
                    } else {
                        None
                    },
                    k_norm: if cfg.qk_norm {
                        Some(t(p("self_attn.k_norm.weight"), &[hd])?)
                    } else {
                        None
                    },
                },
                mlp_norm: t(p("post_attention_layernorm.weight"), &[h])?,
                gate: t(p("mlp.gate_proj.weight"), &[cfg.ffn, h])?,
                up: t(p("mlp.up_proj.weight"), &[cfg.ffn, h])?,
                down: t(p("mlp.down_proj.weight"), &[h, cfg.ffn])?,
            });
        }
        let final_norm = t("model.norm.weight".into(), &[h])?;
        let lm_head = if cfg.tie_embeddings {
            None
        } else {
            Some(t("lm_head.weight".into(), &[cfg.vocab, h])?)
        };
        Ok(ModelWeights {
            embed,
            blocks,
            final_norm,
            lm_head,
        })
    }

    /// Zero F32 gradients shaped like the model.
    pub fn zeros_grads(b: &B, cfg: &ModelConfig) -> Result<Self> {
        Self::build(b, cfg, DType::F32, Category::Grads, |_, s| {
            Ok(vec![0.0; s.iter().product()])
        })
    }

    /// Seeded random initialisation (normal(0, 0.02) matrices, unit norms), HF style.
    pub fn random(b: &B, cfg: &ModelConfig, seed: u64) -> Result<Self> {
        let mut rng = crate::rng::Rng::new(seed);
        Self::build(
            b,
            cfg,
            b.compute_dtype(),
            Category::Weights,
            |name, shape| {
                let n = shape.iter().product();
                Ok(if shape.len() == 1 && name.ends_with("norm.weight") {
                    vec![1.0; n]
                } else {
                    rng.normal_vec(n, 0.02)
                })
            },
        )
    }

    /// The LM head matrix (the embedding when tied).
    pub fn head(&self) -> &Tensor<B> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
    /// Mutable LM head (the embedding when tied).
    pub fn head_mut(&mut self) -> &mut Tensor<B> {
        self.lm_head.as_mut().unwrap_or(&mut self.embed)
    }

    /// Every tensor with its HF name, in model order.
    pub fn named(&self) -> Vec<(String, &Tensor<B>)> {
        let mut v = vec![("model.embed_tokens.weight".to_string(), &self.embed)];
        for (i, blk) in self.blocks.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            v.push((p("input_layernorm.weight"), &blk.attn_norm));
            for (short, t) in blk.attn.named() {
                v.push((p(&attn_name(short)), t));
            }
            v.push((p("post_attention_layernorm.weight"), &blk.mlp_norm));
            v.push((p("mlp.gate_proj.weight"), &blk.gate));
            v.push((p("mlp.up_proj.weight"), &blk.up));
            v.push((p("mlp.down_proj.weight"), &blk.down));
        }
        v.push(("model.norm.weight".to_string(), &self.final_norm));
        if let Some(t) = &self.lm_head {
            v.push(("lm_head.weight".to_string(), t));
        }
        v
    }

    /// Every tensor, mutable, in the order of [`named`](Self::named).
    pub fn named_mut(&mut self) -> Vec<(String, &mut Tensor<B>)> {
        let mut v = vec![("model.embed_tokens.weight".to_string(), &mut self.embed)];
        for (i, blk) in self.blocks.iter_mut().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            v.push((p("input_layernorm.weight"), &mut blk.attn_norm));
            for (short, t) in blk.attn.named_mut() {
                v.push((p(&attn_name(short)), t));
            }
            v.push((p("post_attention_layernorm.weight"), &mut blk.mlp_norm));
            v.push((p("mlp.gate_proj.weight"), &mut blk.gate));
            v.push((p("mlp.up_proj.weight"), &mut blk.up));
            v.push((p("mlp.down_proj.weight"), &mut blk.down));
        }
        v.push(("model.norm.weight".to_string(), &mut self.final_norm));
        if let Some(t) = self.lm_head.as_mut() {
            v.push(("lm_head.weight".to_string(), t));
        }
        v
    }
}

/// HF name of an attention tensor inside a layer.
fn attn_name(short: &str) -> String {
    match short {
        "wq" => "self_attn.q_proj.weight".into(),
        "wk" => "self_attn.k_proj.weight".into(),
        "wv" => "self_attn.v_proj.weight".into(),
        "wo" => "self_attn.o_proj.weight".into(),
        other => format!("self_attn.{other}.weight"),
    }
}
