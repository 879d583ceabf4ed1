//! `TrainConfig`: everything a training run needs, validated once
//! ([`TrainConfig::plan`]), and what follows from it alone (the attention
//! plan, the mesh, the optimizer's settings, the save directory).

use crate::attention::{CpPlan, Strategy};
use crate::checkpoint::save_dir::{Retention, SaveDir, SaveRules};
use crate::comm::MeshShape;
use crate::data::PackMode;
use crate::error::Result;
use crate::model::decoder::attn_dims;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::optim::OptimConfig;
use crate::train::eval::EvalDuring;
use std::path::PathBuf;

/// Everything a training run needs, validated by [`TrainConfig::plan`].
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: ModelConfig,
    /// Data-parallel replicas; each replica's context group holds one sequence.
    pub data_parallel: usize,
    pub strategy: Strategy,
    pub ulysses: usize,
    pub ring: usize,
    pub chunk_heads: Option<usize>,
    /// UPipe: heads per forward stage (`CpPlan::with_fwd_chunk`; default U).
    pub fwd_chunk_heads: Option<usize>,
    pub seq: usize,
    /// How windows are made from the data's documents (`--pack`).
    pub pack: PackMode,
    /// The attention kernel the run decided on before it planned (CUDA:
    /// `cudnn::decide_run_kernel`), given to every rank's backend; `None`
    /// on the CPU, or where the backend decides per call.
    pub attention_kernel: Option<crate::backend::cuda::cudnn::AttentionKernel>,
    /// Whether the run's windows may hold several documents (`--pack
    /// documents|bfd` over ids with a document index): its attention masks
    /// are then documents masks, and a rehearsal, which reads no data,
    /// attends under one (two documents) to allocate what they do.
    pub documents: bool,
    pub steps: u32,
    pub optim: OptimConfig,
    pub seed: u64,
    pub policy: MemoryPolicy,
    /// What the linear layers compute in (`--precision`; `Decoder::set_precision`).
    pub precision: crate::backend::fp8::Precision,
    /// Start from an HF model directory instead of random weights.
    pub init_from: Option<PathBuf>,
    /// What loading weights does with tensors the model has no parameter
    /// for (`--allow-extra-tensors`: ignores them).
    pub extra_tensors: crate::checkpoint::ExtraTensors,
    /// Where training checkpoints go (and are resumed from).
    pub save_dir: Option<PathBuf>,
    /// Save every this many steps (0: only at the end).
    pub save_every: u32,
    /// Which checkpoints are kept: one in `save_dir` itself, or
    /// `checkpoint-STEP` folders (`--keep-last`, `--keep-best`).
    pub keep: Retention,
    /// Resume from `save_dir` if it holds a checkpoint.
    pub resume: bool,
    /// Save into a `save_dir` that holds files upipe did not write
    /// (`--overwrite`; `checkpoint::save_dir`).
    pub overwrite: bool,
    /// Steps whose loss or gradient norm is not finite that the run may
    /// skip (not applied, counted) before it stops (`--skip-nonfinite`).
    pub skip_nonfinite: u32,
    /// Shard parameters, gradients and optimizer state over every rank of
    /// the mesh (FSDP); otherwise every rank holds the whole model.
    pub fsdp: bool,
    /// HSDP: shard inside `world / fsdp_replicas` consecutive ranks,
    /// replicate across the groups (1: shard over every rank).
    pub fsdp_replicas: usize,
    /// The largest weight file a checkpoint writes (HF's `max_shard_size`,
    /// 5 GB by default); more weights spread over several files and an index.
    pub max_file_bytes: usize,
    /// The dtype of a checkpoint's model files (`--save-dtype`); optimizer
    /// state and masters stay F32.
    pub save_dtype: crate::checkpoint::SaveDtype,
    /// The source model's `config.json` (`--init-from`'s, `--model`'s file
    /// or preset): a checkpoint's `config.json` keeps its every field.
    pub source_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Sequences per optimizer step (per data replica), gradients accumulated.
    pub grad_accum: usize,
    /// The run file that repeats this run, written as `run.toml` beside
    /// every checkpoint (`upipe train --config DIR/run.toml`).
    pub run_file: Option<String>,
    /// Pinned host memory each rank may use for offloaded tensors (None: unlimited).
    pub host_budget: Option<usize>,
    /// Time every op of every step by class (`--profile`; the backends'
    /// op profile, `backend::profile`).
    pub profile: bool,
    /// Write rank 0's last step as a Chrome/Perfetto trace here (`--trace`;
    /// needs `profile`).
    pub trace: Option<PathBuf>,
    /// Rehearse two steps instead of training (`upipe train --rehearse`):
    /// every rank's device, wrapped in a `backend::rehearsal::Rehearsal`,
    /// allocates what the step allocates, in the same order, and computes
    /// nothing (`train::trainer::train_threads`, `train_process_rank`;
    /// `rehearse_rank` on a backend that already rehearses); the weights
    /// are allocated unwritten, two steps run whatever `steps` says, and
    /// the reports carry no loss or gradient norm (NaN).
    pub rehearse: bool,
    /// The parameters the run does not train (`--freeze`; checked against
    /// the model by [`TrainConfig::plan`]).
    pub freeze: crate::model::Freeze,
    /// LoRA adapters trained beside the frozen base (`--lora-rank`; `freeze`
    /// is then the whole base).
    pub lora: Option<crate::train::lora_run::LoraRun>,
    /// Held-out evaluation every few steps (`--eval-data`, `--eval-every`;
    /// checked by `train::eval_during::check`, which the loop runs first).
    pub eval: Option<EvalDuring>,
    /// Retrieval trials scored during training (`--eval-task`).
    pub eval_task: Option<crate::train::retrieval::RetrievalDuring>,
}

