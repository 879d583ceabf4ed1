//! The flags of `upipe eval` (the retrieval tasks' own, `--task` and
//! after, are `task_args.rs`'s), and the run-file keys they read.

use super::task_args::TaskArgs;
use crate::cli::config::{Given, RunArgs, RunFile, run_keys};
use crate::cli::mesh::MeshArgs;
use crate::data::PackMode;
use std::path::{Path, PathBuf};

/// Flags of `upipe eval`.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// A run file (TOML); the model directory defaults to its
    /// `[checkpoint] save-dir`, what the run wrote. Flags given here win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// HF model directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Load the weights even when they hold tensors the model has no
    /// parameter for (an error otherwise); they are ignored, and named in a
    /// warning.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub allow_extra_tensors: bool,
    /// Token ids: `.u32` (little-endian uint32) or `.u16`/`.bin` (uint16),
    /// memory-mapped and checked against the model's vocab_size.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Inputs per window: the file is evaluated as consecutive windows of this
    /// many tokens (default: the whole file as one sequence).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Also report the loss over this many equal ranges of positions within
    /// the document (`by_position`; the window under `--pack stream`).
    #[arg(long, default_value_t = 1)]
    pub buckets: usize,
    /// How windows are made of the documents, with the document index and
    /// loss mask `upipe tokenize` wrote beside --tokens (docs/documents.md):
    /// `stream` (the file as one stream; the default), `documents`
    /// (positions and attention restart at each document, no target
    /// across a boundary), `bfd` (whole documents packed by best-fit
    /// decreasing). Targets the loss mask leaves out are not counted.
    #[arg(long, value_enum)]
    pub pack: Option<PackMode>,
    /// Attention strategy: local, ulysses, ring, usp, upipe.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// UPipe heads per forward stage (default U).
    #[arg(long)]
    pub fwd_chunk_heads: Option<usize>,
    /// Rows of logits computed at once.
    #[arg(long, default_value_t = crate::model::DEFAULT_LOSS_CHUNK)]
    pub loss_chunk: usize,
    /// Device: auto (cuda when a GPU is visible, else cpu), cpu (f32), or cuda
    /// (bf16; one process per GPU as `upipe train`).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Attention kernel on GPUs: auto, cudnn, native (see `upipe train --help`).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    /// Evaluate the model with this LoRA adapter beside its weights (PEFT's
    /// `save_pretrained` directory, or a upipe LoRA checkpoint, which may
    /// also be the --model-dir).
    #[arg(long)]
    pub lora_from: Option<PathBuf>,
    /// Print the evaluation as one JSON object (loss, perplexity's ln,
    /// tokens, windows, by_position, tokens/s, memory) instead of the line
    /// `loss L, perplexity P over N tokens in W windows`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub json: bool,
    /// Write the evaluation as one JSON line (loss, tokens/s, model TFLOP/s
    /// of the forward, memory by category; as `train --metrics` writes steps).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    #[command(flatten)]
    pub task: TaskArgs,
}

impl EvalArgs {
    run_keys! {
        model_dir => eval.model_dir,
        lora_from => model.lora_from,
        allow_extra_tensors => model.allow_extra_tensors,
        tokens => eval.tokens,
        metrics => eval.metrics,
        json => run.json,
        seq => eval.seq,
        buckets => eval.buckets,
        pack => data.pack,
        attn => parallel.attn,
        fwd_chunk_heads => eval.fwd_chunk_heads,
        loss_chunk => memory.loss_chunk,
        device => run.device,
        attn_kernel => run.attn_kernel;
        flatten mesh, task
    }
}

impl RunArgs for EvalArgs {
    fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }
    fn take_file(&mut self, file: &RunFile, given: &Given) {
        self.take_keys(file, given);
        if self.model_dir.is_none() {
            self.model_dir.clone_from(&file.checkpoint.save_dir);
        }
    }
    fn to_file(&self) -> RunFile {
        let mut f = RunFile::default();
        self.put_keys(&mut f);
        f
    }
}
