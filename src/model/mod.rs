//! The Llama-family decoder: configs, weights in HF layout, and an explicit
//! forward/backward with the memory policies long-context training needs.

pub mod config;
pub mod decoder;
pub mod flat_layout;
pub mod flops;
pub mod forward;
pub mod progress;
pub mod shapes;
pub mod store;
pub mod unit;
pub mod weights;

pub use config::ModelConfig;
pub use decoder::{DEFAULT_LOSS_CHUNK, Decoder, MemoryPolicy};
pub use store::{HeadView, ParamStore, Unit};
pub use weights::{BlockWeights, ModelWeights, RandomInit};
