//! One attention layer, forward and backward, under one strategy: the
//! harness behind the equivalence tests and `upipe bench attn`. The per-rank
//! body [`run_rank`] runs on thread ranks ([`run_trial`]) or on process ranks
//! (one per GPU, results gathered with [`gather_runs`]).
//!
//! Activation bytes are measured by the ledger: the per-rank peak during
//! forward+backward above what was resident before (weights, gradients, x,
//! dy, RoPE tables), minus the tensors the layer must produce anyway (saved
//! O, output y, input gradient dx).

use super::{AttentionGrads, AttentionWeights, AttnDims, CpAttention, CpPlan, Strategy};
use crate::backend::{AttnMask, Backend, Category, DType, MemoryStats, Tensor};
use crate::comm::Mesh;
use crate::comm::local::run_ranks;
use crate::comm::rendezvous::Rendezvous;
use crate::error::Result;
use crate::rng::Rng;
use std::time::Instant;

/// Host inputs of a trial: global x and dy `[seq, hidden]` and the weights.
#[derive(Debug, Clone)]
pub struct TrialInputs {
    pub seq: usize,
    pub x: Vec<f32>,
    pub dy: Vec<f32>,
    /// `(name, shape, values)` in the order wq, wk, wv, wo[, q_norm, k_norm].
    pub weights: Vec<(&'static str, Vec<usize>, Vec<f32>)>,
}

impl TrialInputs {
    /// Seeded random inputs of realistic scale.
    pub fn random(dims: &AttnDims, seq: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (h, d) = (dims.hidden, dims.head_dim);
        let ws = 1.0 / (h as f32).sqrt();
        let mut weights = vec![
            (
                "wq",
                vec![dims.q_width(), h],
                rng.normal_vec(dims.q_width() * h, ws),
            ),
            (
                "wk",
                vec![dims.kv_width(), h],
                rng.normal_vec(dims.kv_width() * h, ws),
            ),
            (
                "wv",
                vec![dims.kv_width(), h],
                rng.normal_vec(dims.kv_width() * h, ws),
            ),
            (
                "wo",
                vec![h, dims.q_width()],
                rng.normal_vec(h * dims.q_width(), ws),
            ),
        ];
        if dims.qk_norm {
            for name in ["q_norm", "k_norm"] {
                let v = (0..d).map(|_| 1.0 + 0.2 * rng.normal() as f32).collect();
                weights.push((name, vec![d], v));
            }
        }
        TrialInputs {
            seq,
            x: rng.normal_vec(seq * h, 1.0),
            dy: rng.normal_vec(seq * h, 1.0),
            weights,
        }
    }
}

/// What one strategy produced, gathered to global order, plus its memory.
#[derive(Debug, Clone)]
pub struct TrialResult {
    pub strategy: Strategy,
    pub ranks: usize,
    /// Layer output `[seq, hidden]`.
    pub y: Vec<f32>,
    /// Input gradient `[seq, hidden]`.
    pub dx: Vec<f32>,
    /// Parameter gradients summed over ranks, same order as the weights.
    pub grads: Vec<(&'static str, Vec<f32>)>,
    /// Highest per-rank ledger peak.
    pub peak_bytes: usize,
    /// Highest per-rank activation bytes (see module docs).
    pub act_bytes: usize,
    /// Wall time of forward+backward (slowest rank).
    pub seconds: f64,
}

/// `max |a - b| / max |b|`: error relative to the reference's scale; a NaN
/// or infinite difference (or a length mismatch) is an infinite error.
pub fn rel_err(a: &[f32], reference: &[f32]) -> f64 {
    if a.len() != reference.len() {
        return f64::INFINITY;
    }
    let scale = reference.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
    let mut diff = 0.0f64;
    for (&x, &y) in a.iter().zip(reference) {
        let d = (x as f64 - y as f64).abs();
        // `f64::max` drops NaN: a NaN or infinite result must fail, not vanish
        if !d.is_finite() {
            return f64::INFINITY;
        }
        diff = diff.max(d);
    }
    if scale == 0.0 { diff } else { diff / scale }
}

impl TrialResult {
    /// Relative error of every output against a reference trial: y, dx, then each gradient.
    pub fn errors_against(&self, reference: &TrialResult) -> Vec<(String, f64)> {
        let mut out = vec![
            ("y".to_string(), rel_err(&self.y, &reference.y)),
            ("dx".to_string(), rel_err(&self.dx, &reference.dx)),
        ];
        for ((name, g), (_, r)) in self.grads.iter().zip(&reference.grads) {
            out.push((format!("d{name}"), rel_err(g, r)));
        }
        out
    }
    /// The largest of [`errors_against`](Self::errors_against).
    pub fn max_rel_err(&self, reference: &TrialResult) -> f64 {
        self.errors_against(reference)
            .into_iter()
            .map(|(_, e)| e)
            .fold(0.0, f64::max)
    }
}

/// Relative-error bound of a bf16 GPU output of the layer against the CPU f32
/// reference. The weight gradients of K and of the QK norms sum bf16 dK / dQ
/// over every token and GQA group; both attention kernels land at
/// 0.94e-2..1.05e-2 on them (native flash and cuDNN 9.14, H200, 2026-11-30;
/// the flash kernels round P and dS to bf16 before their matmuls as
/// FlashAttention-2 does), so they get 2e-2. Everything else: 1e-2 (measured
/// at most 7.2e-3).
pub fn bf16_tolerance(output: &str) -> f64 {
    if output.ends_with("_norm") || output == "dwk" {
        2e-2
    } else {
        1e-2
    }
}

/// Host inputs of one rank: its shard of x and dy `[local_len, hidden]` and
/// the full weights (as in [`TrialInputs::weights`]).
#[derive(Debug, Clone, Copy)]
pub struct RankInputs<'a> {
    pub x: &'a [f32],
    pub dy: &'a [f32],
    pub weights: &'a [(&'static str, Vec<usize>, Vec<f32>)],
}

