//! Training state: weights (HF model files in the run's `--save-dtype`),
//! AdamW moments and, when the model files are narrower than F32, the F32
//! masters a resume continues from, the step and the caller's state
//! (`state.json`), written so that a directory whose `state.json` is present
//! has all its files.

use super::fs::{create_dir, remove_if_exists, write_atomic};
use super::model_files::{ModelFiles, read_model_files, write_model_files};
use super::save_dtype::SaveDtype;
use super::tensor_file::{HostTensor, load_safetensors, save_safetensors};
use crate::error::{Error, Result};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

pub(super) const STATE_FILE: &str = "state.json";
pub(super) const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_VERSION: u64 = 1;

/// A training checkpoint held in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Weights, by HF name: the F32 masters where the checkpoint kept them
    /// (model files narrower than F32), else the model files' values.
    pub params: BTreeMap<String, HostTensor>,
    /// AdamW first moments, same names and shapes as `params`.
    pub adam_m: BTreeMap<String, HostTensor>,
    /// AdamW second moments, same names and shapes as `params`.
    pub adam_v: BTreeMap<String, HostTensor>,
    /// Caller-defined state (RNG, schedule, sampler position, ...).
    pub extra: Value,
}

/// Saves a training checkpoint into `dir` with its weights in F32 in one
/// file ([`save_train_state_as`] with no masters and [`ModelFiles::f32`]).
pub fn save_train_state(
    dir: &Path,
    step: u64,
    params: &BTreeMap<String, HostTensor>,
    adam_m: &BTreeMap<String, HostTensor>,
    adam_v: &BTreeMap<String, HostTensor>,
    extra: &Value,
) -> Result<()> {
    let state = StateToSave {
        step,
        params: params.iter().map(|(n, t)| (n.clone(), t)).collect(),
        adam_m,
        adam_v,
        masters: None,
        extra,
    };
    save_train_state_as(dir, &state, ModelFiles::f32())
}

/// What [`save_train_state_as`] writes.
pub struct StateToSave<'a> {
    /// Optimizer steps taken.
    pub step: u64,
    /// Weights by HF name, in model order (the order of the weight files).
    pub params: Vec<(String, &'a HostTensor)>,
    /// AdamW first moments, by the names of `params`.
    pub adam_m: &'a BTreeMap<String, HostTensor>,
    /// AdamW second moments, by the names of `params`.
    pub adam_v: &'a BTreeMap<String, HostTensor>,
    /// F32 masters by the names of `params`: what a resume continues from
    /// when the weight files are narrower than the values trained.
    pub masters: Option<&'a BTreeMap<String, HostTensor>>,
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
    write_model_files(dir, &state.params, files)?;
    write_optimizer_and_state(dir, state)
}

