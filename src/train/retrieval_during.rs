//! Retrieval trials during training (`--eval-task T --eval-every N`):
//! every N steps and after the last, the trials of a small grid of lengths
//! (at most the run's `--seq`) × depths, scored as `upipe eval --task`
//! scores them ([`score_length`]) on the training mesh with the parameters
//! the run holds (under FSDP each unit gathered for the forward and freed
//! after), so retrieval can be watched beside the loss. What is scored
//! ([`super::retrieval::RetrievalDuring`]) lives beside the scoring.

use super::config::TrainConfig;
use super::eval_during::settle_if_due;
use super::retrieval::{MakeTrial, RetrievalPoint, score_length, summarize};
use super::state::RankModel;
use crate::attention::CpPlan;
use crate::backend::Backend;
use crate::comm::Mesh;
use crate::data::retrieval::TrialAt;
use crate::error::Result;
use crate::model::Decoder;

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
    let Some(rd) = cfg.eval_task.as_ref() else {
        return Ok(None);
    };
    if !settle_if_due(cfg, rd.every, b, model, step)? {
        return Ok(None);
    }
    let maker = rd.maker()?;
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
