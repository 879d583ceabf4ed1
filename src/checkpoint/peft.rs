//! PEFT adapter directories: `adapter_config.json` (`peft_config.rs`) and
//! `adapter_model.safetensors`, the factors under PEFT's names
//! (`base_model.model.model.layers.{N}.self_attn.q_proj.lora_A.weight`,
//! `...mlp.gate_proj.lora_B.weight`; PEFT strips the adapter's name when
//! it saves, and a name that keeps it, `lora_A.default.weight`, is read
//! too). Written in F32, BF16 or F16; read from any of them, every tensor
//! checked against the model it is loaded for.

use super::fs::{create_dir, write_atomic};
use super::peft_config::{ADAPTER_CONFIG, PeftConfig, adapter_config_json, parse_adapter_config};
use super::save_dtype::SaveDtype;
use super::tensor_file::{HostTensor, read_safetensors, save_safetensors};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
pub use crate::model::lora::{Factor, tensor_name};
use crate::model::lora::{LoraFactors, LoraTarget, LoraWeights, PEFT_LAYER_PREFIX as PREFIX};
use std::collections::BTreeMap;
use std::path::Path;

pub use super::peft_config::ADAPTER_WEIGHTS;

/// The block, target and factor a PEFT tensor name stands for, if it is
/// one (with or without the adapter's name `default`).
fn parse_tensor_name(name: &str) -> Option<(usize, LoraTarget, Factor)> {
    let rest = name.strip_prefix(PREFIX)?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let rest = rest.strip_suffix(".weight")?;
    let rest = rest.strip_suffix(".default").unwrap_or(rest);
    let (module, factor) = rest.rsplit_once('.')?;
    let factor = match factor {
        "lora_A" => Factor::A,
        "lora_B" => Factor::B,
        _ => return None,
    };
    let target = LoraTarget::ALL
        .into_iter()
        .find(|t| t.module_path() == module)?;
    Some((layer, target, factor))
}

/// An adapter read from a directory, checked against a model.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftAdapter {
    pub weights: LoraWeights,
    /// Its `adapter_config.json` beyond the LoRA config.
    pub config: PeftConfig,
}

/// Writes `weights` as a PEFT adapter directory `dir` (created if
/// missing): `adapter_config.json` naming `base_model`, and
/// `adapter_model.safetensors` in `dtype`. A file of those names that
/// upipe's manifest of `dir` does not list is refused, never replaced
/// (`save_dir.rs`'s rule: the owner's files are the owner's).
pub fn write_adapter(
    dir: &Path,
    weights: &LoraWeights,
    base_model: &str,
    dtype: SaveDtype,
) -> Result<()> {
    create_dir(dir)?;
    for name in [ADAPTER_CONFIG, ADAPTER_WEIGHTS] {
        if !super::save_dir::may_write(dir, name)? {
            return crate::config_err!(
                "{} already exists and upipe did not write it; an adapter is saved into a \
                 directory without one, so give another directory or move that file away",
                dir.join(name).display()
            );
        }
    }
    let tensors = adapter_tensors(weights)?;
    let refs: Vec<(String, &HostTensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.join(ADAPTER_WEIGHTS), &refs, dtype)?;
    let config = adapter_config_json(&weights.config, base_model);
    let text = serde_json::to_string_pretty(&config).expect("a JSON value always serialises");
    write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())
}

/// Every factor of `weights` under its PEFT name, in block and target
/// order (`A` then `B`), with PEFT's shapes.
pub fn adapter_tensors(weights: &LoraWeights) -> Result<Vec<(String, HostTensor)>> {
    let mut tensors = Vec::new();
    for (l, factors) in weights.layers.iter().enumerate() {
        for (&target, f) in weights.config.targets.iter().zip(factors) {
            let d = f.dims;
            let a = HostTensor::new(vec![d.rank, d.in_features], f.a.clone())?;
            let b = HostTensor::new(vec![d.out_features, d.rank], f.b.clone())?;
            tensors.push((tensor_name(l, target, Factor::A), a));
            tensors.push((tensor_name(l, target, Factor::B), b));
        }
    }
    Ok(tensors)
}

