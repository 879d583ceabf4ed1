//! `upipe train --rehearse`: two steps of the run at full size through the
//! real allocators (the GPU pool, the pinned host pool, cuDNN plans and
//! workspaces, NCCL communicators where launched) with no kernel or
//! collective launched (the trainer on a `Rehearsal` of each rank's device
//! and rehearsing process groups), and its measured peaks beside the
//! planner's. The preflight's prediction is printed but does not
//! refuse: rehearsing is how a borderline run is checked.
//!
//! The data is zeros of the sequence's length (no corpus is read), the
//! weights are allocated unwritten, and nothing is saved. A run fits when
//! every allocation succeeded (on the CPU, whose zeroed pages are only
//! mapped when written, when the measured peak fits the host's share).

use super::built::Built;
use super::{Route, TrainArgs, preflight};
use crate::backend::{Bytes, Category, PoolReport};
use crate::cli::config::Given;
use crate::data::Tokens;
use crate::error::{Error, Result};
use crate::plan::Prediction;
use crate::plan::preflight::{RankMemory, suggest};
use crate::train::trainer::TrainSummary;
use clap::ArgMatches;

/// The line every rehearsal's output starts with.
pub const BANNER: &str = "rehearsal: allocations only, nothing computed (no loss, no gradient)";

/// Rehearses the built run; the exit status (0: it fits, 1: it does not).
pub(super) fn run(a: &TrainArgs, m: &ArgMatches, run: &mut Built) -> Result<i32> {
    if run.lead {
        notes(a, m);
    }
    let predicted = run.resolve(a)?;
    let mem = preflight::rank_memory(run, a.host_mem)?;
    let held = preflight::held(run, &predicted);
    let refusal = mem
        .and_then(|mem| crate::plan::preflight::check(&run.spec(&run.plan), &held, mem).err())
        .map(|e| match e {
            Error::Config(m) => m,
            e => e.to_string(),
        });
    if run.lead && !a.json {
        header(run, &predicted, mem, refusal.as_deref());
    }
    let tokens = Tokens::from_ids(vec![0u32; run.cfg.seq + 1], "zeros (rehearsal)");
    let rank = match (&run.route, &run.env) {
        (Route::ProcessRank, Some(env)) => env.rank,
        _ => 0,
    };
    let predicted = match rank {
        0 => predicted,
        r => crate::plan::predict_step_rank(&run.spec(&run.plan), r)?,
    };
    let outcome = match super::execute::execute(run, tokens.into(), &|_| {}) {
        Ok(summary) => Ok(summary),
        Err(e @ Error::OutOfMemory { .. }) => Err(e),
        Err(e) => return Err(e),
    };
    let report = Report::new(run, predicted, mem, refusal, outcome);
    if !run.lead {
        report.log(rank);
    } else if a.json {
        println!("{}", report.json(run));
    } else {
        report.print();
    }
    Ok(if report.fits { 0 } else { 1 })
}

/// What a rehearsal leaves out of the flags it was given.
fn notes(a: &TrainArgs, m: &ArgMatches) {
    if Given(m).has("steps") && a.steps != 2 {
        tracing::info!(
            "--rehearse runs two steps (the second starts with what the first kept): --steps {} is ignored",
            a.steps
        );
    }
    if let Some(p) = &a.metrics {
        tracing::info!(
            "--rehearse trains nothing to record: --metrics {} is not written",
            p.display()
        );
    }
    if let Some(p) = &a.data {
        tracing::info!(
            "--rehearse reads no data (its token ids are zeros): --data {} is not read",
            p.display()
        );
    }
}

/// The lines before the step: what is rehearsed and the preflight's view.
fn header(run: &Built, predicted: &Prediction, mem: Option<RankMemory>, refusal: Option<&str>) {
    println!("{BANNER}");
    println!("two steps of {}: {}", run.model_text(), run.layout_text());
    let usable = match mem {
        Some(m) => format!("{} usable", Bytes(m.device)),
        None => "usable memory unknown".into(),
    };
    println!(
        "preflight: the planner predicts a device peak of {} and a host peak of {} per rank (at {}); {usable}",
        Bytes(predicted.peak),
        Bytes(predicted.host_peak),
        predicted.peak_at
    );
    if let Some(r) = refusal {
        println!("preflight (not applied to a rehearsal): {r}");
    }
}

/// What one rank measured in its rehearsed step.
struct Measured {
    peak: usize,
    host_peak: usize,
    /// Bytes of each category at the device peak (`offload_host`: the host peak).
    by_category: Vec<(Category, usize)>,
    pool: Option<PoolReport>,
}

