//! Model families: one file per family of Hugging Face checkpoints upipe
//! reads (`llama.rs`, `qwen2.rs`, `qwen3.rs`, `mistral.rs`), behind one interface, [`Family`], that
//! the config, the decoder, the weights and checkpoint I/O ask:
//!
//! - its `config.json`: the `model_type` it answers to
//!   ([`Family::from_model_type`]), its parsing ([`Family::parse_hf`],
//!   through the keys every Llama-like family shares in `hf.rs`) and what
//!   [`ModelConfig::to_hf_json`] writes (`model_type`, `architectures`);
//! - its parameters: which a block has ([`Family::block_params`]) and their
//!   HF names ([`Family::hf_name`]), the names `model/weights.rs` and the
//!   checkpoint files use;
//! - its quirks, as methods the decoder asks: [`Family::qk_norm`],
//!   [`Family::qkv_bias`], [`Family::has_sliding_window`] (the window
//!   itself, and tied embeddings, are a checkpoint's `sliding_window` and
//!   `tie_word_embeddings`, read into [`ModelConfig::sliding_window`] and
//!   [`ModelConfig::tie_embeddings`] with the family's default);
//! - its presets ([`Family::preset`]).
//!
//! A new family (as `qwen2` came with q/k/v biases and YaRN, and `mistral`
//! with a sliding window) is a file here with its parse and presets, a variant of
//! [`Family`] (the compiler then names every match to extend), and the code
//! of its quirks: new [`BlockParam`]s for biases, a rope-scaling type in
//! `hf.rs`, a mask for the window.
//!
//! [`ModelConfig::to_hf_json`]: super::ModelConfig::to_hf_json
//! [`ModelConfig::sliding_window`]: super::ModelConfig::sliding_window
//! [`ModelConfig::tie_embeddings`]: super::ModelConfig::tie_embeddings

mod family;
mod gemma3;
mod hf;
mod llama;
mod mistral;
mod names;
mod params;
mod parse;
pub(super) mod presets;
mod qwen2;
mod qwen3;
mod spec;

pub use family::{FAMILIES, Family};
pub(super) use hf::to_hf_json;
pub use params::{BlockParam, Param};
pub use spec::{BlockSpec, LayerType, WindowRule};
