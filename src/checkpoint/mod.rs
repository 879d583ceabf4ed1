//! Checkpoints: safetensors files on host memory (`tensor_file.rs`) and
//! written one tensor at a time (`stream.rs`), Hugging Face model
//! directories (`hf.rs`), training state (`train_state.rs`; read back
//! tensor by tensor, `saved_state.rs`),
//! reads by element range (`ranged.rs`), the save directory upipe shares
//! with its owner (`save_dir.rs`: manifest, lock, staging and journaled
//! publishing), and FSDP's per-rank optimizer shards (`sharded.rs`); a
//! checkpoint's weight files in its `--save-dtype` (`save_dtype.rs`,
//! `model_files.rs`: sharded as HF shards them), its `config.json`
//! (`hf_config.rs`: the source's, updated) and the tokenizer files carried
//! from the source (`carried.rs`); LoRA adapters as PEFT's directories
//! (`peft.rs`, their `adapter_config.json` `peft_config.rs`) and merged into
//! their base model (`lora_merge.rs`: `BaseModel`, an HF directory or a
//! seed's random weights; `merge_adapter_dir`, which `upipe merge` and
//! `train --merge-lora` run). A LoRA run's checkpoint is the adapter alone
//! with its optimizer state (`train_state::save_adapter_state`), its
//! `state.json` naming the base a resume reads again.

pub mod carried;
mod fs;
pub mod hf;
pub mod hf_config;
pub mod lora_merge;
pub mod model_dtype;
pub mod model_files;
pub mod peft;
pub mod peft_config;
pub mod ranged;
pub mod save_dir;
pub mod save_dtype;
pub mod saved_state;
pub mod sharded;
pub mod stream;
pub mod tensor_file;
pub mod train_state;

pub use hf::*;
pub use model_files::ModelFiles;
pub use save_dtype::SaveDtype;
pub use stream::TensorSource;
pub use tensor_file::*;
pub use train_state::*;

#[cfg(test)]
mod tests;