/// A rehearsal's outcome against the planner's prediction.
struct Report {
    predicted: Prediction,
    mem: Option<RankMemory>,
    refusal: Option<String>,
    /// `None`: an allocation failed.
    measured: Option<Measured>,
    /// Why it does not fit, with the smallest change that does.
    failure: Option<String>,
    fits: bool,
}

impl Report {
    fn new(
        run: &Built,
        predicted: Prediction,
        mem: Option<RankMemory>,
        refusal: Option<String>,
        outcome: Result<TrainSummary>,
    ) -> Self {
        let spec = run.spec(&run.plan);
        let (measured, failure) = match outcome {
            Ok(s) => {
                let m = measured(&s);
                let failure = over_host_share(run, &m, mem).map(|(need, mem)| {
                    format!(
                        "the rehearsed step needs {} per rank (on the CPU device and offloaded \
                         tensors share the host), but {} is usable. {}",
                        Bytes(need),
                        Bytes(mem.device),
                        suggest(&spec, mem)
                    )
                });
                (Some(m), failure)
            }
            Err(e) => (None, Some(out_of_memory(&e, &spec, &predicted, mem))),
        };
        Report {
            predicted,
            mem,
            refusal,
            fits: failure.is_none(),
            measured,
            failure,
        }
    }
}

/// Rank 0's (a process rank's own) measurement in `s`.
fn measured(s: &TrainSummary) -> Measured {
    let by_category = s
        .memory
        .at_peak_by_category
        .iter()
        .map(|&(c, b)| match c {
            Category::Offload => (c, s.memory.host_peak),
            _ => (c, b),
        })
        .collect();
    Measured {
        peak: s.memory.peak,
        host_peak: s.memory.host_peak,
        by_category,
        pool: s.pool,
    }
}

/// On the CPU, where allocations never fail (untouched pages cost
/// nothing), the bytes the step needs and the memory they exceed.
fn over_host_share(
    run: &Built,
    m: &Measured,
    mem: Option<RankMemory>,
) -> Option<(usize, RankMemory)> {
    let mem = mem.filter(|_| !run.on_gpu())?;
    let need = m.peak + m.host_peak;
    (need > mem.device).then_some((need, mem))
}

/// The failed allocation `e` as the preflight reports a run that does not
/// fit: the bytes by category and the smallest change that fits the memory
/// in use when it failed.
fn out_of_memory(
    e: &Error,
    spec: &crate::plan::StepSpec,
    predicted: &Prediction,
    mem: Option<RankMemory>,
) -> String {
    let Error::OutOfMemory {
        device,
        requested,
        in_use,
        by_category,
        device_state,
    } = e
    else {
        return e.to_string();
    };
    let planned: Vec<String> = predicted
        .at_peak
        .iter()
        .filter(|(c, b)| *b > 0 && c.on_device())
        .map(|(c, b)| format!("{} {}", c.name(), Bytes(*b)))
        .collect();
    let room = RankMemory {
        device: *in_use,
        host: mem.and_then(|m| m.host),
    };
    format!(
        "this run cannot fit: the rehearsal ran out of memory on {device}, asking for {} with {} in use \
         ({by_category}{device_state}); the planner predicts a peak of {} per rank ({}; at {}). {}",
        Bytes(*requested),
        Bytes(*in_use),
        Bytes(predicted.peak),
        planned.join(", "),
        predicted.peak_at,
        suggest(spec, room)
    )
}

impl Report {
    /// The table of rank 0: measured beside planned, by category, then the
    /// totals and the verdict.
    fn print(&self) {
        let p = &self.predicted;
        let Some(m) = &self.measured else {
            println!(
                "does not fit: {}",
                self.failure.as_deref().unwrap_or_default()
            );
            return;
        };
        println!("memory of rank 0 over two steps:");
        println!("  {:<16} {:>12} {:>12}", "category", "measured", "planned");
        for &(cat, bytes) in &m.by_category {
            let (a, b) = (Bytes(bytes).to_string(), Bytes(p.at(cat)).to_string());
            println!("  {:<16} {a:>12} {b:>12}", cat.name());
        }
        let diff = |pred: usize, got: usize| 100.0 * (pred as f64 - got as f64) / got.max(1) as f64;
        for (what, got, pred) in [
            ("device peak", m.peak, p.peak),
            ("host peak", m.host_peak, p.host_peak),
        ] {
            let (a, b) = (Bytes(got).to_string(), Bytes(pred).to_string());
            println!("  {what:<16} {a:>12} {b:>12} ({:+.2}%)", diff(pred, got));
        }
        if let Some(r) = m.pool {
            println!(
                "  {:<16} {:>12} (the CUDA pool's high-water, fragmentation included)",
                "pool reserved",
                Bytes(r.reserved_peak).to_string()
            );
            println!(
                "  {:<16} {:>12} (the CUDA context and libraries, outside the ledger)",
                "outside the pool",
                Bytes(r.outside).to_string()
            );
        }
        match (&self.failure, self.mem) {
            (Some(f), _) => println!("does not fit: {f}"),
            (None, Some(mem)) => println!(
                "fits: every allocation succeeded ({} usable per rank)",
                Bytes(mem.device)
            ),
            (None, None) => println!("fits: every allocation succeeded"),
        }
    }

