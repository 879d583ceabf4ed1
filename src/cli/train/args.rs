//! The flags of `upipe train`, their run-file keys, and their parsed form.

use crate::attention::Strategy;
use crate::backend::cuda::cudnn::AttnKernel;
use crate::checkpoint::SaveDtype;
use crate::cli::config::{self, Given, RunArgs, RunFile, at_least, for_key, run_keys};
use crate::cli::lora::LoraArgs;
use crate::cli::memory::MemoryArgs;
use crate::cli::mesh::MeshArgs;
use crate::cli::schedule::FwdChunkArgs;
use crate::data::PackMode;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::optim::schedule::Decay;
use crate::optim::{AdamWConfig, StateFormat};
pub use crate::plan::FsdpMode;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Flags of `upipe train`.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// A run file (TOML): every flag below is a key in one of its sections
    /// (`upipe train --print-config` shows them); flags given here win.
    #[arg(long, help_heading = "Run")]
    pub config: Option<PathBuf>,
    /// Print the resolved run file (defaults, --config, flags) and exit:
    /// every key, those left unset as comments saying what they do.
    #[arg(long, help_heading = "Run")]
    pub print_config: bool,
    /// Preset name (tiny, llama3.1-8b, llama3.2-1b, qwen3-8b, ...: see docs/checkpoints.md), config.json, or HF model dir (default: --init-from's model when given, else tiny).
    #[arg(long, help_heading = "Model", default_value = "tiny")]
    pub model: String,
    /// Training data: a text file (tokenized with --tokenizer), or pre-tokenized
    /// ids: `.u32` (little-endian uint32) or `.u16`/`.bin` (uint16), memory-mapped
    /// and checked against the model's vocab_size, with the document index
    /// and loss mask `upipe tokenize` writes beside them. Default: the
    /// bundled corpus. JSONL, Parquet and directories are refused with the
    /// `upipe tokenize` command that makes ids of them. A weighted mixture
    /// of corpora: `a.u32:0.7,b.u32:0.3` (each window from one corpus,
    /// every corpus within one window of its share: docs/data.md).
    #[arg(long, help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// Tokenizer for text data: `byte` or a path to an HF tokenizer.json (or
    /// a directory holding one); ignored, with a warning, for pre-tokenized
    /// data. Default: the model's own tokenizer.json when the model comes
    /// from a directory (--init-from, --model DIR), bytes for a model of 256
    /// ids; otherwise text data is refused until it is given.
    #[arg(long, help_heading = "Data")]
    pub tokenizer: Option<String>,
    /// Start from the weights of an HF model directory (config.json + safetensors).
    #[arg(long, help_heading = "Model")]
    pub init_from: Option<PathBuf>,
    /// Load the weights of --init-from (or --resume) even when they hold
    /// tensors the model has no parameter for (an error otherwise); they
    /// are ignored, and named in a warning.
    #[arg(long, help_heading = "Model", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_extra_tensors: bool,
    /// Attention strategy: local, ulysses, ring, usp, upipe.
    #[arg(long, help_heading = "Mesh", default_value = "upipe")]
    pub attn: String,
    #[command(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    pub fwd: FwdChunkArgs,
    /// Tokens per sequence (global, before context sharding).
    #[arg(long, help_heading = "Data", default_value_t = 256)]
    pub seq: usize,
    /// How windows are made from the data's documents (docs/documents.md):
    /// documents (windows cut from the stream, positions restarting and
    /// attention kept inside each document), stream (across documents), bfd
    /// (whole documents packed by best-fit decreasing; needs the document
    /// index `upipe tokenize` writes).
    #[arg(long, help_heading = "Data", value_enum, default_value_t = PackMode::Documents)]
    pub pack: PackMode,
    /// Optimizer steps to train (each of --grad-accum sequences per data
    /// replica); other tools call it max_steps.
    #[arg(long, help_heading = "Optimizer", default_value_t = 300)]
    pub steps: u32,
    /// Passes over the data instead of --steps: the steps are the windows
    /// per epoch (the run header prints them) times N, divided by
    /// --grad-accum and the data-parallel replicas.
    #[arg(long, help_heading = "Optimizer")]
    pub epochs: Option<u32>,
    /// Whether --steps was given (on the command line or in --config), so
    /// that --epochs beside it is an error.
    #[arg(skip)]
    pub steps_given: bool,
    /// Peak learning rate (AdamW), reached after --warmup and decayed by
    /// --schedule to --min-lr.
    #[arg(long, help_heading = "Optimizer", default_value_t = 3e-3)]
    pub lr: f64,
    /// The learning rate the schedule ends at (default: --lr / 10).
    #[arg(long, help_heading = "Optimizer")]
    pub min_lr: Option<f64>,
    /// Linear warm-up steps from 0 to --lr.
    #[arg(long, help_heading = "Optimizer", default_value_t = 20)]
    pub warmup: u32,
    /// The learning rate after the warm-up: cosine (to --min-lr at the last
    /// step), linear (likewise), constant (--lr to the end), or wsd (--lr,
    /// then linear to --min-lr over the last --decay-fraction of the steps).
    #[arg(long, help_heading = "Optimizer", default_value = "cosine")]
    pub schedule: String,
    /// WSD only: the share of --steps the final decay takes, in [0, 1]
    /// (default 0.2); warm-up and decay must fit the run.
    #[arg(long, help_heading = "Optimizer")]
    pub decay_fraction: Option<f64>,
    /// AdamW's moment decays B1,B2, each in [0, 1).
    #[arg(long, help_heading = "Optimizer", default_value = "0.9,0.95")]
    pub betas: String,
    /// AdamW's epsilon, added to the root of the second moment (above 0).
    #[arg(long, help_heading = "Optimizer", default_value_t = 1e-8)]
    pub eps: f64,
    /// AdamW's decoupled weight decay (0: none).
    #[arg(long, help_heading = "Optimizer", default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    #[arg(long, help_heading = "Optimizer", default_value_t = 1.0)]
    pub clip: f64,
    /// How AdamW keeps its two moments: f32 (exact; 8 bytes a parameter),
    /// bf16 (4) or 8bit (block-wise codes with a scale per 256 values,
    /// about 2). Optimizer state offloaded to the host stays f32. auto
    /// chooses the moments, master weights and gradients' dtype together:
    /// f32 throughout where the run fits this machine, else BF16
    /// gradients, else 8-bit moments, no master and BF16 gradients (the
    /// run says which it chose; leave --master-weights and --grad-dtype out).
    #[arg(long, help_heading = "Optimizer", default_value = "f32")]
    pub optim_state: String,
    /// f32: an F32 master copy of BF16 weights (4 bytes a parameter);
    /// none: BF16 weights updated in place by stochastic rounding.
    #[arg(long, help_heading = "Optimizer", default_value = "f32")]
    pub master_weights: String,
    /// f32: the weight matrices' gradients in F32 (4 bytes a parameter,
    /// exact); bf16: in BF16 (2), each accumulation rounded as a BF16
    /// model's gradients are. Norms, biases and the embedding keep F32.
    #[arg(long, help_heading = "Optimizer", default_value = "f32")]
    pub grad_dtype: String,
    /// What the linear layers (q/k/v/o projections, the MLP's GEMMs)
    /// compute in: bf16 (the device's compute dtype) or fp8 (E4M3 weights
    /// and activations, E5M2 gradients, tensor-wise scales; master
    /// weights, optimizer, loss, embedding, LM head and norms unchanged);
    /// fp8-attention: fp8, and attention on cuDNN's FP8 graphs (Hopper,
    /// head dim 128, no documents or sliding windows; docs/fp8.md);
    /// fp8-attention-bwd: the same with attention's forward in BF16 (its
    /// loss stays closer to bf16's).
    #[arg(long, help_heading = "Run", default_value = "bf16")]
    pub precision: String,
    /// Seed of the random initialisation and of the data order.
    #[arg(long, help_heading = "Run", default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[command(flatten)]
    pub lora: crate::cli::lora::LoraArgs,
    /// Held-out data evaluated during the run (as --data: text tokenized
    /// with --tokenizer, or ids of the model's vocabulary): the mean
    /// next-token loss over its windows of --seq inputs, on the training
    /// mesh with the run's parameters, as `upipe eval` computes it; in the
    /// progress line, `--json` and `--metrics` (`eval`). Needs the
    /// unsharded model (--fsdp off or auto deciding off).
    #[arg(long, help_heading = "Evaluation")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate --eval-data after every N steps, and after the last
    /// (default: after the last only).
    #[arg(long, help_heading = "Evaluation")]
    pub eval_every: Option<u32>,
    /// Also give the held-out loss over this many equal ranges of positions
    /// in the window (`by_position`, as `upipe eval --buckets`).
    #[arg(long, help_heading = "Evaluation", default_value_t = 1)]
    pub eval_buckets: usize,
    /// Score retrieval trials (`upipe eval --task`: passkey, multikey,
    /// multivalue, kv; docs/evaluation.md) every --eval-every steps and
    /// after the last, on the training mesh with the run's parameters and
    /// tokenizer, the haystack the built-in filler: in the progress line,
    /// `--metrics` and TensorBoard (`retrieval`: accuracy, mean_logprob).
    #[arg(long, help_heading = "Evaluation")]
    pub eval_task: Option<String>,
    /// Lengths of the trials during training, each at most --seq (K = 1024;
    /// default: --seq).
    #[arg(long, help_heading = "Evaluation")]
    pub eval_task_lengths: Option<String>,
    /// Needle depths of the trials during training, evenly spaced 0-100 %.
    #[arg(long, help_heading = "Evaluation", default_value_t = 5)]
    pub eval_task_depths: usize,
    /// Trials per length and depth during training.
    #[arg(long, help_heading = "Evaluation", default_value_t = 2)]
    pub eval_task_trials: usize,
    /// How trials during training are framed, as `upipe eval --task
    /// --chat-template`: auto (the tokenizer's chat template when it has
    /// one, else plain text), none, or a Jinja file.
    #[arg(
        long,
        help_heading = "Evaluation",
        default_value = "auto",
        value_name = "auto|none|PATH"
    )]
    pub eval_task_chat_template: String,
    /// Directory for training checkpoints (safetensors + optimizer state,
    /// and the resolved run file `run.toml` that repeats the run).
    #[arg(long, help_heading = "Checkpoints")]
    pub save_dir: Option<PathBuf>,
    /// After training, write the model with its LoRA adapters merged in
    /// (W + scale·B·A) as a plain HF model directory here (new or empty),
    /// from the final checkpoint in --save-dir.
    #[arg(long, help_heading = "Checkpoints")]
    pub merge_lora: Option<PathBuf>,
    /// The dtype of a checkpoint's model files: auto (the dtype of
    /// --init-from's model, bf16 without one), f32, bf16 or fp16. Optimizer
    /// state, and the F32 masters a resume continues from, stay F32.
    #[arg(long, help_heading = "Checkpoints", default_value = "auto")]
    pub save_dtype: String,
    /// The largest weight file a checkpoint writes, as HF's `max_shard_size`
    /// spells it (5GB, 500MB, 2GiB, bytes): past it the model is split into
    /// `model-0000k-of-0000n.safetensors` files with their index.
    #[arg(long, help_heading = "Checkpoints", default_value = "5GB")]
    pub max_shard_size: String,
    /// Checkpoint every N steps (0: at the end only).
    #[arg(long, help_heading = "Checkpoints", default_value_t = 0)]
    pub save_every: u32,
    /// Resume from --save-dir when it holds a checkpoint.
    #[arg(long, help_heading = "Checkpoints", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub resume: bool,
    /// Save into a --save-dir that holds a checkpoint of an earlier run (it
    /// is replaced once this run's first save is published) or files upipe
    /// did not write (each save replaces config.json, model*.safetensors,
    /// optimizer*.safetensors, state.json and run.toml and leaves every
    /// other file as it is); without it, or --resume, such a directory is
    /// refused before anything runs.
    #[arg(long, help_heading = "Checkpoints", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub overwrite: bool,
    /// Keep checkpoints as `checkpoint-STEP` folders in --save-dir (each an
    /// HF model directory; PEFT for LoRA runs), the N latest of them; older
    /// ones are removed after each save (without it, or --keep-best, one
    /// checkpoint is kept in --save-dir itself). --resume continues the
    /// latest.
    #[arg(long, help_heading = "Checkpoints", value_name = "N")]
    pub keep_last: Option<u32>,
    /// Keep checkpoints as `checkpoint-STEP` folders, and keep the one of
    /// the lowest --eval-data loss besides the --keep-last latest (1 by
    /// default); needs --eval-data evaluated at every save step.
    #[arg(long, help_heading = "Checkpoints", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", default_value_t = false, action = clap::ArgAction::Set)]
    pub keep_best: bool,
    /// Steps whose loss or gradient norm is not finite that the run may skip
    /// (the update not applied, counted in the metrics) before it stops
    /// with an error; 0: stop at the first.
    #[arg(long, help_heading = "Optimizer", default_value_t = 0)]
    pub skip_nonfinite: u32,
    /// Device: auto (cuda when a GPU is visible, else cpu), cpu, or cuda. On
    /// cuda with 2+ GPUs and a mesh of at most that many ranks, one process per
    /// GPU (NCCL; started by itself, or by `upipe launch`/torchrun/srun);
    /// otherwise ranks are threads (on GPUs: exchanges through host memory).
    #[arg(long, help_heading = "Run", default_value = "auto")]
    pub device: String,
    /// Attention kernel on GPUs: auto (cuDNN SDPA where it supports the call,
    /// else our kernels), cudnn (an error where it cannot), native (ours).
    #[arg(long, help_heading = "Run", default_value = "auto")]
    pub attn_kernel: String,
    /// FSDP: shard parameters, gradients and optimizer state over every
    /// rank of the mesh. auto: on when the mesh has more than one rank and
    /// the whole model's states do not fit the device's memory; on; off.
    #[arg(long, help_heading = "Memory", default_value = "auto")]
    pub fsdp: String,
    /// HSDP (multi-node): shard inside groups of world/R consecutive ranks
    /// (one node each, typically) and replicate across the R groups;
    /// gradients are all-reduced across replicas after the reduce-scatter.
    #[arg(long, help_heading = "Memory", default_value_t = 1)]
    pub fsdp_replicate: usize,
    /// Pinned host memory for offloaded tensors, GiB per node, shared by the
    /// node's ranks (default: the host's available memory at start less a
    /// tenth, 8 to 32 GiB, kept for the system: pinned pages cannot be
    /// reclaimed).
    #[arg(long, help_heading = "Memory")]
    pub host_mem: Option<f64>,
    /// Sequences per optimizer step (per data replica): gradients
    /// accumulate over them, the loss is the mean over the step's tokens.
    #[arg(long, help_heading = "Optimizer", default_value_t = 1)]
    pub grad_accum: usize,
    /// One JSON object per step instead of a progress bar.
    #[arg(long, help_heading = "Logging", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub json: bool,
    /// Write one JSON object per step to this file (JSON Lines: loss, lr,
    /// throughput, model TFLOP/s, memory by category; `upipe report` draws it).
    #[arg(long, help_heading = "Logging")]
    pub metrics: Option<PathBuf>,
    /// Write every step's metrics as TensorBoard scalars to an event file in
    /// this directory (created if missing): loss, lr, grad norm, tokens/s,
    /// model TFLOP/s, memory by category in GiB (`tensorboard --logdir DIR`).
    #[arg(long, help_heading = "Logging", value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Time every op of every step by class (GEMM, attention, recompute,
    /// elementwise, loss, optimizer, copies, collectives, idle): rank 0's
    /// table after the last step, and a `profile` object in every `--json`
    /// and `--metrics` line (`UPIPE_PROFILE=1` does the same).
    #[arg(long, help_heading = "Logging", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub profile: bool,
    /// Write rank 0's last step as a Chrome trace-event JSON file (one track
    /// per stream; open it in ui.perfetto.dev); implies --profile.
    #[arg(long, help_heading = "Logging")]
    pub trace: Option<PathBuf>,
    /// Rehearse two steps at full size instead of training: every tensor
    /// through the real allocators (GPU pool, pinned host pool, cuDNN plans
    /// and workspaces, NCCL communicators), no kernel or collective
    /// launched, nothing computed; prints the measured device and host
    /// peaks beside the planner's. Runs even where the preflight would
    /// refuse the run; exits 1 when it does not fit.
    #[arg(long, help_heading = "Run", num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub rehearse: bool,
}

