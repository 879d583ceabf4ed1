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

pub use config::ModelConfig;
pub use decoder::{DEFAULT_LOSS_CHUNK, Decoder, MemoryPolicy};
pub use families::{BlockParam, Family, Param};
pub use store::{HeadView, ParamStore, Unit};
pub use weights::{BlockWeights, ModelWeights, RandomInit};

/// The attention mask of a training or evaluation window: causal over the
/// whole window, which is one sequence. The decoder's layers and the model
/// FLOP counts read it here; document masks (DESIGN.md §7) will come with
/// each window instead, beside its ids.
pub const WINDOW_MASK: AttnMask = AttnMask::Causal;