    /// One rank's result as a log line (the lead rank prints the table).
    fn log(&self, rank: usize) {
        match &self.measured {
            Some(m) => tracing::info!(
                "rank {rank}: rehearsed device peak {} (planned {}), host peak {} (planned {}){}",
                Bytes(m.peak),
                Bytes(self.predicted.peak),
                Bytes(m.host_peak),
                Bytes(self.predicted.host_peak),
                m.pool
                    .map(|r| format!(
                        ", pool reserved {}, {} outside the pool",
                        Bytes(r.reserved_peak),
                        Bytes(r.outside)
                    ))
                    .unwrap_or_default()
            ),
            None => tracing::warn!(
                "rank {rank}: {}",
                self.failure.as_deref().unwrap_or_default()
            ),
        }
    }

    /// The report as one JSON object.
    fn json(&self, run: &Built) -> serde_json::Value {
        use serde_json::json;
        let p = &self.predicted;
        let m = self.measured.as_ref();
        let by_category: serde_json::Map<String, serde_json::Value> = Category::ALL
            .iter()
            .map(|&c| {
                let got = m.and_then(|m| m.by_category.iter().find(|x| x.0 == c).map(|x| x.1));
                (
                    c.name().to_string(),
                    json!({ "measured": got, "planned": p.at(c) }),
                )
            })
            .collect();
        json!({
            "rehearsal": true,
            "computed": false,
            "fits": self.fits,
            "model": run.cfg.model.name,
            "seq": run.cfg.seq,
            "ranks": run.shape.world_size(),
            "device_peak": { "measured": m.map(|m| m.peak), "planned": p.peak },
            "host_peak": { "measured": m.map(|m| m.host_peak), "planned": p.host_peak },
            "pool_reserved_peak": m.and_then(|m| m.pool).map(|r| r.reserved_peak),
            "outside_pool": m.and_then(|m| m.pool).map(|r| r.outside),
            "peak_at": p.peak_at,
            "usable": self.mem.map(|m| json!({ "device": m.device, "host": m.host })),
            "by_category": by_category,
            "preflight_refusal": self.refusal,
            "failure": self.failure,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{CpPlan, Strategy};
    use crate::model::decoder::attn_dims;
    use crate::model::{MemoryPolicy, ModelConfig};
    use crate::plan::{DeviceKind, StepSpec, predict_step_rank};

    #[test]
    fn a_failed_allocation_is_reported_as_the_preflight_reports_a_run_that_cannot_fit() {
        let model = ModelConfig::resolve("llama3.2-1b").unwrap();
        let plan = CpPlan::new(Strategy::Upipe, &attn_dims(&model), 65536, 1, 1, None).unwrap();
        let spec = StepSpec {
            model,
            plan,
            data: 1,
            policy: MemoryPolicy::default(),
            fsdp: false,
            fsdp_replicas: 1,
            grad_accum: 1,
            device: DeviceKind::CUDA,
            optimizer: true,
            state: Default::default(),
            precision: Default::default(),
            freeze: Default::default(),
            lora: None,
        };
        let pred = predict_step_rank(&spec, 0).unwrap();
        let e = Error::OutOfMemory {
            device: "cuda:0 (NVIDIA H200)".into(),
            requested: 1 << 30,
            in_use: 70 << 30,
            by_category: "weights: 2.30 GiB, activations: 60.00 GiB".into(),
            device_state: String::new(),
        };
        let mem = RankMemory {
            device: 80 << 30,
            host: None,
        };
        let text = out_of_memory(&e, &spec, &pred, Some(mem));
        for want in [
            "cannot fit",
            "ran out of memory on cuda:0",
            "asking for 1.00 GiB with 70.00 GiB in use",
            "activations: 60.00 GiB",
            "the planner predicts a peak of",
            "Adding --checkpoint fits",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }
}
