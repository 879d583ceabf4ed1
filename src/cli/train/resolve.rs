//! Every `auto` of a built run resolved as it will use it: the request to
//! the planner's resolver ([`run_request`]), and what it decided taken into
//! the run.

use super::args::{FsdpMode, TrainArgs};
use super::built::Built;
use super::mesh::MeshChoice;
use super::preflight;
use crate::error::Result;
use crate::plan::preflight::planned_host;
use crate::plan::{
    Depth, DeviceKind, Prediction, RankBudget, ResolvedRun, RunRequest, StageChoices, resolve_run,
};
use crate::train::trainer::TrainConfig;

impl Built {
    /// Every `auto` of the run resolved as it will use it (the one
    /// resolver, [`resolve_run`]: FSDP, offload, kept attention, backward
    /// stages, optimizer offload, forward stages); the planner's prediction
    /// of rank 0's step.
    pub(super) fn resolve(&mut self, a: &TrainArgs) -> Result<Prediction> {
        let world = self.shape.world_size();
        self.budget =
            preflight::memory_per_rank(self.on_gpu(), world, self.gpus, self.host_available);
        if self.lead {
            // a killed run's half-moved save finished, so `resume_dir` sees it;
            // the trainer takes the directory again for the run
            drop(self.cfg.take_save_dir()?);
        }
        let sharded_resume = self
            .cfg
            .resume_dir()
            .is_some_and(|d| crate::checkpoint::sharded::is_sharded(&d));
        let host = match self.on_gpu() {
            true => preflight::host_per_rank(self, a.host_mem)?.map(planned_host),
            false => None,
        };
        let kind = self.device_kind();
        let budget = RankBudget {
            memory: self.budget,
            ledger: self.budget.map(|b| kind.ledger_budget(b)),
            host,
        };
        let mut request = run_request(a, &self.cfg, self.fsdp, kind, budget);
        request.sharded_resume = sharded_resume;
        let resolved = resolve_run(&request, Depth::Run)?;
        self.apply(&resolved)?;
        match self.plan.layout.pr {
            1 => Ok(resolved.prediction),
            _ => crate::plan::predict_step_rank(&self.spec(&self.plan), 0),
        }
    }

    /// Takes what the resolver decided into the run's config and plan,
    /// saying what it decided.
    fn apply(&mut self, resolved: &ResolvedRun) -> Result<()> {
        if self.lead {
            if let Some(note) = &resolved.fsdp_note {
                tracing::warn!("{note}");
            }
            for note in &resolved.notes {
                tracing::info!("{note}");
            }
        }
        let d = resolved.decisions;
        self.cfg.fsdp = d.fsdp;
        self.cfg.fsdp_replicas = resolved.spec.fsdp_replicas;
        self.cfg.policy = d.policy;
        self.cfg.optim.state = resolved.spec.state;
        self.cfg.chunk_heads = d.chunk_heads;
        self.cfg.fwd_chunk_heads = d.fwd_chunk_heads;
        self.plan = resolved.spec.plan.clone();
        // checks the shard groups of --fsdp-replicate against the mesh
        self.cfg.plan()?;
        self.shape = self.cfg.mesh_shape(&self.plan);
        Ok(())
    }
}

/// The resolver's request for the run `cfg`, built from the flags `a`
/// (its `--fsdp` parsed as `fsdp`), on `device` with `budget` per rank:
/// what `upipe train` decides its `auto` choices from ([`resolve_run`]).
pub fn run_request(
    a: &TrainArgs,
    cfg: &TrainConfig,
    fsdp: FsdpMode,
    device: DeviceKind,
    budget: RankBudget,
) -> RunRequest {
    RunRequest {
        model: cfg.model.clone(),
        strategy: cfg.strategy,
        mesh: MeshChoice {
            data: cfg.data_parallel,
            ulysses: cfg.ulysses,
            ring: cfg.ring,
        },
        seq: cfg.seq,
        stages: StageChoices {
            chunk_heads: a.mesh.chunk_heads,
            fwd: a.fwd.fwd_chunk_heads,
            ..StageChoices::default()
        },
        fsdp,
        fsdp_replicas: a.fsdp_replicate,
        sharded_resume: false,
        grad_accum: cfg.grad_accum,
        memory: a.memory.choices(),
        freeze: cfg.freeze.clone(),
        lora: cfg.lora.as_ref().map(|l| l.config.clone()),
        device,
        budget,
        state: cfg.optim.state,
        state_auto: a.state_auto(),
        precision: cfg.precision,
    }
}