impl TrainArgs {
    /// The run-file keys of every flag of `train`: its own, then its flag
    /// groups' (memory, mesh, forward stages).
    pub fn all_keys() -> [&'static [(&'static str, &'static str, &'static str)]; 5] {
        [
            Self::KEYS,
            MemoryArgs::KEYS,
            MeshArgs::KEYS,
            FwdChunkArgs::KEYS,
            LoraArgs::KEYS,
        ]
    }

    /// `--min-lr`, or a tenth of `--lr` when it is not given.
    pub fn min_lr(&self) -> f64 {
        self.min_lr.unwrap_or(self.lr / 10.0)
    }

    run_keys! {
        model => model.model,
        init_from => model.init_from,
        allow_extra_tensors => model.allow_extra_tensors,
        data => data.data,
        tokenizer => data.tokenizer,
        seq => data.seq,
        pack => data.pack,
        grad_accum => data.grad_accum,
        attn => parallel.attn,
        fsdp => parallel.fsdp,
        fsdp_replicate => parallel.fsdp_replicate,
        host_mem => hardware.host_mem,
        lr => optim.lr,
        min_lr => optim.min_lr,
        warmup => optim.warmup,
        schedule => optim.schedule,
        decay_fraction => optim.decay_fraction,
        betas => optim.betas,
        eps => optim.eps,
        weight_decay => optim.weight_decay,
        clip => optim.clip,
        optim_state => optim.optim_state,
        master_weights => optim.master_weights,
        grad_dtype => optim.grad_dtype,
        precision => run.precision,
        eval_data => eval.eval_data,
        eval_every => eval.eval_every,
        eval_buckets => eval.eval_buckets,
        eval_task => eval.eval_task,
        eval_task_lengths => eval.eval_task_lengths,
        eval_task_depths => eval.eval_task_depths,
        eval_task_trials => eval.eval_task_trials,
        eval_task_chat_template => eval.eval_task_chat_template,
        save_dir => checkpoint.save_dir,
        merge_lora => checkpoint.merge_lora,
        save_every => checkpoint.save_every,
        save_dtype => checkpoint.save_dtype,
        max_shard_size => checkpoint.max_shard_size,
        resume => checkpoint.resume,
        overwrite => checkpoint.overwrite,
        keep_last => checkpoint.keep_last,
        keep_best => checkpoint.keep_best,
        skip_nonfinite => optim.skip_nonfinite,
        steps => run.steps,
        epochs => run.epochs,
        seed => run.seed,
        device => run.device,
        attn_kernel => run.attn_kernel,
        json => run.json,
        metrics => run.metrics,
        tensorboard => run.tensorboard,
        profile => run.profile,
        trace => run.trace,
        rehearse => run.rehearse;
        flatten memory, mesh, fwd, lora
    }

    /// The flags' values parsed and checked; errors name the flag and its
    /// run-file key.
    pub fn validate(&self) -> Result<Choices> {
        let k = Self::KEYS;
        self.check_needed_flags()?;
        self.check_input_paths()?;
        self.check_output_paths()?;
        at_least(k, "steps", self.steps, 1)?;
        self.check_epochs()?;
        at_least(k, "seq", self.seq, 1)?;
        crate::cli::plan::at_most_tokens("--seq", self.seq)?;
        at_least(k, "grad_accum", self.grad_accum, 1)?;
        if let Some(every) = self.eval_every {
            at_least(k, "eval_every", every, 1)?;
        }
        at_least(k, "eval_buckets", self.eval_buckets, 1)?;
        self.memory.validate()?;
        at_least(k, "fsdp_replicate", self.fsdp_replicate, 1)?;
        self.mesh.validate()?;
        for (id, v) in [
            ("lr", self.lr),
            ("min_lr", self.min_lr()),
            ("weight_decay", self.weight_decay),
            ("clip", self.clip),
        ] {
            if !v.is_finite() {
                return crate::config_err!(
                    "{} is {v}: must be a finite number",
                    config::key_name(k, id)
                );
            }
            at_least(k, id, v, 0.0)?;
        }
        if let Some(gib) = self.host_mem
            && !(gib.is_finite() && gib > 0.0)
        {
            return crate::config_err!(
                "--host-mem / {} is {gib}: give GiB per node, a finite number above 0",
                config::key_name(k, "host_mem")
            );
        }
        if self.min_lr() > self.lr {
            return crate::config_err!(
                "{} {} is above {} {}: the schedule decays from --lr down to --min-lr; \
                 lower --min-lr, or leave it out for --lr / 10",
                config::key_name(k, "min_lr"),
                self.min_lr(),
                config::key_name(k, "lr"),
                self.lr
            );
        }
        let optim = self.adamw()?;
        let model = for_key(k, "model", ModelConfig::resolve(&self.model))?;
        let resuming = self.save_dir.as_deref().filter(|_| self.resume);
        let lora = self.lora.run_resuming(&model, resuming)?;
        Ok(Choices {
            freeze: LoraArgs::freeze(lora.as_ref(), self.memory.freeze(&model)?),
            lora,
            optim,
            precision: for_key(k, "precision", self.precision.parse())?,
            device: for_key(k, "device", self.device.parse())?,
            kernel: for_key(k, "attn_kernel", self.attn_kernel.parse())?,
            strategy: for_key(k, "attn", self.attn.parse())?,
            fsdp: for_key(k, "fsdp", self.fsdp.parse())?,
            model,
            save_dtype: for_key(k, "save_dtype", self.save_dtype())?,
            max_file_bytes: for_key(
                k,
                "max_shard_size",
                crate::checkpoint::model_files::parse_file_size(&self.max_shard_size),
            )?,
            source_config: for_key(k, "model", self.source_config())?,
        })
    }

    /// `--save-dtype`, with `auto` resolved: the dtype of `--init-from`'s
    /// model (or of the checkpoint a `--resume` continues), else bf16.
    fn save_dtype(&self) -> Result<SaveDtype> {
        if self.save_dtype != "auto" {
            return self.save_dtype.parse();
        }
        let resumed =
            (self.save_dir.as_deref()).filter(|d| self.resume && d.join("state.json").is_file());
        match self.init_from.as_deref().or(resumed) {
            Some(dir) => Ok(SaveDtype::of_model_dir(dir)?.unwrap_or_default()),
            None => Ok(SaveDtype::default()),
        }
    }

    /// The `config.json` a checkpoint starts from: `--init-from`'s when it
    /// has one, else `--model`'s ([`ModelConfig::hf_source`]).
    fn source_config(&self) -> Result<Option<Map<String, Value>>> {
        if let Some(file) = self.init_from.as_ref().map(|d| d.join("config.json"))
            && file.is_file()
        {
            return ModelConfig::hf_source(&file.to_string_lossy());
        }
        ModelConfig::hf_source(&self.model)
    }
}

