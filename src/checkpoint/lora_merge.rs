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

/// The base model an adapter was trained on: an HF model directory
/// (`--init-from`), or the random weights `upipe train` starts a model
/// from without one (`--model NAME`, its `--seed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseModel {
    Dir(std::path::PathBuf),
    Random { seed: u64 },
}

impl BaseModel {
    /// The base's tensors for `cfg`'s model, by HF name (a directory's
    /// adapter factors, an older LoRA checkpoint's, are left out).
    pub fn tensors(&self, cfg: &ModelConfig) -> Result<BTreeMap<String, HostTensor>> {
        match self {
            BaseModel::Dir(dir) => {
                super::load_hf_model_with(dir, cfg, super::ExtraTensors::Adapters)
            }
            BaseModel::Random { seed } => {
                let init = crate::model::RandomInit::new(cfg, *seed);
                let mut out = BTreeMap::new();
                for (p, shape) in cfg.params() {
                    let name = cfg.hf_name(p);
                    let values = init.values(&name, 0..shape.iter().product());
                    out.insert(name, HostTensor::new(shape.to_vec(), values)?);
                }
                Ok(out)
            }
        }
    }

    /// `adapter_config.json`'s `base_model_name_or_path`: the directory
    /// (absolute where it resolves), or the model's name.
    pub fn name(&self, cfg: &ModelConfig) -> String {
        match self {
            BaseModel::Dir(dir) => std::fs::canonicalize(dir)
                .unwrap_or_else(|_| dir.clone())
                .display()
                .to_string(),
            BaseModel::Random { .. } => cfg.name.clone(),
        }
    }
}

/// What [`merge_adapter_dir`] merges and where it writes.
pub struct MergeJob<'a> {
    /// The base model the adapter was trained on.
    pub base: &'a BaseModel,
    /// A PEFT adapter directory (PEFT's, or a upipe LoRA checkpoint).
    pub adapter: &'a std::path::Path,
    /// The merged model's directory: new or empty.
    pub out: &'a std::path::Path,
    /// The base's model.
    pub cfg: &'a ModelConfig,
    pub dtype: super::SaveDtype,
}

/// Writes `job.base` with `job.adapter` merged as a plain HF model
/// directory `job.out` in `job.dtype`: the merged weights, the base's
/// `config.json` (every field kept, the dtype updated) and tokenizer files
/// (the adapter directory's first, then the base's). `out` must be new or
/// empty: nothing of the owner's is replaced, and it is checked first.
pub fn merge_adapter_dir(job: &MergeJob) -> Result<()> {
    check_empty_target(job.out)?;
    let adapter = super::peft::read_adapter(job.adapter, job.cfg)?.weights;
    let mut tensors = job.base.tensors(job.cfg)?;
    merge_adapter(&mut tensors, job.cfg, &adapter)?;
    super::save_hf_model(job.out, job.cfg, &tensors, job.dtype)?;
    let base_dir = match job.base {
        BaseModel::Dir(dir) => Some(dir.as_path()),
        BaseModel::Random { .. } => None,
    };
    // the base's config.json, every field kept, its dtype the one written
    if let Some(source) = base_dir.and_then(|d| source_config(&d.join("config.json"))) {
        let text = super::hf_config::checkpoint_config(Some(&source), job.cfg, job.dtype);
        let path = job.out.join("config.json");
        std::fs::write(&path, text).map_err(|e| Error::io(path.display().to_string(), e))?;
    }
    let carried = super::carried::CARRIED_FILES.iter().filter_map(|name| {
        [Some(job.adapter), base_dir]
            .into_iter()
            .flatten()
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    for from in carried {
        let name = from.file_name().expect("a file path has a name");
        std::fs::copy(&from, job.out.join(name)).map_err(|e| {
            Error::io(
                format!("copying {} into {}", from.display(), job.out.display()),
                e,
            )
        })?;
    }
    Ok(())
}

/// A `config.json`'s fields, where it is a readable JSON object.
fn source_config(path: &std::path::Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
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
