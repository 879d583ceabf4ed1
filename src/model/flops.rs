//! Model FLOPs: the arithmetic a model needs per token, whatever the engine
//! recomputes (activation checkpointing's second forward is not counted,
//! nor segment checkpointing's third, `--checkpoint-every`), so model
//! TFLOP/s compare runs under any memory policy.
//!
//! For a decoder of `L` layers, `H` query heads of width `d`, trained on
//! sequences of `S` tokens:
//!
//! - matrix multiplies: `N` parameters that multiply activations, every
//!   parameter but the input embedding table (a tied LM head counts the
//!   shared matrix once, as the head). A multiply-add per parameter and
//!   token is 2 FLOPs forward and 4 backward: **6·N per token**.
//! - causal attention: `Q·Kᵀ` and `P·V` are `2·S²·d` FLOPs each per head and
//!   layer, times the mask's share of the `S²` scores
//!   ([`AttnMask::flop_fraction`], ½ for the causal
//!   [`WINDOW_MASK`](super::WINDOW_MASK); only the band of a model with a
//!   sliding window, [`stream_mask`](super::stream_mask)): **2·S²·H·d per
//!   layer forward** (causal), and
//!   forward plus backward counted as 3.5 forwards (the backward's five
//!   `S²` products, two of them recomputing the forward's): per token
//!   `3.5 · 2·S·H·d · L = 7·S·H·d·L`.
//!
//! Training: `6·N + 7·L·S·H·d` per token. Forward only (`upipe eval`):
//! `2·N + 2·L·S·H·d`.

use super::{ModelConfig, WINDOW_MASK, window_mask};
use crate::attention::AttnMask;

/// Parameters that multiply activations (`N` in the module docs).
pub fn matmul_params(cfg: &ModelConfig) -> usize {
    let table = if cfg.tie_embeddings {
        0
    } else {
        cfg.vocab * cfg.hidden
    };
    cfg.param_count() - table
}

/// Attention FLOPs of one layer's forward over `seq` tokens under the
/// mask of a stream window for `cfg` ([`stream_mask`]), the mean over its
/// layers: `4·S²·H·d` times the FLOP fraction (`2·S²·H·d` causal; the band
/// of a sliding window).
pub fn attention_forward_flops(cfg: &ModelConfig, seq: usize) -> f64 {
    let layers = cfg.layers.max(1);
    // one mask per distinct window (a mask is as long as the sequence)
    let mut windows: Vec<(Option<usize>, usize)> = Vec::new();
    for l in 0..layers {
        let w = cfg.layer_attention(l).window;
        match windows.iter_mut().find(|(x, _)| *x == w) {
            Some((_, n)) => *n += 1,
            None => windows.push((w, 1)),
        }
    }
    if let [(w, _)] = windows[..] {
        let mask = window_mask(&[0], seq, w).unwrap_or(WINDOW_MASK);
        return masked_attention_forward_flops(cfg, seq, &mask);
    }
    let total: f64 = windows
        .into_iter()
        .map(|(w, n)| {
            // a validated config's window is at least 1, so its mask exists
            let mask = window_mask(&[0], seq, w).unwrap_or(WINDOW_MASK);
            n as f64 * masked_attention_forward_flops(cfg, seq, &mask)
        })
        .sum();
    total / layers as f64
}

/// Attention FLOPs of one layer's forward over `seq` tokens under `mask`:
/// `Q·Kᵀ` and `P·V`, `2·S²·d` each per head, times `mask.flop_fraction`.
pub fn masked_attention_forward_flops(cfg: &ModelConfig, seq: usize, mask: &AttnMask) -> f64 {
    let full = 4.0 * (seq as f64).powi(2) * (cfg.heads * cfg.head_dim) as f64;
    full * mask.flop_fraction(seq)
}

/// Model FLOPs per trained token (forward and backward) on sequences of
/// `seq` tokens: `6·N + 3.5 · L · 2·S·H·d`.
pub fn train_flops_per_token(cfg: &ModelConfig, seq: usize) -> f64 {
    6.0 * matmul_params(cfg) as f64 + train_attention_flops_per_token(cfg, seq)
}

/// The attention part of [`train_flops_per_token`] (causal windows):
/// `3.5 · L · 2·S·H·d`. A step whose windows pack documents computes its
/// masks' share of it instead: this times `attn_flop_fraction / ½`
/// ([`AttnMask::flop_fraction`] of each window's mask).
pub fn train_attention_flops_per_token(cfg: &ModelConfig, seq: usize) -> f64 {
    3.5 * cfg.layers as f64 * attention_forward_flops(cfg, seq) / seq.max(1) as f64
}

