//! What a strategy's run came to ([`Outcome`]) and how it is reported: the
//! tolerances against `local`, the table's header and rows or JSON lines,
//! and the planner's predicted peak beside the measured one.

use super::args::{AttnArgs, attn_dims};
use crate::attention::trial::TrialResult;
use crate::attention::{CpPlan, Strategy};
use crate::backend::Bytes;
use crate::error::Result;
use crate::plan::{DeviceKind, predict_attention_trial};
use serde_json::json;

/// Tolerance of the f32 CPU backend against the local reference, by output.
pub(super) fn cpu_tolerance(_output: &str) -> f64 {
    1e-5
}
/// Tolerance of bf16 on the GPU against the f32 CPU reference, by output
/// (as the GPU tests use).
pub(super) const CUDA_TOLERANCE: fn(&str) -> f64 = crate::attention::trial::bf16_tolerance;

pub(super) enum Outcome {
    Ran(TrialResult, Box<CpPlan>),
    Skipped(String),
}

pub(super) fn print_header(a: &AttnArgs, device: &str, throughput: bool) {
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
pub(super) fn predicted_peak(a: &AttnArgs, plan: &CpPlan) -> Result<usize> {
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
pub(super) fn print_row(
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
