//! `--checkpoint-every k|auto`: segment checkpointing (`model::segments`),
//! one kept block input every k blocks, and `auto`'s order of trial, the
//! fewest recomputed blocks first (the predictions it weighs are
//! `resolve::checkpoint_every_auto`'s).

use crate::error::Result;
use crate::model::MemoryPolicy;

/// The `--checkpoint-every` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointEvery {
    /// The segments with the fewest recomputed blocks whose step fits the
    /// budgets (`resolve::checkpoint_every_auto`).
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
}

/// The segment lengths worth trying for a `policy` over `layers` blocks
/// whose backward stops after block `floor`, fastest first: by the block
/// forwards their backward recomputes
/// ([`Segments::recomputed_blocks`](crate::model::segments::Segments::recomputed_blocks)),
/// then the shorter. A length of all the trained blocks or more is one
/// segment, which keeps every input as 1 does: only 1 stands for those.
pub fn every_candidates(policy: MemoryPolicy, layers: usize, floor: usize) -> Vec<usize> {
    let trained = layers - floor.min(layers);
    let mut ks: Vec<usize> = std::iter::once(1).chain(2..trained).collect();
    ks.sort_by_key(|&k| {
        let p = MemoryPolicy {
            checkpoint_every: k,
            ..policy
        };
        (p.segments(layers, floor).recomputed_blocks(), k)
    });
    ks
}

/// Of `candidates` in order, the first whose step `misses` its budgets by
/// no byte; when none fits, the one that misses by the fewest (the first
/// of equals), so that the preflight reports the closest run; 1 for none.
pub fn first_fitting(
    candidates: &[usize],
    mut misses: impl FnMut(usize) -> Result<usize>,
) -> Result<usize> {
    let mut closest: Option<(usize, usize)> = None;
    for &k in candidates {
        let over = misses(k)?;
        if over == 0 {
            return Ok(k);
        }
        if closest.is_none_or(|(_, o)| over < o) {
            closest = Some((k, over));
        }
    }
    Ok(closest.map_or(1, |(k, _)| k))
}
