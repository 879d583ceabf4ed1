//! A training checkpoint read back: one tensor at a time ([`SavedState`]:
//! `state.json` and the files' headers are read and checked when it is
//! opened, each tensor's values when a resume restores it, so a resume
//! holds one tensor in host memory however large the model), or whole
//! ([`load_train_state`]).

use super::peft_config::ADAPTER_WEIGHTS;
use super::ranged::{RangedFile, RangedModel};
use super::tensor_file::HostTensor;
use super::train_state::{
    OPTIMIZER_FILE, STATE_FILE, STATE_VERSION, check_same_layout_of, is_adapter_only,
};
use crate::error::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// Loads a checkpoint written by [`super::save_train_state`] (or
/// [`super::save_adapter_state`]: its `params` are then the adapter's
/// factors) into host memory whole; a resume reads it tensor by tensor
/// instead ([`SavedState`]).
pub fn load_train_state(dir: &Path) -> Result<TrainState> {
    SavedState::open(dir)?.read_all()
}

/// One of AdamW's moments, as a checkpoint names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// The first moment (`exp_avg.<name>`).
    ExpAvg,
    /// The second moment (`exp_avg_sq.<name>`).
    ExpAvgSq,
}

impl Moment {
    fn prefix(self) -> &'static str {
        match self {
            Moment::ExpAvg => "exp_avg.",
            Moment::ExpAvgSq => "exp_avg_sq.",
        }
    }
}

const MASTER: &str = "master.";

/// Where a checkpoint's weights are: its HF model files, or a LoRA
/// checkpoint's adapter file.
enum WeightFiles {
    Model(RangedModel),
    Adapter(RangedFile),
}

/// A training checkpoint ([`super::save_train_state_as`]'s or
/// [`super::save_adapter_state`]'s) opened for reading tensor by tensor.
pub struct SavedState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Caller-defined state (RNG, schedule, sampler position, ...).
    pub extra: Value,
    weights: WeightFiles,
    optimizer: RangedFile,
    /// Each parameter's shape by name (HF names; PEFT's for an adapter).
    shapes: BTreeMap<String, Vec<usize>>,
    /// Whether the optimizer file holds F32 masters.
    masters: bool,
    dir: PathBuf,
}

