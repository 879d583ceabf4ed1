//! `upipe bench attn`: one attention layer forward+backward under each
//! strategy on the same C = Pu x Pr ranks, with errors against `local` and
//! ledger-measured memory. `--device cuda` runs one process per GPU over
//! NCCL (`gpu.rs`).

mod gpu;
pub mod preflight;

use crate::attention::rope::RopeConfig;
use crate::attention::trial::{TrialInputs, TrialResult, run_trial};
use crate::attention::{AttnDims, CpPlan, Strategy};
use crate::backend::Bytes;
use crate::backend::cpu::CpuBackend;
use crate::cli::config::{self, Given, RunArgs, RunFile, run_keys};
use crate::cli::mesh::MeshArgs;
use crate::cli::schedule::ScheduleArgs;
use crate::error::{Error, Result};
use crate::plan::resolve::Strategies;
use crate::plan::{DeviceKind, predict_attention_trial};
use clap::ArgMatches;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// One attention layer forward+backward under each strategy.
    Attn(AttnArgs),
}

/// Flags of `upipe bench attn`.
#[derive(clap::Args, Debug, Clone)]
pub struct AttnArgs {
    /// A run file (TOML): the keys of `[bench]`, `[parallel]`, `[data] seq`
    /// and `[run]` this command has flags for; flags given here win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Device to run on (cpu: ranks as threads, f32; cuda: one process per
    /// GPU, bf16, NCCL: started by itself when the mesh fits the visible
    /// GPUs, or under `upipe launch`, torchrun or srun).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 32)]
    pub heads: usize,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 8)]
    pub head_dim: usize,
    /// Global sequence length (tokens).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Per-head RMSNorm of q and k (Qwen3).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub qk_norm: bool,
    /// Attention kernel on CUDA: auto (cuDNN SDPA where it supports the call,
    /// else our flash kernels), cudnn (error where it cannot), native (ours).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Comma-separated strategies, or `all`.
    #[arg(long, default_value = "all")]
    pub methods: String,
    /// Fail (exit 1) if any strategy differs from `local` by more than the tolerance.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub check: bool,
    /// Print one JSON object per strategy instead of a table.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub json: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Untimed passes before the timed ones (cuda).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed forward+backward passes; the median is reported (cuda).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
    /// Rounds over the strategies (cuda): each round runs every strategy's
    /// warm-up and timed passes, in reverse order every other round (A B,
    /// B A, ...) so clocks that drift during a run favour no strategy; the
    /// median pools the timed passes of all rounds.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
}

impl AttnArgs {
    run_keys! {
        device => bench.device,
        hidden => bench.hidden,
        heads => bench.heads,
        kv_heads => bench.kv_heads,
        head_dim => bench.head_dim,
        qk_norm => bench.qk_norm,
        methods => bench.methods,
        check => bench.check,
        warmup => bench.warmup,
        iters => bench.iters,
        rounds => bench.rounds,
        seq => data.seq,
        attn_kernel => run.attn_kernel,
        json => run.json,
        seed => run.seed;
        flatten mesh, schedule
    }
}

impl AttnArgs {
    /// The Ulysses degree Pu (`--ulysses`, default 4).
    pub fn ulysses(&self) -> usize {
        self.mesh.ulysses.unwrap_or(4)
    }

    /// The ring degree Pr (`--ring`, default 1).
    pub fn ring(&self) -> usize {
        self.mesh.ring.unwrap_or(1)
    }

    /// The mesh flags this command takes: one context group, so no data
    /// replicas.
    fn check_mesh(&self) -> Result<()> {
        match self.mesh.data_parallel {
            None | Some(1) => Ok(()),
            Some(d) => crate::config_err!(
                "--data-parallel {d}: `bench attn` runs one context group (--ulysses x --ring); \
                 leave --data-parallel out"
            ),
        }
    }
}

impl RunArgs for AttnArgs {
    fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }
    fn take_file(&mut self, file: &RunFile, given: &Given) {
        self.take_keys(file, given);
    }
    fn to_file(&self) -> RunFile {
        let mut f = RunFile::default();
        self.put_keys(&mut f);
        f
    }
}

/// `upipe bench` with the bench command's matches `m`.
pub fn run(cmd: BenchCommand, m: &ArgMatches) -> Result<i32> {
    match cmd {
        BenchCommand::Attn(a) => {
            let sub = m.subcommand_matches("attn").unwrap_or(m);
            bench_attn(&config::resolve(a, sub)?)
        }
    }
}

