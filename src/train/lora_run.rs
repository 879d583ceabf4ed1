//! A LoRA run (`--lora-rank`, `--lora-alpha`, `--lora-targets`,
//! `--lora-from`): the adapters it trains beside the frozen base, where
//! they start (PEFT's initialisation from the run's seed, an adapter
//! directory, or a resumed checkpoint), and the checks that keep a run's
//! flags consistent with them.

use crate::backend::Backend;
use crate::checkpoint::HostTensor;
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
