//! Retrieval trials during training (`--eval-task T --eval-every N`):
//! every N steps and after the last, the trials of a small grid of lengths
//! (at most the run's `--seq`) × depths, scored as `upipe eval --task`
//! scores them ([`score_length`]) on the training mesh with the parameters
//! the run holds (under FSDP each unit gathered for the forward and freed
//! after), so retrieval can be watched beside the loss.

use super::config::TrainConfig;
use super::retrieval::{MakeTrial, score_length, summarize};
use super::state::RankModel;
use crate::attention::CpPlan;
use crate::backend::Backend;
use crate::comm::Mesh;
use crate::data::Tokenizer;
use crate::data::retrieval::{Grid, Haystack, TaskSpec, TrialAt, TrialMaker};
use crate::error::Result;
use crate::model::Decoder;
use serde::Serialize;
use std::fmt;

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
        step == steps || (self.every > 0 && step.is_multiple_of(self.every))
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
        let maker = TrialMaker::new(&self.spec, self.haystack.as_ref(), &self.tok)?;
        for li in 0..self.grid.lengths.len() {
            maker.trial(&self.grid.at(li, 0))?;
        }
        Ok(())
    }
}

/// After step `step`: the retrieval trials, when due (every rank scores
/// them, collectively; each rank gets the same point). Pending host
/// optimizer updates run first, so the trials see the step's parameters.
pub fn after_step<B: Backend>(
    cfg: &TrainConfig,
    plan: &CpPlan,
    b: &B,
    mesh: &Mesh<B>,
    decoder: &mut Decoder<B>,
    model: &mut (dyn RankModel<B> + '_),
    step: u32,
) -> Result<Option<RetrievalPoint>> {
    let Some(rd) = cfg.eval_task.as_ref().filter(|r| r.due(step, cfg.steps)) else {
        return Ok(None);
    };
    if cfg.rehearse {
        return Ok(None);
    }
    model.settle(b)?;
    let maker = TrialMaker::new(&rd.spec, rd.haystack.as_ref(), &rd.tok)?;
    let make = |at: &TrialAt| maker.trial(at);
    let make: MakeTrial = &make;
    b.ledger().enter("eval");
    decoder.set_window(b, &[0])?;
    let mut results = Vec::with_capacity(rd.grid.count());
    for li in 0..rd.grid.lengths.len() {
        let scored = score_length(b, mesh, plan, (&rd.grid, li, make), |ids, rows| {
            model.forward_logit_rows(b, decoder, mesh, ids, rows)
        })?;
        results.extend(scored);
    }
    let s = summarize(&rd.grid, &results);
    Ok(Some(RetrievalPoint {
        task: rd.spec.task.name().to_string(),
        accuracy: s.accuracy,
        mean_logprob: s.mean_logprob,
        passed: s.passed,
        trials: s.trials,
    }))
}
