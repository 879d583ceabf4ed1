//! The staged engine's schedule flags, shared by `bench attn` and `plan`.

use crate::attention::{CpPlan, Settle, Strategy};

/// How the staged engine orders its work (`--overlap`, `--settle-every`).
#[derive(clap::Args, Debug, Clone)]
pub struct ScheduleArgs {
    /// Run transfers beside attention: each next stage's projections and
    /// exchanges before the current stage's attention, each stage's output and
    /// gradients back beside the next one's. Costs a stage and a kv phase of
    /// buffers; slower on 2×H200 with NCCL today (its transfer kernels compete
    /// with attention for SMs; docs/multi-gpu.md).
    #[arg(long)]
    pub overlap: bool,
    /// When backward takes in query gradients: every `stage` (least
    /// memory), every N stages, or once per kv `phase` (one dx GEMM and one
    /// dW GEMM per destination: fewest, largest GEMMs, holding the phase's dQ;
    /// docs/attention-memory.md).
    #[arg(long, default_value_t = Settle::default())]
    pub settle_every: Settle,
}

impl ScheduleArgs {
    /// `plan` with this schedule (`local` has no stages to overlap).
    pub fn apply(&self, plan: CpPlan) -> CpPlan {
        let staged = plan.strategy != Strategy::Local;
        plan.with_overlap(self.overlap && staged)
            .with_settle(self.settle_every)
    }
}
