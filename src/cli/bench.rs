//! `upipe bench attn`: one attention layer forward+backward under each
//! strategy on the same C = Pu x Pr ranks, with errors against `local` and
//! ledger-measured memory. `--device cuda` runs one process per GPU over
//! NCCL (`gpu.rs`).

mod args;
mod gpu;
pub mod preflight;
mod report;

pub use args::AttnArgs;
use args::{attn_dims, methods_of};
use report::{Outcome, cpu_tolerance, predicted_peak, print_header, print_row};

use crate::attention::trial::{TrialInputs, TrialResult, run_trial};
use crate::attention::{AttnDims, CpPlan, Strategy};
use crate::backend::cpu::CpuBackend;
use crate::cli::config;
use crate::error::{Error, Result};
use clap::ArgMatches;

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// One attention layer forward+backward under each strategy.
    Attn(AttnArgs),
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
        let chunk = if m.has_head_stages() {
            crate::cli::schedule::ChunkHeads::fixed(a.mesh.chunk_heads, "bench attn")?
        } else {
            None
        };
        // local runs on one rank; every other strategy on the same C ranks
        let mesh = m.given_mesh(Some(a.ulysses()), Some(a.ring()));
        let plan = match CpPlan::new(m, dims, a.seq, mesh.ulysses, mesh.ring, chunk) {
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