impl TrainArgs {
    /// `--optim-state auto`: the resolver chooses the training state
    /// ([`StateFormat::AUTO_LADDER`]).
    pub fn state_auto(&self) -> bool {
        self.optim_state == "auto"
    }

    /// AdamW and its schedule from `--lr`, `--min-lr`, `--warmup`,
    /// `--schedule`, `--decay-fraction`, `--betas`, `--eps`, `--weight-decay`
    /// and `--clip` (checked: errors name the flag, its key and the fix).
    fn adamw(&self) -> Result<AdamWConfig> {
        let k = Self::KEYS;
        let fraction = self.decay_fraction.map(|f| f as f32);
        let decay = for_key(k, "schedule", Decay::parse(&self.schedule, fraction))?;
        let (beta1, beta2) = for_key(k, "betas", parse_betas(&self.betas))?;
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return crate::config_err!(
                "--eps / {} is {}: give a finite number above 0 (1e-8 is usual)",
                config::key_name(k, "eps"),
                self.eps
            );
        }
        let state = training_state(k, &self.optim_state, &self.master_weights, &self.grad_dtype)?;
        let cfg = AdamWConfig {
            decay,
            beta1,
            beta2,
            eps: self.eps as f32,
            weight_decay: self.weight_decay as f32,
            clip: self.clip as f32,
            state,
            seed: self.seed,
            ..AdamWConfig::schedule(
                self.lr as f32,
                self.min_lr() as f32,
                self.warmup,
                self.steps,
            )
        };
        for_key(k, "decay_fraction", cfg.lr_schedule().validate())?;
        Ok(cfg)
    }

    /// `--epochs` is at least 1 and not given beside `--steps`.
    fn check_epochs(&self) -> Result<()> {
        let k = Self::KEYS;
        let Some(epochs) = self.epochs else {
            return Ok(());
        };
        at_least(k, "epochs", epochs, 1)?;
        if self.steps_given {
            return crate::config_err!(
                "--steps / {} and --epochs / {} are both given, and each sets the length of \
                 the run: keep one (--epochs N derives the steps from the windows per epoch)",
                config::key_name(k, "steps"),
                config::key_name(k, "epochs")
            );
        }
        Ok(())
    }

    /// The steps of `--epochs` over data giving `windows` windows per epoch
    /// (one replica's), each step taking --grad-accum windows on each of
    /// `replicas` data replicas; `--steps` without `--epochs`.
    pub fn steps_for(&self, windows: usize, replicas: usize) -> Result<u32> {
        let Some(epochs) = self.epochs else {
            return Ok(self.steps);
        };
        let per_step = (self.grad_accum * replicas).max(1);
        let steps = (epochs as usize * windows).div_ceil(per_step);
        if steps == 0 {
            return crate::config_err!(
                "--epochs {epochs}: the data gives no window of --seq {} tokens; give more \
                 data or a smaller --seq",
                self.seq
            );
        }
        u32::try_from(steps).map_err(|_| {
            Error::Config(format!(
                "--epochs {epochs} is {steps} steps, more than a run can count; give fewer epochs"
            ))
        })
    }

    /// A flag that does nothing without another is an error naming the
    /// other (rather than silently nothing).
    fn check_needed_flags(&self) -> Result<()> {
        let k = Self::KEYS;
        let no_save_dir = self.save_dir.is_none();
        // (whether flag is given without needed, flag, needed, what needed does for it)
        let unneeded = [
            (
                no_save_dir && self.save_every > 0,
                "save_every",
                "save_dir",
                "checkpoints are written there",
            ),
            (
                no_save_dir && self.resume,
                "resume",
                "save_dir",
                "the checkpoint to resume is read there",
            ),
            (
                no_save_dir && self.overwrite,
                "overwrite",
                "save_dir",
                "it lets checkpoints go there beside files upipe did not write",
            ),
            (
                no_save_dir && (self.keep_last.is_some() || self.keep_best),
                "keep_last",
                "save_dir",
                "checkpoints are kept there",
            ),
            (
                self.eval_data.is_none() && self.keep_best,
                "keep_best",
                "eval_data",
                "the best checkpoint is the one of the lowest held-out loss",
            ),
            (
                no_save_dir && self.merge_lora.is_some(),
                "merge_lora",
                "save_dir",
                "the merged model is made from the final checkpoint there",
            ),
            (
                self.eval_data.is_none() && self.eval_task.is_none() && self.eval_every.is_some(),
                "eval_every",
                "eval_data",
                "it names the held-out data to evaluate; or --eval-task, the retrieval task to score",
            ),
            (
                self.eval_task.is_none()
                    && (self.eval_task_lengths.is_some()
                        || self.eval_task_depths != 5
                        || self.eval_task_trials != 2),
                "eval_task_lengths",
                "eval_task",
                "the lengths, depths and trials are of its retrieval trials",
            ),
            (
                self.eval_task.is_none() && self.eval_task_chat_template != "auto",
                "eval_task_chat_template",
                "eval_task",
                "the chat template frames its retrieval trials",
            ),
            (
                self.allow_extra_tensors && self.init_from.is_none() && !self.resume,
                "allow_extra_tensors",
                "init_from",
                "it names the weights to load (or --resume does)",
            ),
        ];
        if let Some(out) = &self.merge_lora {
            self.check_merge_target(out)?;
        }
        self.check_keep_flags()?;
        let Some((_, flag, needed, why)) = unneeded.into_iter().find(|u| u.0) else {
            return Ok(());
        };
        let flag_name = |id: &str| format!("--{}", id.replace('_', "-"));
        crate::config_err!(
            "{} / {} does nothing without {} / {} ({why}): add {}, or leave {} out",
            flag_name(flag),
            config::key_name(k, flag),
            flag_name(needed),
            config::key_name(k, needed),
            flag_name(needed),
            flag_name(flag)
        )
    }

    /// The paths the run reads are what they must be (a FIFO or a device
    /// is refused before anything opens it, and before the run is planned).
    /// `--merge-lora OUT`: a run that trains adapters (its flags, or a
    /// resumed checkpoint's), into a directory other than `--save-dir`
    /// that is empty or new; refused before anything runs.
    fn check_merge_target(&self, out: &Path) -> Result<()> {
        let save_dir = self.save_dir.as_deref();
        let resumed_adapters = self.resume
            && self.lora.lora_targets.trim() != "none"
            && save_dir.is_some_and(|d| d.join("adapter_config.json").is_file());
        if !self.lora.asks_adapters() && !resumed_adapters {
            let why = match self.lora.lora_targets.trim() {
                "none" => "--lora-targets none adapts nothing",
                _ => "this run trains no LoRA adapters to merge",
            };
            return crate::config_err!(
                "--merge-lora {}: {why}; add --lora-rank (or --lora-from) with the layers to \
                 adapt, or leave --merge-lora out (the checkpoint is the full model)",
                out.display()
            );
        }
        if save_dir.is_some_and(|d| same_path(d, out)) {
            return crate::config_err!(
                "--merge-lora {} is the --save-dir: the merged model is written beside the \
                 checkpoint it is made from, into a directory of its own; name another \
                 --merge-lora directory",
                out.display()
            );
        }
        crate::checkpoint::lora_merge::check_empty_target(out)
    }

    fn check_input_paths(&self) -> Result<()> {
        use crate::input_path::{check_dir, check_file};
        if let Some(data) = &self.data {
            // the fix a refusal names tokenizes with --init-from's own
            // tokenizer, never bytes a model of another vocabulary cannot read
            let own = (self.init_from.as_ref().map(|d| d.join("tokenizer.json")))
                .filter(|t| t.is_file())
                .map(|t| t.to_string_lossy().into_owned());
            let tokenizer = self.tokenizer.as_deref().or(own.as_deref());
            match crate::data::mixture::parse_data_spec(data)? {
                Some(parts) => parts.iter().try_for_each(|(path, _)| {
                    crate::data::mixture::check_mixture_file(path, tokenizer)
                })?,
                None => {
                    crate::data::inputs::refuse_untokenized(data, tokenizer)?;
                    check_file(data, "--data")?;
                }
            }
        }
        if let Some(dir) = &self.init_from {
            check_dir(dir, "--init-from")?;
        }
        if let Some(data) = &self.eval_data {
            check_file(data, "--eval-data")?;
        }
        Ok(())
    }
}

