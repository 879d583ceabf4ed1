//! A family's `config.json` read into a config: the family a `model_type`
//! names, and each family's own parse and presets (one file per family).

use super::family::{FAMILIES, Family};
use super::spec::BlockSpec;
use super::{gemma3, llama, mistral, qwen2, qwen3};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use serde_json::{Map, Value};

/// `model_type`s of related families upipe does not read yet, with what
/// their decoder needs that upipe's lacks.
const NOT_YET: &[(&str, &str)] = &[];

impl Family {
    /// The family of a `config.json`'s `model_type`; an unsupported one is
    /// an error listing the supported ones.
    pub fn from_model_type(model_type: &str) -> Result<Family> {
        if let Some(f) = FAMILIES
            .iter()
            .find(|f| f.model_types().contains(&model_type))
        {
            return Ok(*f);
        }
        let names: Vec<&str> = FAMILIES.iter().map(|f| f.name()).collect();
        if let Some((_, why)) = NOT_YET.iter().find(|(t, _)| *t == model_type) {
            return Err(Error::Config(format!(
                "model_type '{model_type}' {why}; use a {} checkpoint",
                names.join(" or ")
            )));
        }
        let listed: Vec<String> = FAMILIES
            .iter()
            .map(|f| format!("{} ('{}')", f.name(), f.model_type()))
            .collect();
        let listed = match listed.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => String::new(),
        };
        Err(Error::Config(format!(
            "unsupported model_type '{model_type}'; upipe reads {listed} configs"
        )))
    }

    /// Builds a config from the fields of a `config.json` object of this
    /// family (not yet validated).
    pub fn parse_hf(self, obj: &Map<String, Value>) -> Result<ModelConfig> {
        match self {
            Family::Llama => llama::parse_hf(obj),
            Family::Qwen3 => qwen3::parse_hf(obj),
            Family::Qwen2 => qwen2::parse_hf(obj),
            Family::Mistral => mistral::parse_hf(obj),
            Family::Gemma3 => gemma3::parse_hf(obj),
        }
    }

    /// The block the family's file declares.
    pub fn spec(self) -> &'static BlockSpec {
        match self {
            Family::Llama => &llama::SPEC,
            Family::Qwen3 => &qwen3::SPEC,
            Family::Qwen2 => &qwen2::SPEC,
            Family::Mistral => &mistral::SPEC,
            Family::Gemma3 => &gemma3::SPEC,
        }
    }

    /// Writes the `config.json` keys of `cfg` that only this family has
    /// into `out` (Gemma 3's layer types, local RoPE base, score scale).
    pub(super) fn hf_json_extra(self, cfg: &ModelConfig, out: &mut Map<String, Value>) {
        match self {
            Family::Gemma3 => gemma3::hf_json_extra(cfg, out),
            Family::Llama | Family::Qwen3 | Family::Qwen2 | Family::Mistral => {}
        }
    }

    /// The family's built-in preset called `name`, if it has one.
    pub fn preset(self, name: &str) -> Option<ModelConfig> {
        match self {
            Family::Llama => llama::preset(name),
            Family::Qwen3 => qwen3::preset(name),
            Family::Qwen2 => qwen2::preset(name),
            Family::Mistral => mistral::preset(name),
            Family::Gemma3 => None,
        }
    }
}