impl SavedState {
    /// Opens the checkpoint in `dir`: reads `state.json` (its version and
    /// step) and every file's header, and checks that the moments (and
    /// masters) have the names and shapes of the weights. No value is read.
    pub fn open(dir: &Path) -> Result<SavedState> {
        let (step, extra) = read_state_file(dir)?;
        // a LoRA checkpoint holds its adapter, not the base it was trained on
        let (weights, shapes) = match is_adapter_only(dir) {
            true => {
                let file = RangedFile::open(&dir.join(ADAPTER_WEIGHTS))?;
                let shapes = file.tensors().map(|(n, s)| (n.to_string(), s.to_vec()));
                let shapes = shapes.collect();
                (WeightFiles::Adapter(file), shapes)
            }
            false => {
                let model = RangedModel::open(dir)?;
                let shapes = model.tensors().map(|(n, s)| (n.to_string(), s.to_vec()));
                let shapes = shapes.collect();
                (WeightFiles::Model(model), shapes)
            }
        };
        let opt_path = dir.join(OPTIMIZER_FILE);
        let optimizer = RangedFile::open(&opt_path)?;
        let masters = check_optimizer_layout(&shapes, &optimizer, &opt_path)?;
        Ok(SavedState {
            step,
            extra,
            weights,
            optimizer,
            shapes,
            masters,
            dir: dir.to_path_buf(),
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parameters' names (HF's; PEFT's for a LoRA checkpoint), sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.shapes.keys().map(String::as_str)
    }

    /// The shape of parameter `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(Vec::as_slice)
    }

    /// The F32 values a run continues from for parameter `name`: its master
    /// where the checkpoint kept one (weight files narrower than F32), else
    /// the weight files' values. The weight files' values are checked
    /// finite either way.
    pub fn value(&self, name: &str) -> Result<HostTensor> {
        let shape = self.shape(name).ok_or_else(|| {
            Error::Checkpoint(format!(
                "tensor {name} is missing from the checkpoint in {} (is it a checkpoint of \
                 this model?)",
                self.dir.display()
            ))
        })?;
        let all = 0..shape.iter().product();
        let master = format!("{MASTER}{name}");
        // the weight files are read even where a master is: a non-finite
        // weight there is refused as a corrupt checkpoint
        let weights = match &self.weights {
            WeightFiles::Model(model) => model.read(name, all.clone())?,
            WeightFiles::Adapter(file) => file.read(name, all.clone())?,
        };
        let data = match self.masters && self.optimizer.contains(&master) {
            true => {
                drop(weights);
                self.optimizer.read(&master, all)?
            }
            false => weights,
        };
        HostTensor::new(shape.to_vec(), data)
    }

    /// Parameter `name`'s `moment`; `None` where the checkpoint holds none
    /// (a frozen parameter).
    pub fn moment(&self, moment: Moment, name: &str) -> Result<Option<HostTensor>> {
        let key = format!("{}{name}", moment.prefix());
        let Some(shape) = self.optimizer.shape(&key) else {
            return Ok(None);
        };
        let shape = shape.to_vec();
        let data = self.optimizer.read(&key, 0..shape.iter().product())?;
        Ok(Some(HostTensor::new(shape, data)?))
    }

    /// Every parameter's [`value`](Self::value) in host memory at once
    /// (a LoRA checkpoint's adapter, small beside its base).
    pub fn values(&self) -> Result<BTreeMap<String, HostTensor>> {
        let values = self.names().map(|n| Ok((n.to_string(), self.value(n)?)));
        values.collect()
    }

    /// Every tensor of the checkpoint in host memory at once.
    pub fn read_all(&self) -> Result<TrainState> {
        let params = self.values()?;
        let (mut adam_m, mut adam_v) = (BTreeMap::new(), BTreeMap::new());
        for name in self.names() {
            for (moment, into) in [
                (Moment::ExpAvg, &mut adam_m),
                (Moment::ExpAvgSq, &mut adam_v),
            ] {
                if let Some(t) = self.moment(moment, name)? {
                    into.insert(name.to_string(), t);
                }
            }
        }
        Ok(TrainState {
            step: self.step,
            params,
            adam_m,
            adam_v,
            extra: self.extra.clone(),
        })
    }
}

/// Reads `dir`'s `state.json`: its step and caller state, refusing another
/// version.
fn read_state_file(dir: &Path) -> Result<(u64, Value)> {
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
    Ok((step, state.get("extra").cloned().unwrap_or(Value::Null)))
}

/// Checks the optimizer file's header against the weights' `shapes`: its
/// masters, first and second moments each have the weights' names and
/// shapes (a frozen parameter has none), and it holds nothing else.
/// Returns whether it holds masters.
fn check_optimizer_layout(
    shapes: &BTreeMap<String, Vec<usize>>,
    optimizer: &RangedFile,
    path: &Path,
) -> Result<bool> {
    let params: BTreeMap<String, &[usize]> = shapes
        .iter()
        .map(|(n, s)| (n.clone(), s.as_slice()))
        .collect();
    let of = |prefix: &str| -> BTreeMap<String, &[usize]> {
        let tensors = optimizer.tensors();
        let named = tensors.filter_map(|(n, s)| Some((n.strip_prefix(prefix)?.to_string(), s)));
        named.collect()
    };
    let masters = of(MASTER);
    check_same_layout_of(&params, &masters, "master", path)?;
    let known = [Moment::ExpAvg.prefix(), Moment::ExpAvgSq.prefix(), MASTER];
    let mut names: Vec<&str> = optimizer.tensors().map(|(n, _)| n).collect();
    names.sort_unstable();
    if let Some(name) = names
        .iter()
        .find(|n| !known.iter().any(|p| n.starts_with(p)))
    {
        return Err(Error::Checkpoint(format!(
            "{} holds unexpected tensor '{name}'",
            path.display()
        )));
    }
    check_same_layout_of(&params, &of(Moment::ExpAvg.prefix()), "exp_avg", path)?;
    check_same_layout_of(&params, &of(Moment::ExpAvgSq.prefix()), "exp_avg_sq", path)?;
    Ok(!masters.is_empty())
}
