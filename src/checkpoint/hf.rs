//! Checkpoints on host memory: safetensors files, Hugging Face model
//! directories (`config.json` + `model.safetensors`, sharded or not), and
//! training state (weights, AdamW moments, step and schedule state).
//!
//! Tensors keep their HF names and layouts; nothing is permuted.

use crate::backend::tensor::DType;
use crate::error::{Error, Result};
use crate::model::Param;
use crate::model::config::ModelConfig;
use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use serde_json::{Value, json};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// A dense row-major f32 tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A tensor from its shape and data; errors if the lengths disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(Error::Checkpoint(format!(
                "shape {shape:?} holds {numel} values but {} were given",
                data.len()
            )));
        }
        Ok(HostTensor { shape, data })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let numel = shape.iter().product();
        HostTensor {
            shape,
            data: vec![0.0; numel],
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// A host tensor viewed as safetensors data in a chosen dtype; converted when written.
struct Encoded<'a> {
    tensor: &'a HostTensor,
    dtype: DType,
}

impl View for Encoded<'_> {
    fn dtype(&self) -> StDtype {
        match self.dtype {
            DType::F32 => StDtype::F32,
            DType::BF16 => StDtype::BF16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let d = &self.tensor.data;
        let bytes = match self.dtype {
            DType::F32 => d.iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::BF16 => d
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.data.len() * self.dtype.size()
    }
}

/// Writes `tensors` to a safetensors file in `dtype` (bf16 rounds to nearest
/// even), atomically: a temporary file is written, then renamed over `path`.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, &HostTensor)],
    dtype: DType,
) -> Result<()> {
    let mut seen = HashSet::new();
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(Error::Checkpoint(format!(
                "tensor '{name}' is given twice for {}",
                path.display()
            )));
        }
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(Error::Checkpoint(format!(
                "tensor '{name}' has shape {:?} but {} values",
                t.shape,
                t.data.len()
            )));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, t)| (name.as_str(), Encoded { tensor: t, dtype }));
    // transformers refuses safetensors files without a recognised "format".
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let tmp = temp_path(path);
    safetensors::serialize_to_file(views, Some(metadata), &tmp).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::Checkpoint(format!("writing {}: {e}", path.display()))
    })?;
    rename(&tmp, path)
}

/// Reads every tensor of a safetensors file as f32 (from F32, BF16 or F16).
pub fn load_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    load_safetensors_filtered(path, |_| true)
}

/// Reads the tensors of a safetensors file whose names pass `want`, as f32.
pub fn load_safetensors_filtered(
    path: &Path,
    want: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, HostTensor>> {
    Ok(read_safetensors(path, want)?.0)
}

/// The tensors of a safetensors file whose names pass `want`, as f32 (each
/// checked finite), and the names of the others.
fn read_safetensors(
    path: &Path,
    want: impl Fn(&str) -> bool,
) -> Result<(BTreeMap<String, HostTensor>, Vec<String>)> {
    crate::input_path::check_file(path, "checkpoint file")?;
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::Checkpoint(format!(
            "{} is not a valid safetensors file: {e}",
            path.display()
        ))
    })?;
    let mut out = BTreeMap::new();
    let mut skipped = Vec::new();
    for (name, view) in st.iter() {
        if !want(name) {
            skipped.push(name.to_string());
            continue;
        }
        let data = decode(view.dtype(), view.data()).map_err(|dtype| {
            Error::Checkpoint(format!(
                "tensor '{name}' in {} has dtype {dtype:?}; upipe reads F32, BF16 and F16",
                path.display()
            ))
        })?;
        check_finite(&data, name, path, 0)?;
        let tensor = HostTensor {
            shape: view.shape().to_vec(),
            data,
        };
        out.insert(name.to_string(), tensor);
    }
    Ok((out, skipped))
}

/// Errors at the first NaN or infinity of `values`, elements `first..` of
/// tensor `name` in `file`: one such weight makes every loss NaN.
pub fn check_finite(values: &[f32], name: &str, file: &Path, first: usize) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::Checkpoint(format!(
            "tensor '{name}' in {} holds {} at element {} (flat, row-major): a weight or \
             optimizer state must be finite; the file is corrupt or was saved from a diverged \
             run, so load an earlier checkpoint",
            file.display(),
            values[i],
            first + i
        ))),
    }
}

