//! Where returned projection gradients go when a rank takes them in
//! (`Staged::settle`). Pure index math.
//!
//! A settlement holds blocks `[s, nh*d]`, each the gradient of one
//! projection's output for a range of heads (weight rows). They are laid side
//! by side in one `[s, Σ nh*d]` buffer, the matching weight rows stacked the
//! same way, so `dx` is updated by one GEMM. Blocks are ordered by
//! (projection, first head), and neighbours whose heads continue each other
//! form a *run*: one weight-gradient GEMM and one weight-row copy per run
//! instead of per block. A kv phase's query heads for one destination are
//! contiguous across its stages (schedule.rs), so settling a whole phase at
//! once turns its per-stage `M = u*d` weight-gradient GEMMs into one of
//! `M = m*g*d` per destination.

use crate::error::Result;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// When the staged backward takes in returning query gradients
/// (`--settle-every stage|N|phase`); a kv phase's end always takes in
/// everything, its K/V gradients included.
///
/// Each settlement reads and writes `dx` once and runs one weight-gradient
/// GEMM per run of contiguous heads, so fewer settlements mean fewer, larger
/// GEMMs; the price is holding the stages' returned dQ until then. Measured
/// on the Llama3-8B layer (docs/strategies.md, RESULTS.md):
/// one H200 (Pu 1, U 1): `Phase` 2.3-4 % faster than `Stages(1)` at 64K and
/// 128K for 1.5 % more peak; 2×H200 (Pu 2, U 2): `Phase` +1.8 % at 128K and
/// +0.5 % at 256K for 5.6-5.9 % more peak, `Stages(2)` (the default) +1.1 %
/// and 0 % for 1.9 %. With one kv phase per layer (kv heads = Pu) `Phase`
/// holds every head's dQ, as Ulysses does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Every `k ≥ 1` stages of a phase (`Stages(1)`, "stage": least memory).
    Stages(usize),
    /// At the phase's end only.
    Phase,
}

impl Default for Settle {
    fn default() -> Self {
        Settle::Stages(2)
    }
}

impl Settle {
    /// Whether the query gradients in flight are taken in after stage `t`
    /// (0-based, within its phase).
    pub fn after_stage(self, t: usize) -> bool {
        match self {
            Settle::Stages(k) => (t + 1).is_multiple_of(k.max(1)),
            Settle::Phase => false,
        }
    }
}

impl fmt::Display for Settle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Settle::Stages(1) => f.write_str("stage"),
            Settle::Stages(k) => write!(f, "{k}"),
            Settle::Phase => f.write_str("phase"),
        }
    }
}

impl FromStr for Settle {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "stage" => Ok(Settle::Stages(1)),
            "phase" => Ok(Settle::Phase),
            n => match n.parse::<usize>() {
                Ok(k) if k >= 1 => Ok(Settle::Stages(k)),
                _ => Err(crate::Error::Config(format!(
                    "--settle-every {s}: use stage (least memory), a number of stages N >= 1, or phase (fewest, largest gradient GEMMs)"
                ))),
            },
        }
    }
}

/// Which projection a gradient belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proj {
    Q,
    K,
    V,
}

/// Blocks that share one weight-gradient GEMM: `proj`'s weight rows of
/// `heads`, found at head offset `col` of the gathered buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub proj: Proj,
    pub heads: Range<usize>,
    pub col: usize,
}

/// The gathered buffer's layout for one settlement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleLayout {
    /// `col[i]`: head offset of block `i` in the gathered buffer.
    pub col: Vec<usize>,
    /// Maximal runs, in gathered-column order.
    pub runs: Vec<Run>,
    /// Heads in all (the gathered buffer is `[s, width * d]`).
    pub width: usize,
}

