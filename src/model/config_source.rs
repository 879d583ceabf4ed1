//! Where a [`ModelConfig`] comes from and goes: the built-in presets, a
//! `--model` argument (a preset, a `config.json` or a directory holding
//! one), and a Hugging Face `config.json` parsed and written through its
//! family (`families/`).

use super::config::ModelConfig;
use super::families::{FAMILIES, Family, presets};
use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// Names of the built-in presets, in the order they are listed to users.
pub const PRESETS: &[&str] = &[
    "tiny",
    "llama3.2-1b",
    "llama3-8b",
    "llama3-70b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.2-3b",
    "llama3.3-70b",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "qwen2.5-0.5b-instruct",
    "qwen2.5-1.5b-instruct",
    "qwen2.5-3b-instruct",
    "qwen2.5-7b-instruct",
    "qwen2.5-14b-instruct",
    "qwen2.5-32b-instruct",
    "qwen2.5-72b-instruct",
    "mistral-7b",
    "mistral-7b-v0.3",
    "mistral-nemo-12b",
    "gemma3-1b",
    "gemma3-4b",
    "gemma3-12b",
    "gemma3-27b",
];

impl ModelConfig {
    /// The built-in preset called `name`, if there is one: a published
    /// model's `config.json` ([`presets::hf_preset`]), or one a family
    /// holds (`tiny`, and the `llama3-8b`/`llama3-70b` shapes).
    pub fn preset(name: &str) -> Option<ModelConfig> {
        if let Some(json) = presets::hf_preset(name) {
            let cfg = Self::from_hf_json(json).ok()?;
            return Some(ModelConfig {
                name: name.to_string(),
                ..cfg
            });
        }
        FAMILIES.iter().find_map(|f| f.preset(name))
    }

    /// The `config.json` object behind a `--model` argument, which a
    /// checkpoint's `config.json` starts from: a published preset's, or the
    /// file's (a `config.json` or a directory holding one); `None` for a
    /// preset of upipe's own (`tiny`). Call after [`ModelConfig::resolve`]
    /// accepted `arg`.
    pub fn hf_source(arg: &str) -> Result<Option<Map<String, Value>>> {
        let text = match presets::hf_preset(arg) {
            Some(json) => json.to_string(),
            None if Self::preset(arg).is_some() => return Ok(None),
            None => {
                let path = Path::new(arg);
                let file = match path.is_dir() {
                    true => path.join("config.json"),
                    false => path.to_path_buf(),
                };
                std::fs::read_to_string(&file)
                    .map_err(|e| Error::io(format!("reading {}", file.display()), e))?
            }
        };
        match serde_json::from_str(&text) {
            Ok(Value::Object(obj)) => Ok(Some(obj)),
            _ => Err(Error::Config(format!(
                "{arg}: config.json must be a JSON object"
            ))),
        }
    }

    /// Resolves a user argument: a preset name, a path to a `config.json`, or a
    /// directory containing one. The result is validated.
    pub fn resolve(arg: &str) -> Result<ModelConfig> {
        if let Some(cfg) = Self::preset(arg) {
            return Ok(cfg);
        }
        let path = Path::new(arg);
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        if file.exists() {
            // a FIFO or a device exists too: refused before it is opened
            crate::input_path::check_file(&file, "--model")?;
        }
        if !file.is_file() {
            let hint = super::families::presets::model_hint(PRESETS, arg);
            return Err(Error::Config(format!(
                "unknown model '{arg}': not a preset ({}) nor a config.json or a directory \
                 containing one{hint}",
                PRESETS.join(", ")
            )));
        }
        let text = std::fs::read_to_string(&file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        Self::from_hf_json(&text)
            .map_err(|e| Error::Config(format!("{}: {}", file.display(), strip_prefix(&e))))
    }

    /// Parses a Hugging Face `config.json` of a family upipe reads (its
    /// `model_type`: [`Family::from_model_type`]) and validates it.
    pub fn from_hf_json(text: &str) -> Result<ModelConfig> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("config.json is not valid JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| Error::Config("config.json must be a JSON object".to_string()))?;
        let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
        let cfg = Family::from_model_type(model_type)?.parse_hf(obj)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Writes this config as a Hugging Face `config.json` that
    /// [`ModelConfig::from_hf_json`] reads back to an equal config and
    /// `transformers` loads as its family's architecture
    /// (`LlamaForCausalLM` / `Qwen3ForCausalLM`).
    pub fn to_hf_json(&self) -> String {
        super::families::to_hf_json(self)
    }
}

/// The message of a `Config` error without its "invalid configuration: " prefix.
fn strip_prefix(e: &Error) -> String {
    match e {
        Error::Config(m) => m.clone(),
        other => other.to_string(),
    }
}
