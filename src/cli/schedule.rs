//! The staged engine's schedule flags, shared by `bench attn` and `plan`
//! (`--fwd-chunk-heads` by `train` too).

use crate::attention::{CpPlan, Settle};
use crate::error::Result;
pub use crate::plan::stage_width::{ChunkHeads, FwdChunk};

/// How the staged engine orders its work (`--overlap`, `--settle-every`).
#[derive(clap::Args, Debug, Clone)]
pub struct ScheduleArgs {
    /// Run transfers beside attention: each next stage's projections and
    /// exchanges before the current stage's attention, each stage's output and
    /// gradients back beside the next one's. Costs a stage and a kv phase of
    /// buffers; slower on 2×H200 with NCCL today (its transfer kernels compete
    /// with attention for SMs; docs/strategies.md).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub overlap: bool,
    /// When backward takes in query gradients: every `stage` (least
    /// memory), every N stages, or once per kv `phase` (one dx GEMM and one
    /// dW GEMM per destination: fewest, largest GEMMs, holding the phase's dQ;
    /// docs/strategies.md).
    #[arg(long, default_value_t = Settle::default())]
    pub settle_every: Settle,
    #[command(flatten)]
    pub fwd: FwdChunkArgs,
}

/// `--fwd-chunk-heads` (also a flag of `train`).
#[derive(clap::Args, Debug, Clone)]
pub struct FwdChunkArgs {
    /// UPipe heads per forward stage: `auto` (the widest whose predicted
    /// peak is no higher than with the backward's stages) or a number (a
    /// multiple of --chunk-heads that is itself a valid stage size, up to
    /// all heads; the error lists the valid values). The backward holds
    /// more buffers than the forward, so wider forward stages make fewer,
    /// larger attention calls, usually at no memory cost.
    #[arg(long, help_heading = "Mesh", default_value_t = FwdChunk::Auto)]
    pub fwd_chunk_heads: FwdChunk,
}

impl FwdChunkArgs {
    crate::cli::config::run_keys! {
        fwd_chunk_heads => parallel.fwd_chunk_heads,
    }
}

impl ScheduleArgs {
    crate::cli::config::run_keys! {
        overlap => parallel.overlap,
        settle_every => parallel.settle_every;
        flatten fwd
    }

    /// `plan` with this schedule (`local` has no stages to overlap; only
    /// `upipe` has forward stages to widen, judged by `peak`: [`FwdChunk::apply`]).
    pub fn apply(&self, plan: CpPlan, peak: impl Fn(&CpPlan) -> Result<usize>) -> Result<CpPlan> {
        let staged = plan.strategy.is_context_parallel();
        let plan = plan
            .with_overlap(self.overlap && staged)
            .with_settle(self.settle_every);
        self.fwd.fwd_chunk_heads.apply(plan, peak)
    }
}
