//! Held-out evaluation during training (`--eval-data FILE --eval-every N`):
//! every N steps and after the last, the mean next-token loss over the
//! file's windows of the run's `--seq` inputs, overall and by position
//! bucket, computed as `upipe eval` computes it ([`eval_windows`]) on the
//! training mesh with the parameters the run holds (no second copy of the
//! model: under FSDP each unit is gathered for the forward and freed after,
//! as the training forward does).

use super::config::TrainConfig;
use super::eval::{EvalConfig, EvalData, EvalDuring, EvalReport, due, eval_windows};
use super::state::RankModel;
use crate::attention::CpPlan;
use crate::backend::Backend;
use crate::comm::Mesh;
use crate::error::Result;
use crate::model::Decoder;
use crate::model::forward::LossRows;

impl EvalDuring {
    /// What `upipe eval` would run for the same numbers: the run's model,
    /// mesh and stages, windows of the run's `--seq`.
    pub fn eval_config(&self, cfg: &TrainConfig) -> EvalConfig {
        EvalConfig {
            model: cfg.model.clone(),
            strategy: cfg.strategy,
            data_parallel: cfg.data_parallel,
            ulysses: cfg.ulysses,
            ring: cfg.ring,
            chunk_heads: cfg.chunk_heads,
            fwd_chunk_heads: cfg.fwd_chunk_heads,
            seq: Some(cfg.seq),
            buckets: self.buckets,
            loss_chunk: cfg.policy.loss_chunk,
            pack: cfg.pack,
            // the run's weights already carry its adapters
            lora: None,
        }
    }

    /// Checks the evaluation against the run before anything is allocated:
    /// a step count of at least 1, ids within the model's vocabulary, at
    /// least one window of `--seq`, buckets within it. Errors name the flag
    /// and the fix.
    pub fn check(&self, cfg: &TrainConfig) -> Result<()> {
        if self.every == 0 {
            return crate::config_err!(
                "--eval-every 0: give the steps between evaluations, at least 1 \
                 (the run also evaluates after its last step)"
            );
        }
        if let Err(e) = self.data.tokens.check_vocab(cfg.model.vocab) {
            return crate::config_err!(
                "--eval-data {}: {e}; give held-out ids of the model's tokenizer \
                 (`upipe tokenize --tokenizer` the one --data uses)",
                self.data.tokens.name()
            );
        }
        let windows = self.eval_config(cfg).windows(&self.data).map_err(|e| {
            crate::Error::Config(format!(
                "--eval-data at --seq {}: {}",
                cfg.seq,
                e.to_string().replace("--buckets", "--eval-buckets")
            ))
        })?;
        debug_assert!(windows.count >= 1);
        Ok(())
    }
}

/// After step `step`: the held-out evaluation, when one is due (rank 0's
/// report; every rank computes it, collectively). Pending host optimizer
/// updates run first, so it sees the step's parameters.
pub fn after_step<B: Backend>(
    cfg: &TrainConfig,
    plan: &CpPlan,
    b: &B,
    mesh: &Mesh<B>,
    decoder: &mut Decoder<B>,
    model: &mut (dyn RankModel<B> + '_),
    step: u32,
) -> Result<Option<EvalReport>> {
    let Some(ev) = cfg.eval.as_ref() else {
        return Ok(None);
    };
    if !settle_if_due(cfg, ev.every, b, model, step)? {
        return Ok(None);
    }
    let ecfg = ev.eval_config(cfg);
    let win = ecfg.windows(&ev.data)?;
    let ranges = ecfg.bucket_ranges(win.seq);
    let groups = ranges.len();
    b.ledger().enter("eval");
    let report = eval_windows(
        b,
        mesh,
        plan,
        EvalData {
            data: Some(&ev.data),
            pack: ecfg.pack,
            win: &win,
        },
        &ranges,
        |window, ids, tg, rows| {
            decoder.set_window(b, &window.doc_starts)?;
            let rows = LossRows {
                ids,
                targets: tg,
                group_of_row: rows,
                groups,
            };
            model.forward_loss(b, decoder, mesh, rows)
        },
    )?;
    Ok(Some(report))
}

/// Whether an evaluation every `every` steps runs after step `step` (it
/// is due, and the run is not a rehearsal, which computes nothing to
/// evaluate); when it does, the pending host optimizer updates run first,
/// so it sees the step's parameters.
pub(crate) fn settle_if_due<B: Backend>(
    cfg: &TrainConfig,
    every: u32,
    b: &B,
    model: &mut (dyn RankModel<B> + '_),
    step: u32,
) -> Result<bool> {
    if !due(every, step, cfg.steps) || cfg.rehearse {
        return Ok(false);
    }
    model.settle(b)?;
    Ok(true)
}

/// Checks the run's evaluation, if any, before anything is allocated
/// ([`EvalDuring::check`]).
pub fn check(cfg: &TrainConfig) -> Result<()> {
    cfg.eval.as_ref().map_or(Ok(()), |ev| ev.check(cfg))
}
