//! The preflight of `upipe bench attn --device cpu`: before the inputs are
//! drawn, the memory the bench will hold is predicted and held against the
//! host's available memory, as `train`'s preflight holds a run: the inputs
//! and every strategy's kept results (`x`, `dy`, `y`, `dx`: each `seq ×
//! hidden` f32, and the weights with their gradients), and the heaviest
//! strategy's thread ranks, each at the planner's peak for its layer
//! (`plan::predict_attention_trial`, as the table's `predicted` column).

use crate::attention::{AttnDims, CpPlan};
use crate::backend::Bytes;
use crate::error::Result;

/// What a CPU bench holds at its peak, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BenchMemory {
    /// The inputs, and the results kept to compare (every strategy's).
    pub tensors: usize,
    /// The heaviest strategy's ranks at their predicted peak, all of them.
    pub ranks: usize,
    /// Per rank, and how many ranks.
    pub per_rank: usize,
    pub rank_count: usize,
}

impl BenchMemory {
    pub fn total(&self) -> usize {
        self.tensors.saturating_add(self.ranks)
    }
}

/// The memory of a CPU bench of `plans` (the `local` reference among them
/// when it runs), `seq` tokens of `dims`, a rank of each plan at `peak`.
pub fn bench_memory(
    seq: usize,
    dims: &AttnDims,
    plans: &[&CpPlan],
    peak: impl Fn(&CpPlan) -> Result<usize>,
) -> Result<BenchMemory> {
    let f32s = |n: usize| n.saturating_mul(4);
    let activations = f32s(seq.saturating_mul(dims.hidden));
    let weights = f32s(
        (dims.q_width() + 2 * dims.kv_width())
            .saturating_mul(dims.hidden)
            .saturating_add(dims.hidden.saturating_mul(dims.q_width())),
    );
    // x and dy, the weights; then per result y and dx and the weight gradients
    let one_result = activations.saturating_mul(2).saturating_add(weights);
    let tensors = one_result.saturating_mul(plans.len() + 1);
    let mut heaviest = BenchMemory {
        tensors,
        ranks: 0,
        per_rank: 0,
        rank_count: 0,
    };
    for plan in plans {
        let per_rank = peak(plan)?;
        let count = plan.layout.pu * plan.layout.pr;
        let all = per_rank.saturating_mul(count);
        if all >= heaviest.ranks {
            heaviest = BenchMemory {
                ranks: all,
                per_rank,
                rank_count: count,
                ..heaviest
            };
        }
    }
    Ok(heaviest)
}

/// Refuses a bench of `need` beyond `available` bytes (`None`: unknown,
/// not checked), before anything is allocated.
/// `seq` names the length in the message.
pub fn check(seq: usize, need: &BenchMemory, available: Option<usize>) -> Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    if need.total() <= available {
        return Ok(());
    }
    crate::config_err!(
        "bench attn --seq {} cannot fit, so nothing was allocated: it needs about {} of host \
         memory ({} of inputs and results kept to compare, {} on each of {} thread ranks at the \
         planner's peak), but {} is available (MemAvailable); use a shorter --seq or fewer \
         --methods",
        seq,
        Bytes(need.total()),
        Bytes(need.tensors),
        Bytes(need.per_rank),
        need.rank_count,
        Bytes(available)
    )
}
