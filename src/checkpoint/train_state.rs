//! Training state: weights (HF model files in the run's `--save-dtype`),
//! AdamW moments and, when the model files are narrower than F32, the F32
//! masters a resume continues from, the step and the caller's state
//! (`state.json`), written so that a directory whose `state.json` is present
//! has all its files.

use super::fs::{create_dir, remove_if_exists, write_atomic};
use super::model_files::{ModelFiles, write_model_sources};
use super::save_dtype::SaveDtype;
use super::stream::{TensorSource, write_safetensors};
use super::tensor_file::HostTensor;
use crate::error::{Error, Result};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

pub(super) const STATE_FILE: &str = "state.json";
pub(super) const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub(super) const STATE_VERSION: u64 = 1;

/// Saves a training checkpoint held in host memory into `dir` with its
/// weights in F32 in one file ([`save_train_state_as`] with no masters and
/// [`ModelFiles::f32`]).
pub fn save_train_state(
    dir: &Path,
    step: u64,
    params: &BTreeMap<String, HostTensor>,
    adam_m: &BTreeMap<String, HostTensor>,
    adam_v: &BTreeMap<String, HostTensor>,
    extra: &Value,
) -> Result<()> {
    fn host(map: &BTreeMap<String, HostTensor>) -> Vec<TensorSource<'_>> {
        let host = map
            .iter()
            .map(|(n, t)| TensorSource::host(n, &t.shape, &t.data));
        host.collect()
    }
    let (params, adam_m, adam_v) = (host(params), host(adam_m), host(adam_v));
    let state = StateToSave {
        step,
        params: &params,
        adam_m: &adam_m,
        adam_v: &adam_v,
        masters: None,
        extra,
    };
    save_train_state_as(dir, &state, ModelFiles::f32())
}

/// What [`save_train_state_as`] writes: every tensor a [`TensorSource`],
/// fetched when its file is written, so a save holds one tensor in host
/// memory at a time.
pub struct StateToSave<'a> {
    /// Optimizer steps taken.
    pub step: u64,
    /// Weights by HF name, in model order (the order of the weight files).
    pub params: &'a [TensorSource<'a>],
    /// AdamW first moments, by the names of `params` (none for a frozen one).
    pub adam_m: &'a [TensorSource<'a>],
    /// AdamW second moments, by the names of `params`.
    pub adam_v: &'a [TensorSource<'a>],
    /// F32 masters by the names of `params`: what a resume continues from
    /// when the weight files are narrower than the values trained.
    pub masters: Option<&'a [TensorSource<'a>]>,
    /// Caller-defined state.
    pub extra: &'a Value,
}

/// Saves a training checkpoint into `dir`: weights as HF model files
/// (`files`: dtype, shard size; HF names), moments (and masters) in
/// `optimizer.safetensors` (`exp_avg.<name>`, `exp_avg_sq.<name>`,
/// `master.<name>`, always F32), and `state.json` with the step and
/// `extra`. Each file is written to a temporary name and renamed;
/// `state.json` goes last, so a directory whose `state.json` is present has
/// all its files.
pub fn save_train_state_as(dir: &Path, state: &StateToSave, files: ModelFiles) -> Result<()> {
    prepare_save(dir, state)?;
    write_model_sources(dir, state.params, files)?;
    write_optimizer_and_state(dir, state)
}

/// Checks that `state`'s moments (and masters) match its parameters, makes
/// `dir` and removes its old `state.json`: a crash from here on must not
/// leave an old `state.json` next to new weights.
fn prepare_save(dir: &Path, state: &StateToSave) -> Result<()> {
    let place = Path::new("the state to save");
    let params = shapes_of(state.params);
    check_same_layout_of(&params, &shapes_of(state.adam_m), "exp_avg", place)?;
    check_same_layout_of(&params, &shapes_of(state.adam_v), "exp_avg_sq", place)?;
    if let Some(masters) = state.masters {
        check_same_layout_of(&params, &shapes_of(masters), "master", place)?;
    }
    create_dir(dir)?;
    remove_if_exists(&dir.join(STATE_FILE))
}

