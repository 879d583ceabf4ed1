//! An adapter merged into its base model: every adapted weight becomes
//! `W + scale·B·A` (in f32, `model::lora_math::merge`), as PEFT's
//! `merge_and_unload` makes it; the result is a plain HF model's tensors,
//! written in any `SaveDtype` by `model_files.rs` (the cast comes once,
//! after the merge).

use super::tensor_file::HostTensor;
use crate::error::{Error, Result};
use crate::model::lora::LoraWeights;
use crate::model::lora_math::merge;
use crate::model::{ModelConfig, Param};
use std::collections::BTreeMap;

/// Merges `adapter` into `tensors`, a model of `cfg`'s by HF name (from
/// `load_hf_model`): each adapted weight is replaced by its merged value;
/// every other tensor is left as it is. A weight missing or of another
/// shape than the adapter's factors is an error naming it.
pub fn merge_adapter(
    tensors: &mut BTreeMap<String, HostTensor>,
    cfg: &ModelConfig,
    adapter: &LoraWeights,
) -> Result<()> {
    if adapter.layers.len() != cfg.layers {
        return Err(Error::Checkpoint(format!(
            "the adapter has {} layers and model '{}' {}; merge an adapter made for this model",
            adapter.layers.len(),
            cfg.name,
            cfg.layers
        )));
    }
    let scale = adapter.config.scale();
    for (l, factors) in adapter.layers.iter().enumerate() {
        for (&target, f) in adapter.config.targets.iter().zip(factors) {
            let name = cfg.hf_name(Param::Block(l, target.base_param()));
            let Some(w) = tensors.get_mut(&name) else {
                return Err(Error::Checkpoint(format!(
                    "the model has no tensor '{name}' for the adapter's {} of layer {l}",
                    target.peft_name()
                )));
            };
            let (n_in, n_out) = (f.dims.in_features, f.dims.out_features);
            if w.shape != [n_out, n_in] {
                return Err(Error::Checkpoint(format!(
                    "tensor '{name}' is {:?}; the adapter's {} of layer {l} adds to a [{n_out}, \
                     {n_in}] weight",
                    w.shape,
                    target.peft_name()
                )));
            }
            w.data = merge(&w.data, f, scale);
        }
    }
    Ok(())
}

/// Writes the model of a LoRA checkpoint `ckpt` (its base weights and its
/// adapter, `adapter_model.safetensors`) merged, as a plain HF model
/// directory `out` in `dtype`: the merged weights, and the checkpoint's
/// `config.json` and tokenizer files copied. `out` must be new or empty:
/// nothing of the owner's is replaced.
pub fn merge_checkpoint(
    ckpt: &std::path::Path,
    out: &std::path::Path,
    cfg: &ModelConfig,
    dtype: super::SaveDtype,
) -> Result<()> {
    check_empty_target(out)?;
    let adapter = super::peft::read_adapter(ckpt, cfg)?.weights;
    let mut tensors = super::load_hf_model_with(ckpt, cfg, super::ExtraTensors::Adapters)?;
    merge_adapter(&mut tensors, cfg, &adapter)?;
    super::save_hf_model(out, cfg, &tensors, dtype)?;
    // the checkpoint's config.json keeps every field of its source model's
    for name in std::iter::once("config.json").chain(super::carried::CARRIED_FILES) {
        let from = ckpt.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name)).map_err(|e| {
                Error::io(
                    format!("copying {} into {}", from.display(), out.display()),
                    e,
                )
            })?;
        }
    }
    Ok(())
}

/// `--merge-lora DIR`: DIR must not exist yet, or be empty.
pub fn check_empty_target(out: &std::path::Path) -> Result<()> {
    let empty = match std::fs::read_dir(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => return Err(Error::io(format!("reading {}", out.display()), e)),
        Ok(mut entries) => entries.next().is_none(),
    };
    match empty {
        true => Ok(()),
        false => crate::config_err!(
            "--merge-lora {}: the directory is not empty; give a new directory for the merged \
             model (upipe does not write over files it did not write)",
            out.display()
        ),
    }
}
