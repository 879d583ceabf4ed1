//! How wide UPipe's stages are, as `train`, `plan`, `eval` and `bench`
//! take it: `auto` or a number of heads (`--chunk-heads`,
//! `--fwd-chunk-heads`), with its text form for flags and run files.

use crate::attention::CpPlan;
use crate::error::Result;
use std::fmt;
use std::str::FromStr;

/// `--chunk-heads`: UPipe's heads per (backward) stage U, a number or, on
/// `train` and `plan`, `auto` (their default): the widest stages whose
/// predicted peak fits each rank's memory beside what the run already decided
/// (offload, kept attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkHeads {
    Auto,
    Heads(usize),
}

impl ChunkHeads {
    /// The fixed U of `chunk` for a subcommand that cannot choose one
    /// (`None`: U = Pu); `auto` is an error naming `train`.
    pub fn fixed(chunk: Option<ChunkHeads>, command: &str) -> Result<Option<usize>> {
        match chunk {
            Some(ChunkHeads::Heads(n)) => Ok(Some(n)),
            None => Ok(None),
            Some(ChunkHeads::Auto) => crate::config_err!(
                "--chunk-heads auto is chosen by `upipe train` from the memory it has \
                 (`upipe plan` shows its pick); `upipe {command}` needs a number \
                 (default: the Ulysses degree)"
            ),
        }
    }

    /// The U a run starts from: the number, or for `auto` (and by default) Pu.
    pub fn start(chunk: Option<ChunkHeads>) -> Option<usize> {
        match chunk {
            Some(ChunkHeads::Heads(n)) => Some(n),
            _ => None,
        }
    }
}

/// `--fwd-chunk-heads`: `auto` or a number of heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FwdChunk {
    /// The widest forward stages that keep the planned peak
    /// ([`widest_free_forward`]).
    #[default]
    Auto,
    Heads(usize),
}

impl FwdChunk {
    /// `plan` with its forward stages set: `auto` asks `peak` (the planner's
    /// prediction for the run) which widths are free; a number applies to
    /// UPipe plans only, so one flag serves a run of several strategies.
    pub fn apply(self, plan: CpPlan, peak: impl Fn(&CpPlan) -> Result<usize>) -> Result<CpPlan> {
        match self {
            // the prediction only picks a speed-up: without one, run F = U
            FwdChunk::Auto => widest_free_forward(plan.clone(), peak).or_else(|e| {
                tracing::warn!("--fwd-chunk-heads auto: no prediction ({e}); forward stages = U");
                Ok(plan)
            }),
            FwdChunk::Heads(n) if plan.strategy.has_head_stages() => plan.with_fwd_chunk(Some(n)),
            FwdChunk::Heads(_) => Ok(plan),
        }
    }
}

/// `Display` and `FromStr` of a flag that is `auto` or a number of heads.
macro_rules! auto_or_heads_text {
    ($($t:ident),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $t::Auto => f.write_str("auto"),
                    $t::Heads(n) => write!(f, "{n}"),
                }
            }
        }

        impl FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    "auto" => Ok($t::Auto),
                    n => n
                        .parse()
                        .map($t::Heads)
                        .map_err(|_| format!("{s}: use auto or a number of heads")),
                }
            }
        }
    )*};
}

auto_or_heads_text!(ChunkHeads, FwdChunk);

/// `plan` with its forward in the widest stages ([`valid_fwd_chunks`]) whose
/// `peak` is no higher than with forward stages equal to the backward's:
/// fewer, larger attention calls at no memory cost (`--fwd-chunk-heads
/// auto`). `peak` is the planner's prediction for the run at hand (the
/// attention trial, or a training step under its policy). Plans other than
/// UPipe come back unchanged.
///
/// [`valid_fwd_chunks`]: crate::attention::schedule::valid_fwd_chunks
pub fn widest_free_forward(
    plan: CpPlan,
    peak: impl Fn(&CpPlan) -> Result<usize>,
) -> Result<CpPlan> {
    if !plan.strategy.has_head_stages() {
        return Ok(plan);
    }
    let chunk = plan.schedule.chunk;
    let plan = plan.with_fwd_chunk(Some(chunk))?;
    let base = peak(&plan)?;
    for c in crate::attention::schedule::valid_fwd_chunks(&plan.schedule)
        .into_iter()
        .rev()
        .filter(|&c| c != plan.schedule.chunk)
    {
        let wide = plan.clone().with_fwd_chunk(Some(c))?;
        if peak(&wide)? <= base {
            return Ok(wide);
        }
    }
    Ok(plan)
}

/// The widest UPipe backward stage U, a multiple of `pu` from `heads` down
/// to `pu`, for which `fits` gives a plan (`Ok(None)`: that width does not
/// fit, or is not a valid stage; `--chunk-heads auto`): `(U, plan)`, or
/// `None` when no width does.
pub fn widest_fitting<T>(
    heads: usize,
    pu: usize,
    mut fits: impl FnMut(usize) -> Result<Option<T>>,
) -> Result<Option<(usize, T)>> {
    let pu = pu.max(1);
    for u in (pu..=heads).rev().filter(|u| u.is_multiple_of(pu)) {
        if let Some(plan) = fits(u)? {
            return Ok(Some((u, plan)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod widest_tests {
    use super::widest_fitting;
    use proptest::prelude::*;

    proptest! {
        /// The answer is the widest multiple of Pu that fits, or none.
        #[test]
        fn widest_fitting_is_the_widest_multiple_of_pu_that_fits(
            heads in 1usize..64, pu in 1usize..9, limit in 0usize..70,
        ) {
            let got = widest_fitting(heads, pu, |u| Ok((u <= limit).then_some(u))).unwrap();
            let want = (pu..=heads).rev().find(|u| u % pu == 0 && *u <= limit);
            prop_assert_eq!(got.map(|(u, _)| u), want);
            if let Some((u, plan)) = got {
                prop_assert_eq!(u, plan);
            }
        }
    }
}