impl TrialInputs {
    /// The shard of rank `(ring i, ulysses r)` under `plan`'s layout.
    pub fn shard(&self, plan: &CpPlan, hidden: usize, i: usize, r: usize) -> (Vec<f32>, Vec<f32>) {
        (
            plan.layout.shard_rows(&self.x, hidden, i, r),
            plan.layout.shard_rows(&self.dy, hidden, i, r),
        )
    }
}

/// How one rank runs the layer.
#[derive(Debug, Clone, Copy)]
pub struct RankOptions {
    /// Untimed forward+backward passes first.
    pub warmup: usize,
    /// Timed forward+backward passes (at least 1).
    pub iters: usize,
    /// Download y, dx and the (world-summed) gradients of the last pass.
    pub keep_outputs: bool,
}

impl RankOptions {
    /// One timed pass, outputs kept (the equivalence-test setting).
    pub const ONCE: RankOptions = RankOptions {
        warmup: 0,
        iters: 1,
        keep_outputs: true,
    };
}

/// What one rank measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankRun {
    /// This rank's rows of y (empty unless `keep_outputs`).
    pub y: Vec<f32>,
    /// This rank's rows of dx (empty unless `keep_outputs`).
    pub dx: Vec<f32>,
    /// Gradients summed over the world (empty unless `keep_outputs`).
    pub grads: Vec<(&'static str, Vec<f32>)>,
    /// Highest ledger peak over all passes.
    pub peak_bytes: usize,
    /// The ledger of the pass with that peak (the first of equals).
    pub peak_stats: Option<MemoryStats>,
    /// Highest activation bytes over all passes (see module docs).
    pub act_bytes: usize,
    /// Wall time of each timed pass.
    pub seconds: Vec<f64>,
}

impl RankInputs<'_> {
    /// No host inputs: what a rehearsal (the memory planner) passes, whose
    /// tensors take their shapes from the layer and hold no values.
    pub const NONE: RankInputs<'static> = RankInputs {
        x: &[],
        dy: &[],
        weights: &[],
    };
}

