//! `adapter_config.json`, PEFT's description of a LoRA adapter: written
//! with the fields PEFT's `LoraConfig.save_pretrained` writes (keys
//! sorted, as PEFT sorts them), and read back with every field that would
//! change what the adapter computes checked: a config upipe cannot apply
//! exactly (biases, DoRA, per-module ranks or alphas, layer subsets, extra
//! trained modules) is refused naming the field.

use crate::error::{Error, Result};
use crate::model::lora::{LoraConfig, targets_from_names};
use serde_json::{Map, Value, json};
use std::path::Path;

/// The file name PEFT gives an adapter's config.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// The file name PEFT gives an adapter's tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// What an `adapter_config.json` says, beyond the [`LoraConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct PeftConfig {
    pub lora: LoraConfig,
    /// `base_model_name_or_path` (a Hub id or a path; informative: the
    /// tensors' shapes decide whether an adapter fits a model).
    pub base_model: Option<String>,
    /// `lora_dropout`: applied by PEFT while training only; it changes
    /// nothing an adapter computes once trained.
    pub dropout: f64,
}

/// The `adapter_config.json` of an adapter of `lora` on `base_model`, as
/// PEFT writes it for inference (`inference_mode: true`).
pub fn adapter_config_json(lora: &LoraConfig, base_model: &str) -> Value {
    let targets: Vec<&str> = lora.targets.iter().map(|t| t.peft_name()).collect();
    let alpha = if lora.alpha.fract() == 0.0 && lora.alpha < 1e15 {
        json!(lora.alpha as u64)
    } else {
        json!(lora.alpha)
    };
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layer_replication": null,
        "layers_pattern": null,
        "layers_to_transform": null,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": false,
        "lora_dropout": 0.0,
        "megatron_config": null,
        "megatron_core": "megatron.core",
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": lora.rank,
        "rank_pattern": {},
        "revision": null,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": lora.use_rslora,
    })
}

/// Parses the text of `path`, an `adapter_config.json`: a LoRA config
/// upipe applies exactly, or an error naming the field that stops it.
pub fn parse_adapter_config(text: &str, path: &Path) -> Result<PeftConfig> {
    let bad = |msg: String| Error::Checkpoint(format!("{}: {msg}", path.display()));
    let value: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    match obj.get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => {
            return Err(bad(format!(
                "peft_type is {}; upipe reads LoRA adapters (\"LORA\")",
                shown(other.map(|s| json!(s)).as_ref())
            )));
        }
    }
    refuse_unsupported(obj).map_err(bad)?;
    let rank = obj.get("r").and_then(Value::as_u64).ok_or_else(|| {
        bad(format!(
            "r is {}; give the rank, an integer",
            shown(obj.get("r"))
        ))
    })?;
    let alpha = obj
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| {
            bad(format!(
                "lora_alpha is {}; give a number",
                shown(obj.get("lora_alpha"))
            ))
        })?;
    let use_rslora = flag(obj, "use_rslora").map_err(bad)?;
    let names = target_names(obj).map_err(bad)?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let targets = targets_from_names(&names, "target_modules").map_err(|e| bad(e.to_string()))?;
    let lora = LoraConfig::new(rank as usize, alpha, use_rslora, targets)
        .map_err(|e| bad(e.to_string()))?;
    let dropout = match obj.get("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| bad(format!("lora_dropout is {v}; give a number")))?,
    };
    let base_model = obj
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string);
    Ok(PeftConfig {
        lora,
        base_model,
        dropout,
    })
}

/// A field's value as a message shows it (`absent` when missing).
fn shown(v: Option<&Value>) -> String {
    v.map_or("absent".to_string(), Value::to_string)
}

/// A boolean field, `false` when absent or null.
fn flag(obj: &Map<String, Value>, key: &str) -> std::result::Result<bool, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("{key} is {v}; give true or false")),
    }
}

/// `target_modules`: a list of module names, or `"all-linear"`.
fn target_names(obj: &Map<String, Value>) -> std::result::Result<Vec<String>, String> {
    match obj.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => Ok(vec![s.clone()]),
        Some(Value::String(s)) => Err(format!(
            "target_modules is the pattern \"{s}\"; upipe reads a list of module names \
             (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or \"all-linear\""
        )),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("target_modules holds {v}; give module names"))
            })
            .collect(),
        other => Err(format!(
            "target_modules is {}; give the adapted module names",
            shown(other)
        )),
    }
}

/// Whether a field holds something (not absent, null, false, `{}`, `[]` or `""`).
fn set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// The fields that, when set, ask for something upipe does not apply, and why.
const UNSUPPORTED: [(&str, &str); 13] = [
    ("use_dora", "DoRA adds a magnitude vector per module"),
    ("rank_pattern", "per-module ranks differ from r"),
    ("alpha_pattern", "per-module alphas differ from lora_alpha"),
    (
        "modules_to_save",
        "fully trained extra modules come with the adapter",
    ),
    (
        "layers_to_transform",
        "only some layers are adapted; upipe adapts every layer",
    ),
    ("layer_replication", "layers are replicated"),
    ("lora_bias", "lora_B has a bias"),
    ("use_qalora", "QA-LoRA pools the input"),
    (
        "target_parameters",
        "parameters rather than modules are adapted",
    ),
    ("trainable_token_indices", "token embeddings are trained"),
    (
        "alora_invocation_tokens",
        "activated LoRA applies the adapter after those tokens only",
    ),
    ("arrow_config", "Arrow routes between several adapters"),
    ("use_bdlora", "the factors are block-diagonal"),
];

/// Refuses a config whose fields ask for what upipe cannot apply exactly.
fn refuse_unsupported(obj: &Map<String, Value>) -> std::result::Result<(), String> {
    match obj.get("bias").and_then(Value::as_str) {
        None | Some("none") => {}
        Some(other) => {
            return Err(format!(
                "bias is \"{other}\"; upipe's adapters train no biases (bias \"none\")"
            ));
        }
    }
    if flag(obj, "fan_in_fan_out")? {
        return Err(
            "fan_in_fan_out is true (Conv1D layers, GPT-2 style); upipe's layers are \
                    Linear (false)"
                .into(),
        );
    }
    if set(obj.get("exclude_modules")) {
        return Err(format!(
            "exclude_modules is {}; upipe adapts every listed module in every layer (null)",
            shown(obj.get("exclude_modules"))
        ));
    }
    for (key, why) in UNSUPPORTED {
        if set(obj.get(key)) {
            return Err(format!(
                "{key} is {} ({why}); upipe reads plain LoRA adapters, so {key} must be absent, \
                 null, false or empty",
                shown(obj.get(key))
            ));
        }
    }
    Ok(())
}
