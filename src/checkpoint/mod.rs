//! Checkpoints: safetensors files and Hugging Face model directories
//! (`hf.rs`), reads by element range (`ranged.rs`), the save directory
//! upipe shares with its owner (`save_dir.rs`: manifest, lock, staging and
//! journaled publishing), and FSDP's per-rank optimizer shards
//! (`sharded.rs`).

pub mod hf;
pub mod ranged;
pub mod save_dir;
pub mod sharded;

pub use hf::*;