/// This rank's x, dy `[local, hidden]` and the layer's weights on `b`: from
/// `inputs`, or on a rehearsal of the shapes alone.
fn upload_inputs<B: Backend>(
    b: &B,
    dims: &AttnDims,
    local: usize,
    inputs: &RankInputs<'_>,
) -> Result<(Tensor<B>, Tensor<B>, AttentionWeights<B>)> {
    let (hidden, act) = (dims.hidden, b.compute_dtype());
    let tensor = |values: &[f32], shape: &[usize], cat| match b.rehearsing() {
        true => b.empty(shape, act, cat),
        false => b.from_host(values, shape, act, cat),
    };
    let x = tensor(inputs.x, &[local, hidden], Category::Activations)?;
    let dy = tensor(inputs.dy, &[local, hidden], Category::Grads)?;
    let (q, kv, d) = (dims.q_width(), dims.kv_width(), dims.head_dim);
    let shapes = [[q, hidden], [kv, hidden], [kv, hidden], [hidden, q]];
    let up = |k: usize, shape: &[usize]| match inputs.weights.get(k) {
        Some((_, given, values)) => tensor(values, given, Category::Weights),
        None if b.rehearsing() => tensor(&[], shape, Category::Weights),
        None => crate::config_err!("trial inputs lack weight #{k}"),
    };
    let norm = |k: usize| dims.qk_norm.then(|| up(k, &[d])).transpose();
    let w = AttentionWeights {
        wq: up(0, &shapes[0])?,
        wk: up(1, &shapes[1])?,
        wv: up(2, &shapes[2])?,
        wo: up(3, &shapes[3])?,
        q_norm: norm(4)?,
        k_norm: norm(5)?,
        bq: None,
        bk: None,
        bv: None,
        lora: Default::default(),
    };
    Ok((x, dy, w))
}

/// The per-rank body shared by thread ranks ([`run_trial`]) and process
/// ranks (`upipe bench attn --device cuda` under `upipe launch`): uploads
/// this rank's inputs, runs `warmup + iters` forward+backward passes of the
/// causal layer, and measures time and ledger memory of each.
pub fn run_rank<B: Backend>(
    plan: &CpPlan,
    dims: &AttnDims,
    inputs: RankInputs<'_>,
    b: &B,
    mesh: &Mesh<B>,
    opts: &RankOptions,
) -> Result<RankRun> {
    run_rank_masked(plan, dims, inputs, b, mesh, opts, AttnMask::Causal)
}

/// [`run_rank`] with the layer attending under `mask` over the sequence.
pub fn run_rank_masked<B: Backend>(
    plan: &CpPlan,
    dims: &AttnDims,
    inputs: RankInputs<'_>,
    b: &B,
    mesh: &Mesh<B>,
    opts: &RankOptions,
    mask: AttnMask,
) -> Result<RankRun> {
    let (x, dy, w) = upload_inputs(b, dims, plan.layout.local_len(), &inputs)?;
    let layer = CpAttention::new(b, *dims, plan.clone(), mesh, mask)?;
    let ledger = b.ledger();
    let mut run = RankRun::default();
    let mut last = None;
    for pass in 0..opts.warmup + opts.iters.max(1) {
        drop(last.take()); // free the previous pass's outputs first
        let mut g = AttentionGrads::zeros(b, dims)?;
        b.synchronize()?;
        ledger.reset_peak();
        let resident = ledger.current();
        let start = Instant::now();
        let (y, saved) = layer.forward(b, mesh, &w, &x)?;
        let o_bytes = saved.o.bytes();
        let dx = layer.backward((b, mesh), &w, &x, (saved, &dy), &mut g)?;
        b.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        let peak = ledger.peak();
        if run.peak_stats.is_none() || peak > run.peak_bytes {
            run.peak_stats = Some(ledger.stats());
        }
        run.peak_bytes = run.peak_bytes.max(peak);
        run.act_bytes = run
            .act_bytes
            .max(peak.saturating_sub(resident + o_bytes + y.bytes() + dx.bytes()));
        if pass >= opts.warmup {
            run.seconds.push(seconds);
        }
        last = Some((y, dx, g));
    }
    if opts.keep_outputs
        && let Some((y, dx, g)) = last
    {
        for (name, t) in g.named() {
            let mut t32 = crate::backend::cast(b, t, DType::F32, Category::Grads)?;
            mesh.world.all_reduce(&mut t32)?;
            run.grads.push((name, b.to_host(&t32)?));
        }
        run.y = b.to_host(&y)?;
        run.dx = b.to_host(&dx)?;
    }
    Ok(run)
}

