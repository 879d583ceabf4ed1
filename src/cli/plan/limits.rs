//! The sizes `upipe plan` plans at most (GPUs, tokens, ring ranks), each
//! refused beyond its limit with the fix named; `train` refuses a
//! `--seq` beyond the planner's the same way.

use crate::error::Result;
use crate::plan::MAX_PLANNED_SEQ;

/// Most GPUs `plan` plans for: far beyond any cluster (the largest hold
/// about 10^5 GPUs), and few enough that the lengths derived from them
/// (2 x GPUs x 1024 tokens) stay countable.
const MAX_PLANNED_GPUS: usize = 1 << 24;

/// Refuses `what` (`value` GPUs) beyond [`MAX_PLANNED_GPUS`].
pub(super) fn at_most_planned(what: &str, value: usize) -> Result<()> {
    if value <= MAX_PLANNED_GPUS {
        return Ok(());
    }
    crate::config_err!(
        "{what} is {value}: plan at most {MAX_PLANNED_GPUS} GPUs (no cluster has more); give \
         the GPUs of the run you mean"
    )
}

/// Refuses a length (`flag`) beyond [`MAX_PLANNED_SEQ`], naming the fix.
pub(crate) fn at_most_tokens(flag: &str, seq: usize) -> Result<()> {
    if seq <= MAX_PLANNED_SEQ {
        return Ok(());
    }
    crate::config_err!(
        "{flag} {seq} is longer than the {MAX_PLANNED_SEQ} tokens the planner plans (a step's \
         per-token host vectors grow with the length); give a length of at most {MAX_PLANNED_SEQ}"
    )
}

/// The longest ring `plan` walks. A prediction walks every step of the
/// ring in every layer, so its time grows with the ring degree: the search
/// of the tiny model took 1.6 s at a ring of 8192, 9 s at 65536, and
/// llama3-70b's 6 s at 1024 (2-core machine). No run uses a longer ring:
/// Ulysses and data-parallel replicas take the GPUs beyond it.
const MAX_PLANNED_RING: usize = 4096;

/// Refuses a ring degree beyond [`MAX_PLANNED_RING`], naming the fix.
pub(super) fn check_ring(pr: usize) -> Result<()> {
    if pr <= MAX_PLANNED_RING {
        return Ok(());
    }
    crate::config_err!(
        "a ring of {pr} ranks is longer than the {MAX_PLANNED_RING} the planner plans (its \
         time grows with the ring); plan fewer GPUs per context group: give --data-parallel \
         (replicas) or --ulysses/--ring so that the ring has at most {MAX_PLANNED_RING} ranks"
    )
}
