//! Evaluation: the mean next-token cross-entropy of a model over a token
//! file cut into consecutive windows, also by position within the document,
//! forward only ([`Decoder::forward_loss`]) on any strategy and mesh.
//!
//! Windows of `L` inputs take `L + 1` tokens and overlap by one, so every
//! token after the first is a target once: `(N - 1) / L` windows of a file of
//! `N` tokens, the tail past the last whole window left out. A window is
//! padded to a length the layout accepts; padded positions come last, so
//! causal attention keeps them out of every real prediction, and their
//! targets are `IGNORE`. Data replicas take windows round-robin; the sums of
//! every rank are reduced over the world at the end. Ranks are threads
//! ([`eval_threads`]) or one process per GPU (`trainer::eval_process_rank`).

use super::host_weights::weights_from_host;
use crate::attention::{CpPlan, Strategy};
use crate::backend::{Backend, Category, DType, IGNORE};
use crate::checkpoint::HostTensor;
use crate::comm::local::run_ranks;
use crate::comm::{Mesh, MeshShape};
use crate::data::{PackedWindow, Tokens};
use crate::error::Result;
use crate::model::decoder::attn_dims;
use crate::model::{Decoder, MemoryPolicy, ModelConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::time::{Duration, Instant};

/// What an evaluation runs: the model, its mesh and how the data is cut.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    pub model: ModelConfig,
    pub strategy: Strategy,
    /// Data replicas, each evaluating every `data_parallel`-th window.
    pub data_parallel: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub chunk_heads: Option<usize>,
    /// UPipe: heads per forward stage (default U).
    pub fwd_chunk_heads: Option<usize>,
    /// Inputs per window (`None`: the whole file as one window).
    pub seq: Option<usize>,
    /// Equal ranges of positions the loss is also reported for.
    pub buckets: usize,
    /// Rows of logits at once.
    pub loss_chunk: usize,
}

/// What a run evaluates while it trains.
#[derive(Clone)]
pub struct EvalDuring {
    /// The held-out token ids (`--eval-data`).
    pub tokens: Tokens,
    /// Evaluate after every this many steps (`--eval-every`), and after the last.
    pub every: u32,
    /// Equal ranges of positions the loss is also given for (`--eval-buckets`).
    pub buckets: usize,
}

impl fmt::Debug for EvalDuring {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("EvalDuring")
            .field("tokens", &self.tokens.name())
            .field("every", &self.every)
            .field("buckets", &self.buckets)
            .finish()
    }
}

impl EvalDuring {
    /// Whether step `step` of a run of `steps` evaluates.
    pub fn due(&self, step: u32, steps: u32) -> bool {
        step == steps || (self.every > 0 && step.is_multiple_of(self.every))
    }
}

/// The windows an [`EvalConfig`] cuts a token file into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalWindows {
    /// Inputs (and targets) per window, `L`.
    pub seq: usize,
    /// Number of windows.
    pub count: usize,
}

/// The loss over one range of positions within the windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketLoss {
    /// First position (0-based, within the target's document).
    pub from: usize,
    /// One past the last position.
    pub to: usize,
    /// Mean next-token cross-entropy over the counted targets at these
    /// positions of every document.
    pub loss: f64,
}

/// The result of an evaluation (every rank returns the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// Mean next-token cross-entropy over every target.
    pub loss: f64,
    /// Targets evaluated (`windows * L`).
    pub tokens: usize,
    /// Targets counted toward the loss (`tokens` less those masked:
    /// document ends, SFT prompts).
    pub counted_tokens: usize,
    pub windows: usize,
    pub by_position: Vec<BucketLoss>,
    /// Targets per second (see [`eval_on_mesh`]).
    pub tokens_per_s: f64,
    /// Rank 0's ledger peak (this rank's, for a process rank).
    pub peak_bytes: usize,
    /// Rank 0's bytes of each category at that peak (not printed).
    #[serde(skip)]
    pub at_peak_by_category: Vec<(crate::backend::Category, usize)>,
    /// Rank 0's highest host (offload) bytes (not printed).
    #[serde(skip)]
    pub host_peak_bytes: usize,
}

