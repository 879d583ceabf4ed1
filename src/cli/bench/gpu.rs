//! `upipe bench attn --device cuda`: one process per GPU (started by `upipe
//! launch`, torchrun or srun, or by a plain run itself when the mesh fits the
//! visible GPUs: [`bench_route`]; otherwise a world of one), each running
//! its rank of the layer on `CudaBackend::new(LOCAL_RANK)` with an NCCL mesh.
//! Rank 0 gathers the per-rank results over the rendezvous and prints them.
//!
//! Throughput counts the causal attention layer's flops (see
//! [`layer_flops`]) over the median wall time of the timed passes (each pass's
//! time is its slowest rank's).

use super::args::{AttnArgs, methods_of};
use super::report::{CUDA_TOLERANCE, Outcome, predicted_peak, print_header, print_row};
use crate::attention::trial::{
    RankInputs, RankOptions, RankRun, TrialInputs, TrialResult, assemble, gather_runs, run_rank,
    run_trial,
};
use crate::attention::{AttnDims, CpPlan, Strategy};
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::profile::{self, OpTotals};
use crate::comm::env::{DEFAULT_MASTER_ADDR, DistEnv};
use crate::comm::nccl::{self, NcclWorld};
use crate::comm::rendezvous::Rendezvous;
use crate::error::{Error, Result};
use crate::rng::normal_vec_par;
use crate::train::trainer::RENDEZVOUS_TIMEOUT;
use std::sync::Arc;

/// Flops of one causal attention layer forward+backward over `seq` tokens:
/// attention core `2·S²·H·d` forward (QKᵀ and PV, halved by the causal mask),
/// `3.5×` that for forward+backward, plus the projections
/// `2·S·hidden·(H + 2·Hkv + H)·d` forward, `3×` for forward+backward.
pub fn layer_flops(dims: &AttnDims, seq: usize) -> f64 {
    let (s, h, hkv, d) = (
        seq as f64,
        dims.heads as f64,
        dims.kv_heads as f64,
        dims.head_dim as f64,
    );
    let core = 3.5 * 2.0 * s * s * h * d;
    let proj = 3.0 * 2.0 * s * dims.hidden as f64 * (h + 2.0 * hkv + h) * d;
    core + proj
}

/// Median of a non-empty list (mean of the middle two for even lengths).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Indices of `n` strategies in the order round `round` runs them: as given
/// in even rounds, reversed in odd ones, so a drift over the run (clocks,
/// temperature) weighs on every strategy alike.
pub fn round_order(n: usize, round: usize) -> Vec<usize> {
    if round.is_multiple_of(2) {
        (0..n).collect()
    } else {
        (0..n).rev().collect()
    }
}

/// One strategy's GPU timing on rank 0.
pub struct GpuRun {
    /// Median over timed passes of the slowest rank's time.
    pub median_seconds: f64,
    pub world: usize,
}

impl GpuRun {
    pub fn tflops_per_gpu(&self, dims: &AttnDims, seq: usize) -> f64 {
        layer_flops(dims, seq) / self.median_seconds / self.world as f64 / 1e12
    }
    pub fn tokens_per_s_per_gpu(&self, seq: usize) -> f64 {
        seq as f64 / self.median_seconds / self.world as f64
    }
}

/// Where a `bench attn --device cuda` run goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BenchRoute {
    /// This process runs (a launched rank, or a world of one).
    Here,
    /// Start this many processes of this command, one per GPU.
    SelfLaunch(usize),
}

/// Ranks the strategies of `methods` need: `local` one, the others the mesh
/// `ulysses × ring`.
pub fn ranks_needed(methods: &[Strategy], ulysses: usize, ring: usize) -> usize {
    let ranks = |m: &Strategy| m.given_mesh(Some(ulysses), Some(ring)).ranks();
    methods.iter().map(ranks).max().unwrap_or(1)
}

