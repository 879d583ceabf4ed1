//! A built run trained where its route says.

use super::built::Built;
use super::route::{self, Route};
use crate::data::Mixture;
use crate::error::Result;
use crate::train::trainer::{StepReport, TrainSummary, train_cpu, train_process_rank};

/// Trains where the route says, calling `on_step` after every step.
pub(super) fn execute(
    run: &Built,
    data: Mixture,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    match run.route {
        Route::ProcessRank => {
            let env = run
                .env
                .as_ref()
                .expect("a launched run has its environment");
            train_process_rank(&run.cfg, data, env, run.kernel, on_step)
        }
        Route::GpuThreads { gpus, .. } => {
            route::train_on_gpus(&run.cfg, data, gpus, run.kernel, on_step)
        }
        _ => train_cpu(&run.cfg, data, on_step),
    }
}