impl EvalConfig {
    /// `model` on one rank (`local`), the whole file as one window, one bucket.
    pub fn new(model: ModelConfig) -> Self {
        EvalConfig {
            model,
            strategy: Strategy::Local,
            data_parallel: 1,
            ulysses: 1,
            ring: 1,
            chunk_heads: None,
            fwd_chunk_heads: None,
            seq: None,
            buckets: 1,
            loss_chunk: MemoryPolicy::default().loss_chunk,
        }
    }

    /// The windows of `tokens`; errors name the fix.
    pub fn windows(&self, tokens: &Tokens) -> Result<EvalWindows> {
        let n = tokens.len();
        if n < 2 {
            return crate::config_err!(
                "{} holds {n} tokens; at least 2 are needed to predict one",
                tokens.name()
            );
        }
        let seq = self.seq.unwrap_or(n - 1);
        if seq == 0 {
            return crate::config_err!("--seq must be at least 1");
        }
        if seq > n - 1 {
            return crate::config_err!(
                "--seq {seq} is longer than {} allows: its {n} tokens make windows of at most {} \
                 inputs (each window needs one more token for its last target); use a shorter --seq",
                tokens.name(),
                n - 1
            );
        }
        if self.buckets == 0 || self.buckets > seq {
            return crate::config_err!(
                "--buckets {} must be between 1 and the window length {seq}",
                self.buckets
            );
        }
        Ok(EvalWindows {
            seq,
            count: (n - 1) / seq,
        })
    }

    /// `(Pu, Pr)`: 1 and 1 for `local`.
    fn degrees(&self) -> (usize, usize) {
        match self.strategy {
            Strategy::Local => (1, 1),
            _ => (self.ulysses, self.ring),
        }
    }

    /// The attention plan for windows of `seq` inputs, padded to a length the
    /// layout accepts.
    pub fn plan(&self, seq: usize) -> Result<CpPlan> {
        self.model.validate()?;
        if self.data_parallel == 0 {
            return crate::config_err!("--data-parallel must be at least 1");
        }
        if self.loss_chunk == 0 {
            return crate::config_err!("--loss-chunk must be at least 1");
        }
        let (pu, pr) = self.degrees();
        let unit = if pr > 1 { 2 * pr * pu } else { pu.max(1) };
        let padded = seq.div_ceil(unit) * unit;
        let dims = attn_dims(&self.model);
        CpPlan::new(self.strategy, &dims, padded, pu, pr, self.chunk_heads)?
            .with_fwd_chunk(self.fwd_chunk_heads)
    }

    /// The whole mesh of `plan` (data replicas x its context group).
    pub fn mesh_shape(&self, plan: &CpPlan) -> MeshShape {
        MeshShape {
            data: self.data_parallel,
            ..plan.mesh_shape()
        }
    }

    /// The buckets' position ranges over windows of `seq` targets.
    pub fn bucket_ranges(&self, seq: usize) -> Vec<Range<usize>> {
        let k = self.buckets.max(1);
        (0..k).map(|i| i * seq / k..(i + 1) * seq / k).collect()
    }
}

/// Evaluates on ranks as threads, each on a backend from `make_backend`,
/// with weights from `host` (by HF name). Returns rank 0's report.
pub fn eval_threads<B: Backend>(
    cfg: &EvalConfig,
    tokens: &Tokens,
    host: &BTreeMap<String, HostTensor>,
    make_backend: impl Fn() -> B + Sync,
) -> Result<EvalReport> {
    tokens.check_vocab(cfg.model.vocab)?;
    let plan = cfg.plan(cfg.windows(tokens)?.seq)?;
    let out = run_ranks(cfg.mesh_shape(&plan), make_backend, |_, b, mesh| {
        eval_on_mesh(cfg, tokens, host, b.as_ref(), &mesh)
    })?;
    Ok(out.into_iter().next().expect("at least one rank"))
}