impl TrainArgs {
    /// `--keep-last` keeps at least one checkpoint, and `--keep-best`
    /// compares checkpoints whose held-out loss is known: every save step
    /// must be an evaluation step.
    fn check_keep_flags(&self) -> Result<()> {
        let k = Self::KEYS;
        if let Some(n) = self.keep_last {
            at_least(k, "keep_last", n, 1)?;
        }
        let eval_every = self.eval_every.unwrap_or(self.steps).max(1);
        if self.keep_best && self.save_every > 0 && !self.save_every.is_multiple_of(eval_every) {
            return crate::config_err!(
                "--keep-best ranks checkpoints by their held-out loss, but --save-every {} saves \
                 at steps --eval-every {eval_every} does not evaluate: give an --eval-every \
                 that divides --save-every",
                self.save_every
            );
        }
        Ok(())
    }

    /// A checkpoint in `--save-dir` is not replaced unasked: refused, before
    /// any data is read, without `--resume` or `--overwrite`.
    pub fn refuse_replacing(&self) -> Result<()> {
        let Some(dir) = &self.save_dir else {
            return Ok(());
        };
        let rules = crate::checkpoint::save_dir::SaveRules {
            overwrite: self.overwrite,
            resume: self.resume,
        };
        crate::checkpoint::save_dir::refuse_replacing(dir, rules)
    }