/// Each tensor's shape by name.
fn shapes_of<'s>(tensors: &'s [TensorSource]) -> BTreeMap<String, &'s [usize]> {
    let shapes = tensors.iter().map(|t| (t.name.clone(), t.shape.as_slice()));
    shapes.collect()
}

/// A LoRA run's adapter, which [`save_adapter_state`] writes in place of
/// the model files.
pub struct AdapterToSave<'a> {
    pub weights: &'a crate::model::lora::LoraWeights,
    /// `adapter_config.json`'s `base_model_name_or_path`.
    pub base: &'a str,
    pub dtype: SaveDtype,
}

/// Saves a LoRA run's checkpoint into `dir`: the adapter as PEFT writes it
/// (`adapter_config.json`, `adapter_model.safetensors`) and no base model
/// weights; `state.params` (the adapter factors by PEFT name), their
/// moments and masters in `optimizer.safetensors` and `state.json` as
/// [`save_train_state_as`] writes them. `state.json` goes last.
pub fn save_adapter_state(dir: &Path, state: &StateToSave, adapter: &AdapterToSave) -> Result<()> {
    prepare_save(dir, state)?;
    super::peft::write_adapter(dir, adapter.weights, adapter.base, adapter.dtype)?;
    write_optimizer_and_state(dir, state)
}

/// `optimizer.safetensors` (moments and masters, each fetched when its
/// turn comes) and then `state.json`.
fn write_optimizer_and_state(dir: &Path, state: &StateToSave) -> Result<()> {
    fn prefixed<'s>(tensors: &'s [TensorSource], kind: &str) -> Vec<TensorSource<'s>> {
        let renamed = tensors
            .iter()
            .map(|t| t.renamed(format!("{kind}.{}", t.name)));
        renamed.collect()
    }
    let mut tensors = prefixed(state.adam_m, "exp_avg");
    tensors.extend(prefixed(state.adam_v, "exp_avg_sq"));
    tensors.extend(prefixed(state.masters.unwrap_or_default(), "master"));
    let f32 = SaveDtype::F32.safetensors();
    write_safetensors(&dir.join(OPTIMIZER_FILE), &tensors, f32)?;
    let json = json!({ "version": STATE_VERSION, "step": state.step, "extra": state.extra });
    let text = serde_json::to_string_pretty(&json).expect("a JSON value always serialises");
    write_atomic(&dir.join(STATE_FILE), text.as_bytes())
}

/// Whether `dir` holds a LoRA checkpoint's adapter and no model files
/// ([`save_adapter_state`]'s layout).
pub fn is_adapter_only(dir: &Path) -> bool {
    let model = [super::hf::SINGLE_FILE, super::hf::INDEX_FILE];
    dir.join(super::peft_config::ADAPTER_WEIGHTS).is_file()
        && !model.iter().any(|f| dir.join(f).exists())
}

/// Checks that each of `moments` (by name, its shape) is of a parameter
/// of `params` and has its shape; `place` is the file or state named.
pub(super) fn check_same_layout_of(
    params: &BTreeMap<String, &[usize]>,
    moments: &BTreeMap<String, &[usize]>,
    what: &str,
    place: &Path,
) -> Result<()> {
    // a frozen parameter (`--freeze`) keeps no optimizer state: a missing
    // moment is the optimizer's to refuse, for a parameter it trains
    for (name, p) in params {
        match moments.get(name) {
            None => {}
            Some(m) if m != p => {
                return Err(Error::Checkpoint(format!(
                    "{what} moment for '{name}' in {}: expected shape {:?}, found {:?}",
                    place.display(),
                    p,
                    m
                )));
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = moments.keys().find(|k| !params.contains_key(*k)) {
        return Err(Error::Checkpoint(format!(
            "{what} moment for '{extra}' in {} has no matching weight",
            place.display()
        )));
    }
    Ok(())
}
