//! The LoRA flags shared by `train` and `plan` (run-file section
//! `[model]`): `--lora-rank`, `--lora-alpha`, `--lora-targets`,
//! `--lora-rslora`, `--lora-from`, and the [`LoraRun`] they make.

use crate::checkpoint::peft_config::{ADAPTER_CONFIG, parse_adapter_config};
use crate::cli::config::run_keys;
use crate::error::{Error, Result};
use crate::model::lora::{LoraConfig, parse_targets};
use crate::model::{Freeze, ModelConfig};
use crate::train::lora_run::LoraRun;
use std::path::{Path, PathBuf};

/// Adapters trained beside a frozen base.
#[derive(clap::Args, Debug, Clone)]
pub struct LoraArgs {
    /// Train LoRA adapters of this rank (`r`) beside the frozen base model
    /// (0: no adapters, full fine-tuning). The base is then frozen whole.
    #[arg(long, help_heading = "LoRA", default_value_t = 0)]
    pub lora_rank: usize,
    /// LoRA's `lora_alpha`: the adapters' update is scaled by alpha / r
    /// (default: twice the rank).
    #[arg(long, help_heading = "LoRA")]
    pub lora_alpha: Option<f64>,
    /// The adapted layers, PEFT's module names separated by commas
    /// (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj),
    /// all-linear (all seven), or none (no adapters: the run trains as
    /// without --lora-rank).
    #[arg(long, help_heading = "LoRA", default_value = "all-linear")]
    pub lora_targets: String,
    /// rsLoRA's scaling: alpha / √r instead of alpha / r.
    #[arg(long, help_heading = "LoRA", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub lora_rslora: bool,
    /// Continue from this adapter directory (PEFT's `save_pretrained`, or a
    /// upipe checkpoint): its rank, alpha and targets unless given.
    #[arg(long, help_heading = "LoRA")]
    pub lora_from: Option<PathBuf>,
}

impl LoraArgs {
    run_keys! {
        lora_rank => model.lora_rank,
        lora_alpha => model.lora_alpha,
        lora_targets => model.lora_targets,
        lora_rslora => model.lora_rslora,
        lora_from => model.lora_from,
    }

    /// Whether the flags ask for adapters (`--lora-rank` or `--lora-from`,
    /// and targets other than `none`).
    pub fn asks_adapters(&self) -> bool {
        self.lora_targets.trim() != "none" && (self.lora_rank > 0 || self.lora_from.is_some())
    }

    /// The LoRA flags given beside neither `--lora-rank` nor `--lora-from`
    /// (each configures adapters that such a run does not train).
    fn given_without_rank(&self) -> Vec<&'static str> {
        if self.lora_rank > 0 || self.lora_from.is_some() {
            return Vec::new();
        }
        let targets = self.lora_targets.trim();
        [
            (self.lora_alpha.is_some(), "--lora-alpha"),
            (
                targets != "all-linear" && targets != "none",
                "--lora-targets",
            ),
            (self.lora_rslora, "--lora-rslora"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect()
    }

    /// Refuses `--lora-alpha`, `--lora-rslora` or `--lora-targets` given
    /// to `--lora-from` that differ from the adapter's own `config`.
    fn check_matches_adapter(&self, dir: &Path, config: &LoraConfig) -> Result<()> {
        let targets = self.lora_targets.trim();
        let mut differ = Vec::new();
        if let Some(alpha) = self.lora_alpha.filter(|a| *a != config.alpha) {
            differ.push(format!(
                "--lora-alpha {alpha} (the adapter's {})",
                config.alpha
            ));
        }
        if self.lora_rslora && !config.use_rslora {
            differ.push("--lora-rslora (the adapter scales by alpha / r)".into());
        }
        if targets != "all-linear" && parse_targets(targets)? != config.targets {
            differ.push(format!("--lora-targets {targets} (the adapter's {config})"));
        }
        match differ.is_empty() {
            true => Ok(()),
            false => crate::config_err!(
                "--lora-from {}: {} differ from the adapter, which continues as it was trained \
                 ({config}); leave them out, or give the adapter's values",
                dir.display(),
                differ.join(", ")
            ),
        }
    }

    /// The run's adapters, if it trains any, checked against `model`; a
    /// `--resume` of a checkpoint in `resume_dir` that holds adapters,
    /// given no LoRA flag, continues them (and says so).
    pub fn run_resuming(
        &self,
        model: &ModelConfig,
        resume_dir: Option<&Path>,
    ) -> Result<Option<LoraRun>> {
        let asked = self.run(model)?;
        let given = self.asks_adapters() || self.lora_targets.trim() == "none";
        let Some(dir) = resume_dir.filter(|d| !given && d.join(ADAPTER_CONFIG).is_file()) else {
            return Ok(asked);
        };
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let config = parse_adapter_config(&text, &path)?.lora;
        config.validate(model)?;
        tracing::warn!(
            "--resume: {} holds LoRA adapters ({config}): this run continues them with the \
             same configuration (give --lora-targets none to refuse)",
            dir.display()
        );
        Ok(Some(LoraRun { config, from: None }))
    }

    /// The run's adapters, if it trains any, checked against `model`.
    pub fn run(&self, model: &ModelConfig) -> Result<Option<LoraRun>> {
        let stray = self.given_without_rank();
        if !stray.is_empty() {
            return crate::config_err!(
                "{} configure LoRA adapters, but without --lora-rank (or --lora-from) this run \
                 trains none: it would be a full fine-tune; add --lora-rank R (such as 16), or \
                 leave {} out",
                stray.join(", "),
                stray.join(" and ")
            );
        }
        if self.lora_targets.trim() == "none" {
            if let Some(dir) = &self.lora_from {
                return crate::config_err!(
                    "--lora-targets none adapts nothing, but --lora-from {} asks to continue \
                     an adapter; leave one of them out",
                    dir.display()
                );
            }
            return Ok(None);
        }
        let config = match (&self.lora_from, self.lora_rank) {
            (None, 0) => return Ok(None),
            (Some(dir), 0) => {
                let config = crate::checkpoint::peft::read_adapter(dir, model)?
                    .weights
                    .config;
                self.check_matches_adapter(dir, &config)?;
                config
            }
            (_, rank) => {
                let alpha = self.lora_alpha.unwrap_or(2.0 * rank as f64);
                let targets = parse_targets(&self.lora_targets)?;
                LoraConfig::new(rank, alpha, self.lora_rslora, targets)?
            }
        };
        config.validate(model)?;
        Ok(Some(LoraRun {
            config,
            from: self.lora_from.clone(),
        }))
    }

    /// The `--freeze` of a run with `lora`: the whole base when `asked`
    /// (the `--freeze` flag) says none; any other is `asked`, which
    /// [`LoraRun::check`] refuses.
    pub fn freeze(lora: Option<&LoraRun>, asked: Freeze) -> Freeze {
        match lora {
            Some(_) if asked.is_empty() => Freeze::whole_base(),
            _ => asked,
        }
    }
}

/// `upipe plan`'s line about a LoRA run: the adapters, their parameters
/// and the frozen base.
pub fn plan_line(lora: &LoraConfig, model: &ModelConfig) -> String {
    format!(
        "LoRA {lora}: {:.2}M adapter parameters trained (F32 gradients, AdamW state); the \
         {:.2}B base parameters frozen (weights only)",
        lora.param_count(model) as f64 / 1e6,
        model.param_count() as f64 / 1e9
    )
}