/// Tolerance of the f32 CPU backend against the local reference, by output.
fn cpu_tolerance(_output: &str) -> f64 {
    1e-5
}
/// Tolerance of bf16 on the GPU against the f32 CPU reference, by output
/// (as the GPU tests use).
const CUDA_TOLERANCE: fn(&str) -> f64 = crate::attention::trial::bf16_tolerance;

enum Outcome {
    Ran(TrialResult, Box<CpPlan>),
    Skipped(String),
}

/// The layer dimensions of the flags.
fn attn_dims(a: &AttnArgs) -> AttnDims {
    AttnDims {
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        qk_norm: a.qk_norm,
        norm_eps: 1e-6,
        rope: RopeConfig {
            theta: 500000.0,
            scaling: None,
        },
    }
}

fn bench_attn(a: &AttnArgs) -> Result<i32> {
    a.check_mesh()?;
    let dims = attn_dims(a);
    dims.validate()?;
    // checked here so a typo fails on every device
    let _: crate::backend::cuda::cudnn::AttnKernel = a.attn_kernel.parse()?;
    match a.device.as_str() {
        "cpu" => crate::cli::train::check_thread_ranks(
            "bench attn",
            a.ulysses().saturating_mul(a.ring()),
        )?,
        "cuda" => return gpu::bench_attn_cuda(a, &dims),
        other => {
            return Err(Error::Config(format!(
                "--device {other}: use cpu (thread ranks) or cuda (one process per GPU)"
            )));
        }
    }
    let (all, methods) = methods_of(a)?;
    let need_reference = a.check || methods.contains(&Strategy::Local);
    let reference_plan = match need_reference {
        true => Some(CpPlan::new(Strategy::Local, &dims, a.seq, 1, 1, None)?),
        false => None,
    };
    let plans = cpu_plans(a, &dims, all, &methods)?;
    let ran: Vec<&CpPlan> = (plans.iter().filter_map(|(_, p)| p.as_ref().ok()))
        .chain(reference_plan.as_ref())
        .collect();
    let need = preflight::bench_memory(a.seq, &dims, &ran, |p| predicted_peak(a, p))?;
    preflight::check(a.seq, &need, crate::cli::train::host_available_bytes())?;
    let inputs = TrialInputs::random(&dims, a.seq, a.seed);
    let reference = match &reference_plan {
        Some(plan) => Some(run_trial(plan, &dims, &inputs, CpuBackend::new)?),
        None => None,
    };
    let outcomes = cpu_outcomes(&dims, &inputs, plans, reference.as_ref())?;
    let ulysses_act = outcomes.iter().find_map(|(m, o)| match o {
        Outcome::Ran(r, _) if *m == Strategy::Ulysses => Some(r.act_bytes),
        _ => None,
    });
    if !a.json {
        print_header(a, "cpu-f32", false);
    }
    let mut failed = false;
    for (m, o) in &outcomes {
        failed |= print_row(
            a,
            *m,
            o,
            reference.as_ref(),
            ulysses_act,
            cpu_tolerance,
            None,
        );
    }
    Ok(if failed { 1 } else { 0 })
}

/// Each strategy's plan on the CPU's thread ranks, or why it is skipped
/// (with `all`).
fn cpu_plans(
    a: &AttnArgs,
    dims: &AttnDims,
    all: bool,
    methods: &[Strategy],
) -> Result<Vec<(Strategy, std::result::Result<CpPlan, String>)>> {
    let mut plans = Vec::new();
    for &m in methods {
        let chunk = if m == Strategy::Upipe {
            crate::cli::schedule::ChunkHeads::fixed(a.mesh.chunk_heads, "bench attn")?
        } else {
            None
        };
        // local runs on one rank; every other strategy on the same C ranks
        let (pu, pr) = if m == Strategy::Local {
            (1, 1)
        } else {
            (a.ulysses(), a.ring())
        };
        let plan = match CpPlan::new(m, dims, a.seq, pu, pr, chunk) {
            Ok(p) => Ok(a.schedule.apply(p, |p| predicted_peak(a, p))?),
            // with `all`, ulysses and ring (which put all C ranks in one group) may not fit
            Err(e) if all && matches!(m, Strategy::Ulysses | Strategy::Ring) => Err(e.to_string()),
            Err(e) => return Err(Error::Config(format!("{m}: {e}"))),
        };
        plans.push((m, plan));
    }
    Ok(plans)
}