/// Decides how a run needing `ranks` processes starts: under a launch, with
/// one rank, or with fewer GPUs than ranks here (a world of one: the
/// strategies that need more ranks are skipped, or with `--methods` named,
/// refused, saying how many processes they need); otherwise one process per
/// GPU started by this one, which needs NCCL (an error naming the fix when
/// it does not load).
pub fn bench_route(
    launched: bool,
    gpus: usize,
    ranks: usize,
    nccl: &dyn Fn() -> std::result::Result<(), String>,
) -> Result<BenchRoute> {
    if launched || ranks <= 1 || gpus < ranks {
        return Ok(BenchRoute::Here);
    }
    if let Err(e) = nccl() {
        return Err(Error::Config(format!(
            "{ranks} GPU ranks need NCCL, which does not load ({e}); see `upipe info`"
        )));
    }
    Ok(BenchRoute::SelfLaunch(ranks))
}

/// Each strategy's plan on a world of `world` processes, or why it is skipped.
type Planned = Vec<(Strategy, std::result::Result<CpPlan, String>)>;

/// Per strategy: the last round's result and every round's pass times
/// (each the slowest rank's).
type Measured = Vec<Option<(TrialResult, Vec<f64>)>>;

/// Rank 0's GPU time by op per pass and median wall time (ms), by strategy.
type Profiles = Vec<(Strategy, OpTotals, f64)>;

/// Every rank's run of one strategy, and this rank's profile when profiled.
type MethodRun = (Vec<RankRun>, Option<(OpTotals, f64)>);

/// The processes of one GPU bench: this rank's backend, the NCCL world and
/// the rendezvous (rank 0 gathers results over it).
struct Ranks {
    env: DistEnv,
    rv: Rendezvous,
    backend: Arc<CudaBackend>,
    world: NcclWorld,
}

pub fn bench_attn_cuda(a: &AttnArgs, dims: &AttnDims) -> Result<i32> {
    let launched = DistEnv::from_env()?;
    let (all, methods) = methods_of(a)?;
    let ranks = ranks_needed(&methods, a.ulysses(), a.ring());
    let nccl = || nccl::library().map(|_| ()).map_err(|e| e.to_string());
    let gpus = crate::cli::train::visible_gpus();
    if let BenchRoute::SelfLaunch(n) = bench_route(launched.is_some(), gpus, ranks, &nccl)? {
        tracing::info!("{gpus} GPUs visible: starting {n} processes, one per GPU (NCCL)");
        return crate::cli::launch::run_local(n, crate::cli::launch::own_command("bench")?);
    }
    if a.iters == 0 || a.rounds == 0 {
        return Err(Error::Config(
            "--iters and --rounds must be at least 1".into(),
        ));
    }
    let mut ranks = connect(a, launched)?;
    let full_inputs = a.check.then(|| TrialInputs::random(dims, a.seq, a.seed));
    let planned = plan_methods(a, dims, all, &methods, ranks.world.size())?;
    let (measured, profiles) = measure(a, dims, &mut ranks, &planned, full_inputs.as_ref())?;
    let outcomes: Vec<(Strategy, Outcome, Option<f64>)> = planned
        .into_iter()
        .zip(measured)
        .map(|((m, plan), got)| match plan {
            Ok(plan) => {
                let (result, passes) = got.expect("every planned strategy ran (rounds ≥ 1)");
                (
                    m,
                    Outcome::Ran(result, Box::new(plan)),
                    Some(median(&passes)),
                )
            }
            Err(why) => (m, Outcome::Skipped(why), None),
        })
        .collect();
    if ranks.env.rank != 0 {
        return Ok(0);
    }
    let failed = report(a, dims, &ranks, &outcomes, full_inputs.as_ref())?;
    print_profiles(&profiles, a.json);
    Ok(if failed { 1 } else { 0 })
}

/// Joins the rendezvous and the NCCL world (a world of one when not launched).
fn connect(a: &AttnArgs, launched: Option<DistEnv>) -> Result<Ranks> {
    let env = launched.unwrap_or(DistEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        master_addr: DEFAULT_MASTER_ADDR.into(),
        master_port: 1,
    });
    let mut rv = Rendezvous::connect(&env, RENDEZVOUS_TIMEOUT)?;
    let mut backend = CudaBackend::new(env.local_rank)?;
    backend.set_attn_kernel(a.attn_kernel.parse()?);
    let backend = Arc::new(backend);
    let world = NcclWorld::connect(&env, &mut rv, backend.clone())?;
    Ok(Ranks {
        env,
        rv,
        backend,
        world,
    })
}