/// Little-endian bytes of `dtype` as f32 values; an unsupported dtype is returned as the error.
fn decode(dtype: StDtype, bytes: &[u8]) -> std::result::Result<Vec<f32>, StDtype> {
    Ok(match dtype {
        StDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(other),
    })
}

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// What a load does with tensors the model has no parameter for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExtraTensors {
    /// An error naming them (the default: the checkpoint is probably of
    /// another architecture, e.g. one with biases upipe would drop).
    #[default]
    Refuse,
    /// Skipped, with a warning naming them (`--allow-extra-tensors`).
    Ignore,
}

/// [`load_hf_model_with`], refusing extra tensors.
pub fn load_hf_model(dir: &Path, cfg: &ModelConfig) -> Result<BTreeMap<String, HostTensor>> {
    load_hf_model_with(dir, cfg, ExtraTensors::Refuse)
}

/// Loads the weights of an HF model directory (`model.safetensors`, or the
/// shards listed in `model.safetensors.index.json`) and checks them against
/// `cfg`: every expected tensor must be present with its exact shape and
/// finite values; a tensor `cfg` has no parameter for is an error or
/// skipped as `extras` says ([`check_extra_tensors`]).
pub fn load_hf_model_with(
    dir: &Path,
    cfg: &ModelConfig,
    extras: ExtraTensors,
) -> Result<BTreeMap<String, HostTensor>> {
    super::save_dir::finish_for_reading(dir)?;
    let expected = cfg.hf_param_shapes();
    let wanted: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    let mut loaded = BTreeMap::new();
    let mut source: HashMap<String, PathBuf> = HashMap::new();
    let (files, mut unwanted) = weight_files(dir, &wanted)?;
    for (file, names) in files {
        let (part, skipped) = read_safetensors(&file, |n| names.contains(n))?;
        unwanted.extend(skipped);
        for name in part.keys() {
            source.insert(name.clone(), file.clone());
        }
        loaded.extend(part);
    }
    check_extra_tensors(dir, cfg, unwanted.iter().map(String::as_str), extras)?;
    for (name, shape) in &expected {
        let Some(t) = loaded.get(name) else {
            return Err(missing_tensor(dir, name, shape, cfg));
        };
        if &t.shape != shape {
            return Err(Error::Checkpoint(format!(
                "tensor '{name}' in {}: expected shape {shape:?} for model '{}', found {:?}",
                source[name].display(),
                cfg.name,
                t.shape
            )));
        }
    }
    Ok(loaded)
}

/// Tensors `transformers` writes that carry no parameter: a model's RoPE
/// frequencies (`*.rotary_emb.inv_freq`, a buffer older versions saved),
/// and the LM head of a model whose head is tied to the embeddings (the
/// same values as the embedding, which is what upipe reads); the family
/// names them ([`ModelConfig::is_parameterless`]).
fn is_parameterless(name: &str, cfg: &ModelConfig) -> bool {
    cfg.is_parameterless(name)
}

/// Checks `names` (every tensor a checkpoint in `dir` holds, or any subset
/// including the ones not loaded) against `cfg`'s parameters: a tensor
/// that is not one, and not [`is_parameterless`], is an error naming the
/// first few, or with [`ExtraTensors::Ignore`] a warning (once per process).
pub fn check_extra_tensors<'a>(
    dir: &Path,
    cfg: &ModelConfig,
    names: impl IntoIterator<Item = &'a str>,
    extras: ExtraTensors,
) -> Result<()> {
    let params: HashSet<String> = cfg.hf_param_shapes().into_iter().map(|(n, _)| n).collect();
    let mut extra: Vec<&str> = names
        .into_iter()
        .filter(|n| !params.contains(*n) && !is_parameterless(n, cfg))
        .collect();
    extra.sort_unstable();
    extra.dedup();
    if extra.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 5;
    let mut list = extra[..extra.len().min(SHOWN)].join(", ");
    if extra.len() > SHOWN {
        list.push_str(&format!(" and {} more", extra.len() - SHOWN));
    }
    let (model, dir) = (&cfg.name, dir.display());
    let n = match extra.len() {
        1 => "1 tensor".to_string(),
        n => format!("{n} tensors"),
    };
    if extras == ExtraTensors::Ignore {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "--allow-extra-tensors: ignoring {n} of {dir} that model '{model}' has no parameter for: {list}"
            );
        });
        return Ok(());
    }
    Err(Error::Checkpoint(format!(
        "{dir} holds {n} that model '{model}' has no parameter for: {list}. Is the \
         checkpoint of another architecture (give its directory to --model too)? To load the \
         model's parameters and ignore these, add --allow-extra-tensors"
    )))
}

