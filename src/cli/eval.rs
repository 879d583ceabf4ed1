//! `upipe eval`: the mean next-token cross-entropy of an HF checkpoint on a
//! token file, forward only, under any strategy and mesh, overall and by
//! position within the window — for checking against other frameworks on
//! the same weights, and for long-context evaluation.
//!
//! Runs go where `upipe train`'s would ([`route_for`]): on the CPU (f32) as
//! thread ranks; on GPUs (bf16) as one process per GPU (started by itself,
//! or by `upipe launch`/torchrun/srun), or as thread ranks spread over the
//! GPUs when the mesh has more ranks than GPUs.
//!
//! `--task` scores synthetic retrieval trials instead (`eval/task.rs`,
//! its flags `eval/task_args.rs`, its outputs `eval/task_report.rs`).

mod args;
mod place;
mod preflight;
mod task;
mod task_args;
mod task_report;

pub use args::EvalArgs;
use place::{Placed, gpu_backends, load_weights, open_model, place};
pub use task_args::TaskArgs;

use crate::cli::config;
use crate::cli::metrics::{MetricsFile, RunClock, StepMetrics, by_category};
use crate::cli::train::Route;
use crate::data::{Dataset, PackMode, Tokens};
use crate::error::{Error, Result};
use crate::model::flops::forward_flops_per_token;
use crate::plan::{EvalForward, Prediction};
use crate::train::eval::{EvalConfig, EvalReport, eval_cpu, eval_threads};
use crate::train::trainer::eval_process_rank;
use clap::ArgMatches;
use std::path::{Path, PathBuf};

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

/// `upipe eval` with flags `a`, parsed from the command line `m`.
pub fn run(a: EvalArgs, m: &ArgMatches) -> Result<i32> {
    let a = config::resolve(a, m)?;
    if a.task.task.is_some() {
        return run_task(&a);
    }
    if let Some(flag) = a.task.given_without_task() {
        return crate::config_err!(
            "{flag} is a flag of --task: add --task (passkey, multikey, multivalue or kv)"
        );
    }
    let run = build(&a)?;
    if let Route::SelfLaunch { nproc } = run.placed.route {
        let gpus = run.placed.gpus;
        tracing::info!("{gpus} GPUs visible: starting {nproc} processes, one per GPU (NCCL)");
        let child = crate::cli::launch::own_command("eval")?;
        return crate::cli::launch::run_local(nproc, child);
    }
    check_mask_counts(&run.data)?;
    let clock = RunClock::start();
    let report = execute(&a, &run)?;
    if report.counted_tokens == 0 {
        return Err(nothing_counted(&run.data, "its windows"));
    }
    if run.placed.lead() {
        match a.json {
            true => {
                let text = serde_json::to_string(&report).expect("a report always serialises");
                println!("{text}");
            }
            false => println!("{}", summary_line(&report)),
        }
        if let Some(path) = &a.metrics {
            let ranks = run.placed.shape.world_size();
            let facts = (&run.placed.cfg, &run.predicted, ranks);
            write_metrics(path, facts, &report, &clock)?;
        }
    }
    Ok(0)
}

/// `upipe eval --task`: retrieval trials (`eval/task.rs`) with the flags
/// they share with `upipe eval`, placed and loaded as it places and loads.
fn run_task(a: &EvalArgs) -> Result<i32> {
    task::run(a)
}

/// Refuses data whose loss mask counts no token at all, before any weight
/// is loaded: its loss would be 0/0.
fn check_mask_counts(data: &Dataset) -> Result<()> {
    match &data.mask {
        Some(mask) if !mask.counts_any(0..mask.tokens()) => Err(nothing_counted(data, "any")),
        _ => Ok(()),
    }
}

