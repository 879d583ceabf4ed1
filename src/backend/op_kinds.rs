//! The kinds the parameterised elementwise ops take: which RMSNorm
//! ([`RmsNorm`]) and which gated activation ([`GatedAct`]) a model's block
//! runs. A family names its kinds in its spec; every device computes each
//! kind with the same formula.

/// An RMSNorm over the last dimension:
/// `y = x / sqrt(mean(x²) + eps) · (w + weight_offset)`.
///
/// Llama-like families scale by `w` (`weight_offset` 0); Gemma stores its
/// norm weights around zero and scales by `1 + w` (`weight_offset` 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNorm {
    /// Added to the mean square before the root.
    pub eps: f32,
    /// Added to each weight before it scales the normalised row.
    pub weight_offset: f32,
}

impl RmsNorm {
    /// The norm Llama-like families run: `x / rms(x) · w`.
    pub fn plain(eps: f32) -> Self {
        RmsNorm {
            eps,
            weight_offset: 0.0,
        }
    }

    /// The factor a weight `w` scales by: `w`, or `w + weight_offset` where
    /// there is an offset (no addition at all without one, so a plain
    /// norm's arithmetic is exactly `x · r · w`).
    #[inline]
    pub fn weight(self, w: f32) -> f32 {
        if self.weight_offset == 0.0 {
            w
        } else {
            w + self.weight_offset
        }
    }
}

/// The activation of a gated MLP, `out = act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GatedAct {
    /// `silu(g) = g · sigmoid(g)` (SwiGLU: Llama, Qwen, Mistral).
    Silu,
    /// GELU by its tanh approximation,
    /// `0.5 · g · (1 + tanh(√(2/π) · (g + 0.044715 g³)))` (GeGLU: Gemma's
    /// `gelu_pytorch_tanh`).
    GeluTanh,
}

/// `√(2/π)`, the tanh GELU's inner scale.
const GELU_K: f32 = 0.797_884_6;
/// The tanh GELU's cubic coefficient.
const GELU_C: f32 = 0.044_715;

impl GatedAct {
    /// Its name in messages and in a `config.json` (`hidden_act`).
    pub fn hf_name(self) -> &'static str {
        match self {
            GatedAct::Silu => "silu",
            GatedAct::GeluTanh => "gelu_pytorch_tanh",
        }
    }

    /// The code the CUDA kernels take for it.
    pub fn code(self) -> i32 {
        match self {
            GatedAct::Silu => 0,
            GatedAct::GeluTanh => 1,
        }
    }

    /// `act(g) · u`, in f32 (the CPU reference's arithmetic).
    #[inline]
    pub fn forward(self, g: f32, u: f32) -> f32 {
        match self {
            GatedAct::Silu => g / (1.0 + (-g).exp()) * u,
            GatedAct::GeluTanh => {
                let t = (GELU_K * (g + GELU_C * g * g * g)).tanh();
                0.5 * g * (1.0 + t) * u
            }
        }
    }

    /// The gradients `(d gate, d up)` of `act(g) · u` given `d out`.
    #[inline]
    pub fn backward(self, g: f32, u: f32, d: f32) -> (f32, f32) {
        match self {
            GatedAct::Silu => {
                let s = 1.0 / (1.0 + (-g).exp());
                (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
            }
            GatedAct::GeluTanh => {
                let t = (GELU_K * (g + GELU_C * g * g * g)).tanh();
                let act = 0.5 * g * (1.0 + t);
                let dt = (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * g * g);
                let dact = 0.5 * (1.0 + t) + 0.5 * g * dt;
                (d * u * dact, d * act)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradients equal central differences of the forward
    /// (in f64 arithmetic of the same formulas).
    #[test]
    fn gated_gradients_match_finite_differences() {
        for act in [GatedAct::Silu, GatedAct::GeluTanh] {
            for &g in &[-4.0f32, -1.3, -0.2, 0.0, 0.4, 1.7, 3.5] {
                let (u, d) = (0.7f32, 1.3f32);
                let (dg, du) = act.backward(g, u, d);
                let h = 1e-3f32;
                let num_g = (act.forward(g + h, u) - act.forward(g - h, u)) / (2.0 * h) * d;
                let num_u = (act.forward(g, u + h) - act.forward(g, u - h)) / (2.0 * h) * d;
                assert!((dg - num_g).abs() < 2e-3, "{act:?} g={g}: {dg} vs {num_g}");
                assert!((du - num_u).abs() < 2e-3, "{act:?} g={g}: {du} vs {num_u}");
            }
        }
    }

    /// The tanh GELU at known points (PyTorch's `gelu(approximate='tanh')`).
    #[test]
    fn gelu_tanh_takes_known_values() {
        let act = GatedAct::GeluTanh;
        for (g, want) in [
            (0.0f32, 0.0f32),
            (1.0, 0.841_192),
            (-1.0, -0.158_808),
            (2.0, 1.954_598),
        ] {
            let y = act.forward(g, 1.0);
            assert!((y - want).abs() < 1e-5, "gelu_tanh({g}) = {y}, want {want}");
        }
    }

    #[test]
    fn a_plain_norm_weight_is_untouched() {
        let n = RmsNorm::plain(1e-6);
        assert_eq!(n.weight(-0.0).to_bits(), (-0.0f32).to_bits());
        let g = RmsNorm {
            eps: 1e-6,
            weight_offset: 1.0,
        };
        assert_eq!(g.weight(0.25), 1.25);
    }
}
