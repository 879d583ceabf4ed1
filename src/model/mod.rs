//! The Llama-family decoder: configs (`config.rs`; families, one file each,
//! in `families/`), weights in HF layout, and an explicit forward/backward
//! with the memory policies long-context training needs.

pub mod config;
pub mod decoder;
pub mod families;
pub mod flat_layout;
pub mod flops;
pub mod forward;
pub mod progress;
pub mod shapes;
pub mod store;
pub mod unit;
pub mod weights;

use crate::attention::AttnMask;
use crate::backend::BoundedMask;
use crate::error::Result;

pub use config::ModelConfig;
pub use decoder::{DEFAULT_LOSS_CHUNK, Decoder, MemoryPolicy};
pub use families::{BlockParam, Family, Param};
pub use store::{HeadView, ParamStore, Unit};
pub use weights::{BlockWeights, ModelWeights, RandomInit};

/// The attention mask of a training or evaluation window that is one
/// document (or one stream): causal over the whole window. A window
/// packing several documents attends under [`window_mask`] instead.
pub const WINDOW_MASK: AttnMask = AttnMask::Causal;

/// The attention mask of a window of `seq` tokens whose documents start at
/// `doc_starts`: [`WINDOW_MASK`] for one document, else block-diagonal
/// causal over the documents ([`AttnMask::Bounded`]).
pub fn window_mask(doc_starts: &[u32], seq: usize) -> Result<AttnMask> {
    if doc_starts.len() <= 1 && doc_starts.first().is_none_or(|&s| s == 0) {
        return Ok(WINDOW_MASK);
    }
    Ok(AttnMask::Bounded(BoundedMask::documents(doc_starts, seq)?))
}