/// The error for an evaluation with no counted target (`what`: where none is).
fn nothing_counted(data: &Dataset, what: &str) -> Error {
    let name = data.tokens.name();
    Error::Config(format!(
        "{name}: the evaluation counts no target: the loss mask {} counts no token of {what} \
         (SFT prompts, document ends and padding are not counted), so there is no loss to \
         report; evaluate data with answers to score, a longer --seq, or the ids without \
         their .mask",
        crate::data::doc_index::mask_path(std::path::Path::new(name)).display()
    ))
}

/// `--metrics` writes over none of the files the evaluation reads (the
/// token file and the index and mask beside it, the model and adapter
/// directories, the run file).
fn check_outputs(a: &EvalArgs, model_dir: &Path, tokens: &Path) -> Result<()> {
    use crate::output_path::{Input, Output};
    let Some(metrics) = &a.metrics else {
        return Ok(());
    };
    let (docs, mask) = (
        crate::data::doc_index::index_path(tokens),
        crate::data::doc_index::mask_path(tokens),
    );
    let inputs = [
        ("--tokens", Some(tokens)),
        ("--tokens' document index", Some(docs.as_path())),
        ("--tokens' loss mask", Some(mask.as_path())),
        ("--config", a.config.as_deref()),
    ];
    let mut inputs: Vec<Input> = inputs
        .into_iter()
        .filter_map(|(flag, path)| path.map(|path| Input { flag, path }))
        .collect();
    // a model or adapter directory: the files in it (a new file beside
    // them overwrites nothing)
    let dirs = [
        ("--model-dir", Some(model_dir)),
        ("--lora-from", a.lora_from.as_deref()),
    ];
    let dir_files = crate::output_path::directory_inputs(&dirs);
    inputs.extend(dir_files.iter().map(|(flag, path)| Input { flag, path }));
    crate::output_path::check_outputs(&[Output::file("--metrics", metrics)], &inputs)
}

/// The evaluation in one line: `loss 3.1234, perplexity 22.74 over 4096
/// tokens (2 windows of 2048)`, the loss by positions after it when
/// `--buckets` asks (`--json` prints every field).
pub fn summary_line(r: &EvalReport) -> String {
    let mut line = format!(
        "loss {:.4}, perplexity {:.2} over {} tokens ({} window{} of {})",
        r.loss,
        r.loss.exp(),
        r.counted_tokens,
        r.windows,
        if r.windows == 1 { "" } else { "s" },
        r.tokens / r.windows.max(1)
    );
    if r.by_position.len() > 1 {
        let parts: Vec<String> = (r.by_position.iter())
            .map(|b| format!("{}-{} {:.4}", b.from, b.to, b.loss))
            .collect();
        line.push_str(&format!("; by position: {}", parts.join(" ")));
    }
    line
}

/// `--tokens FILE` that holds no ids (JSONL, text, Parquet): the error
/// names the `upipe tokenize` command that writes them with the model's
/// tokenizer (its directory's `tokenizer.json` when it has one).
fn refuse_not_ids(tokens: &Path, model_dir: &Path) -> Result<()> {
    if crate::data::TokenFormat::of_path(tokens).is_some() {
        return Ok(());
    }
    let own = model_dir.join("tokenizer.json");
    let tokenizer = match own.is_file() {
        true => own.display().to_string(),
        false => "TOKENIZER.json (the model's)".to_string(),
    };
    let out = tokens.with_extension("u32");
    crate::config_err!(
        "--tokens {}: upipe eval reads token ids (.u32, .u16, .bin), not text or documents; \
         write them once with `upipe tokenize {} --tokenizer {tokenizer} --out {}`, then \
         evaluate --tokens {}",
        tokens.display(),
        tokens.display(),
        out.display(),
        out.display()
    )
}

/// An evaluation built from its flags, up to the moment it runs.
struct Built {
    placed: Placed,
    model_dir: PathBuf,
    data: Dataset,
    /// The planner's prediction of the evaluation's peak.
    predicted: Prediction,
}