    /// The checkpoints the run keeps (`--keep-best` alone keeps the latest
    /// beside the best).
    pub fn retention(&self) -> crate::checkpoint::save_dir::Retention {
        crate::checkpoint::save_dir::Retention {
            keep_last: self.keep_last.or(self.keep_best.then_some(1)),
            keep_best: self.keep_best,
        }
    }

    /// No output of the run (metrics, trace, TensorBoard and merged-model
    /// directories) writes over one of its inputs, and every path can be
    /// written into the run file (`run.toml` is UTF-8 TOML); checked before
    /// anything is opened for writing. The save directory has its own rule
    /// (`checkpoint::save_dir`: only upipe's files, replaced by rename).
    fn check_output_paths(&self) -> Result<()> {
        use crate::output_path::{Input, Output, check_outputs};
        let outputs: Vec<Output> = [
            self.metrics
                .as_deref()
                .map(|p| Output::file("--metrics", p)),
            self.trace.as_deref().map(|p| Output::file("--trace", p)),
            (self.tensorboard.as_deref()).map(|p| Output::dir("--tensorboard", p)),
            (self.merge_lora.as_deref()).map(|p| Output::dir("--merge-lora", p)),
        ]
        .into_iter()
        .flatten()
        .collect();
        let data_parts = match &self.data {
            Some(d) => crate::data::mixture::parse_data_spec(d)?
                .map(|parts| parts.into_iter().map(|(p, _)| p).collect())
                .unwrap_or_else(|| vec![d.clone()]),
            None => vec![],
        };
        let mut inputs: Vec<Input> = data_parts
            .iter()
            .map(|p| Input {
                flag: "--data",
                path: p,
            })
            .collect();
        let tokenizer = (self.tokenizer.as_deref())
            .map(|t| crate::output_path::tokenizer_files(Path::new(t)))
            .unwrap_or_default();
        inputs.extend(tokenizer.iter().map(|path| Input {
            flag: "--tokenizer",
            path,
        }));
        let others = [
            ("--eval-data", self.eval_data.as_deref()),
            ("--config", self.config.as_deref()),
        ];
        for (flag, path) in others {
            if let Some(path) = path {
                inputs.push(Input { flag, path });
            }
        }
        // a model or adapter directory: the files in it (a new file beside
        // them overwrites nothing)
        let dirs = [
            ("--init-from", self.init_from.as_deref()),
            ("--lora-from", self.lora.lora_from.as_deref()),
            ("--model", Some(Path::new(&self.model))),
        ];
        let dir_files = crate::output_path::directory_inputs(&dirs);
        inputs.extend(dir_files.iter().map(|(flag, path)| Input { flag, path }));
        let save_dir = self.save_dir.as_deref().map(|p| ("--save-dir", p));
        let paths = (outputs.iter().map(|o| (o.flag, o.path))).chain(save_dir);
        for (flag, path) in paths.chain(inputs.iter().map(|i| (i.flag, i.path))) {
            config::utf8_path(flag, path)?;
        }
        check_outputs(&outputs, &inputs)
    }
}

