//! Rotary position embedding tables, with linear, Llama-3 or YaRN frequency
//! scaling.

use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// A `rope_scaling` (`rope_parameters`) of a `config.json`: how the
/// rotation frequencies are changed for a longer context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Meta's Llama 3.1 scaling (`rope_type: llama3`).
    Llama3(Llama3Scaling),
    /// YaRN (`rope_type: yarn`; Qwen2.5's long-context setting).
    Yarn(YarnScaling),
    /// Every frequency divided by the factor (`rope_type: linear`; Gemma 3's
    /// global layers).
    Linear(f32),
}

impl RopeScaling {
    /// Its `factor`: how many times the original context it stretches to.
    pub fn factor(&self) -> f32 {
        match self {
            RopeScaling::Llama3(s) => s.factor,
            RopeScaling::Yarn(y) => y.factor,
            RopeScaling::Linear(f) => *f,
        }
    }
}

/// Llama-3 style RoPE frequency scaling (`rope_scaling` with `rope_type: llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// YaRN scaling (`rope_type: yarn`), the fields `transformers`'
/// `_compute_yarn_parameters` reads; `None` where the config leaves a field
/// out (its default applies, and a checkpoint writes it out again).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnScaling {
    /// `factor`: the context extension (interpolated frequencies are divided by it).
    pub factor: f32,
    /// `original_max_position_embeddings` (default: `max_position_embeddings`,
    /// filled in when the config is read).
    pub original_max_position_embeddings: usize,
    /// Whether the config gave `original_max_position_embeddings` itself.
    pub original_given: bool,
    /// `beta_fast` (default 32): rotations above which a dimension is kept.
    pub beta_fast: Option<f32>,
    /// `beta_slow` (default 1): rotations below which it is interpolated.
    pub beta_slow: Option<f32>,
    /// `attention_factor`: the scale of cos and sin (default from `mscale`).
    pub attention_factor: Option<f32>,
    /// `mscale` and `mscale_all_dim` (DeepSeek's form of the attention factor).
    pub mscale: Option<f32>,
    pub mscale_all_dim: Option<f32>,
    /// `truncate` (default true): round the ramp's ends to whole dimensions.
    pub truncate: Option<bool>,
}

impl YarnScaling {
    /// The scale `transformers` applies to cos and sin: `attention_factor`
    /// when given, else `get_mscale(factor, mscale) / get_mscale(factor,
    /// mscale_all_dim)` when both are given and nonzero, else
    /// `get_mscale(factor)` = `0.1 ln(factor) + 1` (1 for factor ≤ 1).
    pub fn attention_factor(&self) -> f64 {
        fn get_mscale(scale: f64, mscale: f64) -> f64 {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * mscale * scale.ln() + 1.0
            }
        }
        let factor = f64::from(self.factor);
        if let Some(a) = self.attention_factor {
            return f64::from(a);
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(factor, f64::from(m)) / get_mscale(factor, f64::from(all))
            }
            _ => get_mscale(factor, 1.0),
        }
    }

    /// What is out of range, with the fix (`None` when every field is in
    /// range; a zero beta or attention factor means the default, as in Python).
    pub fn invalid(&self) -> Option<String> {
        let bad = |v: f32| !(v.is_finite() && v > 0.0);
        if bad(self.factor) {
            return Some(format!(
                "rope_scaling.factor is {}; it must be a positive finite number",
                self.factor
            ));
        }
        for (what, v) in [
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
            ("attention_factor", self.attention_factor),
        ] {
            if let Some(v) = v.filter(|&v| v != 0.0 && bad(v)) {
                return Some(format!(
                    "rope_scaling.{what} is {v}; it must be a positive finite number"
                ));
            }
        }
        (self.original_max_position_embeddings == 0).then(|| {
            "rope_scaling.original_max_position_embeddings is 0; Qwen2.5 uses 32768".to_string()
        })
    }

    /// The `head_dim / 2` inverse frequencies of `_compute_yarn_parameters`:
    /// each dimension's extrapolated frequency `θ^(-2i/d)` blended with the
    /// interpolated one (divided by `factor`) by a linear ramp between the
    /// dimensions that turn `beta_fast` and `beta_slow` times over the
    /// original context.
    pub fn inv_freq(&self, theta: f64, head_dim: usize) -> Vec<f64> {
        let dim = head_dim as f64;
        let orig = self.original_max_position_embeddings as f64;
        let correction_dim = |rotations: f64| {
            dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        // `beta_fast or 32`: a zero falls back to the default as in Python
        let beta_fast = self.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0);
        let beta_slow = self.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0);
        let (mut low, mut high) = (
            correction_dim(f64::from(beta_fast)),
            correction_dim(f64::from(beta_slow)),
        );
        if self.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001; // transformers' guard against a zero-width ramp
        }
        let factor = f64::from(self.factor);
        (0..head_dim / 2)
            .map(|i| {
                let extrapolated = 1.0 / theta.powf(2.0 * i as f64 / dim);
                let interpolated = extrapolated / factor;
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }
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
        if let Some(RopeScaling::Yarn(y)) = self.scaling {
            return y.inv_freq(f64::from(self.theta), head_dim);
        }
        let half = head_dim / 2;
        (0..half)
            .map(|i| {
                let f = 1.0 / (self.theta as f64).powf(2.0 * i as f64 / head_dim as f64);
                match self.scaling {
                    Some(RopeScaling::Llama3(s)) => llama3_scale(f, s),
                    Some(RopeScaling::Linear(factor)) => f / f64::from(factor),
                    Some(RopeScaling::Yarn(_)) | None => f,
                }
            })
            .collect()
    }

    /// The factor cos and sin are multiplied by (YaRN's attention scaling;
    /// 1 otherwise): q·k is scaled by its square.
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            Some(RopeScaling::Yarn(y)) => y.attention_factor(),
            Some(RopeScaling::Llama3(_) | RopeScaling::Linear(_)) | None => 1.0,
        }
    }

    /// `(cos, sin)` host tables `[positions.len(), head_dim/2]` for the given
    /// positions (times [`attention_factor`](Self::attention_factor)).
    pub fn tables(&self, head_dim: usize, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let inv = self.inv_freq(head_dim);
        let scale = self.attention_factor();
        let mut cos = Vec::with_capacity(positions.len() * inv.len());
        let mut sin = Vec::with_capacity(positions.len() * inv.len());
        for &p in positions {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push((a.cos() * scale) as f32);
                sin.push((a.sin() * scale) as f32);
            }
        }
        (cos, sin)
    }
}

