//! A decoder's attention layers: one [`CpAttention`] for each distinct way
//! its layers attend (window and RoPE: [`ModelConfig::layer_attention`]),
//! and which one each layer uses. A Llama has one; Gemma 3 two (sliding
//! local layers and global ones).

use super::config::{LayerAttention, ModelConfig};
use crate::attention::{AttnDims, CpAttention, CpPlan};
use crate::backend::Backend;
use crate::comm::Mesh;
use crate::error::Result;

/// The attention of each layer of a decoder, one [`CpAttention`] per
/// distinct [`LayerAttention`].
pub struct LayerAttentions<B: Backend> {
    /// Each distinct way of attending with its layer.
    kinds: Vec<(LayerAttention, CpAttention<B>)>,
    /// The index into `kinds` of each layer.
    of_layer: Vec<usize>,
}

impl<B: Backend> LayerAttentions<B> {
    /// The layers of `cfg` on `plan`'s rank of `mesh`, attending over one
    /// stream window (one document).
    pub fn new(b: &B, cfg: &ModelConfig, plan: CpPlan, mesh: &Mesh<B>) -> Result<Self> {
        let seq = plan.layout.seq;
        let mut kinds: Vec<(LayerAttention, CpAttention<B>)> = Vec::new();
        let mut of_layer = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let la = cfg.layer_attention(l);
            if let Some(i) = kinds.iter().position(|(k, _)| *k == la) {
                of_layer.push(i);
                continue;
            }
            let mut dims = attn_dims(cfg);
            dims.rope = la.rope;
            let mask = super::window_mask(&[0], seq, la.window)?;
            let attn = CpAttention::new(b, dims, plan.clone(), mesh, mask)?;
            of_layer.push(kinds.len());
            kinds.push((la, attn));
        }
        Ok(LayerAttentions { kinds, of_layer })
    }

    /// Runs every layer's q/k/v/o projections in `precision`.
    pub fn set_precision(&mut self, precision: crate::backend::fp8::Precision) {
        for (_, attn) in &mut self.kinds {
            attn.dims.precision = precision;
        }
    }

    /// Layer `l`'s attention.
    pub fn layer(&self, l: usize) -> &CpAttention<B> {
        &self.kinds[self.of_layer[l]].1
    }

    /// Attends under the masks of the next window, whose documents start at
    /// `doc_starts`, each layer bounded by its own window.
    pub fn set_window(&mut self, b: &B, doc_starts: &[u32]) -> Result<()> {
        for (la, attn) in &mut self.kinds {
            let mask = super::window_mask(doc_starts, attn.plan.layout.seq, la.window)?;
            attn.set_mask(b, mask)?;
        }
        Ok(())
    }

    /// The share of the `S²` scores the current window's masks compute,
    /// the mean over the layers (`AttnMask::flop_fraction`).
    pub fn flop_fraction(&self, seq: usize) -> f64 {
        if let [(_, attn)] = &self.kinds[..] {
            return attn.mask().flop_fraction(seq);
        }
        let total: f64 = self
            .of_layer
            .iter()
            .map(|&i| self.kinds[i].1.mask().flop_fraction(seq))
            .sum();
        total / self.of_layer.len().max(1) as f64
    }
}

/// The attention dimensions of a model config.
pub fn attn_dims(cfg: &ModelConfig) -> AttnDims {
    AttnDims {
        hidden: cfg.hidden,
        heads: cfg.heads,
        kv_heads: cfg.kv_heads,
        head_dim: cfg.head_dim,
        qk_norm: cfg.qk_norm(),
        norm: cfg.norm(),
        rope: crate::attention::rope::RopeConfig {
            theta: cfg.rope_theta,
            scaling: cfg.rope_scaling,
        },
        softmax_scale: cfg.softmax_scale(),
        precision: crate::backend::fp8::Precision::Bf16,
    }
}
