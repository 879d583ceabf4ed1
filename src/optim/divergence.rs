//! What a run does when a step's loss or gradient norm is not finite: the
//! optimizer has already left the weights and its state as they were
//! (`optim::Update::applies`); this guard counts such steps and stops the
//! run once more than `--skip-nonfinite` of them happened, so a diverged
//! run never goes on to save a model over its last good checkpoint.

use super::optimizer::Update;
use crate::error::{Error, Result};
use std::path::PathBuf;

/// Counts a run's non-finite steps against what it may skip.
#[derive(Debug, Clone)]
pub struct DivergenceGuard {
    /// Non-finite steps the run may skip before it stops.
    allowed: u32,
    /// Non-finite steps so far.
    skipped: u32,
    /// Where checkpoints go, and the step of the last one there.
    save_dir: Option<PathBuf>,
    last_saved: Option<u32>,
    /// Whether this rank logs the skipped steps (rank 0).
    lead: bool,
}

impl DivergenceGuard {
    /// A guard for a run that may skip `allowed` steps, saving into
    /// `save_dir`, whose last checkpoint there is of `last_saved` (a resumed run's).
    pub fn new(allowed: u32, save_dir: Option<PathBuf>, last_saved: Option<u32>) -> Self {
        DivergenceGuard {
            allowed,
            skipped: 0,
            save_dir,
            last_saved,
            lead: true,
        }
    }

    /// The same guard on a rank that does not log (every rank but rank 0).
    pub fn quiet(self, quiet: bool) -> Self {
        DivergenceGuard {
            lead: !quiet,
            ..self
        }
    }

    /// Non-finite steps skipped so far.
    pub fn skipped(&self) -> u32 {
        self.skipped
    }

    /// Takes the outcome of `step`: counts it if it was not applied, and
    /// stops the run (an error naming the step, the last checkpoint and the
    /// usual causes) once more steps were not applied than allowed.
    pub fn after_step(&mut self, step: u32, loss: f64, update: &Update) -> Result<()> {
        if update.applied {
            return Ok(());
        }
        self.skipped += 1;
        if self.skipped <= self.allowed {
            if !self.lead {
                return Ok(());
            }
            tracing::warn!(
                "step {step}: loss {loss}, gradient norm {}: not applied ({} of --skip-nonfinite {} skipped)",
                update.grad_norm,
                self.skipped,
                self.allowed
            );
            return Ok(());
        }
        Err(Error::Diverged(self.message(step, loss, update.grad_norm)))
    }

    /// Records that the checkpoint of `step` was saved.
    pub fn saved(&mut self, step: u32) {
        self.last_saved = Some(step);
    }

    fn message(&self, step: u32, loss: f64, grad_norm: f64) -> String {
        let checkpoint = match (&self.save_dir, self.last_saved) {
            (Some(dir), Some(s)) => format!(
                "the last checkpoint, of step {s}, is in {} (continue from it with --resume)",
                dir.display()
            ),
            (Some(dir), None) => format!("no checkpoint was saved into {} yet", dir.display()),
            (None, _) => "no --save-dir was given, so nothing was saved".to_string(),
        };
        let skipped = match self.allowed {
            0 => String::new(),
            n => format!(" after {n} skipped step(s) (--skip-nonfinite {n})"),
        };
        format!(
            "step {step}: the loss is {loss} and the gradient norm {grad_norm}{skipped}; the update \
             was not applied and nothing was saved; {checkpoint}. Usual causes: a learning rate \
             too high for the model (lower --lr, or a longer --warmup), or bad data (ids beyond \
             the vocabulary, a corrupt file); --skip-nonfinite N skips up to N such steps"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(applied: bool) -> Update {
        Update {
            lr: 1e-3,
            grad_norm: if applied { 1.0 } else { f64::NAN },
            applied,
        }
    }

    #[test]
    fn stops_after_the_allowed_skips_naming_the_last_checkpoint() {
        let mut g = DivergenceGuard::new(1, Some("runs/a".into()), None);
        g.after_step(1, 2.0, &update(true)).unwrap();
        g.saved(1);
        g.after_step(2, f64::NAN, &update(false)).unwrap();
        assert_eq!(g.skipped(), 1);
        let e = g.after_step(3, f64::INFINITY, &update(false)).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("step 3") && e.contains("of step 1") && e.contains("runs/a"),
            "{e}"
        );
        assert!(e.contains("--lr") && e.contains("--skip-nonfinite"), "{e}");
    }

    #[test]
    fn with_none_allowed_the_first_non_finite_step_stops() {
        let mut g = DivergenceGuard::new(0, None, None);
        let e = g
            .after_step(5, f64::NAN, &update(false))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no --save-dir"), "{e}");
        assert!(Update::applies(true, 0.5));
        assert!(!Update::applies(false, 0.5) && !Update::applies(true, f64::INFINITY));
    }
}