/// Each strategy's plan, or why it is skipped (with `all`); a strategy
/// given by name that cannot run on `world` processes is an error.
fn plan_methods(
    a: &AttnArgs,
    dims: &AttnDims,
    all: bool,
    methods: &[Strategy],
    world: usize,
) -> Result<Planned> {
    let mut planned: Planned = Vec::new();
    for &m in methods {
        let chunk = if m.has_head_stages() {
            crate::cli::schedule::ChunkHeads::fixed(a.mesh.chunk_heads, "bench attn")?
        } else {
            None
        };
        let mesh = m.given_mesh(Some(a.ulysses()), Some(a.ring()));
        let plan = match CpPlan::new(m, dims, a.seq, mesh.ulysses, mesh.ring, chunk) {
            Ok(p) => a.schedule.apply(p, |p| predicted_peak(a, p))?,
            Err(e) if all && matches!(m, Strategy::Ulysses | Strategy::Ring) => {
                planned.push((m, Err(e.to_string())));
                continue;
            }
            Err(e) => return Err(Error::Config(format!("{m}: {e}"))),
        };
        let ranks = plan.mesh_shape().world_size();
        if ranks != world {
            let why = format!(
                "{m} on {}x{} needs {ranks} processes, {world} were launched",
                plan.layout.pu, plan.layout.pr,
            );
            if all {
                planned.push((m, Err(why)));
                continue;
            }
            return Err(Error::Config(format!(
                "{why}; start with `upipe launch --nproc-per-node {ranks} -- bench attn --device cuda ...`"
            )));
        }
        planned.push((m, Ok(plan)));
    }
    Ok(planned)
}

/// Runs every planned strategy `--rounds` times; with rank 0's GPU time by
/// op per pass (`UPIPE_PROFILE=1`; first round).
fn measure(
    a: &AttnArgs,
    dims: &AttnDims,
    ranks: &mut Ranks,
    planned: &Planned,
    full_inputs: Option<&TrialInputs>,
) -> Result<(Measured, Profiles)> {
    let weights = match full_inputs {
        Some(f) => f.weights.clone(),
        None => TrialInputs::random(dims, 0, a.seed).weights,
    };
    let mut profiles = Vec::new();
    ranks.backend.profile().take()?;
    let mut measured: Measured = vec![None; planned.len()];
    for round in 0..a.rounds {
        for i in round_order(planned.len(), round) {
            let (m, Ok(plan)) = (&planned[i].0, &planned[i].1) else {
                continue;
            };
            let (runs, profile) = run_method(a, dims, ranks, plan, full_inputs, &weights, round)?;
            if let Some((times, wall_ms)) = profile {
                profiles.push((*m, times, wall_ms));
            }
            // Slowest rank per pass.
            let per_pass = (0..a.iters).map(|k| {
                runs.iter()
                    .filter_map(|r| r.seconds.get(k).copied())
                    .fold(0.0, f64::max)
            });
            let result = assemble(plan, dims.hidden, &runs);
            match &mut measured[i] {
                Some((last, passes)) => {
                    *last = result;
                    passes.extend(per_pass);
                }
                none => *none = Some((result, per_pass.collect())),
            }
        }
    }
    Ok((measured, profiles))
}

