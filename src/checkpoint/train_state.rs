//! Training state: weights, AdamW moments, the step and the caller's state
//! (`state.json`), written so that a directory whose `state.json` is present
//! has all its files.

use super::fs::{create_dir, remove_if_exists, write_atomic};
use super::hf::SINGLE_FILE;
use super::tensor_file::{HostTensor, load_safetensors, save_safetensors};
use crate::backend::tensor::DType;
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
    /// Weights, by HF name.
    pub params: BTreeMap<String, HostTensor>,
    /// AdamW first moments, same names and shapes as `params`.
    pub adam_m: BTreeMap<String, HostTensor>,
    /// AdamW second moments, same names and shapes as `params`.
    pub adam_v: BTreeMap<String, HostTensor>,
    /// Caller-defined state (RNG, schedule, sampler position, ...).
    pub extra: Value,
}

/// Saves a training checkpoint into `dir`: weights in `model.safetensors` (f32,
/// HF names), moments in `optimizer.safetensors` (`exp_avg.<name>`,
/// `exp_avg_sq.<name>`), and `state.json` with the step and `extra`. Each file
/// is written to a temporary name and renamed; `state.json` goes last, so a
/// directory whose `state.json` is present has all its files.
pub fn save_train_state(
    dir: &Path,
    step: u64,
    params: &BTreeMap<String, HostTensor>,
    adam_m: &BTreeMap<String, HostTensor>,
    adam_v: &BTreeMap<String, HostTensor>,
    extra: &Value,
) -> Result<()> {
    check_same_layout(params, adam_m, "exp_avg", Path::new("the state to save"))?;
    check_same_layout(params, adam_v, "exp_avg_sq", Path::new("the state to save"))?;
    create_dir(dir)?;
    // A crash from here on must not leave an old state.json next to new weights.
    remove_if_exists(&dir.join(STATE_FILE))?;
    let weights: Vec<(String, &HostTensor)> = params.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.join(SINGLE_FILE), &weights, DType::F32)?;
    let moments: Vec<(String, &HostTensor)> = adam_m
        .iter()
        .map(|(n, t)| (format!("exp_avg.{n}"), t))
        .chain(adam_v.iter().map(|(n, t)| (format!("exp_avg_sq.{n}"), t)))
        .collect();
    save_safetensors(&dir.join(OPTIMIZER_FILE), &moments, DType::F32)?;
    let state = json!({ "version": STATE_VERSION, "step": step, "extra": extra });
    let text = serde_json::to_string_pretty(&state).expect("a JSON value always serialises");
    write_atomic(&dir.join(STATE_FILE), text.as_bytes())
}

/// Loads a checkpoint written by [`save_train_state`].
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
    let params = load_safetensors(&dir.join(SINGLE_FILE))?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let mut moments = load_safetensors(&opt_path)?;
    let adam_m = take_prefixed(&mut moments, "exp_avg.");
    let adam_v = take_prefixed(&mut moments, "exp_avg_sq.");
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
    for (name, p) in params {
        match moments.get(name) {
            None => {
                return Err(Error::Checkpoint(format!(
                    "{what} moment for '{name}' is missing in {}",
                    place.display()
                )));
            }
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