impl RunArgs for TrainArgs {
    fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }
    fn take_file(&mut self, file: &RunFile, given: &Given) {
        self.take_keys(file, given);
    }
    fn to_file(&self) -> RunFile {
        let mut f = RunFile::default();
        self.put_keys(&mut f);
        if self.epochs.is_some() {
            // the length is the epochs', the steps derived from them
            f.run.steps = None;
        }
        f
    }
    /// `--init-from DIR` without `--model` trains DIR's model (its
    /// config.json), not the default tiny one.
    fn infer(&mut self, file: Option<&RunFile>, given: &Given) {
        self.steps_given = given.has("steps") || file.is_some_and(|f| f.run.steps.is_some());
        let model_set = given.has("model") || file.is_some_and(|f| f.model.model.is_some());
        if let (false, Some(dir)) = (model_set, &self.init_from) {
            self.model = dir.to_string_lossy().into_owned();
        }
    }
}

/// The flags of a run, parsed.
#[derive(Debug, Clone)]
pub struct Choices {
    /// AdamW and its schedule (its state's place is the memory policy's).
    pub optim: AdamWConfig,
    /// `--precision`: what the linear layers compute in.
    pub precision: crate::backend::fp8::Precision,
    pub device: Device,
    pub kernel: AttnKernel,
    pub strategy: Strategy,
    pub fsdp: FsdpMode,
    pub model: ModelConfig,
    /// `--save-dtype`, `auto` resolved.
    pub save_dtype: SaveDtype,
    /// `--max-shard-size` in bytes.
    pub max_file_bytes: usize,
    /// The `config.json` a checkpoint keeps every field of.
    pub source_config: Option<Map<String, Value>>,
    /// `--freeze`, checked against the model (the whole base with LoRA).
    pub freeze: crate::model::Freeze,
    /// `--lora-rank` and the other LoRA flags: the adapters trained.
    pub lora: Option<crate::train::lora_run::LoraRun>,
}