fn missing_tensor(dir: &Path, name: &str, shape: &[usize], cfg: &ModelConfig) -> Error {
    let hint = if name == cfg.hf_name(Param::LmHead) {
        "; if the checkpoint ties the LM head to the embeddings, set tie_word_embeddings true"
    } else {
        ""
    };
    Error::Checkpoint(format!(
        "tensor '{name}' (expected shape {shape:?} for model '{}') is missing from {}{hint}",
        cfg.name,
        dir.display()
    ))
}

/// A directory's weight files, each with the tensor names to take from it.
type WeightFiles<'a> = Vec<(PathBuf, HashSet<&'a str>)>;

/// The safetensors files of an HF model directory, each with the wanted
/// tensor names to take from it (the ones the index assigns to it, if
/// sharded), and the names the index lists that are not wanted.
fn weight_files<'a>(
    dir: &Path,
    wanted: &HashSet<&'a str>,
) -> Result<(WeightFiles<'a>, Vec<String>)> {
    crate::input_path::check_dir(dir, "model directory")?;
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let map = read_weight_map(&index)?;
        let mut by_file: BTreeMap<&str, HashSet<&'a str>> = BTreeMap::new();
        for name in wanted {
            if let Some(file) = map.get(*name) {
                by_file.entry(file.as_str()).or_default().insert(name);
            }
        }
        let files = by_file
            .into_iter()
            .map(|(file, names)| (dir.join(file), names))
            .collect();
        let unwanted = map.into_keys().filter(|n| !wanted.contains(n.as_str()));
        return Ok((files, unwanted.collect()));
    }
    let single = dir.join(SINGLE_FILE);
    if single.exists() {
        return Ok((vec![(single, wanted.clone())], Vec::new()));
    }
    Err(Error::Checkpoint(format!(
        "{} has neither {SINGLE_FILE} nor {INDEX_FILE}; point at an HF model directory",
        dir.display()
    )))
}

/// The `weight_map` (tensor name → shard file name) of a sharded index;
/// a file name that is not directly inside the directory is an error.
pub(crate) fn read_weight_map(index: &Path) -> Result<HashMap<String, String>> {
    crate::input_path::check_file(index, "checkpoint index")?;
    let text = std::fs::read_to_string(index)
        .map_err(|e| Error::io(format!("reading {}", index.display()), e))?;
    let bad = |why: String| Error::Checkpoint(format!("{} is malformed: {why}", index.display()));
    let value: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".to_string()))?;
    map.iter()
        .map(|(name, file)| match file.as_str() {
            Some(f) if is_plain_file_name(f) => Ok((name.clone(), f.to_string())),
            _ => Err(bad(format!(
                "entry for '{name}' is not a file name in the directory: {file}"
            ))),
        })
        .collect()
}

/// Whether `f` names a file directly inside the directory (no separators, no `..`).
pub(crate) fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains(['/', '\\'])
}