impl TrainConfig {
    /// What this process decided on its own (the `auto` choices of
    /// `train`, resolved from its GPU's and its host's memory, and its
    /// attention kernel), as the flags that repeat it. Process ranks check that they agree before they
    /// train ([`ProcessRank::join`]).
    pub fn decided_flags(&self) -> String {
        let mut f = vec![format!("--fsdp {}", if self.fsdp { "on" } else { "off" })];
        if let Some(u) = self.chunk_heads {
            f.push(format!("--chunk-heads {u}"));
        }
        if let Some(n) = self.fwd_chunk_heads {
            f.push(format!("--fwd-chunk-heads {n}"));
        }
        let p = self.policy;
        if p.checkpoint {
            f.push(format!("--offload {}", p.offload));
            f.push(format!("--save-attention {}", p.save_attention));
            f.push(format!("--checkpoint-every {}", p.checkpoint_every));
        }
        f.push(format!("--offload-optimizer {}", p.offload_optimizer));
        if p.offload_optimizer > 0 {
            f.push(format!("--host-update {}", p.host_update));
        }
        // the attention kernel (ranks that could load different cuDNNs
        // would plan differently)
        use crate::backend::cuda::cudnn::AttentionKernel;
        match self.attention_kernel {
            Some(AttentionKernel::Cudnn { .. }) => f.push("--attn-kernel cudnn".into()),
            Some(AttentionKernel::Flash | AttentionKernel::Naive) => {
                f.push("--attn-kernel native".into())
            }
            None => {}
        }
        f.join(" ")
    }

    /// The optimizer's settings, its state kept where the memory policy
    /// says (`--offload-optimizer`).
    pub fn optimizer(&self) -> OptimConfig {
        self.optim.placed(
            self.policy.offload_optimizer,
            self.policy.host_update,
            self.seed,
        )
    }