/// [`train_flops_per_token`] and its attention part as if every window
/// were causal over the whole sequence (no sliding window either): the
/// attention a step's `attn_flop_fraction` scales, over the causal ½.
pub fn causal_train_flops_per_token(cfg: &ModelConfig, seq: usize) -> (f64, f64) {
    let causal = masked_attention_forward_flops(cfg, seq, &WINDOW_MASK);
    let attention = 3.5 * cfg.layers as f64 * causal / seq.max(1) as f64;
    (6.0 * matmul_params(cfg) as f64 + attention, attention)
}

/// What a run with frozen parameters and LoRA adapters changes in
/// [`train_flops_per_token`] outside the attention, per token: a frozen
/// matrix's weight-gradient GEMM is not computed (`−2·n` for its `n`
/// weights; the input embedding table, a gather, has none unless tied to
/// the head), nor the input-gradient GEMMs of the blocks below the
/// backward's floor (`Freeze::backward_floor`: another `−2·n`), and each
/// adapter adds its forward, input-gradient and weight-gradient GEMMs
/// (`6·r·(in + out)`).
pub fn frozen_and_adapter_flops(
    cfg: &ModelConfig,
    frozen: &super::Freeze,
    lora: Option<&super::lora::LoraConfig>,
) -> f64 {
    let floor = frozen.backward_floor(cfg, lora.is_some());
    let mut saved = 0usize;
    for (p, shape) in cfg.params() {
        let gathered = p == super::Param::Embed && !cfg.tie_embeddings;
        let n = shape.iter().product::<usize>();
        if frozen.is_frozen(cfg, p) && !gathered {
            saved += n;
        }
        if matches!(p, super::Param::Block(l, _) if l < floor) {
            saved += n;
        }
    }
    let adapters = lora.map_or(0, |l| l.param_count(cfg));
    6.0 * adapters as f64 - 2.0 * saved as f64
}

/// The share of [`train_attention_flops_per_token`] a run does not compute
/// because its backward stops after block `Freeze::backward_floor`: the
/// attention backward (2.5 of the 3.5 forward units) of the blocks below.
pub fn skipped_attention_share(
    cfg: &ModelConfig,
    frozen: &super::Freeze,
    lora: Option<&super::lora::LoraConfig>,
) -> f64 {
    let floor = frozen.backward_floor(cfg, lora.is_some());
    (2.5 / 3.5) * floor as f64 / cfg.layers.max(1) as f64
}

