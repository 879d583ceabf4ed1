//! `upipe eval`: mean next-token cross-entropy of an HF checkpoint on a token
//! file taken as one sequence, under any strategy — for checking against
//! other frameworks on the same weights.

use crate::attention::{CpPlan, Strategy};
use crate::backend::{Category, IGNORE, MemoryStats};
use crate::cli::config::{self, Given, RunArgs, RunFile, at_least, for_key, run_keys};
use crate::cli::metrics::{MetricsFile, StepMetrics, by_category};
use crate::error::{Error, Result};
use crate::model::decoder::attn_dims;
use crate::model::flops::forward_flops_per_token;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::train::checkpoint::load_hf_model;
use crate::train::data::{check_vocab, read_u32_tokens};
use crate::train::trainer::{loss_grads_and_memory_cpu, weights_from_host};
use clap::ArgMatches;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    /// Token ids as raw little-endian u32 (`.u32`).
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// Attention strategy.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    #[arg(long, default_value_t = 1)]
    pub ulysses: usize,
    #[arg(long, default_value_t = 1)]
    pub ring: usize,
    #[arg(long)]
    pub chunk_heads: Option<usize>,
    /// Write the evaluation as one JSON line (loss, tokens/s, model TFLOP/s
    /// of the forward, memory by category; as `train --metrics`).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
}

impl EvalArgs {
    run_keys! {
        model_dir => eval.model_dir,
        tokens => eval.tokens,
        metrics => eval.metrics,
        attn => parallel.attn,
        ulysses => parallel.ulysses,
        ring => parallel.ring,
        chunk_heads => parallel.chunk_heads,
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

/// A required path: the flag or its key.
fn required<'a>(p: &'a Option<PathBuf>, id: &str) -> Result<&'a Path> {
    p.as_deref().ok_or_else(|| {
        Error::Config(format!(
            "upipe eval needs --{} (or {} in --config)",
            id.replace('_', "-"),
            config::key_name(EvalArgs::KEYS, id)
        ))
    })
}

pub fn run(a: EvalArgs, m: &ArgMatches) -> Result<i32> {
    let a = config::resolve(a, m)?;
    let model_dir = required(&a.model_dir, "model_dir")?;
    let tokens_path = required(&a.tokens, "tokens")?;
    at_least(EvalArgs::KEYS, "ulysses", a.ulysses, 1)?;
    at_least(EvalArgs::KEYS, "ring", a.ring, 1)?;
    let strategy: Strategy = for_key(EvalArgs::KEYS, "attn", a.attn.parse())?;
    let cfg = ModelConfig::resolve(&model_dir.to_string_lossy())?;
    let tokens = read_u32_tokens(tokens_path)?;
    check_vocab(&tokens, cfg.vocab)?;
    if tokens.len() < 2 {
        return Err(Error::Config(format!(
            "{} holds {} tokens; at least 2 are needed to predict one",
            tokens_path.display(),
            tokens.len()
        )));
    }
    let (pu, pr) = if strategy == Strategy::Local {
        (1, 1)
    } else {
        (a.ulysses, a.ring)
    };
    let (ids, targets) = padded_sequence(&tokens, pu, pr);
    let (n, seq) = (tokens.len() - 1, ids.len());
    let plan = CpPlan::new(strategy, &attn_dims(&cfg), seq, pu, pr, a.chunk_heads)?;
    let host = load_hf_model(model_dir, &cfg)?;
    let weights = |b: &crate::backend::cpu::CpuBackend| {
        weights_from_host(
            b,
            &cfg,
            &host,
            crate::backend::DType::F32,
            Category::Weights,
        )
    };
    let start = Instant::now();
    let (loss, _, memory) = loss_grads_and_memory_cpu(
        &cfg,
        &plan,
        MemoryPolicy::default(),
        &ids,
        &targets,
        &weights,
    )?;
    let seconds = start.elapsed().as_secs_f64();
    println!("{}", serde_json::json!({ "loss": loss, "tokens": n }));
    if let Some(path) = &a.metrics {
        let line = eval_metrics(&cfg, &plan, n, loss, seconds, &memory);
        let file = MetricsFile::create(path)?;
        file.write(&line);
        file.finish()?;
    }
    Ok(0)
}

/// Inputs and targets of `tokens` as one sequence, padded to a length a
/// mesh of `pu` x `pr` accepts; padded positions come last, so causal
/// attention keeps them out of every real prediction.
fn padded_sequence(tokens: &[u32], pu: usize, pr: usize) -> (Vec<u32>, Vec<u32>) {
    let n = tokens.len() - 1;
    let unit = if pr > 1 { 2 * pr * pu } else { pu };
    let seq = n.div_ceil(unit) * unit;
    let mut ids = tokens[..n].to_vec();
    let mut targets = tokens[1..].to_vec();
    ids.resize(seq, 0);
    targets.resize(seq, IGNORE);
    (ids, targets)
}

/// The metrics line of an evaluation of `n` tokens under `plan` that took
/// `seconds` (model FLOPs of the forward only).
fn eval_metrics(
    cfg: &ModelConfig,
    plan: &CpPlan,
    n: usize,
    loss: f64,
    seconds: f64,
    memory: &MemoryStats,
) -> StepMetrics {
    let ranks = plan.mesh_shape().world_size();
    let seq = plan.layout.seq;
    let tokens_per_s = seq as f64 / seconds;
    let tflops = forward_flops_per_token(cfg, seq) * tokens_per_s / 1e12;
    StepMetrics {
        step: 0,
        loss,
        lr: None,
        grad_norm: None,
        tokens: n,
        tokens_per_s,
        tflops,
        tflops_per_rank: tflops / ranks as f64,
        ranks,
        peak_bytes: memory.peak,
        peak_by_category: by_category(&memory.at_peak_by_category, memory.host_peak),
        predicted_peak_bytes: None,
        predicted_by_category: None,
    }
}
