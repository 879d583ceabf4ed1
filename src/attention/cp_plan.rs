//! The context-parallel strategies ([`Strategy`]) and a strategy resolved
//! for a layer, sequence and mesh ([`CpPlan`]): its layout, stage schedules
//! and overlap.

use super::dims::AttnDims;
use super::layout::SeqLayout;
use super::schedule::{self, StageSchedule};
use super::settle::Settle;
use crate::comm::MeshShape;
use crate::error::Result;
use std::fmt;
use std::str::FromStr;

/// A context-parallel attention strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    Local,
    Ulysses,
    Ring,
    Usp,
    Upipe,
}

impl Strategy {
    pub const ALL: [Strategy; 5] = [
        Strategy::Local,
        Strategy::Ulysses,
        Strategy::Ring,
        Strategy::Usp,
        Strategy::Upipe,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Local => "local",
            Strategy::Ulysses => "ulysses",
            Strategy::Ring => "ring",
            Strategy::Usp => "usp",
            Strategy::Upipe => "upipe",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                crate::Error::Config(format!(
                    "unknown attention strategy '{s}'; use one of local, ulysses, ring, usp, upipe"
                ))
            })
    }
}

/// A strategy resolved for a layer, sequence and context-parallel degree.
#[derive(Debug, Clone, PartialEq)]
pub struct CpPlan {
    pub strategy: Strategy,
    pub layout: SeqLayout,
    pub schedule: StageSchedule,
    /// The forward's stages: the backward's, or wider ones (`--fwd-chunk-heads`)
    /// where every rank keeps its query heads ([`schedule::lse_pieces`]).
    /// The forward holds fewer buffers than the backward, so wider forward
    /// stages can run fewer, larger attention calls under the same peak.
    pub fwd_schedule: StageSchedule,
    /// Issue stage t+1's projections and exchanges before stage t's attention
    /// (one extra stage of buffers) so that an asynchronous backend overlaps
    /// communication with attention. Same results either way.
    pub overlap: bool,
    /// When backward takes in the query gradients: per stage, or per kv
    /// phase (one dx GEMM and per-destination dW GEMMs for the whole phase,
    /// holding the phase's dQ until then). Same results either way.
    pub settle_every: Settle,
}

impl CpPlan {
    /// Resolves `strategy` on `ulysses x ring` ranks (ulysses/ring strategies use all
    /// of them as one group). `chunk_heads` is UPipe's U (default: the Ulysses degree).
    pub fn new(
        strategy: Strategy,
        dims: &AttnDims,
        seq: usize,
        ulysses: usize,
        ring: usize,
        chunk_heads: Option<usize>,
    ) -> Result<Self> {
        dims.validate()?;
        let Some(c) = ulysses.checked_mul(ring) else {
            return crate::config_err!(
                "Ulysses degree {ulysses} x ring degree {ring} is more ranks than can be counted; \
                 give degrees whose product is at most the sequence length"
            );
        };
        let (pu, pr, u) = match strategy {
            Strategy::Local => {
                if c != 1 {
                    return crate::config_err!("the local strategy runs on one rank, not {c}");
                }
                (1, 1, dims.heads)
            }
            Strategy::Ulysses => (c, 1, dims.heads),
            Strategy::Ring => (1, c, dims.heads),
            Strategy::Usp => (ulysses, ring, dims.heads),
            Strategy::Upipe => (ulysses, ring, chunk_heads.unwrap_or(ulysses)),
        };
        if chunk_heads.is_some() && strategy != Strategy::Upipe {
            return crate::config_err!("--chunk-heads applies to upipe only, not {strategy}");
        }
        let schedule = StageSchedule::new(dims.heads, dims.kv_heads, pu, u)?;
        let layout = SeqLayout::new(seq, pu, pr)?;
        Ok(CpPlan {
            strategy,
            layout,
            fwd_schedule: schedule.clone(),
            schedule,
            overlap: false,
            settle_every: Settle::default(),
        })
    }
    /// The same plan running its forward in stages of `fwd_chunk` heads
    /// (`None`: the backward's). UPipe only; the value must be one of
    /// [`schedule::valid_fwd_chunks`], which the error lists.
    pub fn with_fwd_chunk(self, fwd_chunk: Option<usize>) -> Result<Self> {
        let Some(c) = fwd_chunk else {
            return Ok(self);
        };
        if self.strategy != Strategy::Upipe {
            return crate::config_err!(
                "--fwd-chunk-heads applies to upipe only, not {}",
                self.strategy
            );
        }
        let bwd = &self.schedule;
        let fwd = StageSchedule::new(bwd.heads, bwd.kv_heads, bwd.pu, c)
            .and_then(|fwd| schedule::lse_pieces(&fwd, bwd).map(|_| fwd));
        match fwd {
            Ok(fwd_schedule) => Ok(CpPlan {
                fwd_schedule,
                ..self
            }),
            Err(e) => crate::config_err!(
                "--fwd-chunk-heads {c}: {e}; valid values with --chunk-heads {}: {:?}",
                bwd.chunk,
                schedule::valid_fwd_chunks(bwd)
            ),
        }
    }

    /// U as tables print it: `2`, or `2f8` when the forward runs in wider
    /// stages (of 8 heads).
    pub fn chunk_text(&self) -> String {
        let (u, uf) = (self.schedule.chunk, self.fwd_schedule.chunk);
        if u == uf {
            u.to_string()
        } else {
            format!("{u}f{uf}")
        }
    }

    /// The same plan with the stage-prefetch schedule on or off.
    pub fn with_overlap(self, overlap: bool) -> Self {
        CpPlan { overlap, ..self }
    }

    /// The same plan taking in query gradients per stage or per kv phase.
    pub fn with_settle(self, settle: Settle) -> Self {
        CpPlan {
            settle_every: settle,
            ..self
        }
    }

    /// The mesh this plan runs on (one data replica).
    pub fn mesh_shape(&self) -> MeshShape {
        MeshShape {
            data: 1,
            ring: self.layout.pr,
            ulysses: self.layout.pu,
            fsdp_replicas: 1,
        }
    }
}