fn llama3_scale(f: f64, s: Llama3Scaling) -> f64 {
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
        let shape = rope_table(n, head_dim);
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

/// Rows of the RoPE tables a rank holds (`cos` and `sin`, `[n, d/2]` F32 each).
pub fn rope_table(n: usize, head_dim: usize) -> [usize; 2] {
    [n, head_dim / 2]
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
            scaling: Some(RopeScaling::Llama3(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })),
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

    fn yarn(factor: f32, orig: usize) -> YarnScaling {
        YarnScaling {
            factor,
            original_max_position_embeddings: orig,
            original_given: true,
            beta_fast: None,
            beta_slow: None,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: None,
        }
    }

    /// θ = 10⁴, d = 16, factor 4 over an original context of 64: the ramp
    /// runs from dimension floor(16 ln(64/(32·2π)) / (2 ln θ)) → 0 to
    /// ceil(16 ln(64/(2π)) / (2 ln θ)) = ceil(2.016) = 3, so pair 0 keeps its
    /// frequency, pairs 1 and 2 blend (ramp 1/3, 2/3) and pairs 3.. are
    /// divided by 4.
    #[test]
    fn yarn_frequencies_follow_the_ramp_formula() {
        let theta = 10_000f64;
        let ext = |i: usize| theta.powf(-(2.0 * i as f64) / 16.0);
        let got = yarn(4.0, 64).inv_freq(theta, 16);
        let mut want = vec![
            1.0,
            (1.0 / 3.0) * ext(1) / 4.0 + (2.0 / 3.0) * ext(1),
            (2.0 / 3.0) * ext(2) / 4.0 + (1.0 / 3.0) * ext(2),
        ];
        want.extend((3..8).map(|i| ext(i) / 4.0));
        assert_eq!(got.len(), 8);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-15 * w.abs(), "pair {i}: {g} vs {w}");
        }
        // untruncated ends: the ramp runs from 0 to 2.016 (the exact dimension)
        let untruncated = YarnScaling {
            truncate: Some(false),
            ..yarn(4.0, 64)
        };
        let high = 16.0 * (64.0 / (2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let got = untruncated.inv_freq(theta, 16);
        let r = 1.0 / high;
        let w1 = r * ext(1) / 4.0 + (1.0 - r) * ext(1);
        assert!((got[1] - w1).abs() <= 1e-15, "{} vs {w1}", got[1]);
        assert!((got[3] - ext(3) / 4.0).abs() <= 1e-18);
    }

    #[test]
    fn yarn_attention_factor_is_mscale_unless_given() {
        let f = |y: YarnScaling| y.attention_factor();
        assert!((f(yarn(4.0, 64)) - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        assert_eq!(f(yarn(1.0, 64)), 1.0, "no extension: no scaling");
        let given = YarnScaling {
            attention_factor: Some(0.5),
            ..yarn(4.0, 64)
        };
        assert_eq!(f(given), 0.5);
        let deepseek = YarnScaling {
            mscale: Some(1.0),
            mscale_all_dim: Some(0.5),
            ..yarn(40.0, 4096)
        };
        let m = |k: f64| 0.1 * k * 40f64.ln() + 1.0;
        assert!((f(deepseek) - m(1.0) / m(0.5)).abs() < 1e-12);
        // cos and sin carry the factor
        let cfg = RopeConfig {
            theta: 10_000.0,
            scaling: Some(RopeScaling::Yarn(yarn(4.0, 64))),
        };
        let (cos, sin) = cfg.tables(16, &[0]);
        let scale = (0.1 * 4f64.ln() + 1.0) as f32;
        assert!(cos.iter().all(|&c| c == scale) && sin.iter().all(|&s| s == 0.0));
    }
}
