//! A training step's windows as each rank takes them: its rows of every
//! micro-step's [`PackedWindow`], drawn before the step's first forward so
//! that the step's counted targets (the loss's denominator) are known
//! before any backward.

use crate::attention::CpPlan;
use crate::backend::{Backend, Category, DType, IGNORE};
use crate::comm::Mesh;
use crate::data::{MixtureSampler, PackedWindow};
use crate::error::{Error, Result};

/// One micro-step's window on this rank.
pub struct RankWindow {
    /// `[local]` input ids of this rank's rows.
    pub ids: Vec<u32>,
    /// `[local]` targets of this rank's rows; [`IGNORE`] where no loss counts.
    pub targets: Vec<u32>,
    /// Where the window's documents start (the whole window's; `[0]` for one).
    pub doc_starts: Vec<u32>,
}

impl RankWindow {
    /// This rank's rows (`positions`) of `window`.
    pub fn of(window: &PackedWindow, positions: &[usize]) -> Result<RankWindow> {
        window.validate()?;
        Ok(RankWindow {
            ids: positions.iter().map(|&p| window.inputs[p]).collect(),
            targets: positions.iter().map(|&p| window.targets[p]).collect(),
            doc_starts: window.doc_starts.clone(),
        })
    }

    /// The rank's targets that count toward the loss.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }
}

/// This rank's rows of the step's `grad_accum` windows. A rehearsal reads
/// no data and computes nothing with it: it takes zeros for this rank's
/// rows, every target counted, in one document, or where the run's windows
/// hold several (`documents`) in two (`[0, 1)` and the rest: the attention
/// of a documents mask, with the causal mask's ring blocks).
pub fn draw_step(
    sampler: &mut MixtureSampler,
    plan: &CpPlan,
    positions: &[usize],
    grad_accum: usize,
    (rehearse, documents): (bool, bool),
) -> Result<Vec<RankWindow>> {
    (0..grad_accum.max(1))
        .map(|_| {
            if rehearse {
                let n = plan.layout.local_len();
                let two = documents && plan.layout.seq >= 2;
                return Ok(RankWindow {
                    ids: vec![0; n],
                    targets: vec![0; n],
                    doc_starts: if two { vec![0, 1] } else { vec![0] },
                });
            }
            RankWindow::of(&sampler.next_packed(), positions)
        })
        .collect()
}

/// The targets counted toward the loss in the whole step: every rank's rows
/// of every micro-step, summed over the world (ranks of one replica hold
/// disjoint rows). One all-reduce of two F32 words (the count's high and
/// low parts, exact in F32 up to 2^36 targets). A step without one counted
/// target is an error (its loss would be 0/0).
pub fn step_counted<B: Backend>(b: &B, mesh: &Mesh<B>, windows: &[RankWindow]) -> Result<usize> {
    // a rehearsal's windows count every target (`draw_step`), and reading
    // billions of them would cost what the rehearsal saves
    let mine: usize = if b.rehearsing() {
        windows.iter().map(|w| w.targets.len()).sum()
    } else {
        windows.iter().map(RankWindow::counted).sum()
    };
    let parts = [(mine >> 12) as f32, (mine & 0xfff) as f32];
    let mut t = b.from_host(&parts, &[2], DType::F32, Category::Workspace)?;
    mesh.world.all_reduce(&mut t)?;
    if b.rehearsing() {
        return Ok(mine.max(1));
    }
    let sum = b.to_host(&t)?;
    let counted = ((sum[0] as usize) << 12) + sum[1] as usize;
    if counted == 0 {
        return Err(Error::Config(
            "a training step whose windows hold no counted target (every target masked: \
             padding, document ends or SFT prompts); the data gives no loss to train on"
                .into(),
        ));
    }
    Ok(counted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::comm::MeshShape;
    use crate::comm::local::run_ranks;

    fn rows(counted: usize, ignored: usize) -> RankWindow {
        let mut targets = vec![7; counted];
        targets.extend(std::iter::repeat_n(IGNORE, ignored));
        RankWindow {
            ids: vec![1; targets.len()],
            targets,
            doc_starts: vec![0],
        }
    }

    /// The step's count is every rank's counted rows of every micro-step,
    /// exact past F32's 2^24; none at all is an error.
    #[test]
    fn the_step_counts_every_ranks_counted_targets() {
        let shape = MeshShape {
            data: 2,
            ring: 1,
            ulysses: 2,
            fsdp_replicas: 1,
        };
        let counts = run_ranks(shape, CpuBackend::new, |rank, b, mesh| {
            let windows = vec![rows(rank * 5000, 3), rows((1 << 24) + 1, 2)];
            step_counted(b.as_ref(), &mesh, &windows)
        })
        .unwrap();
        let want = 5000 * (1 + 2 + 3) + 4 * ((1 << 24) + 1);
        assert!(counts.iter().all(|&c| c == want), "{counts:?} vs {want}");
        let none = run_ranks(shape, CpuBackend::new, |_, b, mesh| {
            step_counted(b.as_ref(), &mesh, &[rows(0, 4)])
        });
        let err = none.unwrap_err().to_string();
        assert!(err.contains("no counted target"), "{err}");
    }
}
