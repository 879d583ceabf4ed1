//! Scoring synthetic retrieval trials (`upipe eval --task`,
//! `data::retrieval`) without a generation engine: each trial — context,
//! question and answer — is one forward pass through the engine, and its
//! answer is scored teacher-forced. A trial passes when the model's argmax
//! equals the answer's token at every answer position (what greedy
//! decoding of the answer would produce); the answer's mean log-likelihood
//! is reported beside it.
//!
//! Only the rows that predict the answer's tokens are multiplied by the LM
//! head ([`Decoder::forward_logit_rows`]: a handful of `[1, vocab]` rows,
//! on whichever rank holds those positions after context-parallel
//! sharding), so it runs under every strategy, mesh, kernel and memory
//! policy `upipe eval` runs under. Each rank writes the values of its
//! rows into its replica's slots and the world sums them; data replicas
//! take the trials of a length round-robin, and every rank builds every
//! trial of a round (cheap beside the forward) so that all of them know
//! every trial's answer.

use super::eval::{EvalConfig, reduce_sums};
use crate::attention::CpPlan;
use crate::backend::Backend;
use crate::checkpoint::HostTensor;
use crate::comm::Mesh;
use crate::comm::local::run_ranks;
use crate::data::Tokenizer;
use crate::data::retrieval::{ChatFrame, Grid, Haystack, TaskSpec, Trial, TrialAt, TrialMaker};
use crate::error::Result;
use crate::model::Decoder;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

/// Builds the trial at a place of the grid (every rank calls it alike).
pub type MakeTrial<'a> = &'a (dyn Fn(&TrialAt) -> Result<Trial> + Sync);

/// A retrieval evaluation: the model and mesh, the grid, the trials.
pub struct RetrievalRun<'a> {
    pub cfg: &'a EvalConfig,
    pub grid: &'a Grid,
    pub make: MakeTrial<'a>,
}

/// One trial's result (a line of the trials JSONL).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrialResult {
    /// The trial's length asked (`tokens`: its ids).
    pub length: usize,
    pub depth: f64,
    /// The trial's index within its cell.
    pub index: usize,
    pub seed: u64,
    pub tokens: usize,
    /// Where the asked needle starts, and where it went as a fraction of
    /// the haystack.
    pub needle_at: usize,
    pub placed_depth: f64,
    pub key: String,
    pub expected: String,
    /// Whether the argmax equals the answer at every answer token.
    pub passed: bool,
    pub correct_tokens: usize,
    pub answer_tokens: usize,
    /// Mean log-likelihood (nats) of the answer's tokens.
    pub mean_logprob: f64,
    /// The argmax at every answer position.
    pub predicted_ids: Vec<u32>,
}

/// What a retrieval evaluation returns: every trial's result, in grid
/// order (length, then depth, then trial), and each length's cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub trials: Vec<TrialResult>,
    /// One per length of the grid, in its order.
    pub lengths: Vec<LengthCost>,
}

/// What one length of a retrieval evaluation cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LengthCost {
    pub length: usize,
    /// The highest ledger peak of any rank over the length's trials (the
    /// weights included): what the planner predicts.
    pub peak_bytes: usize,
    /// Wall seconds of one trial's forward (a round of the data replicas'
    /// trials at once), the decoder's setup for the length included.
    pub seconds_per_trial: f64,
}

/// Scores every trial of `run` on ranks as threads, each on a backend from
/// `make_backend`, with weights from `host`. Returns rank 0's results.
pub fn retrieval_threads<B: Backend>(
    run: &RetrievalRun,
    host: &BTreeMap<String, HostTensor>,
    make_backend: impl Fn() -> B + Sync,
) -> Result<Scored> {
    let longest = run.grid.lengths.iter().copied().max().unwrap_or(1);
    let shape = run.cfg.mesh_shape(&run.cfg.plan(longest)?);
    let out = run_ranks(shape, make_backend, |_, b, mesh| {
        retrieval_on_mesh(run, host, b.as_ref(), &mesh)
    })?;
    Ok(out.into_iter().next().expect("at least one rank"))
}

/// [`retrieval_threads`] on the CPU reference backend (f32).
pub fn retrieval_cpu(run: &RetrievalRun, host: &BTreeMap<String, HostTensor>) -> Result<Scored> {
    retrieval_threads(run, host, crate::backend::cpu::CpuBackend::new)
}