/// Lays out `blocks` (projection and heads of each, in arrival order).
pub fn settle_layout(blocks: &[(Proj, Range<usize>)]) -> SettleLayout {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by_key(|&i| (blocks[i].0, blocks[i].1.start, i));
    let mut col = vec![0; blocks.len()];
    let mut runs: Vec<Run> = Vec::new();
    let mut width = 0;
    for i in order {
        let (proj, heads) = &blocks[i];
        col[i] = width;
        match runs.last_mut() {
            Some(r) if r.proj == *proj && r.heads.end == heads.start => r.heads.end = heads.end,
            _ => runs.push(Run {
                proj: *proj,
                heads: heads.clone(),
                col: width,
            }),
        }
        width += heads.len();
    }
    SettleLayout { col, runs, width }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn settle_every_parses_and_counts_stages() {
        assert_eq!("stage".parse::<Settle>().unwrap(), Settle::Stages(1));
        assert_eq!("3".parse::<Settle>().unwrap(), Settle::Stages(3));
        assert_eq!("phase".parse::<Settle>().unwrap(), Settle::Phase);
        for bad in ["0", "-1", "stages", ""] {
            assert!(bad.parse::<Settle>().is_err(), "{bad}");
        }
        for s in [Settle::Stages(1), Settle::Stages(4), Settle::Phase] {
            assert_eq!(s.to_string().parse::<Settle>().unwrap(), s);
        }
        let after = |s: Settle| (0..6).filter(|&t| s.after_stage(t)).collect::<Vec<_>>();
        assert_eq!(after(Settle::Stages(1)), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(after(Settle::Stages(2)), vec![1, 3, 5]);
        assert_eq!(after(Settle::Stages(4)), vec![3]);
        assert!(after(Settle::Phase).is_empty());
    }

    #[test]
    fn a_phase_of_query_stages_merges_per_destination() {
        // 2 destinations, 4 stages of one head each, then K and V of one head.
        let mut blocks = Vec::new();
        for t in 0..4 {
            blocks.push((Proj::Q, t..t + 1));
            blocks.push((Proj::Q, 16 + t..17 + t));
        }
        blocks.extend([(Proj::K, 0..1), (Proj::K, 4..5)]);
        blocks.extend([(Proj::V, 0..1), (Proj::V, 4..5)]);
        let l = settle_layout(&blocks);
        let runs: Vec<(Proj, Range<usize>, usize)> = l
            .runs
            .iter()
            .map(|r| (r.proj, r.heads.clone(), r.col))
            .collect();
        assert_eq!(
            runs,
            vec![
                (Proj::Q, 0..4, 0),
                (Proj::Q, 16..20, 4),
                (Proj::K, 0..1, 8),
                (Proj::K, 4..5, 9),
                (Proj::V, 0..1, 10),
                (Proj::V, 4..5, 11),
            ]
        );
        assert_eq!(l.width, 12);
        assert_eq!(&l.col[..4], &[0, 4, 1, 5]);
    }

    #[test]
    fn replicated_heads_stay_separate() {
        // kv heads shared by two destinations arrive twice: never one run.
        let l = settle_layout(&[(Proj::K, 0..1), (Proj::K, 0..1)]);
        assert_eq!(l.runs.len(), 2);
        assert_eq!(l.col, vec![0, 1]);
    }

    fn blocks() -> impl Strategy<Value = Vec<(Proj, Range<usize>)>> {
        let proj = prop_oneof![Just(Proj::Q), Just(Proj::K), Just(Proj::V)];
        proptest::collection::vec((proj, 0usize..12, 1usize..4), 0..12)
            .prop_map(|v| v.into_iter().map(|(p, a, n)| (p, a..a + n)).collect())
    }

    proptest! {
        #[test]
        fn runs_tile_the_buffer_and_hold_their_blocks(blocks in blocks()) {
            let l = settle_layout(&blocks);
            prop_assert_eq!(l.width, blocks.iter().map(|b| b.1.len()).sum::<usize>());
            // runs are back to back and cover every column once
            let mut at = 0;
            for r in &l.runs {
                prop_assert_eq!(r.col, at);
                at += r.heads.len();
            }
            prop_assert_eq!(at, l.width);
            // every block sits in a run of its projection, at its heads' place
            for (i, (proj, heads)) in blocks.iter().enumerate() {
                let r = l.runs.iter().find(|r| r.col <= l.col[i] && l.col[i] < r.col + r.heads.len());
                prop_assert!(r.is_some());
                let r = r.unwrap();
                prop_assert_eq!(r.proj, *proj);
                prop_assert_eq!(heads.start, r.heads.start + (l.col[i] - r.col));
                prop_assert!(l.col[i] + heads.len() <= r.col + r.heads.len());
            }
            // blocks never overlap in the buffer
            let mut spans: Vec<(usize, usize)> =
                blocks.iter().enumerate().map(|(i, b)| (l.col[i], l.col[i] + b.1.len())).collect();
            spans.sort();
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0);
            }
            // runs are maximal
            for w in l.runs.windows(2) {
                prop_assert!(!(w[0].proj == w[1].proj && w[0].heads.end == w[1].heads.start));
            }
        }
    }
}
