//! A run built from its flags, up to the moment it trains ([`Built`]):
//! its config, plan, mesh and route, and how it reads in messages.

use super::args::FsdpMode;
use super::route::Route;
use crate::attention::CpPlan;
use crate::backend::cuda::cudnn::AttnKernel;
use crate::comm::MeshShape;
use crate::comm::env::DistEnv;
use crate::plan::DeviceKind;
use crate::train::trainer::TrainConfig;

/// A run built from its flags, up to the moment it trains.
pub(super) struct Built {
    pub(super) cfg: TrainConfig,
    pub(super) plan: CpPlan,
    pub(super) shape: MeshShape,
    pub(super) route: Route,
    pub(super) kernel: AttnKernel,
    pub(super) fsdp: FsdpMode,
    pub(super) env: Option<DistEnv>,
    pub(super) gpus: usize,
    /// Memory each rank has (`None`: unknown), set by [`Built::resolve`].
    pub(super) budget: Option<usize>,
    /// The host's `MemAvailable` as the run read it at start, once: every
    /// host budget of the run derives from this one reading.
    pub(super) host_available: Option<usize>,
    /// Whether this process reports (under a launch only rank 0 does).
    pub(super) lead: bool,
}

impl Built {
    /// `llama3-8b (8030.26M params)`.
    pub(super) fn model_text(&self) -> String {
        let m = &self.cfg.model;
        format!("{} ({:.2}M params)", m.name, m.param_count() as f64 / 1e6)
    }

    /// Where and how the ranks run: `upipe on 4 CPU thread ranks (data 1 x
    /// ulysses 2 x ring 2; attention stages of 2 heads, forward 4), seq 256`.
    pub(super) fn layout_text(&self) -> String {
        let where_ = match self.route {
            Route::ProcessRank => "GPU process ranks (NCCL)",
            Route::GpuThreads { .. } => "GPU thread ranks",
            _ => "CPU thread ranks",
        };
        let (u, uf) = (self.plan.schedule.chunk, self.plan.fwd_schedule.chunk);
        let stages = match u == uf {
            true => format!("attention stages of {u} heads"),
            false => format!("attention stages of {u} heads, forward {uf}"),
        };
        format!(
            "{} on {} {where_} (data {} x ulysses {} x ring {}; {stages}), seq {}",
            self.cfg.strategy,
            self.shape.world_size(),
            self.cfg.data_parallel,
            self.plan.layout.pu,
            self.plan.layout.pr,
            self.cfg.seq
        )
    }

    pub(super) fn on_gpu(&self) -> bool {
        self.route != Route::CpuThreads
    }

    /// The device the planner predicts for: the decided attention kernel's.
    pub(super) fn device_kind(&self) -> DeviceKind {
        DeviceKind::of_kernel(self.cfg.attention_kernel, self.cfg.documents)
    }

    /// The planner's description of a step of `plan` here.
    pub(super) fn spec(&self, plan: &CpPlan) -> crate::plan::StepSpec {
        crate::plan::StepSpec::of_run(&self.cfg, plan, self.device_kind())
    }
}
