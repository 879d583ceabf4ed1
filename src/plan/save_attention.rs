//! `--save-attention N|all|none|auto`: which checkpointed blocks keep their
//! attention output and LSEs from forward (auto: as many as fit).

use super::predict::predict_step;
use super::step::StepSpec;
use crate::error::Result;
use crate::model::MemoryPolicy;

/// `--save-attention`: which checkpointed blocks keep their attention output
/// O and LSEs from forward, so that their backward skips the attention
/// forward (the last blocks: [`MemoryPolicy::save_attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveAttention {
    /// As many as fit the device budget beside everything else
    /// ([`save_attention_auto`]); none without checkpointing.
    Auto,
    /// Every block.
    All,
    /// The last N blocks (`none`: 0).
    Blocks(usize),
}

impl std::fmt::Display for SaveAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SaveAttention::Auto => f.write_str("auto"),
            SaveAttention::All => f.write_str("all"),
            SaveAttention::Blocks(0) => f.write_str("none"),
            SaveAttention::Blocks(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for SaveAttention {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(SaveAttention::Auto),
            "all" => Ok(SaveAttention::All),
            "none" => Ok(SaveAttention::Blocks(0)),
            n => n.parse().map(SaveAttention::Blocks).map_err(|_| {
                crate::Error::Config(format!(
                    "--save-attention {n}: use none, all, a number of blocks, or auto"
                ))
            }),
        }
    }
}

impl SaveAttention {
    /// Checks a number or `all` against `policy` and a model of `layers`
    /// blocks, before any budget is known: without checkpointing, or above
    /// the model's blocks, it is an error naming the fix.
    pub fn check(self, policy: MemoryPolicy, layers: usize) -> Result<()> {
        let n = match self {
            SaveAttention::Auto => 0,
            SaveAttention::All => layers,
            SaveAttention::Blocks(n) => n,
        };
        MemoryPolicy {
            save_attention: n,
            ..policy
        }
        .check_save_attention(&self.to_string(), Some(layers))
    }

    /// The number of blocks that keep their attention state in a step of
    /// `spec` (its `policy.save_attention` is ignored) when the ledger may
    /// use `budget` bytes per rank (`None`: unknown, and `auto` keeps none;
    /// [`DeviceKind::ledger_budget`] turns a device's memory into this).
    /// Errors as [`check`](Self::check).
    pub fn resolve(self, spec: &StepSpec, budget: Option<usize>) -> Result<usize> {
        let layers = spec.model.layers;
        self.check(spec.policy, layers)?;
        Ok(match self {
            SaveAttention::Auto if !spec.policy.checkpoint => 0,
            SaveAttention::Auto => budget.map_or(Ok(0), |b| save_attention_auto(spec, b))?,
            SaveAttention::All => layers,
            SaveAttention::Blocks(n) => n,
        })
    }
}

/// The most blocks (the last ones) that can keep their attention output and
/// LSEs under checkpointing with the step's predicted peak within `budget`
/// bytes per rank ([`Prediction::rank_bytes`]: on the CPU the offloaded
/// bytes count too, as in `upipe train`'s preflight): from 0 (when even that does not fit; the caller
/// decides what then) to every block. `spec.policy.save_attention` is
/// ignored. Each kept block adds its O and LSEs from its forward to its
/// backward and removes the transients of its attention recompute, so the
/// peak grows with the count; the search bisects on that, and the count it
/// returns has been predicted to fit. It counts only blocks whose backward
/// runs: at most those from [`StepSpec::backward_floor`] up.
pub fn save_attention_auto(spec: &StepSpec, budget: usize) -> Result<usize> {
    if !spec.policy.checkpoint {
        return Ok(0);
    }
    let peak = |n: usize| -> Result<usize> {
        let mut s = spec.clone();
        s.policy.save_attention = n;
        Ok(predict_step(&s)?.rank_bytes(spec.device))
    };
    let useful = spec.model.layers - spec.backward_floor();
    if peak(useful)? <= budget {
        return Ok(useful);
    }
    // peak(lo) fits (or lo is 0), peak(hi) does not
    let (mut lo, mut hi) = (0, useful);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if peak(mid)? <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}
