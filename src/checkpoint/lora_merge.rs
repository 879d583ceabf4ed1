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
