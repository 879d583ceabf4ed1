//! Checkpoints: safetensors files on host memory (`tensor_file.rs`), Hugging
//! Face model directories (`hf.rs`), training state (`train_state.rs`),
//! reads by element range (`ranged.rs`), the save directory upipe shares
//! with its owner (`save_dir.rs`: manifest, lock, staging and journaled
//! publishing), and FSDP's per-rank optimizer shards (`sharded.rs`).

mod fs;
pub mod hf;
pub mod ranged;
pub mod save_dir;
pub mod sharded;
pub mod tensor_file;
pub mod train_state;

pub use hf::*;
pub use tensor_file::*;
pub use train_state::*;

#[cfg(test)]
mod tests;
