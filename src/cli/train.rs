//! `upipe train`: with no arguments, the embedded default — tiny model,
//! bundled corpus, 4 ranks (2 Ulysses x 2 ring) running UPipe — threads on
//! the CPU, or on the visible GPUs when there are any.

use crate::attention::Strategy;
use crate::backend::{Bytes, Category};
use crate::error::{Error, Result};
use crate::model::{MemoryPolicy, ModelConfig};
use crate::train::data::{Tokenizer, load_tokens};
use crate::train::optim::AdamWConfig;
use crate::train::trainer::{StepReport, TrainConfig, train_cpu};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Flags of `upipe train`.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// Preset name (tiny, llama3.2-1b, llama3-8b, llama3-70b, qwen3-32b), config.json, or HF model dir.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Training data: a text file (tokenized) or pre-tokenized `.u32` ids. Default: the bundled corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Tokenizer for text data: `byte` or a path to an HF tokenizer.json.
    #[arg(long, default_value = "byte")]
    pub tokenizer: String,
    /// Start from the weights of an HF model directory (config.json + safetensors).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Attention strategy: local, ulysses, ring, usp, upipe.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    /// Ulysses degree Pu.
    #[arg(long, default_value_t = 2)]
    pub ulysses: usize,
    /// Ring degree Pr.
    #[arg(long, default_value_t = 2)]
    pub ring: usize,
    /// UPipe heads per stage U (default Pu).
    #[arg(long)]
    pub chunk_heads: Option<usize>,
    /// Data-parallel replicas (each runs its own context-parallel group).
    #[arg(long, default_value_t = 1)]
    pub data_parallel: usize,
    /// Tokens per sequence (global, before context sharding).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[arg(long, default_value_t = 300)]
    pub steps: u32,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    #[arg(long, default_value_t = 3e-4)]
    pub min_lr: f32,
    #[arg(long, default_value_t = 20)]
    pub warmup: u32,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Full activation checkpointing per block.
    #[arg(long)]
    pub checkpoint: bool,
    /// Hold checkpointed block inputs in host memory (needs --checkpoint).
    #[arg(long)]
    pub offload: bool,
    /// Tiled MLP/RMSNorm (token tiles of about `hidden` rows).
    #[arg(long)]
    pub tiled_mlp: bool,
    /// Rows of logits per fused-loss chunk.
    #[arg(long, default_value_t = 256)]
    pub loss_chunk: usize,
    /// Directory for training checkpoints (safetensors + optimizer state).
    #[arg(long)]
    pub save_dir: Option<PathBuf>,
    /// Checkpoint every N steps (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub save_every: u32,
    /// Resume from --save-dir when it holds a checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Device: auto (cuda when a GPU is visible, else cpu), cpu, or cuda. Ranks
    /// are threads; on cuda they are spread over the visible GPUs and exchange
    /// through host memory (multi-process NCCL training is not built yet).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// One JSON object per step instead of a progress bar.
    #[arg(long)]
    pub json: bool,
}