/// One rank's scoring of every trial; collective over `mesh`. Each
/// length's peak is measured from its start (the ledger's peak reset to
/// what is resident: the weights).
pub fn retrieval_on_mesh<B: Backend>(
    run: &RetrievalRun,
    host: &BTreeMap<String, HostTensor>,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<Scored> {
    let cfg = run.cfg;
    let w = cfg.weights(b, host)?;
    let mut out = Scored {
        trials: Vec::with_capacity(run.grid.count()),
        lengths: Vec::with_capacity(run.grid.lengths.len()),
    };
    for li in 0..run.grid.lengths.len() {
        let length = run.grid.lengths[li];
        b.ledger().reset_peak();
        let start = Instant::now();
        let plan = cfg.plan(length)?;
        let shape = cfg.mesh_shape(&plan);
        if mesh.shape != shape {
            return crate::config_err!(
                "the retrieval mesh is {shape:?} but the process groups were built for {:?}",
                mesh.shape
            );
        }
        let mut decoder = Decoder::new(b, cfg.model.clone(), plan.clone(), mesh, cfg.policy())?;
        decoder.set_window(b, &[0])?;
        let scored = score_length(b, mesh, &plan, (run.grid, li, run.make), |ids, rows| {
            decoder.forward_logit_rows(b, mesh, &w, ids, rows)
        })?;
        drop(decoder);
        let rounds = run.grid.per_length().div_ceil(mesh.shape.data).max(1);
        let seconds_per_trial = start.elapsed().as_secs_f64() / rounds as f64;
        let peak_bytes = max_over_world(b, mesh, b.ledger().peak())?;
        out.trials.extend(scored);
        out.lengths.push(LengthCost {
            length,
            peak_bytes,
            seconds_per_trial,
        });
    }
    Ok(out)
}

/// One rank's rehearsal of [`retrieval_on_mesh`] at `length` on a
/// rehearsing backend `b` (the memory planner's counting one): the same
/// weights, decoder and scoring over one trial of zeros (a rehearsal reads
/// no data), whose rows each rank computes as the rank holding the
/// answer would ([`score_length`]).
pub fn rehearse_retrieval_on_mesh<B: Backend>(
    cfg: &EvalConfig,
    length: usize,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<Scored> {
    let grid = Grid {
        lengths: vec![length],
        depths: vec![0.5],
        trials: 1,
        seed: 0,
    };
    let make = |at: &TrialAt| Ok(rehearsal_trial(at.length));
    let run = RetrievalRun {
        cfg,
        grid: &grid,
        make: &make,
    };
    retrieval_on_mesh(&run, &BTreeMap::new(), b, mesh)
}

/// A rehearsal's trial of `length` ids: zeros, the last one the answer.
fn rehearsal_trial(length: usize) -> Trial {
    let length = length.max(2);
    Trial {
        ids: vec![0; length],
        answer: length - 1..length,
        needle_at: 0,
        placed_depth: 0.5,
        key: String::new(),
        expected: String::new(),
    }
}

/// The highest of every rank's `value` (each rank writes its own into a
/// slot of the world's sum).
fn max_over_world<B: Backend>(b: &B, mesh: &Mesh<B>, value: usize) -> Result<usize> {
    let mut slots = vec![0f64; mesh.shape.world_size()];
    slots[mesh.rank] = value as f64;
    let all = reduce_sums(b, mesh, &slots)?;
    Ok(all
        .into_iter()
        .fold(value, |m, x| m.max(x.round() as usize)))
}

/// Scores the trials of length `li` of `grid` under `plan` (one document
/// per window: the caller has set the decoder's window), `forward` giving
/// the host logits of some of this rank's rows (its ids, the rows).
/// Collective over `mesh`.
pub(crate) fn score_length<B: Backend>(
    b: &B,
    mesh: &Mesh<B>,
    plan: &CpPlan,
    (grid, li, make): (&Grid, usize, MakeTrial),
    mut forward: impl FnMut(&[u32], &[usize]) -> Result<Vec<Vec<f32>>>,
) -> Result<Vec<TrialResult>> {
    let positions = plan
        .layout
        .rank_positions(mesh.ring.rank(), mesh.ulysses.rank());
    let (replica, replicas) = (mesh.shape.coords(mesh.rank).data, mesh.shape.data);
    let total = grid.per_length();
    let mut out = Vec::with_capacity(total);
    for first in (0..total).step_by(replicas) {
        let ats: Vec<TrialAt> = (first..total.min(first + replicas))
            .map(|i| grid.at(li, i))
            .collect();
        let trials = ats.iter().map(make).collect::<Result<Vec<Trial>>>()?;
        let offsets = slot_offsets(&trials);
        let mut sums = vec![0f64; *offsets.last().expect("one offset more than trials")];
        if let Some(trial) = trials.get(replica) {
            check_fits(trial, plan.layout.seq)?;
            let mut ids = trial.ids.clone();
            ids.resize(plan.layout.seq, 0);
            let local: Vec<u32> = positions.iter().map(|&p| ids[p]).collect();
            // a rehearsal, which reads no trial, gives every rank one row
            // (the rank holding the answer computes its rows one at a time)
            let (rows, tokens) = match b.rehearsing() {
                true => (vec![local.len() - 1], vec![0]),
                false => answer_rows(trial, &positions),
            };
            let logits = forward(&local, &rows)?;
            let slot = &mut sums[offsets[replica]..offsets[replica + 1]];
            write_slot(slot, trial, &tokens, &logits);
        }
        let sums = reduce_sums(b, mesh, &sums)?;
        for (k, (at, trial)) in ats.iter().zip(&trials).enumerate() {
            out.push(result_of(at, trial, &sums[offsets[k]..offsets[k + 1]]));
        }
    }
    Ok(out)
}

/// A trial longer than the window is an error (the plan is the length's).
fn check_fits(trial: &Trial, seq: usize) -> Result<()> {
    match trial.ids.len() <= seq {
        true => Ok(()),
        false => crate::config_err!(
            "a trial of {} tokens does not fit the window of {seq}",
            trial.ids.len()
        ),
    }
}

/// Where each trial's values start in a round's sums: three per answer
/// token (argmax correct, log-likelihood, argmax id); one past the last.
fn slot_offsets(trials: &[Trial]) -> Vec<usize> {
    let mut offsets = vec![0];
    for t in trials {
        offsets.push(offsets.last().expect("starts at 0") + 3 * t.answer.len());
    }
    offsets
}

/// This rank's rows that predict an answer token (the row at position
/// `p` predicts the token at `p + 1`; every position is on one rank of
/// the context group), and which answer token each predicts.
fn answer_rows(trial: &Trial, positions: &[usize]) -> (Vec<usize>, Vec<usize>) {
    positions
        .iter()
        .enumerate()
        .filter(|&(_, &p)| trial.answer.contains(&(p + 1)))
        .map(|(row, &p)| (row, p + 1 - trial.answer.start))
        .unzip()
}

/// Writes, for each answer token this rank predicts, whether its argmax
/// is the answer's token, its log-likelihood and the argmax.
fn write_slot(slot: &mut [f64], trial: &Trial, tokens: &[usize], logits: &[Vec<f32>]) {
    let n = trial.answer.len();
    for (&j, row) in tokens.iter().zip(logits) {
        let target = trial.ids[trial.answer.start + j] as usize;
        let (argmax, logprob) = argmax_logprob(row, target);
        slot[j] = f64::from(u8::from(argmax == target));
        slot[n + j] = logprob;
        slot[2 * n + j] = argmax as f64;
    }
}

/// The argmax of `logits` (the first on a tie) and the log-softmax at `target`.
pub fn argmax_logprob(logits: &[f32], target: usize) -> (usize, f64) {
    let (mut best, mut max) = (0, f64::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if f64::from(x) > max {
            (best, max) = (i, f64::from(x));
        }
    }
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    (best, f64::from(logits[target]) - max - sum.ln())
}

/// A trial's result from its summed slot.
fn result_of(at: &TrialAt, trial: &Trial, slot: &[f64]) -> TrialResult {
    let n = trial.answer.len();
    let correct = slot[..n].iter().filter(|&&c| c > 0.5).count();
    TrialResult {
        length: at.length,
        depth: at.depth,
        index: at.index,
        seed: at.seed,
        tokens: trial.ids.len(),
        needle_at: trial.needle_at,
        placed_depth: trial.placed_depth,
        key: trial.key.clone(),
        expected: trial.expected.clone(),
        passed: correct == n,
        correct_tokens: correct,
        answer_tokens: n,
        mean_logprob: slot[n..2 * n].iter().sum::<f64>() / n.max(1) as f64,
        predicted_ids: slot[2 * n..].iter().map(|&x| x.round() as u32).collect(),
    }
}

/// The accuracy of one (length, depth) cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellSummary {
    pub length: usize,
    pub depth: f64,
    pub trials: usize,
    pub passed: usize,
    pub accuracy: f64,
    pub mean_logprob: f64,
}

/// Every cell's accuracy, and the whole grid's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetrievalSummary {
    pub trials: usize,
    pub passed: usize,
    pub accuracy: f64,
    pub mean_logprob: f64,
    /// Length-major, depths ascending.
    pub cells: Vec<CellSummary>,
}

