//! Buffer shapes of the staged attention engine, shared by the engine and
//! the planner.
//!
//! The staged attention engine (`attention::staged`) and the memory planner
//! take the shapes of their buffers from here (the RoPE tables' from
//! `attention::rope`, re-exported here), so the planner's byte counts are
//! the engine's own sizes, not a second description kept in sync by hand.

pub use super::rope::rope_table;
use super::schedule::StageSchedule;
use super::{AttnDims, CpPlan};

/// Shapes of one rank's staged attention layer under a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageShapes {
    /// Local tokens of this rank (`seq / (pu * pr)`).
    pub s: usize,
    /// Tokens a rank attends over after the Ulysses exchange (`seq / pr`).
    pub n: usize,
    pub pu: usize,
    pub pr: usize,
    /// Query heads per rank per stage.
    pub u: usize,
    /// Kv heads per rank per phase.
    pub m: usize,
    pub head_dim: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hidden: usize,
}

impl StageShapes {
    /// The shapes of `plan`'s (backward) stages for a layer of `dims`.
    pub fn new(plan: &CpPlan, dims: &AttnDims) -> Self {
        Self::of(&plan.schedule, plan, dims)
    }

    /// The shapes of `plan`'s forward stages (`CpPlan::fwd_schedule`).
    pub fn forward(plan: &CpPlan, dims: &AttnDims) -> Self {
        Self::of(&plan.fwd_schedule, plan, dims)
    }

    fn of(schedule: &StageSchedule, plan: &CpPlan, dims: &AttnDims) -> Self {
        StageShapes {
            s: plan.layout.local_len(),
            n: plan.layout.shard_len(),
            pu: plan.layout.pu,
            pr: plan.layout.pr,
            u: schedule.u(),
            m: schedule.m(),
            head_dim: dims.head_dim,
            heads: dims.heads,
            kv_heads: dims.kv_heads,
            hidden: dims.hidden,
        }
    }

    /// A buffer of `nh` heads per destination rank, packed by destination:
    /// `[pu * s, nh, d]`. After the all-to-all the same shape is `[n, nh, d]`.
    pub fn packed(&self, nh: usize) -> [usize; 3] {
        [self.pu * self.s, nh, self.head_dim]
    }

    /// The saved attention output in canonical head order: `[s, H, d]`.
    pub fn saved_o(&self) -> [usize; 3] {
        [self.s, self.heads, self.head_dim]
    }

    /// The layer's input, output and input gradient: `[s, hidden]`.
    pub fn layer_io(&self) -> [usize; 2] {
        [self.s, self.hidden]
    }

    /// One stage's LSE (F32): `[n, u]`.
    pub fn stage_lse(&self) -> [usize; 2] {
        [self.n, self.u]
    }

    /// Whether a projection for `nh` heads per destination runs as one GEMM
    /// over stacked weight rows (its `[s, pu * nh * d]` result then copied
    /// into the packed blocks) instead of one GEMM per destination. Merging
    /// saves `pu - 1` reads of the `[s, hidden]` input and costs one write and
    /// one read of the result, so it pays for small stages. (A strided batch
    /// of GEMMs that writes the packed blocks directly, with the input shared,
    /// still reads the input once per destination: on 2×H200 at 128K its
    /// 2×(65536×128×4096) took 0.31 ms against 0.23 ms for the merged GEMM,
    /// more than the copies it saves; RESULTS.md.)
    pub fn merge_destinations(&self, nh: usize) -> bool {
        self.pu > 1 && 2 * self.pu * nh * self.head_dim < (self.pu - 1) * self.hidden
    }

    /// The `[hidden, nh * d]` weight operands of `nh` heads for every
    /// destination, side by side: `[hidden, pu * nh * d]` (for weight rows,
    /// the same bytes hold the rows stacked, `[pu * nh * d, hidden]`).
    pub fn stacked_operands(&self, nh: usize) -> [usize; 2] {
        [self.hidden, self.pu * nh * self.head_dim]
    }

    /// One projection over stacked weights before it is packed: `[s, pu * nh * d]`.
    pub fn stacked_projection(&self, nh: usize) -> [usize; 2] {
        [self.s, self.pu * nh * self.head_dim]
    }

    /// Projection gradients of `nh` heads per destination for this rank's
    /// tokens, side by side for one `dx` GEMM: `[s, pu * nh * d]`.
    pub fn gathered_grads(&self, nh: usize) -> [usize; 2] {
        [self.s, self.pu * nh * self.head_dim]
    }

    /// The weight rows matching [`Self::gathered_grads`]: `[pu * nh * d, hidden]`.
    pub fn gathered_weights(&self, nh: usize) -> [usize; 2] {
        [self.pu * nh * self.head_dim, self.hidden]
    }

    /// Number of kv phases and stages per phase of a schedule.
    pub fn phases_and_stages(s: &StageSchedule) -> (usize, usize) {
        (s.phases.len(), s.phases[0].stages.len())
    }
}