/// `--betas B1,B2`: two moment decays, each in [0, 1).
fn parse_betas(text: &str) -> Result<(f32, f32)> {
    let fix = "give two numbers in [0, 1) as --betas B1,B2 (0.9,0.95 is usual)";
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    let [b1, b2] = parts[..] else {
        return crate::config_err!("--betas {text}: {fix}");
    };
    let mut betas = [0f32; 2];
    for (i, (part, beta)) in [b1, b2].into_iter().zip(&mut betas).enumerate() {
        let v: f64 = match part.parse() {
            Ok(v) => v,
            Err(_) => return crate::config_err!("--betas {text}: `{part}` is not a number; {fix}"),
        };
        if !(0.0..1.0).contains(&v) {
            return crate::config_err!(
                "--betas {text}: beta{} is {v}, outside [0, 1) (at 1 the moment never \
                 forgets its start and never learns from a gradient); {fix}",
                i + 1
            );
        }
        *beta = v as f32;
    }
    Ok((betas[0], betas[1]))
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// cuda when a GPU is visible, else cpu.
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => crate::config_err!("--device {other}: use auto, cpu or cuda"),
        }
    }
}

/// Whether `a` and `b` name the same directory (made absolute, `.` and
/// `..` resolved where they exist).
fn same_path(a: &Path, b: &Path) -> bool {
    let norm = |p: &Path| {
        std::fs::canonicalize(p)
            .or_else(|_| std::path::absolute(p))
            .unwrap_or_else(|_| p.to_path_buf())
    };
    norm(a) == norm(b)
}