/// [`eval_threads`] on the CPU reference backend (f32).
pub fn eval_cpu(
    cfg: &EvalConfig,
    tokens: &Tokens,
    host: &BTreeMap<String, HostTensor>,
) -> Result<EvalReport> {
    eval_threads(cfg, tokens, host, crate::backend::cpu::CpuBackend::new)
}

/// One rank's evaluation; collective over `mesh` (every rank calls it with
/// the same arguments). `tokens_per_s` counts every target from the first
/// window to the final reduction on this rank's clock, leaving out the first
/// round of windows (kernel compilation, first allocations) when every
/// replica has at least two.
pub fn eval_on_mesh<B: Backend>(
    cfg: &EvalConfig,
    tokens: &Tokens,
    host: &BTreeMap<String, HostTensor>,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<EvalReport> {
    let win = cfg.windows(tokens)?;
    let plan = cfg.plan(win.seq)?;
    let shape = cfg.mesh_shape(&plan);
    if mesh.shape != shape {
        return crate::config_err!(
            "the evaluation mesh is {shape:?} but the process groups were built for {:?}",
            mesh.shape
        );
    }
    let policy = MemoryPolicy {
        loss_chunk: cfg.loss_chunk,
        ..MemoryPolicy::default()
    };
    let mut decoder = Decoder::new(b, cfg.model.clone(), plan.clone(), mesh, policy)?;
    let w = weights_from_host(b, &cfg.model, host, b.compute_dtype(), Category::Weights)?;
    let ranges = cfg.bucket_ranges(win.seq);
    let groups = ranges.len();
    eval_windows(
        b,
        mesh,
        &plan,
        tokens,
        &win,
        &ranges,
        |window, ids, targets, bucket_of| {
            decoder.set_window(b, &window.doc_starts)?;
            decoder.forward_loss(b, mesh, &w, ids, targets, bucket_of, groups)
        },
    )
}

/// Evaluates this rank's share of the windows `win` of `tokens` under
/// `plan` on `mesh` (data replicas take windows round-robin), `forward`
/// giving one window's loss sums by bucket for this rank's rows (given the
/// window, for its documents, and its ids, targets and each row's bucket of
/// `ranges`, by position within the document); the sums, and the targets
/// counted, reduced over the world. Collective. `upipe eval` and evaluation during training
/// (`train::eval_during`) both run it.
pub(crate) fn eval_windows<B: Backend>(
    b: &B,
    mesh: &Mesh<B>,
    plan: &CpPlan,
    tokens: &Tokens,
    win: &EvalWindows,
    ranges: &[Range<usize>],
    mut forward: impl FnMut(&PackedWindow, &[u32], &[u32], &[usize]) -> Result<Vec<f64>>,
) -> Result<EvalReport> {
    let positions = plan
        .layout
        .rank_positions(mesh.ring.rank(), mesh.ulysses.rank());
    let (replica, replicas) = (mesh.shape.coords(mesh.rank).data, mesh.shape.data);
    // per bucket: summed loss, then counted targets
    let mut sums = vec![0f64; 2 * ranges.len()];
    let mut tokens_read = Vec::with_capacity(win.seq + 1);
    let start = Instant::now();
    let mut timed_from = None;
    for (round, wi) in (replica..win.count).step_by(replicas).enumerate() {
        tokens.read_into(wi * win.seq..(wi + 1) * win.seq + 1, &mut tokens_read);
        let window = padded_window(&tokens_read, plan.layout.seq);
        let (ids, targets): (Vec<u32>, Vec<u32>) = positions
            .iter()
            .map(|&p| (window.inputs[p], window.targets[p]))
            .unzip();
        let bucket_of = buckets_by_document_position(&window, &positions, ranges);
        let s = forward(&window, &ids, &targets, &bucket_of)?;
        sums.iter_mut().zip(s).for_each(|(a, x)| *a += x);
        for (&bucket, &t) in bucket_of.iter().zip(&targets) {
            sums[ranges.len() + bucket] += f64::from(u8::from(t != IGNORE));
        }
        if round == 0 {
            timed_from = Some(Instant::now());
        }
    }
    let sums = reduce_sums(b, mesh, &sums)?;
    let per_replica = win.count / replicas;
    let (elapsed, timed_windows) = match timed_from {
        Some(t) if per_replica >= 2 => (t.elapsed(), win.count - replicas),
        _ => (start.elapsed(), win.count),
    };
    let (losses, counted) = sums.split_at(ranges.len());
    Ok(report(
        win,
        ranges,
        losses,
        counted,
        timed_windows,
        elapsed,
        b,
    ))
}

/// A window of `L + 1` read tokens as the model takes it, padded to the
/// plan's `padded` inputs: padded positions come last, with input 0 and
/// target `IGNORE` (causal attention keeps them out of every real
/// prediction). One document: the window is one stream.
fn padded_window(read: &[u32], padded: usize) -> PackedWindow {
    let seq = read.len() - 1;
    let (inputs, targets) = (0..padded)
        .map(|p| match p < seq {
            true => (read[p], read[p + 1]),
            false => (0, IGNORE),
        })
        .unzip();
    PackedWindow::stream(inputs, targets)
}

/// The bucket of each of `positions` (rows of `window`): its position
/// within its document, in `ranges` (contiguous; positions past the last go
/// with the last bucket).
fn buckets_by_document_position(
    window: &PackedWindow,
    positions: &[usize],
    ranges: &[Range<usize>],
) -> Vec<usize> {
    let within = window.positions();
    positions
        .iter()
        .map(|&p| {
            let q = within[p] as usize;
            ranges.partition_point(|r| r.end <= q).min(ranges.len() - 1)
        })
        .collect()
}

/// The report of sums reduced over the world: per bucket, the summed loss
/// and the targets counted.
fn report<B: Backend>(
    win: &EvalWindows,
    ranges: &[Range<usize>],
    losses: &[f64],
    counted: &[f64],
    timed_windows: usize,
    elapsed: Duration,
    b: &B,
) -> EvalReport {
    let by_position = ranges
        .iter()
        .zip(losses.iter().zip(counted))
        .map(|(r, (s, n))| BucketLoss {
            from: r.start,
            to: r.end,
            loss: s / n.max(1.0),
        })
        .collect();
    let total: f64 = counted.iter().sum();
    EvalReport {
        loss: losses.iter().sum::<f64>() / total.max(1.0),
        tokens: win.count * win.seq,
        counted_tokens: total.round() as usize,
        windows: win.count,
        by_position,
        tokens_per_s: (timed_windows * win.seq) as f64 / elapsed.as_secs_f64().max(1e-9),
        peak_bytes: b.ledger().peak(),
        at_peak_by_category: b.ledger().stats().at_peak_by_category,
        host_peak_bytes: b.ledger().stats().host_peak,
    }
}

/// Sums `local` over every rank of the world. Each value travels as an f32
/// pair (value, rounding remainder), so the f64 sums keep their precision
/// through the f32 reduction.
fn reduce_sums<B: Backend>(b: &B, mesh: &Mesh<B>, local: &[f64]) -> Result<Vec<f64>> {
    let pairs: Vec<f32> = local
        .iter()
        .flat_map(|&x| {
            let hi = x as f32;
            [hi, (x - f64::from(hi)) as f32]
        })
        .collect();
    let mut t = b.from_host(&pairs, &[pairs.len()], DType::F32, Category::Workspace)?;
    mesh.world.all_reduce(&mut t)?;
    let got = b.to_host(&t)?;
    Ok(got
        .chunks_exact(2)
        .map(|p| f64::from(p[0]) + f64::from(p[1]))
        .collect())
}