/// Writes an HF model directory: `config.json` and `model.safetensors` in
/// `dtype`, after checking that `tensors` are exactly `cfg`'s parameters.
pub fn save_hf_model(
    dir: &Path,
    cfg: &ModelConfig,
    tensors: &BTreeMap<String, HostTensor>,
    dtype: DType,
) -> Result<()> {
    let expected = cfg.hf_param_shapes();
    for (name, shape) in &expected {
        match tensors.get(name) {
            None => {
                return Err(missing_tensor(
                    Path::new("the tensors to save"),
                    name,
                    shape,
                    cfg,
                ));
            }
            Some(t) if &t.shape != shape => {
                return Err(Error::Checkpoint(format!(
                    "tensor '{name}': expected shape {shape:?} for model '{}', found {:?}",
                    cfg.name, t.shape
                )));
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = tensors
        .keys()
        .find(|k| !expected.iter().any(|(n, _)| n == *k))
    {
        return Err(Error::Checkpoint(format!(
            "tensor '{extra}' is not a parameter of model '{}'",
            cfg.name
        )));
    }
    create_dir(dir)?;
    let list: Vec<(String, &HostTensor)> = expected
        .iter()
        .map(|(n, _)| (n.clone(), &tensors[n]))
        .collect();
    save_safetensors(&dir.join(SINGLE_FILE), &list, dtype)?;
    write_atomic(&dir.join("config.json"), config_json(cfg, dtype).as_bytes())
}

/// `cfg.to_hf_json()` with `torch_dtype` set to the dtype the weights are stored in.
fn config_json(cfg: &ModelConfig, dtype: DType) -> String {
    let mut value: Value =
        serde_json::from_str(&cfg.to_hf_json()).expect("to_hf_json writes valid JSON");
    let name = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
    };
    value["torch_dtype"] = json!(name);
    serde_json::to_string_pretty(&value).expect("a JSON value always serialises")
}

const STATE_FILE: &str = "state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
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

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))
}

pub(crate) fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", path.display()), e))
        }
        _ => Ok(()),
    }
}

