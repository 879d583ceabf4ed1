//! Evaluation: the mean next-token cross-entropy of a model over a token
//! file cut into windows, also by position within the document, forward
//! only ([`Decoder::forward_loss`]) on any strategy and mesh.
//!
//! The windows are made as `--pack` makes training's (`data::packing`),
//! with the document index and loss mask beside the file: `stream` and
//! `documents` cut consecutive windows of `L` inputs that take `L + 1`
//! tokens and overlap by one, so every token after the first is a target
//! once: `(N - 1) / L` windows of a file of `N` tokens, the tail past the
//! last whole window left out (`documents` restarts positions and attention
//! at every document start and counts no target across a boundary); `bfd`
//! packs whole documents by best-fit decreasing, every window of the
//! packing once, in order. Targets the loss mask does not count are left
//! out. A window is padded to a length the layout accepts; padded positions
//! come last, so causal attention keeps them out of every real prediction,
//! and their targets are `IGNORE`. Data replicas take windows round-robin; the sums of
//! every rank are reduced over the world at the end. Ranks are threads
//! ([`eval_threads`]) or one process per GPU (`trainer::eval_process_rank`).

use super::host_weights::weights_from_host;
use super::step_windows::RankWindow;
use crate::attention::{CpPlan, Strategy};
use crate::backend::{Backend, Category, DType, IGNORE};
use crate::checkpoint::HostTensor;
use crate::comm::local::run_ranks;
use crate::comm::{Mesh, MeshShape};
use crate::data::packing::{Piece, best_fit_decreasing, bin_window, cut_window, pieces};
use crate::data::{Dataset, PackMode, PackedWindow};
use crate::error::Result;
use crate::model::decoder::attn_dims;
use crate::model::forward::LossRows;
use crate::model::{Decoder, MemoryPolicy, ModelConfig, ModelWeights};
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
    /// How windows are made of the documents (`--pack`; `stream`: the file
    /// as one stream, its document index unused).
    pub pack: PackMode,
    /// A LoRA adapter evaluated beside the base weights, unmerged, as
    /// training applies it (`upipe eval --lora-from`).
    pub lora: Option<crate::model::lora::LoraWeights>,
}

/// What a run evaluates while it trains.
#[derive(Clone)]
pub struct EvalDuring {
    /// The held-out ids (`--eval-data`), with the document index and loss
    /// mask beside them.
    pub data: Dataset,
    /// Evaluate after every this many steps (`--eval-every`), and after the last.
    pub every: u32,
    /// Equal ranges of positions the loss is also given for (`--eval-buckets`).
    pub buckets: usize,
}

impl fmt::Debug for EvalDuring {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("EvalDuring")
            .field("data", &self.data.tokens.name())
            .field("every", &self.every)
            .field("buckets", &self.buckets)
            .finish()
    }
}

impl EvalDuring {
    /// Whether step `step` of a run of `steps` evaluates.
    pub fn due(&self, step: u32, steps: u32) -> bool {
        due(self.every, step, steps)
    }
}