/// The flags parsed and checked, the token file opened, the mesh chosen,
/// where the ranks run decided and the evaluation planned (refused when
/// it cannot fit).
fn build(a: &EvalArgs) -> Result<Built> {
    let model_dir = required(&a.model_dir, "model_dir")?;
    let tokens_path = required(&a.tokens, "tokens")?;
    check_outputs(a, model_dir, tokens_path)?;
    refuse_not_ids(tokens_path, model_dir)?;
    let model = open_model(model_dir)?;
    let tokens = Tokens::open_checked(tokens_path, model.vocab)?;
    let data = Dataset::with_files_beside(tokens, tokens_path)?;
    let probe = EvalConfig {
        seq: a.seq,
        buckets: a.buckets,
        pack: a.pack.unwrap_or(PackMode::Stream),
        ..EvalConfig::new(model.clone())
    };
    let seq = probe.windows(&data)?.seq;
    let placed = place(a, &model, seq)?;
    let documents = crate::cli::train::may_hold_documents(placed.cfg.pack, Some(tokens_path));
    let at = preflight::Placement {
        route: &placed.route,
        device: placed.device,
        kernel: placed.kernel,
        gpus: placed.gpus,
        documents,
    };
    let planned = preflight::preflight(&placed.cfg, &[seq], EvalForward::Loss, &at)?;
    Ok(Built {
        placed,
        model_dir: model_dir.to_path_buf(),
        data,
        predicted: planned.predictions.into_iter().next().expect("one length"),
    })
}

/// Loads the weights and evaluates where the route says.
fn execute(a: &EvalArgs, run: &Built) -> Result<EvalReport> {
    let (p, data) = (&run.placed, &run.data);
    let host = load_weights(a, &run.model_dir, &p.cfg.model)?;
    match &p.route {
        Route::ProcessRank => {
            let env = p.env.as_ref().expect("a launched run has its environment");
            eval_process_rank(&p.cfg, data.clone(), &host, env, p.kernel)
        }
        Route::GpuThreads { gpus, why } => {
            tracing::info!("thread ranks on GPUs: {why}");
            eval_threads(&p.cfg, data.clone(), &host, gpu_backends(*gpus, p.kernel)?)
        }
        _ => eval_cpu(&p.cfg, data.clone(), &host),
    }
}

/// `--metrics`: the evaluation as one metrics line (step 0; model FLOPs of
/// the forward only; the planner's prediction, the highest rank's peak,
/// beside rank 0's measured one), stamped with the time on `clock` (started with the
/// evaluation).
fn write_metrics(
    path: &Path,
    (cfg, predicted, ranks): (&EvalConfig, &Prediction, usize),
    r: &EvalReport,
    clock: &RunClock,
) -> Result<()> {
    let seq = r.tokens / r.windows.max(1);
    let tflops = forward_flops_per_token(&cfg.model, seq) * r.tokens_per_s / 1e12;
    let line = StepMetrics {
        step: 0,
        time_unix_s: None,
        elapsed_s: None,
        loss: r.loss,
        lr: None,
        skipped_steps: None,
        grad_norm: None,
        tokens: r.tokens,
        counted_tokens: Some(r.counted_tokens),
        attn_flop_fraction: None,
        tokens_per_s: r.tokens_per_s,
        attention_kernel: None,
        optim_state: None,
        precision: None,
        tflops,
        tflops_per_rank: tflops / ranks.max(1) as f64,
        ranks,
        peak_bytes: r.peak_bytes,
        peak_by_category: by_category(&r.at_peak_by_category, r.host_peak_bytes),
        predicted_peak_bytes: Some(predicted.peak),
        predicted_by_category: Some(by_category(&predicted.at_peak, predicted.host_peak)),
        profile: None,
        eval: None,
        retrieval: None,
        mixture: None,
        skipped_windows: None,
    }
    .at(clock);
    let file = MetricsFile::create(path)?;
    file.write(&line);
    file.finish()
}