/// Checks that `state`'s moments (and masters) match its parameters, makes
/// `dir` and removes its old `state.json`: a crash from here on must not
/// leave an old `state.json` next to new weights.
fn prepare_save(dir: &Path, state: &StateToSave) -> Result<()> {
    let place = Path::new("the state to save");
    let names: BTreeMap<String, &HostTensor> = state.params.iter().cloned().collect();
    check_same_layout_of(&names, state.adam_m, "exp_avg", place)?;
    check_same_layout_of(&names, state.adam_v, "exp_avg_sq", place)?;
    if let Some(masters) = state.masters {
        check_same_layout_of(&names, masters, "master", place)?;
    }
    create_dir(dir)?;
    remove_if_exists(&dir.join(STATE_FILE))
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

/// `optimizer.safetensors` (moments and masters) and then `state.json`.
fn write_optimizer_and_state(dir: &Path, state: &StateToSave) -> Result<()> {
    let masters = state.masters.into_iter().flatten();
    let moments: Vec<(String, &HostTensor)> = (state.adam_m.iter())
        .map(|(n, t)| (format!("exp_avg.{n}"), t))
        .chain(
            state
                .adam_v
                .iter()
                .map(|(n, t)| (format!("exp_avg_sq.{n}"), t)),
        )
        .chain(masters.map(|(n, t)| (format!("master.{n}"), t)))
        .collect();
    save_safetensors(&dir.join(OPTIMIZER_FILE), &moments, SaveDtype::F32)?;
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

/// Loads a checkpoint written by [`save_train_state`] (or
/// [`save_adapter_state`]: its `params` are then the adapter's factors).
pub fn load_train_state(dir: &Path) -> Result<TrainState> {
    let state_path = dir.join(STATE_FILE);
    crate::input_path::check_file(&state_path, "checkpoint state")?;
    let text = std::fs::read_to_string(&state_path).map_err(|e| {
        Error::io(
            format!(
                "reading {} (is this a complete training checkpoint?)",
                state_path.display()
            ),
            e,
        )
    })?;
    let bad =
        |why: &str| Error::Checkpoint(format!("{} is malformed: {why}", state_path.display()));
    let state: Value = serde_json::from_str(&text).map_err(|e| bad(&e.to_string()))?;
    match state.get("version").and_then(Value::as_u64) {
        Some(STATE_VERSION) => {}
        Some(v) => {
            return Err(bad(&format!(
                "version {v}, this build reads version {STATE_VERSION}"
            )));
        }
        None => return Err(bad("no \"version\"")),
    }
    let step = state
        .get("step")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("no integer \"step\""))?;
    let extra = state.get("extra").cloned().unwrap_or(Value::Null);
    // a LoRA checkpoint holds its adapter, not the base it was trained on
    let mut params = match is_adapter_only(dir) {
        true => load_safetensors(&dir.join(super::peft_config::ADAPTER_WEIGHTS))?,
        false => read_model_files(dir)?,
    };
    let opt_path = dir.join(OPTIMIZER_FILE);
    let mut moments = load_safetensors(&opt_path)?;
    let adam_m = take_prefixed(&mut moments, "exp_avg.");
    let adam_v = take_prefixed(&mut moments, "exp_avg_sq.");
    let masters = take_prefixed(&mut moments, "master.");
    if !masters.is_empty() {
        check_same_layout(&params, &masters, "master", &opt_path)?;
        params = masters;
    }
    if let Some(name) = moments.keys().next() {
        return Err(Error::Checkpoint(format!(
            "{} holds unexpected tensor '{name}'",
            opt_path.display()
        )));
    }
    check_same_layout(&params, &adam_m, "exp_avg", &opt_path)?;
    check_same_layout(&params, &adam_v, "exp_avg_sq", &opt_path)?;
    Ok(TrainState {
        step,
        params,
        adam_m,
        adam_v,
        extra,
    })
}

/// Removes the tensors named `prefix<name>` from `all`, returning them keyed by `<name>`.
fn take_prefixed(
    all: &mut BTreeMap<String, HostTensor>,
    prefix: &str,
) -> BTreeMap<String, HostTensor> {
    let names: Vec<String> = all
        .keys()
        .filter(|k| k.starts_with(prefix))
        .cloned()
        .collect();
    names
        .into_iter()
        .map(|k| {
            let t = all.remove(&k).expect("name was just listed");
            (k[prefix.len()..].to_string(), t)
        })
        .collect()
}

/// Checks that `moments` has exactly the names and shapes of `params`.
fn check_same_layout(
    params: &BTreeMap<String, HostTensor>,
    moments: &BTreeMap<String, HostTensor>,
    what: &str,
    place: &Path,
) -> Result<()> {
    let params: BTreeMap<String, &HostTensor> =
        params.iter().map(|(n, t)| (n.clone(), t)).collect();
    check_same_layout_of(&params, moments, what, place)
}

/// [`check_same_layout`] of borrowed weights.
fn check_same_layout_of(
    params: &BTreeMap<String, &HostTensor>,
    moments: &BTreeMap<String, HostTensor>,
    what: &str,
    place: &Path,
) -> Result<()> {
    // a frozen parameter (`--freeze`) keeps no optimizer state: a missing
    // moment is the optimizer's to refuse, for a parameter it trains
    for (name, p) in params {
        match moments.get(name) {
            None => {}
            Some(m) if m.shape != p.shape => {
                return Err(Error::Checkpoint(format!(
                    "{what} moment for '{name}' in {}: expected shape {:?}, found {:?}",
                    place.display(),
                    p.shape,
                    m.shape
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