/// Model FLOPs per token of a forward pass over sequences of `seq` tokens:
/// `2·N + L · 2·S·H·d`.
pub fn forward_flops_per_token(cfg: &ModelConfig, seq: usize) -> f64 {
    let attention = cfg.layers as f64 * attention_forward_flops(cfg, seq) / seq.max(1) as f64;
    2.0 * matmul_params(cfg) as f64 + attention
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_at_128k_by_hand() {
        let m = ModelConfig::preset("llama3-8b").unwrap();
        // 8.03B parameters, untied: the 128256 x 4096 input table is left out
        assert_eq!(m.param_count(), 8_030_261_248);
        let n = 8_030_261_248 - 128_256 * 4096;
        assert_eq!(matmul_params(&m), n);
        let s = 131_072.0;
        // 2·S²·H·d with H·d = 32·128 = 4096
        assert_eq!(attention_forward_flops(&m, 131_072), 2.0 * s * s * 4096.0);
        let want = 6.0 * n as f64 + 7.0 * s * 4096.0 * 32.0;
        assert_eq!(train_flops_per_token(&m, 131_072), want);
        // attention dominates at 128K: 120 GFLOP of 165 per token
        assert!((train_flops_per_token(&m, 131_072) / 1e9 - 165.0).abs() < 1.0);
        let fwd = 2.0 * n as f64 + 2.0 * s * 4096.0 * 32.0;
        assert_eq!(forward_flops_per_token(&m, 131_072), fwd);
    }

    #[test]
    fn the_mask_scales_the_attention_flops() {
        let m = ModelConfig::preset("llama3-8b").unwrap();
        let causal = masked_attention_forward_flops(&m, 4096, &AttnMask::Causal);
        assert_eq!(causal, attention_forward_flops(&m, 4096));
        let full = masked_attention_forward_flops(&m, 4096, &AttnMask::Full);
        assert_eq!(full, 2.0 * causal);
    }

    /// Mistral-7B (window 4096) at 128K counts only the band:
    /// `4·H·d · (w(w+1)/2 + (S−w)·w − S/2)` per layer forward, against the
    /// causal count the metrics scale.
    #[test]
    fn a_sliding_window_counts_the_band() {
        let m = ModelConfig::preset("mistral-7b").unwrap();
        assert_eq!(m.sliding_window, Some(4096));
        let (s, w, hd) = (131_072.0f64, 4096.0f64, 4096.0f64);
        let band = w * (w + 1.0) / 2.0 + (s - w) * w - s / 2.0;
        let got = attention_forward_flops(&m, 131_072);
        assert!((got / (4.0 * hd * band) - 1.0).abs() < 1e-12, "{got}");
        let (total, attention) = causal_train_flops_per_token(&m, 131_072);
        assert_eq!(attention, 7.0 * s * hd * 32.0);
        assert_eq!(total, 6.0 * matmul_params(&m) as f64 + attention);
        assert!(train_flops_per_token(&m, 131_072) < total / 2.0);
        // a window no shorter than the sequence hides nothing
        let short = attention_forward_flops(&m, 4096);
        assert_eq!(
            short,
            masked_attention_forward_flops(&m, 4096, &AttnMask::Causal)
        );
    }

    #[test]
    fn a_tied_head_counts_the_shared_matrix() {
        let m = ModelConfig::preset("llama3.2-1b").unwrap();
        assert!(m.tie_embeddings);
        assert_eq!(matmul_params(&m), m.param_count());
        // short sequences: the 6·N term alone, nearly
        let per_token = train_flops_per_token(&m, 1);
        assert_eq!(
            per_token,
            6.0 * m.param_count() as f64 + 7.0 * 2048.0 * 16.0
        );
    }

    /// Frozen matrices take off their weight-gradient GEMMs (the untied
    /// input embedding, a gather, has none); adapters add `6·r·(in+out)`.
    #[test]
    fn frozen_weights_and_adapters_change_the_count_by_hand() {
        use crate::model::Freeze;
        use crate::model::lora::{LoraConfig, LoraTarget};
        let cfg = ModelConfig::resolve("llama3-8b").unwrap();
        let none = frozen_and_adapter_flops(&cfg, &Freeze::none(), None);
        assert_eq!(none, 0.0);
        let embed = Freeze::parse("embeddings").unwrap();
        assert_eq!(frozen_and_adapter_flops(&cfg, &embed, None), 0.0);
        let head = Freeze::parse("head").unwrap();
        let vh = (cfg.vocab * cfg.hidden) as f64;
        assert_eq!(frozen_and_adapter_flops(&cfg, &head, None), -2.0 * vh);
        let lora = LoraConfig::new(16, 32.0, false, vec![LoraTarget::Q]).unwrap();
        let base = Freeze::whole_base();
        let got = frozen_and_adapter_flops(&cfg, &base, Some(&lora));
        let q = (16 * (4096 + 4096) * 32) as f64;
        let n = (cfg.param_count() - cfg.vocab * cfg.hidden) as f64; // untied: table gathered
        assert_eq!(got, 6.0 * q - 2.0 * n);
        assert_eq!(skipped_attention_share(&cfg, &base, Some(&lora)), 0.0);
    }

    /// Below the backward's floor no input-gradient GEMM runs either, nor
    /// any attention backward.
    #[test]
    fn blocks_below_the_backward_floor_count_their_forward_only() {
        use crate::model::{Freeze, Param};
        let cfg = ModelConfig::resolve("llama3-8b").unwrap();
        let f = Freeze::parse("embeddings,blocks:0-15").unwrap();
        assert_eq!(f.backward_floor(&cfg, false), 16);
        let block: usize = cfg
            .params()
            .iter()
            .filter(|(p, _)| matches!(p, Param::Block(0, _)))
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        // weight and input gradients of 16 blocks
        let want = -2.0 * 2.0 * (16 * block) as f64;
        assert_eq!(frozen_and_adapter_flops(&cfg, &f, None), want);
        assert_eq!(skipped_attention_share(&cfg, &f, None), 2.5 / 3.5 / 2.0);
        let blocks_only = Freeze::parse("blocks:0-15").unwrap();
        assert_eq!(skipped_attention_share(&cfg, &blocks_only, None), 0.0);
    }
}