/// GPUs visible to the driver (none when CUDA is unavailable).
/// Thread ranks spread round-robin over `gpus` devices.
fn train_on_gpus(
    cfg: &TrainConfig,
    tokens: std::sync::Arc<[u32]>,
    gpus: usize,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<crate::train::trainer::TrainSummary> {
    use crate::backend::cuda::CudaBackend;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // open every device once here, so a failure is an error rather than a
    // failure inside a rank thread
    for g in 0..gpus {
        CudaBackend::new(g)?;
    }
    let next = AtomicUsize::new(0);
    let make = || {
        let g = next.fetch_add(1, Ordering::Relaxed) % gpus;
        CudaBackend::new(g).expect("the device opened a moment ago")
    };
    crate::train::trainer::train_threads(cfg, tokens, make, on_step)
}

fn visible_gpus() -> usize {
    crate::backend::cuda::device::gpus().map_or(0, |g| g.len())
}

pub fn run(a: TrainArgs) -> Result<i32> {
    let gpus = match a.device.as_str() {
        "cpu" => 0,
        "auto" => visible_gpus(),
        "cuda" => match visible_gpus() {
            0 => {
                return Err(Error::Config(
                    "--device cuda: no GPU is visible (see `upipe info`); use --device cpu".into(),
                ));
            }
            n => n,
        },
        other => {
            return Err(Error::Config(format!(
                "--device {other}: use auto, cpu or cuda"
            )));
        }
    };
    let model = ModelConfig::resolve(&a.model)?;
    let strategy: Strategy = a.attn.parse()?;
    let (ulysses, ring) = if strategy == Strategy::Local {
        (1, 1)
    } else {
        (a.ulysses, a.ring)
    };
    let tokenizer = Tokenizer::resolve(&a.tokenizer)?;
    let tokens = load_tokens(a.data.as_deref(), &tokenizer)?;
    let cfg = TrainConfig {
        model,
        data_parallel: a.data_parallel,
        strategy,
        ulysses,
        ring,
        chunk_heads: a.chunk_heads,
        seq: a.seq,
        steps: a.steps,
        optim: AdamWConfig {
            lr: a.lr,
            min_lr: a.min_lr,
            warmup: a.warmup,
            total_steps: a.steps,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: a.weight_decay,
            clip: a.clip,
        },
        seed: a.seed,
        policy: MemoryPolicy {
            checkpoint: a.checkpoint,
            offload: a.offload,
            tiled_mlp: a.tiled_mlp,
            loss_chunk: a.loss_chunk,
        },
        init_from: a.init_from.clone(),
        save_dir: a.save_dir.clone(),
        save_every: a.save_every,
        resume: a.resume,
    };
    let plan = cfg.plan()?;
    if !a.json {
        println!(
            "training {} ({:.2}M params) on {} tokens: {} on {} {} ranks (data {} x Pu {} x Pr {}, U {}), seq {}, {} steps",
            cfg.model.name,
            cfg.model.param_count() as f64 / 1e6,
            tokens.len(),
            strategy,
            plan.mesh_shape().world_size() * cfg.data_parallel,
            if gpus > 0 { "GPU thread" } else { "CPU" },
            cfg.data_parallel,
            plan.layout.pu,
            plan.layout.pr,
            plan.schedule.chunk,
            cfg.seq,
            cfg.steps
        );
    }
    // what `upipe plan` predicts for this run (rank 0's ledger peak)
    let predicted = crate::plan::predict_step_rank(
        &crate::plan::StepSpec {
            model: cfg.model.clone(),
            plan: plan.clone(),
            data: cfg.data_parallel,
            policy: cfg.policy,
            fsdp: false,
            device: if gpus > 0 {
                crate::plan::DeviceKind::Cuda
            } else {
                crate::plan::DeviceKind::Cpu
            },
            optimizer: true,
        },
        0,
    )?;
    let predicted_peak = predicted.peak;
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(cfg.steps as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
        );
        b
    };
    let json = a.json;
    let on_step = |r: &StepReport| {
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "step": r.step, "loss": r.loss, "tokens_per_s": r.tokens_per_s,
                    "peak_bytes": r.peak_bytes, "lr": r.lr, "grad_norm": r.grad_norm,
                    "predicted_peak_bytes": predicted_peak,
                })
            );
        } else {
            bar.set_position(r.step as u64);
            bar.set_message(format!(
                "loss {:.4}  {:.0} tok/s  peak {}",
                r.loss,
                r.tokens_per_s,
                Bytes(r.peak_bytes)
            ));
        }
    };
    let summary = if gpus > 0 {
        train_on_gpus(&cfg, tokens.into(), gpus, &on_step)?
    } else {
        train_cpu(&cfg, tokens.into(), &on_step)?
    };
    bar.finish();
    let measured = summary.memory.peak;
    let diff = 100.0 * (predicted.peak as f64 - measured as f64) / measured.max(1) as f64;
    if !json {
        let first = summary.reports.first().map_or(f64::NAN, |r| r.loss);
        let last = summary.reports.last().map_or(f64::NAN, |r| r.loss);
        println!("loss {first:.4} -> {last:.4}");
        println!(
            "peak of rank 0: predicted {} (upipe plan), measured {} ({diff:+.2}%)",
            Bytes(predicted.peak),
            Bytes(measured)
        );
        println!("memory of rank 0 (peak {}):", Bytes(summary.memory.peak));
        println!(
            "  {:<14} {:>12} {:>12} {:>12}",
            "category", "at peak", "predicted", "now"
        );
        for (cat, at_peak) in &summary.memory.at_peak_by_category {
            let now = summary
                .memory
                .current_by_category
                .iter()
                .find(|(c, _)| c == cat)
                .map_or(0, |x| x.1);
            let peak = if *cat == Category::Offload {
                summary.memory.host_peak
            } else {
                *at_peak
            };
            println!(
                "  {:<14} {:>12} {:>12} {:>12}",
                cat.name(),
                Bytes(peak).to_string(),
                Bytes(predicted.at(*cat)).to_string(),
                Bytes(now).to_string()
            );
        }
    }
    Ok(0)
}
