//! The attention mask of a training, evaluation or stream window: causal,
//! or bounded by its documents' starts and the model's sliding window.

use super::config::ModelConfig;
use crate::attention::AttnMask;
use crate::backend::BoundedMask;
use crate::error::Result;

/// The attention mask of a training or evaluation window that is one
/// document (or one stream) of a model without a sliding window: causal
/// over the whole window. A window packing several documents, or a model
/// with a sliding window, attends under [`window_mask`] instead.
pub const WINDOW_MASK: AttnMask = AttnMask::Causal;

/// The attention mask of a window of `seq` tokens whose documents start at
/// `doc_starts`, for a model whose attention sees at most `sliding_window`
/// keys per query (itself included; `None`: no window): [`WINDOW_MASK`]
/// for one document without a window (or with one of at least `seq` keys,
/// which hides nothing), else causal with each query's lower bound
/// ([`AttnMask::Bounded`]: its document's start, or its window's first key
/// if later). A window of 0 is refused.
pub fn window_mask(
    doc_starts: &[u32],
    seq: usize,
    sliding_window: Option<usize>,
) -> Result<AttnMask> {
    let window = sliding_window.filter(|&w| w < seq || w == 0);
    let one_document = doc_starts.len() <= 1 && doc_starts.first().is_none_or(|&s| s == 0);
    if one_document && window.is_none() {
        return Ok(WINDOW_MASK);
    }
    let starts = if doc_starts.is_empty() {
        &[0][..]
    } else {
        doc_starts
    };
    let mask = BoundedMask::documents(starts, seq)?;
    Ok(AttnMask::Bounded(match window {
        Some(w) => mask.with_window(w)?,
        None => mask,
    }))
}

/// The attention mask of layer `layer` over a stream window (one
/// document) of `seq` tokens for `cfg`'s model: [`WINDOW_MASK`], or the
/// band of that layer's sliding window.
pub fn stream_mask(cfg: &ModelConfig, layer: usize, seq: usize) -> Result<AttnMask> {
    window_mask(&[0], seq, cfg.layer_attention(layer).window)
}
