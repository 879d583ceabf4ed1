//! `--checkpoint-every k|auto`: segment checkpointing (`model::segments`),
//! one kept block input every k blocks, and `auto`, the fewest recomputed
//! blocks whose step fits.

use super::{OffloadBlocks, StepSpec, predict_step};
use crate::error::Result;
use crate::model::MemoryPolicy;

/// The `--checkpoint-every` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// The segments with the fewest recomputed blocks whose step fits the
    /// budgets ([`checkpoint_every_auto`]).
    Auto,
    /// Segments of k blocks (1: every block keeps its input).
    Blocks(usize),
}

impl Default for CheckpointEvery {
    fn default() -> Self {
        CheckpointEvery::Blocks(1)
    }
}

impl std::fmt::Display for CheckpointEvery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointEvery::Auto => f.write_str("auto"),
            CheckpointEvery::Blocks(k) => write!(f, "{k}"),
        }
    }
}

impl std::str::FromStr for CheckpointEvery {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(CheckpointEvery::Auto),
            k => k.parse().map(CheckpointEvery::Blocks).map_err(|_| {
                crate::Error::Config(format!(
                    "--checkpoint-every {k}: use a number of blocks (1: every block keeps its \
                     checkpointed input) or auto"
                ))
            }),
        }
    }
}

/// The memory a rank has for [`CheckpointEvery::resolve`].
#[derive(Debug, Clone, Copy)]
pub struct EveryBudget {
    /// Bytes the ledger may use per rank (`None`: unknown; `auto` is then 1).
    pub ledger: Option<usize>,
    /// Host bytes for offloaded tensors per rank (`None`: unchecked).
    pub host: Option<usize>,
    /// `--offload` as given, resolved for each k tried (`auto`: the fewest
    /// blocks that fit that k's step).
    pub offload: OffloadBlocks,
}

impl CheckpointEvery {
    /// Checks a number against `policy` before any budget is known: 0, or
    /// more than 1 (or `auto`) without checkpointing, is an error naming
    /// the fix.
    pub fn check(self, policy: MemoryPolicy) -> Result<()> {
        let k = match self {
            CheckpointEvery::Auto if !policy.checkpoint => {
                return crate::config_err!(
                    "--checkpoint-every auto chooses how many blocks share one checkpointed \
                     input: add --checkpoint, or use --checkpoint-every 1"
                );
            }
            CheckpointEvery::Auto => 1,
            CheckpointEvery::Blocks(k) => k,
        };
        MemoryPolicy {
            checkpoint_every: k,
            ..policy
        }
        .check_checkpoint_every(&self.to_string())
    }

    /// The segment length of a step of `spec` (its `policy.checkpoint_every`
    /// and `policy.offload` are ignored) within `budget`. Errors as
    /// [`check`](Self::check).
    pub fn resolve(self, spec: &StepSpec, budget: EveryBudget) -> Result<usize> {
        self.check(spec.policy)?;
        match (self, budget.ledger) {
            (CheckpointEvery::Blocks(k), _) => Ok(k),
            (CheckpointEvery::Auto, None) => Ok(1),
            (CheckpointEvery::Auto, Some(ledger)) => {
                checkpoint_every_auto(spec, ledger, budget.host, budget.offload)
            }
        }
    }
}

/// The segment lengths worth trying for a step of `spec`, fastest first:
/// by the block forwards their backward recomputes
/// ([`Segments::recomputed_blocks`](crate::model::segments::Segments::recomputed_blocks)),
/// then the shorter. A length of all the trained blocks or more is one
/// segment, which keeps every input as 1 does: only 1 stands for those.
pub fn every_candidates(spec: &StepSpec) -> Vec<usize> {
    let (layers, floor) = (spec.model.layers, spec.backward_floor());
    let trained = layers - floor;
    let mut ks: Vec<usize> = std::iter::once(1).chain(2..trained).collect();
    ks.sort_by_key(|&k| {
        let p = MemoryPolicy {
            checkpoint_every: k,
            ..spec.policy
        };
        (p.segments(layers, floor).recomputed_blocks(), k)
    });
    ks
}

/// The fastest segment length whose step fits: of
/// [`every_candidates`] in order, the first whose predicted step, with
/// `offload` resolved for it, fits `ledger` device bytes
/// ([`Prediction::rank_bytes`](super::Prediction::rank_bytes)) and `host`
/// bytes of host memory. When none fits, the one that misses by the fewest
/// bytes (device and host together), so that the preflight reports the
/// closest run. Without checkpointing, 1.
pub fn checkpoint_every_auto(
    spec: &StepSpec,
    ledger: usize,
    host: Option<usize>,
    offload: OffloadBlocks,
) -> Result<usize> {
    if !spec.policy.checkpoint {
        return Ok(1);
    }
    let mut closest: Option<(usize, usize)> = None;
    let over = |s: &StepSpec| -> Result<usize> {
        let p = predict_step(s)?;
        Ok(p.rank_bytes(s.device).saturating_sub(ledger)
            + host.map_or(0, |h| p.host_peak.saturating_sub(h)))
    };
    for k in every_candidates(spec) {
        let mut s = spec.clone();
        s.policy.checkpoint_every = k;
        // a length whose device peak misses with every kept input on the
        // host misses with any `--offload auto` picks: one prediction
        if offload == OffloadBlocks::Auto {
            s.policy.offload = s.model.layers;
            let p = predict_step(&s)?;
            let device = p.rank_bytes(s.device).saturating_sub(ledger);
            if device > 0 {
                if closest.is_none_or(|(_, o)| device < o) {
                    closest = Some((k, device));
                }
                continue;
            }
        }
        s.policy.offload = offload.resolve(&s, Some(ledger), host)?;
        let missed = over(&s)?;
        if missed == 0 {
            return Ok(k);
        }
        if closest.is_none_or(|(_, o)| missed < o) {
            closest = Some((k, missed));
        }
    }
    Ok(closest.map_or(1, |(k, _)| k))
}