/// Joins per-rank runs (indexed by global rank of a one-replica mesh) into
/// the global result: y and dx unsharded, gradients from rank 0 (already
/// summed over the world), the highest peak/activation bytes, and the wall
/// time of the first timed pass on the slowest rank.
/// y and dx are empty unless every rank kept complete outputs.
pub fn assemble(plan: &CpPlan, hidden: usize, runs: &[RankRun]) -> TrialResult {
    let rows = plan.layout.local_len() * hidden;
    let complete = runs.len() == plan.mesh_shape().world_size()
        && runs.iter().all(|r| r.y.len() == rows && r.dx.len() == rows);
    let unshard = |pick: fn(&RankRun) -> &Vec<f32>| {
        if !complete {
            return Vec::new();
        }
        let shards: Vec<Vec<f32>> = runs.iter().map(|r| pick(r).clone()).collect();
        plan.layout.unshard_rows(&shards, hidden)
    };
    TrialResult {
        strategy: plan.strategy,
        ranks: runs.len(),
        y: unshard(|r| &r.y),
        dx: unshard(|r| &r.dx),
        grads: runs.first().map(|r| r.grads.clone()).unwrap_or_default(),
        peak_bytes: runs.iter().map(|r| r.peak_bytes).max().unwrap_or(0),
        act_bytes: runs.iter().map(|r| r.act_bytes).max().unwrap_or(0),
        seconds: runs
            .iter()
            .filter_map(|r| r.seconds.first().copied())
            .fold(0.0, f64::max),
    }
}

/// Runs forward+backward of one causal layer under `plan` on
/// `plan.mesh_shape()` thread ranks.
pub fn run_trial<B: Backend>(
    plan: &CpPlan,
    dims: &AttnDims,
    inputs: &TrialInputs,
    make_backend: impl Fn() -> B + Sync,
) -> Result<TrialResult> {
    run_trial_masked(plan, dims, inputs, AttnMask::Causal, make_backend)
}

/// [`run_trial`] with the layer attending under `mask` over the sequence.
pub fn run_trial_masked<B: Backend>(
    plan: &CpPlan,
    dims: &AttnDims,
    inputs: &TrialInputs,
    mask: AttnMask,
    make_backend: impl Fn() -> B + Sync,
) -> Result<TrialResult> {
    let runs = run_ranks(plan.mesh_shape(), make_backend, |_rank, b, mesh| {
        let (x, dy) = inputs.shard(plan, dims.hidden, mesh.ring.rank(), mesh.ulysses.rank());
        let rank_inputs = RankInputs {
            x: &x,
            dy: &dy,
            weights: &inputs.weights,
        };
        let once = &RankOptions::ONCE;
        run_rank_masked(
            plan,
            dims,
            rank_inputs,
            b.as_ref(),
            &mesh,
            once,
            mask.clone(),
        )
    })?;
    Ok(assemble(plan, dims.hidden, &runs))
}

/// Wire form of a [`RankRun`] without its gradients (those are identical on
/// every rank), for gathering runs of process ranks over the rendezvous.
pub fn encode_run(run: &RankRun) -> Vec<u8> {
    let mut out = Vec::new();
    let mut word = |x: u64| out.extend_from_slice(&x.to_le_bytes());
    word(run.peak_bytes as u64);
    word(run.act_bytes as u64);
    word(run.seconds.len() as u64);
    for s in &run.seconds {
        word(s.to_bits());
    }
    word(run.y.len() as u64);
    word(run.dx.len() as u64);
    for v in run.y.iter().chain(&run.dx) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Inverse of [`encode_run`] (gradients empty); `None` when malformed.
pub fn decode_run(bytes: &[u8]) -> Option<RankRun> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = bytes.get(at..at.checked_add(n)?)?;
        at += n;
        Some(s)
    };
    let mut word = || -> Option<u64> { Some(u64::from_le_bytes(take(8)?.try_into().ok()?)) };
    let peak_bytes = word()? as usize;
    let act_bytes = word()? as usize;
    let n = word()? as usize;
    let seconds = (0..n)
        .map(|_| word().map(f64::from_bits))
        .collect::<Option<Vec<_>>>()?;
    let (ny, ndx) = (word()? as usize, word()? as usize);
    let mut read = |n: usize| -> Option<Vec<f32>> {
        let raw = bytes.get(at..at.checked_add(n.checked_mul(4)?)?)?;
        at += n * 4;
        Some(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    };
    let y = read(ny)?;
    let dx = read(ndx)?;
    (at == bytes.len()).then_some(RankRun {
        y,
        dx,
        grads: Vec::new(),
        peak_bytes,
        act_bytes,
        seconds,
        peak_stats: None,
    })
}