/// Each strategy's CPU trial on thread ranks (`local`'s is the `reference`
/// when there is one), or why it is skipped.
fn cpu_outcomes(
    dims: &AttnDims,
    inputs: &TrialInputs,
    plans: Vec<(Strategy, std::result::Result<CpPlan, String>)>,
    reference: Option<&TrialResult>,
) -> Result<Vec<(Strategy, Outcome)>> {
    let mut outcomes = Vec::new();
    for (m, plan) in plans {
        let plan = match plan {
            Ok(p) => p,
            Err(why) => {
                outcomes.push((m, Outcome::Skipped(why)));
                continue;
            }
        };
        let result = match (m, reference) {
            (Strategy::Local, Some(r)) => r.clone(),
            _ => run_trial(&plan, dims, inputs, CpuBackend::new)?,
        };
        outcomes.push((m, Outcome::Ran(result, Box::new(plan))));
    }
    Ok(outcomes)
}

fn print_header(a: &AttnArgs, device: &str, throughput: bool) {
    println!(
        "attention layer fwd+bwd on {device}: hidden {} heads {} kv {} d {} seq {} qk_norm {} | C = {} ranks (Pu {} x Pr {})",
        a.hidden,
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.seq,
        a.qk_norm,
        a.ulysses() * a.ring(),
        a.ulysses(),
        a.ring()
    );
    print!(
        "{:<8} {:>6} {:>4} {:>7} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9}",
        "method",
        "mesh",
        "U",
        "stages",
        "max_rel_err",
        "peak/rank",
        "predicted",
        "act/rank",
        "act/uly",
        "time_s"
    );
    if throughput {
        print!(" {:>10} {:>12}", "TF/s/GPU", "tok/s/GPU");
    }
    println!();
}

/// What `upipe plan` predicts this run's layer peaks at (the highest rank's
/// ledger peak): the CPU trial runs one pass; the GPU one warm-up, timed and
/// (profiled) extra passes, which start with cuDNN's kept workspace.
pub(crate) fn predicted_peak(a: &AttnArgs, plan: &CpPlan) -> Result<usize> {
    // the bench's backend routes each call by the cuDNN it loads, if any
    let loaded = crate::backend::cuda::cudnn::probe().map(|(v, _)| v);
    let device = match (a.device.as_str(), a.attn_kernel.parse(), loaded) {
        ("cuda", Ok(crate::backend::cuda::cudnn::AttnKernel::Native), _) | ("cuda", _, Err(_)) => {
            DeviceKind::CudaNative
        }
        ("cuda", _, Ok(version)) => DeviceKind::CUDA.with_cudnn(version),
        _ => DeviceKind::Cpu,
    };
    let passes = if a.device == "cuda" {
        a.warmup + a.iters
    } else {
        1
    };
    Ok(predict_attention_trial(plan, &attn_dims(a), device, passes)?.peak)
}

/// Prints one strategy's row (table or JSON); returns whether `--check` fails it.
/// `throughput` is `(tflops_per_gpu, tokens_per_s_per_gpu, median seconds)`.
fn print_row(
    a: &AttnArgs,
    m: Strategy,
    o: &Outcome,
    reference: Option<&TrialResult>,
    ulysses_act: Option<usize>,
    tolerance: fn(&str) -> f64,
    throughput: Option<(f64, f64, f64)>,
) -> bool {
    match o {
        Outcome::Skipped(why) => {
            if a.json {
                println!(
                    "{}",
                    json!({"method": m.name(), "ok": false, "skipped": why})
                );
            } else {
                println!("{:<8} skipped: {why}", m.name());
            }
            false
        }
        Outcome::Ran(r, plan) => {
            let row = Row {
                err: reference.map(|rf| r.max_rel_err(rf)),
                ok: reference.is_none_or(|rf| {
                    r.errors_against(rf)
                        .iter()
                        .all(|(name, e)| *e <= tolerance(name))
                }),
                ratio: ulysses_act.map(|u| r.act_bytes as f64 / u.max(1) as f64),
                seconds: throughput.map_or(r.seconds, |t| t.2),
                // what `upipe plan` predicts for this layer (the highest rank's ledger peak)
                predicted: predicted_peak(a, plan).ok(),
            };
            if a.json {
                println!("{}", json_row(a, m, r, plan, &row, reference, throughput));
            } else {
                println!("{}", table_row(m, r, plan, &row, throughput));
            }
            a.check && !row.ok
        }
    }
}