/// The training state of `--optim-state`, `--master-weights` and
/// `--grad-dtype` (`keys`: the command's run-file keys). Under
/// `--optim-state auto` the ladder's first, which the resolver replaces
/// ([`StateFormat::AUTO_LADDER`]); an error where `--master-weights` or
/// `--grad-dtype` was given beside auto, which chooses them too.
pub fn training_state(
    keys: &[(&str, &str, &str)],
    optim_state: &str,
    master_weights: &str,
    grad_dtype: &str,
) -> Result<StateFormat> {
    if optim_state != "auto" {
        return Ok(StateFormat {
            moments: for_key(keys, "optim_state", optim_state.parse())?,
            master: for_key(keys, "master_weights", master_weights.parse())?,
            grads: for_key(keys, "grad_dtype", grad_dtype.parse())?,
        });
    }
    for (id, flag, value) in [
        ("master_weights", "--master-weights", master_weights),
        ("grad_dtype", "--grad-dtype", grad_dtype),
    ] {
        if value != "f32" {
            return crate::config_err!(
                "--optim-state auto chooses {flag} too, so {flag} {value} (run-file key {}) \
                 cannot be kept: leave {flag} out, or give --optim-state f32|bf16|8bit",
                config::key_name(keys, id)
            );
        }
    }
    Ok(StateFormat::AUTO_LADDER[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_parses() {
        assert_eq!("auto".parse::<Device>().unwrap(), Device::Auto);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda);
        let e = "tpu".parse::<Device>().unwrap_err();
        assert!(e.to_string().contains("auto, cpu or cuda"), "{e}");
    }

    #[test]
    fn betas_parse_in_zero_to_one() {
        assert_eq!(parse_betas("0.9,0.95").unwrap(), (0.9, 0.95));
        assert_eq!(parse_betas(" 0, 0.5 ").unwrap(), (0.0, 0.5));
        let e = parse_betas("1.0,0.9").unwrap_err().to_string();
        assert!(
            e.contains("beta1 is 1, outside [0, 1)") && e.contains("--betas B1,B2"),
            "{e}"
        );
        let e = parse_betas("0.9").unwrap_err().to_string();
        assert!(e.contains("--betas 0.9: give two numbers"), "{e}");
        let e = parse_betas("0.9,x").unwrap_err().to_string();
        assert!(e.contains("`x` is not a number"), "{e}");
        let e = parse_betas("0.9,-0.1").unwrap_err().to_string();
        assert!(e.contains("beta2 is -0.1"), "{e}");
    }
}