/// `path` with `.tmp-<pid>` appended, in the same directory (so rename is atomic).
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|e| {
        let _ = std::fs::remove_file(from);
        Error::io(
            format!("renaming {} to {}", from.display(), to.display()),
            e,
        )
    })
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh empty directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("upipe-ckpt-{}-{tag}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Deterministic pseudo-random values in [-2, 2) that are not bf16-exact.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn random_model(cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
        cfg.hf_param_shapes()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n = shape.iter().product();
                (name, HostTensor::new(shape, values(n, i as u32)).unwrap())
            })
            .collect()
    }

    fn small_qwen() -> ModelConfig {
        ModelConfig {
            name: "small-qwen".into(),
            family: crate::model::Family::Qwen3,
            tie_embeddings: true,
            ..ModelConfig::preset("tiny").unwrap()
        }
    }

    fn checkpoint_error<T>(r: Result<T>) -> String {
        match r {
            Err(Error::Checkpoint(m)) => m,
            Err(e) => panic!("expected a checkpoint error, got {e}"),
            Ok(_) => panic!("expected a checkpoint error, got Ok"),
        }
    }

    #[test]
    fn host_tensor_checks_its_length() {
        assert!(HostTensor::new(vec![2, 3], vec![0.0; 6]).is_ok());
        assert!(HostTensor::new(vec![2, 3], vec![0.0; 5]).is_err());
        assert_eq!(HostTensor::zeros(vec![4, 5]).numel(), 20);
    }

    #[test]
    fn safetensors_f32_round_trip_is_exact() {
        let dir = TempDir::new("f32");
        let a = HostTensor::new(vec![3, 5], values(15, 1)).unwrap();
        let b = HostTensor::new(vec![7], values(7, 2)).unwrap();
        let scalar = HostTensor::new(vec![], vec![1.5]).unwrap();
        let path = dir.0.join("t.safetensors");
        let list = [
            ("a".to_string(), &a),
            ("b".to_string(), &b),
            ("s".to_string(), &scalar),
        ];
        save_safetensors(&path, &list, DType::F32).unwrap();
        let back = load_safetensors(&path).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back["a"], a);
        assert_eq!(back["b"], b);
        assert_eq!(back["s"], scalar);
        let leftovers: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file may remain");
    }

    #[test]
    fn safetensors_bf16_round_trip_is_within_rounding() {
        let dir = TempDir::new("bf16");
        let a = HostTensor::new(vec![64, 33], values(64 * 33, 3)).unwrap();
        let path = dir.0.join("t.safetensors");
        save_safetensors(&path, &[("a".to_string(), &a)], DType::BF16).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize % 2, 0);
        let back = load_safetensors(&path).unwrap().remove("a").unwrap();
        assert_eq!(back.shape, a.shape);
        let mut changed = 0;
        for (x, y) in a.data.iter().zip(&back.data) {
            // bf16 keeps 8 significant bits: round-to-nearest error ≤ 2^-8 relative.
            assert!((x - y).abs() <= x.abs() / 256.0, "{x} vs {y}");
            assert_eq!(*y, bf16::from_f32(*x).to_f32());
            changed += usize::from(x != y);
        }
        assert!(changed > 0, "values were chosen not to be bf16-exact");
    }

    #[test]
    fn f16_files_are_read() {
        let dir = TempDir::new("f16");
        let vals = [0.5f32, -1.25, 3.0];
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(StDtype::F16, vec![3], &bytes).unwrap();
        let path = dir.0.join("h.safetensors");
        safetensors::serialize_to_file([("h", view)], None, &path).unwrap();
        assert_eq!(load_safetensors(&path).unwrap()["h"].data, vals);
    }

    #[test]
    fn malformed_and_unsupported_files_are_refused() {
        let dir = TempDir::new("bad");
        let path = dir.0.join("junk.safetensors");
        std::fs::write(&path, b"definitely not safetensors").unwrap();
        let m = checkpoint_error(load_safetensors(&path));
        assert!(
            m.contains("junk.safetensors") && m.contains("not a valid safetensors"),
            "{m}"
        );
        let ints = [1i32, 2];
        let bytes: Vec<u8> = ints.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(StDtype::I32, vec![2], &bytes).unwrap();
        safetensors::serialize_to_file([("ids", view)], None, &path).unwrap();
        let m = checkpoint_error(load_safetensors(&path));
        assert!(m.contains("'ids'") && m.contains("I32"), "{m}");
        let t = HostTensor::zeros(vec![2]);
        let dup = [("x".to_string(), &t), ("x".to_string(), &t)];
        assert!(checkpoint_error(save_safetensors(&path, &dup, DType::F32)).contains("twice"));
    }

    #[test]
    fn hf_model_round_trip_is_exact() {
        for cfg in [ModelConfig::preset("tiny").unwrap(), small_qwen()] {
            let dir = TempDir::new("hf");
            let weights = random_model(&cfg);
            save_hf_model(&dir.0, &cfg, &weights, DType::F32).unwrap();
            let cfg_back = ModelConfig::resolve(dir.0.to_str().unwrap()).unwrap();
            assert_eq!(cfg_back, cfg);
            let text = std::fs::read_to_string(dir.0.join("config.json")).unwrap();
            assert!(text.contains("\"torch_dtype\": \"float32\""));
            assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), weights);
        }
    }

    #[test]
    fn hf_model_bf16_save_loads_rounded() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("hf-bf16");
        let weights = random_model(&cfg);
        save_hf_model(&dir.0, &cfg, &weights, DType::BF16).unwrap();
        let back = load_hf_model(&dir.0, &cfg).unwrap();
        let w = &weights["model.layers.1.mlp.down_proj.weight"].data;
        let b = &back["model.layers.1.mlp.down_proj.weight"].data;
        assert!(
            w.iter()
                .zip(b)
                .all(|(x, y)| *y == bf16::from_f32(*x).to_f32())
        );
    }

    #[test]
    fn hf_load_refuses_wrong_shapes_and_missing_tensors() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("hf-wrong");
        let mut weights = random_model(&cfg);
        let name = "model.layers.1.self_attn.k_proj.weight";
        weights.insert(name.into(), HostTensor::zeros(vec![64, 64]));
        let list: Vec<(String, &HostTensor)> =
            weights.iter().map(|(n, t)| (n.clone(), t)).collect();
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(
            m.contains(name) && m.contains("[32, 64]") && m.contains("[64, 64]"),
            "{m}"
        );

        weights.remove(name);
        let list: Vec<(String, &HostTensor)> =
            weights.iter().map(|(n, t)| (n.clone(), t)).collect();
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(
            m.contains(name) && m.contains("missing") && m.contains("[32, 64]"),
            "{m}"
        );

        let m = checkpoint_error(save_hf_model(&dir.0, &cfg, &weights, DType::F32));
        assert!(m.contains(name), "{m}");

        let empty = TempDir::new("hf-empty");
        let m = checkpoint_error(load_hf_model(&empty.0, &cfg));
        assert!(m.contains(INDEX_FILE), "{m}");
    }

    #[test]
    fn hf_load_refuses_extras_unless_allowed_but_not_parameterless_tensors() {
        let cfg = small_qwen();
        let dir = TempDir::new("hf-extra");
        let mut weights = random_model(&cfg);
        let inv_freq = HostTensor::zeros(vec![8]);
        let head = HostTensor::zeros(vec![256, 64]);
        let mut list: Vec<(String, &HostTensor)> =
            weights.iter().map(|(n, t)| (n.clone(), t)).collect();
        list.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            &inv_freq,
        ));
        list.push(("lm_head.weight".into(), &head));
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        // written by transformers, no parameter: accepted silently
        assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), weights);

        // biases upipe has no parameter for: named, counted, the fix said
        let bias = HostTensor::zeros(vec![64]);
        let biases: Vec<String> = (0..7)
            .map(|l| format!("model.layers.{l}.self_attn.q_proj.bias"))
            .collect();
        list.extend(biases.iter().map(|n| (n.clone(), &bias)));
        save_safetensors(&dir.0.join(SINGLE_FILE), &list, DType::F32).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(
            m.contains("7 tensors")
                && m.contains(&biases[0])
                && m.contains("and 2 more")
                && m.contains("--allow-extra-tensors"),
            "{m}"
        );
        let ignored = load_hf_model_with(&dir.0, &cfg, ExtraTensors::Ignore).unwrap();
        assert_eq!(ignored, weights);

        let untied = ModelConfig {
            tie_embeddings: false,
            ..cfg.clone()
        };
        weights.insert("lm_head.weight".into(), head.clone());
        let loaded = load_hf_model_with(&dir.0, &untied, ExtraTensors::Ignore).unwrap();
        assert_eq!(loaded, weights);
    }

    #[test]
    fn extras_listed_only_by_a_sharded_index_are_refused_too() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("hf-extra-index");
        let weights = random_model(&cfg);
        let list: Vec<(String, &HostTensor)> =
            weights.iter().map(|(n, t)| (n.clone(), t)).collect();
        let file = "model-00001-of-00002.safetensors";
        save_safetensors(&dir.0.join(file), &list, DType::F32).unwrap();
        let extra = HostTensor::zeros(vec![64]);
        let other = "model-00002-of-00002.safetensors";
        save_safetensors(&dir.0.join(other), &[("x.bias".into(), &extra)], DType::F32).unwrap();
        let mut map: serde_json::Map<String, Value> =
            weights.keys().map(|n| (n.clone(), json!(file))).collect();
        map.insert("x.bias".into(), json!(other));
        let index = json!({ "weight_map": map });
        std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(m.contains("1 tensor ") && m.contains("x.bias"), "{m}");
        let loaded = load_hf_model_with(&dir.0, &cfg, ExtraTensors::Ignore).unwrap();
        assert_eq!(loaded, weights);
    }

    #[test]
    fn non_finite_weights_and_moments_are_refused_naming_tensor_file_and_index() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("nan");
        let params = random_model(&cfg);
        let name = "model.layers.1.mlp.up_proj.weight";
        for bad in [f32::NAN, f32::INFINITY] {
            let mut broken = params.clone();
            broken.get_mut(name).unwrap().data[77] = bad;
            save_hf_model(&dir.0, &cfg, &broken, DType::BF16).unwrap();
            let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
            assert!(
                m.contains(name) && m.contains(SINGLE_FILE) && m.contains("element 77"),
                "{m}"
            );
            let f = crate::checkpoint::ranged::RangedFile::open(&dir.0.join(SINGLE_FILE)).unwrap();
            let m = checkpoint_error(f.read(name, 50..100));
            assert!(m.contains(name) && m.contains("element 77"), "{m}");
            assert!(f.read(name, 0..77).is_ok(), "the finite part reads");
        }
        let mut v = params.clone();
        v.get_mut("model.norm.weight").unwrap().data[3] = f32::NAN;
        save_train_state(&dir.0, 1, &params, &params, &v, &json!(null)).unwrap();
        let m = checkpoint_error(load_train_state(&dir.0));
        assert!(
            m.contains("exp_avg_sq.model.norm.weight")
                && m.contains(OPTIMIZER_FILE)
                && m.contains("element 3"),
            "{m}"
        );
    }

    #[test]
    fn sharded_index_is_followed() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("sharded");
        let weights = random_model(&cfg);
        let names: Vec<&String> = weights.keys().collect();
        let (first, second) = names.split_at(names.len() / 2);
        let mut map = serde_json::Map::new();
        for (file, part) in [
            ("model-00001-of-00002.safetensors", first),
            ("model-00002-of-00002.safetensors", second),
        ] {
            let list: Vec<(String, &HostTensor)> =
                part.iter().map(|n| ((*n).clone(), &weights[*n])).collect();
            save_safetensors(&dir.0.join(file), &list, DType::BF16).unwrap();
            for n in part {
                map.insert((*n).clone(), json!(file));
            }
        }
        let index = json!({ "metadata": { "total_size": 0 }, "weight_map": map });
        std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
        let back = load_hf_model(&dir.0, &cfg).unwrap();
        assert_eq!(back.len(), weights.len());
        for (name, t) in &weights {
            let rounded: Vec<f32> = t.data.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            assert_eq!(back[name].data, rounded, "{name}");
        }

        let missing_name = second[0].clone();
        map.remove(&missing_name);
        let index = json!({ "weight_map": map });
        std::fs::write(dir.0.join(INDEX_FILE), index.to_string()).unwrap();
        assert!(checkpoint_error(load_hf_model(&dir.0, &cfg)).contains(&missing_name));

        std::fs::write(
            dir.0.join(INDEX_FILE),
            "{\"weight_map\": {\"x\": \"../evil\"}}",
        )
        .unwrap();
        let m = checkpoint_error(load_hf_model(&dir.0, &cfg));
        assert!(m.contains(INDEX_FILE) && m.contains("'x'"), "{m}");
        std::fs::write(dir.0.join(INDEX_FILE), "[]").unwrap();
        assert!(checkpoint_error(load_hf_model(&dir.0, &cfg)).contains("weight_map"));
    }

    #[test]
    fn train_state_round_trips() {
        let cfg = small_qwen();
        let dir = TempDir::new("train");
        let params = random_model(&cfg);
        let shift = |d: u32| -> BTreeMap<String, HostTensor> {
            params
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        HostTensor::new(t.shape.clone(), values(t.numel(), d)).unwrap(),
                    )
                })
                .collect()
        };
        let (m, v) = (shift(100), shift(200));
        let extra = json!({ "rng": [1, 2, 3], "lr": 3e-4, "sampler": { "epoch": 2, "cursor": 5 } });
        save_train_state(&dir.0, 42, &params, &m, &v, &extra).unwrap();
        let state = load_train_state(&dir.0).unwrap();
        assert_eq!(state.step, 42);
        assert_eq!(state.params, params);
        assert_eq!(state.adam_m, m);
        assert_eq!(state.adam_v, v);
        assert_eq!(state.extra, extra);
        // The weights file is also a valid HF weights file for the model.
        assert_eq!(load_hf_model(&dir.0, &cfg).unwrap(), params);

        save_train_state(&dir.0, 43, &params, &v, &m, &json!(null)).unwrap();
        let state = load_train_state(&dir.0).unwrap();
        assert_eq!((state.step, state.adam_m == v), (43, true));
    }

    #[test]
    fn train_state_refuses_mismatched_moments() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let dir = TempDir::new("train-bad");
        let params = random_model(&cfg);
        let mut m = params.clone();
        m.insert("model.norm.weight".into(), HostTensor::zeros(vec![3]));
        let m_err = checkpoint_error(save_train_state(
            &dir.0,
            1,
            &params,
            &m,
            &params,
            &json!({}),
        ));
        assert!(
            m_err.contains("model.norm.weight") && m_err.contains("[3]"),
            "{m_err}"
        );
        assert!(!dir.0.join(STATE_FILE).exists());
        let err = load_train_state(&dir.0).unwrap_err().to_string();
        assert!(err.contains("state.json"), "{err}");
        std::fs::write(dir.0.join(STATE_FILE), "{\"version\": 99, \"step\": 1}").unwrap();
        assert!(checkpoint_error(load_train_state(&dir.0)).contains("version 99"));
    }
}