/// What a strategy's row shows beside its trial's own numbers.
struct Row {
    /// Largest relative error against the reference.
    err: Option<f64>,
    /// Every output within the tolerance (or no reference).
    ok: bool,
    /// Activation bytes against Ulysses'.
    ratio: Option<f64>,
    seconds: f64,
    /// The planner's peak for this layer.
    predicted: Option<usize>,
}

/// One strategy's JSON line.
fn json_row(
    a: &AttnArgs,
    m: Strategy,
    r: &TrialResult,
    plan: &CpPlan,
    row: &Row,
    reference: Option<&TrialResult>,
    throughput: Option<(f64, f64, f64)>,
) -> serde_json::Value {
    let mut line = json!({
        "method": m.name(), "max_rel_err": row.err, "peak_bytes": r.peak_bytes,
        "predicted_peak_bytes": row.predicted,
        "act_bytes": r.act_bytes, "ok": row.ok, "ranks": r.ranks,
        "ulysses": plan.layout.pu, "ring": plan.layout.pr,
        "chunk_heads": plan.schedule.chunk, "fwd_chunk_heads": plan.fwd_schedule.chunk, "stages": plan.schedule.n_stages(),
        "overlap": plan.overlap, "settle_every": plan.settle_every.to_string(),
        "act_vs_ulysses": row.ratio, "seconds": row.seconds,
    });
    if let Some(rf) = reference {
        line["errors"] = r.errors_against(rf).into_iter().collect();
    }
    if let Some((tf, tok, _)) = throughput {
        line["tflops_per_gpu"] = json!(tf);
        line["tokens_per_s_per_gpu"] = json!(tok);
        line["seq"] = json!(a.seq);
        line["device"] = json!(a.device);
        // the Ulysses exchanges' copy-engine window (NCCL ranks only)
        let window = (a.device == "cuda")
            .then(|| {
                crate::comm::nccl::exchange_window::size_from_env()
                    .ok()
                    .flatten()
            })
            .flatten();
        line["exchange_window_mib"] = json!(window.map(|b| b >> 20));
    }
    line
}

/// One strategy's row of the table.
fn table_row(
    m: Strategy,
    r: &TrialResult,
    plan: &CpPlan,
    row: &Row,
    throughput: Option<(f64, f64, f64)>,
) -> String {
    let mut line = format!(
        "{:<8} {:>6} {:>4} {:>7} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9.3}",
        m.name(),
        format!("{}x{}", plan.layout.pu, plan.layout.pr),
        plan.chunk_text(),
        plan.schedule.n_stages(),
        row.err.map_or("-".into(), |e| format!("{e:.2e}")),
        Bytes(r.peak_bytes).to_string(),
        row.predicted.map_or("-".into(), |p| Bytes(p).to_string()),
        Bytes(r.act_bytes).to_string(),
        row.ratio.map_or("-".into(), |x| format!("{x:.3}")),
        row.seconds
    );
    if let Some((tf, tok, _)) = throughput {
        line += &format!(" {tf:>10.1} {tok:>12.0}");
    }
    line
}

/// `(is_all, strategies)` of `--methods`; UPipe's stage flags given
/// without upipe among them are an error (they would do nothing).
fn methods_of(a: &AttnArgs) -> Result<(bool, Vec<Strategy>)> {
    let (all, methods) = parse_methods(&a.methods)?;
    let fwd_given = a.schedule.fwd.fwd_chunk_heads != crate::cli::schedule::FwdChunk::Auto;
    let flag = match (a.mesh.chunk_heads.is_some(), fwd_given) {
        (true, _) => "--chunk-heads",
        (false, true) => "--fwd-chunk-heads",
        (false, false) => return Ok((all, methods)),
    };
    if !methods.contains(&Strategy::Upipe) {
        return crate::config_err!(
            "{flag} sets UPipe's stages, and --methods {} has no upipe: add upipe to \
             --methods, or leave {flag} out",
            a.methods
        );
    }
    Ok((all, methods))
}

/// `(is_all, strategies)` from the `--methods` flag.
fn parse_methods(s: &str) -> Result<(bool, Vec<Strategy>)> {
    match s.parse()? {
        Strategies::All => Ok((true, Strategy::ALL.to_vec())),
        Strategies::Listed(list) if list.is_empty() => Err(Error::Config(
            "--methods needs at least one strategy".into(),
        )),
        Strategies::Listed(list) => Ok((false, list)),
    }
}
