//! The dimensions of one attention layer ([`AttnDims`]): heads, kv heads,
//! head size, QK norm and RoPE.

use super::rope::RopeConfig;
use crate::backend::RmsNorm;
use crate::backend::fp8::Precision;
use crate::error::Result;

/// Dimensions of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The QK-norm's RMSNorm (the model's eps and weight offset).
    pub norm: RmsNorm,
    pub rope: RopeConfig,
    /// The scale of the attention scores, `softmax(scale·q·kᵀ)`: the
    /// model's, [`default_softmax_scale`](Self::default_softmax_scale) for
    /// most.
    pub softmax_scale: f32,
    /// What the q/k/v/o projections' GEMMs compute in (`--precision`).
    pub precision: Precision,
}

impl AttnDims {
    /// Checks the dimensions once.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 || self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return crate::config_err!("attention dimensions must be positive: {self:?}");
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return crate::config_err!(
                "{} heads must be a multiple of {} kv heads (GQA groups)",
                self.heads,
                self.kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return crate::config_err!("head_dim {} must be even for RoPE", self.head_dim);
        }
        if !(self.softmax_scale.is_finite() && self.softmax_scale > 0.0) {
            return crate::config_err!(
                "the attention softmax scale {} must be finite and positive",
                self.softmax_scale
            );
        }
        Ok(())
    }
    /// The usual softmax scale of heads of `head_dim`: `1/sqrt(head_dim)`.
    pub fn default_softmax_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
    }
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