/// Whether an evaluation every `every` steps (0: none but the last) is
/// due after step `step` of a run of `steps`: every `every`-th, and the last.
pub(crate) fn due(every: u32, step: u32, steps: u32) -> bool {
    step == steps || (every > 0 && step.is_multiple_of(every))
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
            pack: PackMode::Stream,
            lora: None,
        }
    }

    /// The windows of `data`; errors name the fix.
    pub fn windows(&self, data: &Dataset) -> Result<EvalWindows> {
        let n = data.len();
        let name = data.tokens.name();
        if n < 2 {
            return crate::config_err!(
                "{name} holds {n} tokens; at least 2 are needed to predict one"
            );
        }
        let seq = self.seq.unwrap_or(n - 1);
        if seq == 0 {
            return crate::config_err!("--seq must be at least 1");
        }
        if seq > n - 1 {
            return crate::config_err!(
                "--seq {seq} is longer than {name} allows: its {n} tokens make windows of at most {} \
                 inputs (each window needs one more token for its last target); use a shorter --seq",
                n - 1
            );
        }
        if self.buckets == 0 || self.buckets > seq {
            return crate::config_err!(
                "--buckets {} must be between 1 and the window length {seq}",
                self.buckets
            );
        }
        let count = match self.pack {
            PackMode::Bfd => bfd_bins(data, seq)?.len(),
            _ => (n - 1) / seq,
        };
        Ok(EvalWindows { seq, count })
    }

    /// `(Pu, Pr)`: 1 and 1 for `local`.
    fn degrees(&self) -> (usize, usize) {
        let m = self
            .strategy
            .given_mesh(Some(self.ulysses), Some(self.ring));
        (m.ulysses, m.ring)
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

    /// The decoder's memory policy: the defaults, `loss_chunk` rows of
    /// logits at once.
    pub fn policy(&self) -> MemoryPolicy {
        MemoryPolicy {
            loss_chunk: self.loss_chunk,
            ..MemoryPolicy::default()
        }
    }

    /// The model's weights on `b` from `host` (by HF name; a rehearsal reads
    /// none), with the adapter attached when there is one.
    pub fn weights<B: Backend>(
        &self,
        b: &B,
        host: &BTreeMap<String, HostTensor>,
    ) -> Result<ModelWeights<B>> {
        let mut w = weights_from_host(b, &self.model, host, b.compute_dtype(), Category::Weights)?;
        if let Some(lora) = &self.lora {
            crate::train::lora_run::attach(b, &mut w, lora)?;
        }
        Ok(w)
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
    data: impl Into<Dataset>,
    host: &BTreeMap<String, HostTensor>,
    make_backend: impl Fn() -> B + Sync,
) -> Result<EvalReport> {
    let data = data.into();
    data.tokens.check_vocab(cfg.model.vocab)?;
    let plan = cfg.plan(cfg.windows(&data)?.seq)?;
    let out = run_ranks(cfg.mesh_shape(&plan), make_backend, |_, b, mesh| {
        eval_on_mesh(cfg, &data, host, b.as_ref(), &mesh)
    })?;
    Ok(out.into_iter().next().expect("at least one rank"))
}

/// [`eval_threads`] on the CPU reference backend (f32).
pub fn eval_cpu(
    cfg: &EvalConfig,
    data: impl Into<Dataset>,
    host: &BTreeMap<String, HostTensor>,
) -> Result<EvalReport> {
    eval_threads(cfg, data, host, crate::backend::cpu::CpuBackend::new)
}

/// One rank's evaluation; collective over `mesh` (every rank calls it with
/// the same arguments). `tokens_per_s` counts every target from the first
/// window to the final reduction on this rank's clock, leaving out the first
/// round of windows (kernel compilation, first allocations) when every
/// replica has at least two.
pub fn eval_on_mesh<B: Backend>(
    cfg: &EvalConfig,
    data: &Dataset,
    host: &BTreeMap<String, HostTensor>,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<EvalReport> {
    let win = cfg.windows(data)?;
    windows_on_mesh(cfg, (Some(data), &win), host, b, mesh)
}

/// [`eval_on_mesh`] rehearsed on a rehearsing backend `b` (the memory
/// planner's counting one) for windows of `seq` inputs: the same model,
/// decoder and windows loop over one window of zeros (a rehearsal reads no
/// data; every window of a length allocates alike), every target counted,
/// in one document, or two where `--pack` makes documents masks.
pub fn rehearse_eval_on_mesh<B: Backend>(
    cfg: &EvalConfig,
    seq: usize,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<EvalReport> {
    let win = EvalWindows { seq, count: 1 };
    windows_on_mesh(cfg, (None, &win), &BTreeMap::new(), b, mesh)
}

/// [`eval_on_mesh`] over the windows `win` of `data` (`None`: a rehearsal's).
fn windows_on_mesh<B: Backend>(
    cfg: &EvalConfig,
    (data, win): (Option<&Dataset>, &EvalWindows),
    host: &BTreeMap<String, HostTensor>,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<EvalReport> {
    let plan = cfg.plan(win.seq)?;
    let shape = cfg.mesh_shape(&plan);
    if mesh.shape != shape {
        return crate::config_err!(
            "the evaluation mesh is {shape:?} but the process groups were built for {:?}",
            mesh.shape
        );
    }
    let mut decoder = Decoder::new(b, cfg.model.clone(), plan.clone(), mesh, cfg.policy())?;
    let w = cfg.weights(b, host)?;
    let ranges = cfg.bucket_ranges(win.seq);
    let groups = ranges.len();
    eval_windows(
        b,
        mesh,
        &plan,
        EvalData {
            data,
            pack: cfg.pack,
            win,
        },
        &ranges,
        |window, ids, targets, bucket_of| {
            decoder.set_window(b, &window.doc_starts)?;
            let rows = LossRows {
                ids,
                targets,
                group_of_row: bucket_of,
                groups,
            };
            decoder.forward_loss(b, mesh, &w, rows)
        },
    )
}

/// The windows an evaluation reads: `win` of `data`, made as `pack` says.
#[derive(Clone, Copy)]
pub(crate) struct EvalData<'a> {
    /// `None`: a rehearsal's windows ([`rehearse_eval_on_mesh`]).
    pub data: Option<&'a Dataset>,
    pub pack: PackMode,
    pub win: &'a EvalWindows,
}

/// Evaluates this rank's share of the windows of `ev` under `plan` on
/// `mesh` (data replicas take windows round-robin), `forward` giving one
/// window's loss sums by bucket for this rank's rows (given the window, for
/// its documents, and its ids, targets and each row's bucket of `ranges`,
/// by position within the document); the sums, and the targets counted,
/// reduced over the world. Collective. `upipe eval` and evaluation during
/// training (`train::eval_during`) both run it.
pub(crate) fn eval_windows<B: Backend>(
    b: &B,
    mesh: &Mesh<B>,
    plan: &CpPlan,
    ev: EvalData,
    ranges: &[Range<usize>],
    mut forward: impl FnMut(&PackedWindow, &[u32], &[u32], &[usize]) -> Result<Vec<f64>>,
) -> Result<EvalReport> {
    let positions = plan
        .layout
        .rank_positions(mesh.ring.rank(), mesh.ulysses.rank());
    let (replica, replicas) = (mesh.shape.coords(mesh.rank).data, mesh.shape.data);
    let win = ev.win;
    if ev.data.is_none() && !b.rehearsing() {
        return crate::config_err!("an evaluation without data is a rehearsal's only");
    }
    let windows = EvalWindowMaker::new(ev, plan.layout.seq)?;
    // per bucket: summed loss, then counted targets
    let mut sums = vec![0f64; 2 * ranges.len()];
    let start = Instant::now();
    let mut timed_from = None;
    for (round, wi) in (replica..win.count).step_by(replicas).enumerate() {
        let window = windows.window(wi);
        let rows = RankWindow::of(&window, &positions)?;
        let bucket_of = buckets_by_document_position(&window, &positions, ranges);
        let s = forward(&window, &rows.ids, &rows.targets, &bucket_of)?;
        sums.iter_mut().zip(s).for_each(|(a, x)| *a += x);
        for (&bucket, &t) in bucket_of.iter().zip(&rows.targets) {
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

/// `--pack bfd`'s windows of `data`: whole documents packed into windows
/// of `seq` by best-fit decreasing (`data::packing`), in the packing's order.
fn bfd_bins(data: &Dataset, seq: usize) -> Result<Vec<Vec<Piece>>> {
    let Some(docs) = &data.docs else {
        return crate::config_err!(
            "--pack bfd packs whole documents, but {} has no document index: write the ids with \
             `upipe tokenize` (it writes the index IDS.docs beside them), or use --pack stream",
            data.tokens.name()
        );
    };
    Ok(best_fit_decreasing(&pieces(docs, seq), seq))
}

/// Makes evaluation window `wi` of a dataset as `--pack` says.
struct EvalWindowMaker<'a> {
    ev: EvalData<'a>,
    /// `bfd`: the packing's windows.
    bins: Option<Vec<Vec<Piece>>>,
    /// The layout's window length, `>= seq`.
    padded: usize,
}

impl<'a> EvalWindowMaker<'a> {
    fn new(ev: EvalData<'a>, padded: usize) -> Result<Self> {
        let bins = match (ev.pack, ev.data) {
            (PackMode::Bfd, Some(data)) => Some(bfd_bins(data, ev.win.seq)?),
            _ => None,
        };
        Ok(EvalWindowMaker { ev, bins, padded })
    }

    /// Window `wi`, padded to the layout's length.
    fn window(&self, wi: usize) -> PackedWindow {
        let seq = self.ev.win.seq;
        let mut w = match (self.ev.data, &self.bins) {
            (None, _) => rehearsal_window(seq, self.ev.pack),
            (Some(d), Some(bins)) => bin_window(&bins[wi], &d.tokens, d.mask.as_ref(), seq),
            (Some(d), None) => {
                let ids = d.tokens.read(wi * seq..(wi + 1) * seq + 1);
                let docs = d.docs.as_deref();
                cut_window((wi * seq) as u64, &ids, docs, d.mask.as_ref(), self.ev.pack)
            }
        };
        // padded positions come last, input 0 and target `IGNORE`, in the
        // last document: causal attention keeps them out of every real prediction
        w.inputs.resize(self.padded, 0);
        w.targets.resize(self.padded, IGNORE);
        w
    }
}

/// A rehearsal's window of `seq` inputs (it reads no data): zeros, every
/// target counted, one document, or where `pack` makes documents masks
/// two (`[0, 1)` and the rest), as a training rehearsal's windows.
fn rehearsal_window(seq: usize, pack: PackMode) -> PackedWindow {
    let two = pack != PackMode::Stream && seq >= 2;
    PackedWindow {
        inputs: vec![0; seq],
        targets: vec![0; seq],
        doc_starts: if two { vec![0, 1] } else { vec![0] },
    }
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
pub(crate) fn reduce_sums<B: Backend>(b: &B, mesh: &Mesh<B>, local: &[f64]) -> Result<Vec<f64>> {
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
