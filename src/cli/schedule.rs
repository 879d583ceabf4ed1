//! The staged engine's schedule flags, shared by `bench attn` and `plan`.

use crate::attention::{CpPlan, Settle, Strategy};
use crate::error::Result;

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
    /// UPipe: run the forward in stages of this many heads (a multiple of
    /// --chunk-heads that keeps every rank's query heads; the error lists
    /// the valid values). The backward holds more buffers than the forward,
    /// so wider forward stages make fewer, larger attention calls without
    /// raising the peak while the forward stays below the backward (`upipe
    /// plan` and `bench attn` predict the peak with it). Default: --chunk-heads.
    #[arg(long)]
    pub fwd_chunk_heads: Option<usize>,
}

impl ScheduleArgs {
    /// `plan` with this schedule (`local` has no stages to overlap; only
    /// `upipe` has forward stages to widen).
    pub fn apply(&self, plan: CpPlan) -> Result<CpPlan> {
        let staged = plan.strategy != Strategy::Local;
        let fwd_chunk = self
            .fwd_chunk_heads
            .filter(|_| plan.strategy == Strategy::Upipe);
        plan.with_overlap(self.overlap && staged)
            .with_settle(self.settle_every)
            .with_fwd_chunk(fwd_chunk)
    }
}
