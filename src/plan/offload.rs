//! `--offload`: how many blocks (the first ones) keep their checkpointed
//! input in host memory, and `auto`, the fewest that make a step fit.

use super::{StepSpec, predict_step};
use crate::error::Result;

/// The `--offload` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadBlocks {
    /// The fewest blocks that make the step fit the device budget (or, when
    /// none do, the most the host budget holds): [`offload_auto`].
    Auto,
    /// Every block.
    All,
    /// The first N blocks (`none`: 0).
    Blocks(usize),
}

impl std::fmt::Display for OffloadBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OffloadBlocks::Auto => f.write_str("auto"),
            OffloadBlocks::All => f.write_str("all"),
            OffloadBlocks::Blocks(0) => f.write_str("none"),
            OffloadBlocks::Blocks(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for OffloadBlocks {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(OffloadBlocks::Auto),
            "all" | "true" => Ok(OffloadBlocks::All),
            "none" | "false" => Ok(OffloadBlocks::Blocks(0)),
            n => n.parse().map(OffloadBlocks::Blocks).map_err(|_| {
                crate::Error::Config(format!(
                    "--offload {n}: use all (the flag alone), a number of blocks, auto, or none"
                ))
            }),
        }
    }
}

impl OffloadBlocks {
    /// The blocks offloaded in a step of `spec` (its `policy.offload` is
    /// ignored) with `budget` device bytes per rank and `host` bytes of host
    /// memory per rank (`None`: unknown; `auto` then offloads nothing).
    /// A number above the model's blocks, or any offload without
    /// checkpointing, is an error naming the fix.
    pub fn resolve(
        self,
        spec: &StepSpec,
        budget: Option<usize>,
        host: Option<usize>,
    ) -> Result<usize> {
        let layers = spec.model.layers;
        let n = match self {
            OffloadBlocks::Auto if !spec.policy.checkpoint => 0,
            OffloadBlocks::Auto => budget.map_or(Ok(0), |b| offload_auto(spec, b, host))?,
            OffloadBlocks::All => layers,
            OffloadBlocks::Blocks(n) => n,
        };
        let mut policy = spec.policy;
        policy.offload = n;
        policy.validate_for(layers)?;
        Ok(n)
    }
}

/// The fewest blocks whose offload brings the step's predicted device peak
/// within `budget` (0 when it fits already); when even every block does
/// not, the most blocks whose host peak stays within `host` (all when that
/// is unknown), so the preflight reports the closest run. Each offloaded
/// block moves one `[s, hidden]` input off the device, so the device peak
/// falls and the host peak grows with the count: both searches bisect.
pub fn offload_auto(spec: &StepSpec, budget: usize, host: Option<usize>) -> Result<usize> {
    let layers = spec.model.layers;
    let at = |n: usize| {
        let mut s = spec.clone();
        s.policy.offload = n;
        predict_step(&s)
    };
    if at(0)?.rank_bytes(spec.device) <= budget {
        return Ok(0);
    }
    if at(layers)?.rank_bytes(spec.device) <= budget {
        // at(lo) does not fit, at(hi) does
        let (mut lo, mut hi) = (0, layers);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if at(mid)?.rank_bytes(spec.device) <= budget {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        return Ok(hi);
    }
    let Some(host) = host else {
        return Ok(layers);
    };
    // at(lo) fits the host (or lo is 0), at(hi) does not
    if at(layers)?.host_peak <= host {
        return Ok(layers);
    }
    let (mut lo, mut hi) = (0, layers);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if at(mid)?.host_peak <= host {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}