/// Reads the PEFT adapter directory `dir` for `cfg`'s model: its config
/// (refused where upipe cannot apply it exactly, `peft_config.rs`; the
/// rank checked against the model), and every factor of every block and
/// target, each with the shape `cfg`'s model needs. A tensor the config
/// does not account for, or one missing, is an error naming it.
pub fn read_adapter(dir: &Path, cfg: &ModelConfig) -> Result<PeftAdapter> {
    crate::input_path::check_dir(dir, "adapter directory")?;
    super::save_dir::finish_for_reading(dir)?;
    let config_path = dir.join(ADAPTER_CONFIG);
    crate::input_path::check_file(&config_path, "adapter config")?;
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| Error::io(format!("reading {}", config_path.display()), e))?;
    let config = parse_adapter_config(&text, &config_path)?;
    config
        .lora
        .validate(cfg)
        .map_err(|e| Error::Checkpoint(format!("{}: {e}", config_path.display())))?;
    let weights_path = dir.join(ADAPTER_WEIGHTS);
    if !weights_path.exists() && dir.join("adapter_model.bin").exists() {
        return Err(Error::Checkpoint(format!(
            "{} holds adapter_model.bin (PyTorch's pickle format), which upipe does not read; \
             load the adapter with PEFT and save it again with save_pretrained (safetensors is \
             its default) to write {ADAPTER_WEIGHTS}",
            dir.display()
        )));
    }
    let (tensors, _) = read_safetensors(&weights_path, |_| true)?;
    let weights = factors_of(&tensors, &config.lora, cfg, &weights_path)?;
    Ok(PeftAdapter { weights, config })
}

/// The adapter `lora` among a checkpoint's `tensors` (those named under
/// PEFT's prefix; the base model's are left alone), checked like an
/// adapter file's (`place` names where they came from).
pub fn adapter_from_tensors(
    tensors: &BTreeMap<String, HostTensor>,
    lora: &crate::model::lora::LoraConfig,
    cfg: &ModelConfig,
    place: &Path,
) -> Result<LoraWeights> {
    let factors: BTreeMap<String, HostTensor> = tensors
        .iter()
        .filter(|(n, _)| n.starts_with(PREFIX))
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect();
    factors_of(&factors, lora, cfg, place)
}

/// Every factor the config names, from `tensors` (by PEFT name), checked.
fn factors_of(
    tensors: &BTreeMap<String, HostTensor>,
    lora: &crate::model::lora::LoraConfig,
    cfg: &ModelConfig,
    file: &Path,
) -> Result<LoraWeights> {
    let bad = |msg: String| Error::Checkpoint(format!("{}: {msg}", file.display()));
    let mut found: BTreeMap<(usize, LoraTarget, u8), &HostTensor> = BTreeMap::new();
    for (name, t) in tensors {
        let Some((layer, target, factor)) = parse_tensor_name(name) else {
            return Err(bad(format!(
                "tensor '{name}' is not a LoRA factor upipe knows (it reads \
                 {PREFIX}{{N}}.self_attn.q_proj.lora_A.weight and the like)"
            )));
        };
        if layer >= cfg.layers || !lora.targets.contains(&target) {
            return Err(bad(format!(
                "tensor '{name}' is outside the adapter: model '{}' has {} layers and \
                 adapter_config.json's target_modules are {:?}; the adapter was made for \
                 another model or its config does not match its tensors",
                cfg.name,
                cfg.layers,
                lora.targets
                    .iter()
                    .map(|t| t.peft_name())
                    .collect::<Vec<_>>()
            )));
        }
        if found.insert((layer, target, factor as u8), t).is_some() {
            return Err(bad(format!(
                "tensor '{name}' is there twice (with and without .default)"
            )));
        }
    }
    let mut layers = Vec::with_capacity(cfg.layers);
    for l in 0..cfg.layers {
        let mut factors = Vec::with_capacity(lora.targets.len());
        for &target in &lora.targets {
            let dims = lora.dims(cfg, target);
            let [a_shape, b_shape] = lora.factor_shapes(cfg, target);
            let a = factor(&found, l, target, Factor::A, a_shape, cfg).map_err(&bad)?;
            let b = factor(&found, l, target, Factor::B, b_shape, cfg).map_err(&bad)?;
            factors.push(LoraFactors { dims, a, b });
        }
        layers.push(factors);
    }
    Ok(LoraWeights {
        config: lora.clone(),
        layers,
    })
}

/// Factor `factor` of `target` in block `l`, which must have `shape`.
fn factor(
    found: &BTreeMap<(usize, LoraTarget, u8), &HostTensor>,
    l: usize,
    target: LoraTarget,
    factor: Factor,
    shape: [usize; 2],
    cfg: &ModelConfig,
) -> std::result::Result<Vec<f32>, String> {
    let what = format!("{}.{} of layer {l}", target.peft_name(), factor.peft_name());
    let Some(t) = found.get(&(l, target, factor as u8)) else {
        return Err(format!(
            "{what} ('{}') is missing; every layer has both factors of every target module",
            tensor_name(l, target, factor)
        ));
    };
    if t.shape != shape {
        return Err(format!(
            "{what} is {:?}, model '{}' needs {shape:?} (lora_A is [r, in_features], lora_B \
             [out_features, r]); the adapter was made for another base model or another r",
            t.shape, cfg.name
        ));
    }
    Ok(t.data.clone())
}
