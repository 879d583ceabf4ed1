//! The Llama-family decoder: configs (`config.rs`; families, one file each,
//! in `families/`), weights in HF layout, and an explicit forward/backward
//! with the memory policies long-context training needs; LoRA adapters
//! (`lora.rs`, their arithmetic `lora_math.rs`).

pub mod adapters;
pub mod chunk_loop;
pub mod config;
pub mod config_source;
pub mod decoder;
pub mod families;
pub mod flat_layout;
pub mod flops;
pub mod forward;
pub mod freeze;
pub mod grads;
pub mod kept_inputs;
pub mod layer_attention;
pub mod lora;
pub mod lora_math;
pub mod lora_params;
pub mod mask;
pub mod progress;
pub mod segments;
pub mod shapes;
pub mod store;
mod tensor_order;
pub mod unit;
pub mod weights;

pub use config::ModelConfig;
pub use decoder::{DEFAULT_LOSS_CHUNK, Decoder, HostUpdate, MemoryPolicy};
pub use families::{BlockParam, Family, Param};
pub use freeze::Freeze;
pub use grads::{BlockGrads, GradSpec, ModelGrads};
pub use mask::{WINDOW_MASK, stream_mask, window_mask};
pub use store::{HeadView, ParamStore, Unit};
pub use weights::{BlockWeights, ModelWeights, RandomInit};
