//! `upipe merge BASE ADAPTER OUT`: a LoRA adapter (PEFT's directory, or a
//! upipe LoRA checkpoint) merged into its base model without training,
//! written as a plain HF model directory (`checkpoint::lora_merge`).

use crate::checkpoint::SaveDtype;
use crate::checkpoint::lora_merge::{BaseModel, MergeJob, check_empty_target, merge_adapter_dir};
use crate::error::Result;
use crate::model::ModelConfig;
use std::path::{Path, PathBuf};

/// Flags of `upipe merge`.
#[derive(clap::Args, Debug, Clone)]
pub struct MergeArgs {
    /// The base model: an HF model directory (config.json and safetensors),
    /// or a built-in model name, whose random weights from --seed are what
    /// `upipe train --model NAME` without --init-from starts from.
    pub base: String,
    /// The adapter: a PEFT adapter directory (adapter_config.json,
    /// adapter_model.safetensors) or a upipe LoRA checkpoint.
    pub adapter: PathBuf,
    /// The merged model's directory (new or empty).
    pub out: PathBuf,
    /// The merged weights' dtype: f32, bf16, f16, or auto (the base's; bf16
    /// for a built-in model).
    #[arg(long, default_value = "auto")]
    pub save_dtype: String,
    /// The seed of a built-in base's random weights (train's --seed).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Merges and prints where the model went.
pub fn run(a: MergeArgs) -> Result<i32> {
    // the target is checked before anything is read
    check_empty_target(&a.out)?;
    crate::checkpoint::refuse_adapter_dir(Path::new(&a.base), "BASE")?;
    let dir = Path::new(&a.base);
    let base = match dir.is_dir() {
        true => BaseModel::Dir(dir.to_path_buf()),
        false => BaseModel::Random { seed: a.seed },
    };
    let cfg = ModelConfig::resolve(&a.base)?;
    let dtype = match (a.save_dtype.as_str(), &base) {
        ("auto", BaseModel::Dir(d)) => SaveDtype::of_model_dir(d)?.unwrap_or_default(),
        ("auto", BaseModel::Random { seed }) => {
            tracing::info!(
                "BASE {}: a built-in model, so its random weights from --seed {seed} (as \
                 `upipe train --model {}` starts from); merged in {}",
                a.base,
                a.base,
                SaveDtype::default().hf_name()
            );
            SaveDtype::default()
        }
        (name, _) => name.parse()?,
    };
    merge_adapter_dir(&MergeJob {
        base: &base,
        adapter: &a.adapter,
        out: &a.out,
        cfg: &cfg,
        dtype,
    })?;
    println!(
        "merged {} into {} ({}): {}",
        a.adapter.display(),
        a.base,
        dtype.hf_name(),
        a.out.display()
    );
    Ok(0)
}