    /// `steps` steps of `model` on sequences of `seq` tokens with `optim`, on
    /// one rank (`local`), seed 0, the default memory policy, no checkpoints
    /// (F32 model files when a `save_dir` is set);
    /// change the rest with struct update syntax.
    pub fn new(model: ModelConfig, seq: usize, steps: u32, optim: OptimConfig) -> Self {
        TrainConfig {
            model,
            data_parallel: 1,
            strategy: Strategy::Local,
            ulysses: 1,
            ring: 1,
            chunk_heads: None,
            fwd_chunk_heads: None,
            seq,
            pack: PackMode::default(),
            attention_kernel: None,
            documents: false,
            steps,
            optim,
            seed: 0,
            policy: MemoryPolicy::default(),
            precision: Default::default(),
            init_from: None,
            extra_tensors: crate::checkpoint::ExtraTensors::Refuse,
            save_dir: None,
            save_every: 0,
            keep: Retention::default(),
            resume: false,
            overwrite: false,
            skip_nonfinite: 0,
            fsdp: false,
            fsdp_replicas: 1,
            max_file_bytes: crate::checkpoint::sharded::FILE_BYTES,
            // exact for the CPU's F32 weights (`upipe train` resolves `auto`)
            save_dtype: crate::checkpoint::SaveDtype::F32,
            source_config: None,
            grad_accum: 1,
            run_file: None,
            host_budget: None,
            profile: false,
            trace: None,
            rehearse: false,
            freeze: crate::model::Freeze::none(),
            lora: None,
            eval: None,
            eval_task: None,
        }
    }

    /// The checkpoint a `--resume` continues from, if the save directory
    /// holds one: the latest, in it or in its `checkpoint-STEP` folders (after [`take_save_dir`](Self::take_save_dir) finished a save
    /// that a killed run left half moved in, which the trainer's entry
    /// points do first).
    pub fn resume_dir(&self) -> Option<PathBuf> {
        let dir = self.save_dir.as_deref().filter(|_| self.resume)?;
        crate::checkpoint::save_dir::latest(dir)
    }

    /// Checks that a checkpoint of `step` in `dir` can be resumed by this
    /// run: one past `--steps` cannot (its schedule ran past this one's end).
    pub fn check_resume_step(&self, dir: &std::path::Path, step: u64) -> Result<()> {
        let steps = u64::from(self.steps);
        if step <= steps {
            return Ok(());
        }
        crate::config_err!(
            "--resume: the checkpoint in {} is at step {step}, past --steps {steps}; give \
             --steps above {step} to continue it, or another --save-dir to start afresh",
            dir.display()
        )
    }

    /// Says so (on the group's first rank, `lead`) when `--resume` of `dir`
    /// keeps the optimizer state in another format than the checkpoint's
    /// run did: its saved (decoded F32) values are encoded in this run's
    /// format.
    pub fn note_state_format(&self, dir: &std::path::Path, extra: &serde_json::Value, lead: bool) {
        if !lead {
            return;
        }
        let plain = crate::optim::StateFormat::default().to_string();
        let saved = extra.get("optim_state").and_then(|v| v.as_str());
        let saved = saved.unwrap_or(&plain);
        let now = self.optim.state.saved().to_string();
        if saved != now {
            tracing::info!(
                "--resume: {} kept its optimizer state as {saved}, this run as {now}: the saved \
                 values are converted (exactly where this format holds them)",
                dir.display()
            );
        }
    }

    /// Checks that a checkpoint in `dir`, whose caller state is `extra`,
    /// froze what this run freezes (`extra["freeze"]`; a checkpoint
    /// without it froze nothing): its optimizer state covers exactly the
    /// parameters this run trains.
    pub fn check_resume_freeze(
        &self,
        dir: &std::path::Path,
        extra: &serde_json::Value,
    ) -> Result<()> {
        let saved = extra
            .get("freeze")
            .and_then(|v| v.as_str())
            .unwrap_or("none");
        let saved = crate::model::Freeze::parse(saved).map_err(|e| {
            crate::error::Error::Checkpoint(format!("{}: bad freeze set: {e}", dir.display()))
        })?;
        if saved == self.freeze {
            return Ok(());
        }
        let name = |f: &crate::model::Freeze| match f.is_empty() {
            true => "none".to_string(),
            false => f.to_string(),
        };
        crate::config_err!(
            "--resume: {} was trained with --freeze {}, this run asks for --freeze {}: its \
             optimizer state is for other parameters; resume with --freeze {}",
            dir.display(),
            name(&saved),
            name(&self.freeze),
            name(&saved)
        )
    }