/// The summary of `results` over the cells of `grid`.
pub fn summarize(grid: &Grid, results: &[TrialResult]) -> RetrievalSummary {
    let cell = |length: usize, depth: f64| {
        let of: Vec<&TrialResult> = (results.iter())
            .filter(|r| r.length == length && r.depth == depth)
            .collect();
        let passed = of.iter().filter(|r| r.passed).count();
        CellSummary {
            length,
            depth,
            trials: of.len(),
            passed,
            accuracy: passed as f64 / of.len().max(1) as f64,
            mean_logprob: of.iter().map(|r| r.mean_logprob).sum::<f64>() / of.len().max(1) as f64,
        }
    };
    let cells: Vec<CellSummary> = (grid.lengths.iter())
        .flat_map(|&l| grid.depths.iter().map(move |&d| (l, d)))
        .map(|(l, d)| cell(l, d))
        .collect();
    let passed = results.iter().filter(|r| r.passed).count();
    let n = results.len().max(1) as f64;
    RetrievalSummary {
        trials: results.len(),
        passed,
        accuracy: passed as f64 / n,
        mean_logprob: results.iter().map(|r| r.mean_logprob).sum::<f64>() / n,
        cells,
    }
}

/// What a run scores while it trains.
#[derive(Clone)]
pub struct RetrievalDuring {
    pub spec: TaskSpec,
    /// Lengths (each at most the run's `--seq`), depths, trials, seed.
    pub grid: Grid,
    pub tok: Tokenizer,
    /// `None` for `kv`.
    pub haystack: Option<Haystack>,
    /// Score after every this many steps, and after the last.
    pub every: u32,
    /// The chat template's frame of each trial (`None`: plain text).
    pub chat: Option<ChatFrame>,
}

