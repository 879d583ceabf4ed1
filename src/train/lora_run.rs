//! A LoRA run (`--lora-rank`, `--lora-alpha`, `--lora-targets`,
//! `--lora-from`): the adapters it trains beside the frozen base, where
//! they start (PEFT's initialisation from the run's seed, an adapter
//! directory, or a resumed checkpoint), and the checks that keep a run's
//! flags consistent with them.

use crate::backend::Backend;
use crate::checkpoint::HostTensor;
pub use crate::checkpoint::lora_merge::BaseModel;
use crate::error::Result;
use crate::model::lora::{LoraConfig, LoraWeights};
use crate::model::lora_params::attach_adapters;
use crate::model::{Freeze, ModelConfig, ModelWeights};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The adapters a run trains.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRun {
    /// Rank, alpha, rsLoRA and targets (PEFT's meaning).
    pub config: LoraConfig,
    /// Continue from this adapter directory (PEFT's or upipe's) instead of
    /// PEFT's initialisation (`--lora-from`).
    pub from: Option<PathBuf>,
}

impl LoraRun {
    /// Checks the adapter against `cfg`'s model and the run's `freeze`,
    /// which must be the whole base ([`Freeze::whole_base`]): adapters
    /// train, nothing else does.
    pub fn check(&self, cfg: &ModelConfig, freeze: &Freeze) -> Result<()> {
        self.config.validate(cfg)?;
        if *freeze != Freeze::whole_base() {
            return crate::config_err!(
                "--freeze {freeze} with --lora-rank: a LoRA run freezes the whole base model \
                 and trains only its adapters; leave --freeze out"
            );
        }
        Ok(())
    }

    /// The adapters the run starts from: `--lora-from`'s, or PEFT's
    /// initialisation from `seed`.
    pub fn initial(&self, cfg: &ModelConfig, seed: u64) -> Result<LoraWeights> {
        let Some(dir) = &self.from else {
            return LoraWeights::init(cfg, &self.config, seed);
        };
        let adapter = crate::checkpoint::peft::read_adapter(dir, cfg)?;
        if adapter.weights.config != self.config {
            return crate::config_err!(
                "--lora-from {}: the adapter has {}, this run asks for {}; give the same \
                 --lora-rank, --lora-alpha and --lora-targets (or leave them out to take the \
                 adapter's)",
                dir.display(),
                adapter.weights.config,
                self.config
            );
        }
        Ok(adapter.weights)
    }

    /// The adapters of a resumed checkpoint in `dir`, from its tensors (F32
    /// masters where it kept them) by PEFT name.
    pub fn resumed(
        &self,
        cfg: &ModelConfig,
        dir: &Path,
        params: &BTreeMap<String, HostTensor>,
    ) -> Result<LoraWeights> {
        crate::checkpoint::peft::adapter_from_tensors(params, &self.config, cfg, dir)
    }
}

/// Puts `lora`'s adapters beside `w`'s blocks, in the weights' dtype.
pub fn attach<B: Backend>(b: &B, w: &mut ModelWeights<B>, lora: &LoraWeights) -> Result<()> {
    attach_adapters(b, w, lora, w.embed.dtype())
}

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
    pub fn of(cfg: &crate::train::config::TrainConfig, base: BaseModel) -> Option<Self> {
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
pub fn run_base(cfg: &crate::train::config::TrainConfig) -> BaseModel {
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
pub fn resumed_base(
    cfg: &crate::train::config::TrainConfig,
    dir: &Path,
    extra: &serde_json::Value,
) -> Result<BaseModel> {
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
pub fn trainable_parameters(cfg: &crate::train::config::TrainConfig) -> (usize, usize) {
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
pub fn trainable_line(cfg: &crate::train::config::TrainConfig) -> String {
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
