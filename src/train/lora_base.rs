//! The base model a LoRA run trains on, and what its saves and the run
//! header say of it: the base a new run reads (`--init-from`, or a seed's
//! random weights), the one a resume reads again (named in the adapter-only
//! checkpoint's `state.json`), and the trainable-parameter count.

pub use crate::checkpoint::lora_merge::BaseModel;
use crate::error::Result;
use crate::model::lora::LoraConfig;
use crate::train::config::TrainConfig;
use std::path::{Path, PathBuf};

/// What a LoRA run's saves need: the adapters' config, the base they were
/// trained on (named in `state.json`, so a resume finds it again) and its
/// name for `adapter_config.json`.
#[derive(Debug, Clone)]
pub struct LoraSave {
    pub config: LoraConfig,
    pub base: BaseModel,
    /// `base_model_name_or_path`.
    pub base_name: String,
}

impl LoraSave {
    /// The saves of `cfg`'s run, if it trains adapters, on `base`.
    pub fn of(cfg: &TrainConfig, base: BaseModel) -> Option<Self> {
        cfg.lora.as_ref().map(|l| LoraSave {
            config: l.config.clone(),
            base_name: base.name(&cfg.model),
            base,
        })
    }
}

/// The `state.json` key under which a LoRA checkpoint names its base.
const BASE_KEY: &str = "lora_base";

/// The base a new LoRA run trains on: `--init-from`'s directory, or the
/// model's random weights from `--seed`.
pub fn run_base(cfg: &TrainConfig) -> BaseModel {
    match &cfg.init_from {
        Some(dir) => BaseModel::Dir(dir.clone()),
        None => BaseModel::Random { seed: cfg.seed },
    }
}

/// `base` as a LoRA checkpoint's `state.json` keeps it (the directory
/// absolute, so a resume from elsewhere finds it).
pub fn base_key(base: &BaseModel) -> serde_json::Value {
    match base {
        BaseModel::Dir(dir) => {
            let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            serde_json::json!({ "init_from": dir })
        }
        BaseModel::Random { seed } => serde_json::json!({ "random_seed": seed }),
    }
}

/// `extra` with the run's base added (a LoRA checkpoint holds the adapter
/// only; a resume reads the base again from where it came).
pub fn with_base(extra: &serde_json::Value, base: &BaseModel) -> serde_json::Value {
    let mut extra = extra.clone();
    if let Some(map) = extra.as_object_mut() {
        map.insert(BASE_KEY.into(), base_key(base));
    }
    extra
}

/// The base a resumed LoRA run reads again: `--init-from` where given,
/// else the directory or seed the checkpoint in `dir` names (`extra`), else
/// (a checkpoint that held its base, from before adapter-only saves) `dir`
/// itself. A base directory that is gone is an error naming `--init-from`.
pub fn resumed_base(cfg: &TrainConfig, dir: &Path, extra: &serde_json::Value) -> Result<BaseModel> {
    if let Some(from) = &cfg.init_from {
        return Ok(BaseModel::Dir(from.clone()));
    }
    let saved = extra.get(BASE_KEY);
    if let Some(seed) = saved.and_then(|b| b.get("random_seed")) {
        let seed = seed.as_u64().ok_or_else(|| {
            crate::error::Error::Checkpoint(format!("{}: bad {BASE_KEY}", dir.display()))
        })?;
        return Ok(BaseModel::Random { seed });
    }
    if let Some(from) = saved
        .and_then(|b| b.get("init_from"))
        .and_then(|p| p.as_str())
    {
        if Path::new(from).join("config.json").is_file() {
            return Ok(BaseModel::Dir(PathBuf::from(from)));
        }
        return crate::config_err!(
            "--resume: the LoRA checkpoint in {} holds the adapter only, and its base model, \
             {from}, is not there any more; give --init-from with the base model's directory",
            dir.display()
        );
    }
    if crate::checkpoint::is_adapter_only(dir) {
        return crate::config_err!(
            "--resume: the LoRA checkpoint in {} holds the adapter only and does not name its \
             base model; give --init-from with the base model's directory",
            dir.display()
        );
    }
    Ok(BaseModel::Dir(dir.to_path_buf()))
}

/// Parameters a run trains and holds, as PEFT's
/// `print_trainable_parameters` counts them: the base's parameters not
/// frozen plus the adapters', of the base's plus the adapters'.
pub fn trainable_parameters(cfg: &TrainConfig) -> (usize, usize) {
    let m = &cfg.model;
    let adapters = cfg.lora.as_ref().map_or(0, |l| l.config.param_count(m));
    let size = |s: &Vec<usize>| s.iter().product::<usize>();
    let params = m.params();
    let all: usize = params.iter().map(|(_, s)| size(s)).sum();
    let trained: usize = (params.iter())
        .filter(|(p, _)| !cfg.freeze.is_frozen(m, *p))
        .map(|(_, s)| size(s))
        .sum();
    (trained + adapters, all + adapters)
}

/// `trainable parameters 41,943,040 of 8,072,204,288 (0.5196 %)`.
pub fn trainable_line(cfg: &TrainConfig) -> String {
    let (trained, all) = trainable_parameters(cfg);
    let commas = |n: usize| {
        let s = n.to_string();
        let mut out = String::new();
        for (i, c) in s.chars().enumerate() {
            if i > 0 && (s.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    };
    let share = 100.0 * trained as f64 / all.max(1) as f64;
    format!(
        "trainable parameters {} of {} ({share:.4} %)",
        commas(trained),
        commas(all)
    )
}