impl fmt::Debug for RetrievalDuring {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("RetrievalDuring")
            .field("task", &self.spec.task)
            .field("grid", &self.grid)
            .field("every", &self.every)
            .finish()
    }
}

/// The scores of one evaluation during training (a metrics line's
/// `retrieval`; TensorBoard's `retrieval/accuracy`, `retrieval/mean_logprob`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct RetrievalPoint {
    pub task: String,
    /// Trials passed of those scored.
    pub accuracy: f64,
    /// Mean log-likelihood of the answers' tokens (nats).
    pub mean_logprob: f64,
    pub passed: usize,
    pub trials: usize,
}

impl RetrievalDuring {
    /// Whether step `step` of a run of `steps` scores.
    pub fn due(&self, step: u32, steps: u32) -> bool {
        super::eval::due(self.every, step, steps)
    }

    /// The maker of the trials (framed by the chat template, if any).
    pub fn maker(&self) -> Result<TrialMaker<'_>> {
        let maker = TrialMaker::new(&self.spec, self.haystack.as_ref(), &self.tok)?;
        Ok(match &self.chat {
            Some(frame) => maker.with_chat(frame),
            None => maker,
        })
    }

    /// Checks the grid against the run and builds the first trial of every
    /// length, before anything is allocated (errors name the flag and the fix).
    pub fn check(&self, seq: usize) -> Result<()> {
        if let Some(&l) = self.grid.lengths.iter().find(|&&l| l > seq) {
            return crate::config_err!(
                "--eval-task-lengths {l} is longer than the run's --seq {seq}: trials during \
                 training run at most at the training length; give lengths up to {seq} (score \
                 longer ones afterwards with `upipe eval --task`)"
            );
        }
        let maker = self.maker()?;
        for li in 0..self.grid.lengths.len() {
            maker.trial(&self.grid.at(li, 0))?;
        }
        Ok(())
    }
}