/// Every rank's run, in rank order, on every rank: gathered over the TCP
/// rendezvous (host bytes; y and dx travel only when they were kept). The
/// gradients of `mine` (world-summed, so the same everywhere) are put on
/// every entry.
pub fn gather_runs(rv: &mut Rendezvous, mine: RankRun) -> Result<Vec<RankRun>> {
    let all = rv.all_gather_bytes(&encode_run(&mine))?;
    all.iter()
        .enumerate()
        .map(|(r, bytes)| {
            let mut run = decode_run(bytes).ok_or_else(|| {
                crate::error::Error::Comm(format!("malformed trial result from rank {r}"))
            })?;
            run.grads = mine.grads.clone();
            Ok(run)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_err_counts_nan_and_mismatches_as_infinite() {
        assert_eq!(rel_err(&[1.0, 2.5], &[1.0, 2.0]), 0.25);
        assert_eq!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0, f32::INFINITY], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_err(&[0.5], &[0.0]), 0.5);
    }

    #[test]
    fn run_wire_round_trip() {
        let run = RankRun {
            y: vec![1.0, -2.5, f32::MAX],
            dx: vec![0.25],
            grads: vec![("wq", vec![1.0])],
            peak_bytes: 1 << 40,
            act_bytes: 12345,
            seconds: vec![0.5, 1e-9],
            peak_stats: None,
        };
        let back = decode_run(&encode_run(&run)).unwrap();
        assert_eq!(back.y, run.y);
        assert_eq!(back.dx, run.dx);
        assert!(back.grads.is_empty(), "gradients do not travel");
        assert_eq!(
            (back.peak_bytes, back.act_bytes, back.seconds),
            (run.peak_bytes, run.act_bytes, run.seconds.clone())
        );
        let bytes = encode_run(&run);
        assert!(decode_run(&bytes[..bytes.len() - 1]).is_none());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_run(&longer).is_none());
        assert!(decode_run(&[]).is_none());
    }

    #[test]
    fn assemble_without_outputs_keeps_the_measurements() {
        let dims = AttnDims {
            hidden: 16,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            qk_norm: false,
            norm: crate::backend::RmsNorm::plain(1e-6),
            rope: crate::attention::rope::RopeConfig {
                theta: 10000.0,
                scaling: None,
            },
            softmax_scale: AttnDims::default_softmax_scale(4),
            precision: crate::backend::fp8::Precision::Bf16,
        };
        let plan = CpPlan::new(Strategy::Ulysses, &dims, 8, 2, 1, None).unwrap();
        let runs = vec![
            RankRun {
                peak_bytes: 10,
                act_bytes: 3,
                seconds: vec![0.5, 0.25],
                ..RankRun::default()
            },
            RankRun {
                peak_bytes: 12,
                act_bytes: 2,
                seconds: vec![0.75, 0.1],
                ..RankRun::default()
            },
        ];
        let t = assemble(&plan, dims.hidden, &runs);
        assert!(t.y.is_empty() && t.dx.is_empty());
        assert_eq!((t.peak_bytes, t.act_bytes, t.seconds), (12, 3, 0.75));
        // a rank with partial outputs is not unsharded either
        let mut partial = runs.clone();
        partial[0].y = vec![1.0; 4 * 16];
        partial[0].dx = vec![1.0; 4 * 16];
        assert!(assemble(&plan, dims.hidden, &partial).y.is_empty());
    }
}