    /// The gradients the step writes: none for what `--freeze` freezes,
    /// the weight matrices' in `--grad-dtype`.
    pub fn grad_spec(&self) -> crate::model::GradSpec<'_> {
        crate::model::GradSpec {
            frozen: &self.freeze,
            matrices: self.optim.state.grads.dtype(),
        }
    }

    /// The `--freeze` set as `state.json`'s caller state keeps it.
    pub fn freeze_key(&self) -> String {
        match self.freeze.is_empty() {
            true => "none".into(),
            false => self.freeze.to_string(),
        }
    }

    /// How a checkpoint stores the model's weights (`--save-dtype`, shard size).
    pub fn model_files(&self) -> crate::checkpoint::ModelFiles {
        crate::checkpoint::ModelFiles {
            dtype: self.save_dtype,
            max_file_bytes: self.max_file_bytes,
        }
    }

    /// The model directory whose tokenizer files a checkpoint carries:
    /// `--init-from`, else the save directory a resumed run continues
    /// (carrying forward what an earlier save copied there).
    pub fn carry_from(&self) -> Option<PathBuf> {
        self.init_from.clone().or_else(|| self.resume_dir())
    }

    /// Takes the save directory for this run (once per run, before any
    /// rank reads or writes it): locked for the run's life, a killed run's
    /// save finished, its staging removed, and its files checked to be
    /// upipe's unless `overwrite` (`checkpoint::save_dir::SaveDir::acquire`).
    pub fn take_save_dir(&self) -> Result<Option<SaveDir>> {
        self.save_dir
            .as_deref()
            .map(|dir| SaveDir::acquire(dir, self.save_rules()))
            .transpose()
    }

    /// What the run may do with a checkpoint its save directory holds
    /// (`--resume`, `--overwrite`).
    pub fn save_rules(&self) -> SaveRules {
        SaveRules {
            overwrite: self.overwrite,
            resume: self.resume,
        }
    }

    /// Validates the configuration and resolves the attention plan.
    pub fn plan(&self) -> Result<CpPlan> {
        self.model.validate()?;
        self.policy.validate_for(self.model.layers)?;
        match &self.lora {
            Some(lora) => lora.check(&self.model, &self.freeze)?,
            None => self.freeze.check(&self.model)?,
        }
        if self.fsdp {
            crate::train::fsdp::check_whole_units(&self.model, &self.freeze)?;
        }
        if self.steps == 0 {
            return crate::config_err!("--steps must be at least 1");
        }
        if self.data_parallel == 0 {
            return crate::config_err!("--data-parallel must be at least 1");
        }
        if self.grad_accum == 0 {
            return crate::config_err!("--grad-accum must be at least 1 (sequences per step)");
        }
        if self.rehearse && (self.save_dir.is_some() || self.resume) {
            let flag = if self.resume {
                "--resume"
            } else {
                "--save-dir"
            };
            return crate::config_err!(
                "--rehearse computes and trains nothing, so there is nothing for {flag} to save or resume: \
                 drop {flag} (or --rehearse)"
            );
        }
        self.optim.lr_schedule().validate()?;
        let plan = CpPlan::new(
            self.strategy,
            &attn_dims(&self.model),
            self.seq,
            self.ulysses,
            self.ring,
            self.chunk_heads,
        )?
        .with_fwd_chunk(self.fwd_chunk_heads)?;
        if self.fsdp_replicas != 1 {
            if !self.fsdp {
                return crate::config_err!(
                    "--fsdp-replicate {} replicates FSDP shard groups: add --fsdp on",
                    self.fsdp_replicas
                );
            }
            MeshShape {
                data: self.data_parallel,
                ..plan.mesh_shape()
            }
            .with_fsdp_replicas(self.fsdp_replicas)?;
        }
        Ok(plan)
    }

    /// The whole mesh of `plan` (data replicas x its context group).
    pub fn mesh_shape(&self, plan: &CpPlan) -> MeshShape {
        MeshShape {
            data: self.data_parallel,
            fsdp_replicas: self.fsdp_replicas,
            ..plan.mesh_shape()
        }
    }
}
