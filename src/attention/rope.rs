//! Rotary position embedding tables, with Llama-3 frequency scaling.

use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// Llama-3 style RoPE frequency scaling (`rope_scaling` with `rope_type: llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// RoPE parameters of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub scaling: Option<RopeScaling>,
}

impl RopeConfig {
    /// Inverse frequencies for the `head_dim / 2` rotation pairs.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f64> {
        let half = head_dim / 2;
        (0..half)
            .map(|i| {
                let f = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / head_dim as f64);
                match self.scaling {
                    None => f,
                    Some(s) => llama3_scale(f, s),
                }
            })
            .collect()
    }

    /// `(cos, sin)` host tables `[positions.len(), head_dim/2]` for the given positions.
    pub fn tables(&self, head_dim: usize, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let inv = self.inv_freq(head_dim);
        let mut cos = Vec::with_capacity(positions.len() * inv.len());
        let mut sin = Vec::with_capacity(positions.len() * inv.len());
        for &p in positions {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        (cos, sin)
    }
}

fn llama3_scale(f: f64, s: RopeScaling) -> f64 {
    let orig = s.original_max_position_embeddings as f64;
    let low_wavelen = orig / s.low_freq_factor as f64;
    let high_wavelen = orig / s.high_freq_factor as f64;
    let wavelen = 2.0 * std::f64::consts::PI / f;
    if wavelen < high_wavelen {
        f
    } else if wavelen > low_wavelen {
        f / s.factor as f64
    } else {
        let smooth = (orig / wavelen - s.low_freq_factor as f64)
            / (s.high_freq_factor - s.low_freq_factor) as f64;
        (1.0 - smooth) * f / s.factor as f64 + smooth * f
    }
}

/// Device-resident RoPE tables for one list of positions.
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B>,
    pub sin: Tensor<B>,
}

impl<B: Backend> RopeTables<B> {
    /// Uploads tables for `positions` (category `Workspace`: they live as
    /// long as the layer setup); a rehearsing backend allocates them
    /// unwritten, without computing them (at 1M tokens most of a counted
    /// step's time went to the tables' sines and cosines).
    pub fn new(b: &B, cfg: &RopeConfig, head_dim: usize, positions: &[usize]) -> Result<Self> {
        Self::of(b, cfg, head_dim, positions.len(), || positions.to_vec())
    }

    /// [`new`](Self::new) for the `n` positions `positions()` lists, which
    /// a rehearsal never asks for.
    pub fn of(
        b: &B,
        cfg: &RopeConfig,
        head_dim: usize,
        n: usize,
        positions: impl FnOnce() -> Vec<usize>,
    ) -> Result<Self> {
        let shape = super::shapes::rope_table(n, head_dim);
        if b.rehearsing() {
            return Ok(RopeTables {
                cos: b.zeros(&shape, DType::F32, Category::Workspace)?,
                sin: b.zeros(&shape, DType::F32, Category::Workspace)?,
            });
        }
        let (cos, sin) = cfg.tables(head_dim, &positions());
        Ok(RopeTables {
            cos: b.from_host(&cos, &shape, DType::F32, Category::Workspace)?,
            sin: b.from_host(&sin, &shape, DType::F32, Category::Workspace)?,
        })
    }
}

impl<B: Backend> RopeTables<B> {
    /// Rewrites the tables in place for `positions` (as many as the tables
    /// hold): a window's positions within its documents.
    pub fn rewrite(
        &mut self,
        b: &B,
        cfg: &RopeConfig,
        head_dim: usize,
        positions: &[usize],
    ) -> Result<()> {
        let (cos, sin) = cfg.tables(head_dim, positions);
        b.upload(&mut self.cos, &cos)?;
        b.upload(&mut self.sin, &sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let base = RopeConfig {
            theta: 500000.0,
            scaling: None,
        };
        let scaled = RopeConfig {
            scaling: Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..base
        };
        let (a, b) = (base.inv_freq(128), scaled.inv_freq(128));
        assert_eq!(a[0], b[0], "highest frequency unchanged");
        assert!(
            (a[63] / b[63] - 8.0).abs() < 1e-9,
            "lowest frequency divided by the factor"
        );
        assert!(a.iter().zip(&b).all(|(x, y)| y <= x));
    }
}
