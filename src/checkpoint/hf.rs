//! Hugging Face model directories: `config.json` + `model.safetensors`,
//! sharded (`model.safetensors.index.json`) or not. Tensors keep their HF
//! names and layouts; nothing is permuted.

use super::fs::{create_dir, is_plain_file_name, write_atomic};
use super::save_dtype::SaveDtype;
use super::tensor_file::{HostTensor, read_safetensors, save_safetensors};
use crate::error::{Error, Result};
use crate::model::Param;
use crate::model::config::ModelConfig;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

pub(super) const SINGLE_FILE: &str = "model.safetensors";
pub(super) const INDEX_FILE: &str = "model.safetensors.index.json";

/// What a load does with tensors the model has no parameter for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExtraTensors {
    /// An error naming them (the default: the checkpoint is probably of
    /// another architecture, e.g. one with biases upipe would drop).
    #[default]
    Refuse,
    /// Skipped, with a warning naming them (`--allow-extra-tensors`).
    Ignore,
    /// A LoRA checkpoint's adapter factors (PEFT's names) skipped quietly,
    /// as the adapter is read on its own (`--lora-from`); any other extra
    /// refused.
    Adapters,
}

impl ExtraTensors {
    /// The policy for a checkpoint whose adapter factors are read on their
    /// own (`adapters`: a LoRA run's resume, `eval --lora-from`):
    /// [`Adapters`](Self::Adapters) in place of `Refuse`; `Ignore` stays.
    pub fn beside_adapters(self, adapters: bool) -> Self {
        match (self, adapters) {
            (ExtraTensors::Refuse, true) => ExtraTensors::Adapters,
            (extras, _) => extras,
        }
    }
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
    refuse_adapter_dir(dir, "the model directory")?;
    let expected = cfg.hf_param_shapes();
    // another name a checkpoint may store a parameter under → its own
    let aliases: HashMap<String, &str> = expected
        .iter()
        .flat_map(|(n, _)| {
            cfg.family
                .stored_aliases(n)
                .into_iter()
                .map(move |a| (a, n.as_str()))
        })
        .collect();
    let mut wanted: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    wanted.extend(aliases.keys().map(String::as_str));
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
    for (alias, name) in &aliases {
        if let Some(t) = loaded.remove(alias) {
            source.insert(name.to_string(), source[alias].clone());
            loaded.insert(name.to_string(), t);
        }
    }
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

/// An adapter directory (a LoRA checkpoint, or PEFT's `save_pretrained`)
/// given where a model is read (`what`: the flag): an error naming the base
/// its `adapter_config.json` names, `--lora-from` and `upipe merge`.
pub fn refuse_adapter_dir(dir: &Path, what: &str) -> Result<()> {
    let config = dir.join(super::peft_config::ADAPTER_CONFIG);
    let has_model = [SINGLE_FILE, INDEX_FILE]
        .iter()
        .any(|f| dir.join(f).exists());
    if has_model || !config.is_file() {
        return Ok(());
    }
    let base = std::fs::read_to_string(&config)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("base_model_name_or_path")?.as_str().map(String::from))
        .unwrap_or_else(|| "BASE".into());
    crate::config_err!(
        "{what} {} is a LoRA adapter (adapter_config.json), not a model: it holds no base \
         weights. Give its base model ({base}) there and the adapter as --lora-from {}, or \
         merge them into one model with `upipe merge {base} {} OUT`",
        dir.display(),
        dir.display(),
        dir.display()
    )
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
    let is_adapter = |n: &&str| n.starts_with(crate::model::lora::PEFT_LAYER_PREFIX);
    if extras == ExtraTensors::Adapters {
        extra.retain(|n| !is_adapter(n));
    } else if !extra.is_empty() && extra.iter().all(is_adapter) && extras == ExtraTensors::Refuse {
        return Err(Error::Checkpoint(format!(
            "{} is a LoRA checkpoint: it holds {} adapter tensors beside model '{}''s \
             parameters; use the base and the adapter with --lora-from {}, or the base alone \
             with --allow-extra-tensors",
            dir.display(),
            extra.len(),
            cfg.name,
            dir.display()
        )));
    }
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

/// Writes an HF model directory: `config.json` and `model.safetensors` in
/// `dtype`, after checking that `tensors` are exactly `cfg`'s parameters.
pub fn save_hf_model(
    dir: &Path,
    cfg: &ModelConfig,
    tensors: &BTreeMap<String, HostTensor>,
    dtype: impl Into<SaveDtype>,
) -> Result<()> {
    let dtype = dtype.into();
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
    let config = super::hf_config::checkpoint_config(None, cfg, dtype);
    write_atomic(&dir.join("config.json"), config.as_bytes())
}