/// One strategy's passes on every rank: the ranks' runs (gathered on rank
/// 0) and, when profiled, this rank's GPU time by op per pass and the
/// median wall time (ms).
fn run_method(
    a: &AttnArgs,
    dims: &AttnDims,
    ranks: &mut Ranks,
    plan: &CpPlan,
    full_inputs: Option<&TrialInputs>,
    weights: &[(&'static str, Vec<usize>, Vec<f32>)],
    round: usize,
) -> Result<MethodRun> {
    let b = ranks.backend.as_ref();
    let opts = RankOptions {
        warmup: a.warmup,
        iters: a.iters,
        keep_outputs: a.check,
    };
    let mesh = ranks.world.mesh(plan.mesh_shape())?;
    let (ri, rr) = (mesh.ring.rank(), mesh.ulysses.rank());
    let (x, dy) = match full_inputs {
        Some(f) => f.shard(plan, dims.hidden, ri, rr),
        None => {
            // Timing only: this rank's rows, seeded per rank.
            // (parallel: at 1M tokens each is 2G values per rank)
            let n = plan.layout.local_len() * dims.hidden;
            let seed = a.seed ^ (0x9e37_79b9_7f4a_7c15 ^ ranks.env.rank as u64);
            (normal_vec_par(seed, n, 1.0), normal_vec_par(!seed, n, 1.0))
        }
    };
    let inputs = RankInputs {
        x: &x,
        dy: &dy,
        weights,
    };
    let profiled = b.profile().enabled() && round == 0;
    if profiled {
        // warm up outside the profile: first calls build cuDNN plans while
        // the stream idles, which events would count as op time
        let warm = RankOptions {
            warmup: 0,
            iters: opts.warmup.max(1),
            keep_outputs: false,
        };
        run_rank(plan, dims, inputs, b, &mesh, &warm)?;
        b.synchronize()?;
        b.profile().take()?;
    }
    let timed = RankOptions {
        warmup: if profiled { 0 } else { opts.warmup },
        ..opts
    };
    let run = run_rank(plan, dims, inputs, b, &mesh, &timed)?;
    drop((x, dy));
    b.synchronize()?;
    let times = b.profile().take()?;
    let profile = profiled.then(|| {
        (
            times.per_pass(timed.iters as f64),
            1e3 * median(&run.seconds),
        )
    });
    drop(mesh);
    // the next method's peak must not include this one's cuDNN workspace
    b.release_attention_workspace()?;
    Ok((gather_runs(&mut ranks.rv, run)?, profile))
}

/// Rank 0's table or JSON lines; whether `--check` fails a strategy.
fn report(
    a: &AttnArgs,
    dims: &AttnDims,
    ranks: &Ranks,
    outcomes: &[(Strategy, Outcome, Option<f64>)],
    full_inputs: Option<&TrialInputs>,
) -> Result<bool> {
    let reference = match full_inputs {
        Some(f) => {
            let plan = CpPlan::new(Strategy::Local, dims, a.seq, 1, 1, None)?;
            Some(run_trial(&plan, dims, f, CpuBackend::new)?)
        }
        None => None,
    };
    let world = ranks.world.size();
    if !a.json {
        let lib = nccl::library()?;
        println!(
            "device {} x {world} processes | NCCL {}",
            ranks.backend.name(),
            lib.describe()
        );
        print_header(a, "cuda-bf16", true);
    }
    let ulysses_act = outcomes.iter().find_map(|(m, o, _)| match o {
        Outcome::Ran(r, _) if *m == Strategy::Ulysses => Some(r.act_bytes),
        _ => None,
    });
    let mut failed = false;
    for (m, o, median_s) in outcomes {
        let extra = match (o, median_s) {
            (Outcome::Ran(..), Some(s)) => {
                let g = GpuRun {
                    median_seconds: *s,
                    world,
                };
                Some((
                    g.tflops_per_gpu(dims, a.seq),
                    g.tokens_per_s_per_gpu(a.seq),
                    *s,
                ))
            }
            _ => None,
        };
        let tolerance = CUDA_TOLERANCE;
        failed |= print_row(a, *m, o, reference.as_ref(), ulysses_act, tolerance, extra);
    }
    Ok(failed)
}

/// Shapes listed per method under `UPIPE_PROFILE=shapes` (the costliest).
const TOP_SHAPES: usize = 30;

/// Rank 0's GPU time by op (and by op shape when profiled), per
/// forward+backward pass.
fn print_profiles(profiles: &[(Strategy, OpTotals, f64)], json: bool) {
    for (m, times, wall_ms) in profiles {
        let shapes = &times.by_shape[..times.by_shape.len().min(TOP_SHAPES)];
        if json {
            let ops: serde_json::Map<String, serde_json::Value> = times
                .by_kind
                .iter()
                .map(|t| (t.kind.clone(), serde_json::json!(t.ms)))
                .collect();
            let by_shape: Vec<serde_json::Value> = shapes
                .iter()
                .map(|t| serde_json::json!({"op": t.kind, "ms": t.ms, "calls": t.calls}))
                .collect();
            let row = serde_json::json!({
                "method": m.to_string(),
                "profile_ms_per_pass": ops,
                "profile_by_shape": by_shape,
                "idle_ms_per_pass": times.idle_ms,
                "host_wait_ms_per_pass": times.host_wait_ms,
                "idle_before_ms_per_pass": times
                    .idle_before
                    .iter()
                    .map(|t| (t.kind.clone(), serde_json::json!(t.ms)))
                    .collect::<serde_json::Map<String, serde_json::Value>>(),
                "wall_ms_per_pass": wall_ms,
            });
            println!("{row}");
        } else {
            println!("\n{m}: rank 0 GPU time per pass (wall {wall_ms:.2} ms)");
            print!("{}", profile::table(&times.by_kind, Some(*wall_ms)));
            println!(
                "compute stream idle between ops: {:.2} ms per pass, {:.2} of it waiting for the host",
                times.idle_ms, times.host_wait_ms
            );
            if !times.idle_before.is_empty() {
                println!("idle by the op after the gap:");
                print!("{}", profile::table(&times.idle_before, Some(*wall_ms)));
            }
            if !shapes.is_empty() {
                println!("by shape (costliest {TOP_SHAPES}):");
                print!("{}", profile::table(shapes, Some(*wall_ms)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_run_starts_one_process_per_gpu_when_the_mesh_fits() {
        let ok = || Ok(());
        let no_nccl = || Err("libnccl.so.2 not found".to_string());
        let (u, r) = (Strategy::Upipe, Strategy::Ulysses);
        assert_eq!(ranks_needed(&[Strategy::Local], 4, 2), 1);
        assert_eq!(ranks_needed(&[Strategy::Local, u], 2, 2), 4);
        assert_eq!(ranks_needed(&[r], 2, 1), 2);
        // launched ranks and one-rank runs stay here
        assert_eq!(bench_route(true, 8, 4, &ok).unwrap(), BenchRoute::Here);
        assert_eq!(bench_route(false, 0, 1, &ok).unwrap(), BenchRoute::Here);
        assert_eq!(
            bench_route(false, 2, 2, &ok).unwrap(),
            BenchRoute::SelfLaunch(2)
        );
        assert_eq!(
            bench_route(false, 8, 4, &ok).unwrap(),
            BenchRoute::SelfLaunch(4)
        );
        // more ranks than GPUs: a world of one here (its strategies say why)
        assert_eq!(bench_route(false, 2, 4, &ok).unwrap(), BenchRoute::Here);
        let e = bench_route(false, 2, 2, &no_nccl).unwrap_err().to_string();
        assert!(e.contains("NCCL") && e.contains("libnccl"), "{e}");
    }

    #[test]
    fn flops_formula() {
        let dims = AttnDims {
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            qk_norm: false,
            norm: crate::backend::RmsNorm::plain(1e-6),
            rope: crate::attention::rope::RopeConfig {
                theta: 500000.0,
                scaling: None,
            },
            softmax_scale: AttnDims::default_softmax_scale(128),
            precision: crate::backend::fp8::Precision::Bf16,
        };
        let s = 131072.0f64;
        let core = 7.0 * s * s * 32.0 * 128.0;
        let proj = 6.0 * s * 4096.0 * 80.0 * 128.0;
        assert_eq!(layer_flops(&dims, 131072), core + proj);
        // at 128K the attention core dominates (~0.94 of the total)
        assert!(core / (core + proj) > 0.9);
    }

    #[test]
    fn rounds_alternate_the_order() {
        assert_eq!(round_order(3, 0), vec![0, 1, 2]);
        assert_eq!(round_order(3, 1), vec![2, 1, 0]);
        assert_eq!(round_order(3, 2), vec![0, 1, 2]);
        assert!(round_order(0, 1).is_empty());
        // over two rounds every strategy sits at every position once
        for n in 1..6 {
            for pos in 0..n {
                let mut at: Vec<usize> = (0..2).map(|r| round_order(n, r)[pos]).collect();
                at.sort();
                at.dedup();
                assert_eq!(at.len(), if 2 * pos + 1 == n { 1 } else { 2 });
            }
        }
    }

    #[test]
    fn median_of_passes() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[5.0]), 5.0);
    }
}
