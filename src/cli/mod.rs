//! The `upipe` command line: parsing, logging setup and dispatch. Each
//! subcommand lives in its own file and validates its flags once, here at the edge.

pub mod bench;
pub mod config;
pub mod eval;
pub mod hints;
pub mod info;
pub mod launch;
pub mod lora;
pub mod memory;
pub mod merge;
pub mod mesh;
pub mod metrics;
pub mod plan;
pub mod print_config;
pub mod rendezvous_check;
pub mod report;
pub mod schedule;
pub mod svg;
pub mod tensorboard;
pub mod tokenize;
pub mod train;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Long-context transformer training with UPipe context parallelism.
#[derive(Parser, Debug)]
#[command(name = "upipe", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// One value, parsed once at start: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model (no arguments: tiny model, bundled data, UPipe on 4 CPU thread ranks, or one NCCL process per GPU when 2+ GPUs are visible).
    Train(train::TrainArgs),
    /// Next-token cross-entropy of a model on a token file (forward only; by position with --buckets).
    Eval(eval::EvalArgs),
    /// Merge a LoRA adapter into its base model (no training): a plain HF model directory.
    Merge(merge::MergeArgs),
    /// Tokenize text/JSONL files into a .u32 (or .u16/.bin) token file with a tokenizer.json.
    Tokenize(tokenize::TokenizeArgs),
    /// Benchmarks (attention layer across strategies).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Predict per-rank memory and the longest context that fits.
    Plan(plan::PlanArgs),
    /// Start one process per local rank (torchrun-style) and supervise them.
    Launch(launch::LaunchArgs),
    /// Draw a metrics file (`train --metrics`) as one SVG: loss and eval loss, throughput, learning rate, memory at the peak.
    Report(report::ReportArgs),
    /// Show devices and which GPU libraries were found.
    Info(info::InfoArgs),
    /// Test the rendezvous between real processes (run under `upipe launch`).
    #[command(hide = true)]
    RendezvousCheck(rendezvous_check::Args),
}

/// Entry point of the binary; returns the process exit status.
pub fn main() -> i32 {
    let matches = Cli::command().try_get_matches().unwrap_or_else(|e| {
        // clap's error, then what the unknown flag is called here
        let command = std::env::args().nth(1).unwrap_or_default();
        let hint = hints::error_hint(&command, &e);
        let _ = e.print();
        if let Some(hint) = hint {
            eprintln!("\nhint: {hint}");
        }
        std::process::exit(e.exit_code())
    });
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logging();
    // each subcommand's own matches: which flags the command line gave
    let (_, sub) = matches.subcommand().expect("clap requires a subcommand");
    let result = match cli.command {
        Command::Train(a) => train::run(a, sub),
        Command::Eval(a) => eval::run(a, sub),
        Command::Merge(a) => merge::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Bench(a) => bench::run(a, sub),
        Command::Plan(a) => plan::run(a, sub),
        Command::Report(a) => report::run(a),
        Command::Launch(a) => launch::run(a),
        Command::Info(a) => info::run(a),
        Command::RendezvousCheck(a) => rendezvous_check::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("UPIPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // colours only on a terminal, and never under NO_COLOR
        .with_ansi(console::colors_enabled_stderr())
        .with_target(false)
        .try_init();
}
