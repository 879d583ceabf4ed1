//! Which global token positions each rank holds (pure index math).
//!
//! The sequence of `seq` tokens is split into `2*pr` zigzag chunks; ring rank
//! `i` holds chunks `i` and `2*pr-1-i` (its *ring shard*, `seq/pr` tokens,
//! which balances causal work). Inside a ring shard, the `pu` Ulysses ranks
//! hold consecutive pieces of `seq/(pr*pu)` tokens. With `pr == 1` the ring
//! shard is the whole sequence and the layout is contiguous.

use crate::error::Result;
use std::ops::Range;

/// Sequence layout over a `ring x ulysses` context-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqLayout {
    pub seq: usize,
    pub pu: usize,
    pub pr: usize,
}

impl SeqLayout {
    /// Validates divisibility, naming a valid sequence length if it fails.
    pub fn new(seq: usize, pu: usize, pr: usize) -> Result<Self> {
        let unit = match pr {
            0 | 1 => Some(pu),
            _ => pr.checked_mul(pu).and_then(|c| c.checked_mul(2)),
        };
        let Some(unit) = unit.filter(|&unit| unit > 0) else {
            return crate::config_err!(
                "a sequence cannot be split over ring degree {pr} x Ulysses degree {pu} \
                 (more ranks than can be counted, or none); give degrees of at least 1 whose \
                 product is at most the sequence length"
            );
        };
        if seq == 0 || !seq.is_multiple_of(unit) {
            let what = if pr > 1 {
                format!("2 x ring degree {pr} x Ulysses degree {pu} = {unit} (zigzag chunks)")
            } else {
                format!("the Ulysses degree {pu}")
            };
            return crate::config_err!(
                "sequence length {seq} must be a positive multiple of {what}; try --seq {}",
                (seq / unit).max(1) * unit
            );
        }
        Ok(SeqLayout { seq, pu, pr })
    }
    /// Tokens per rank.
    pub fn local_len(&self) -> usize {
        self.seq / (self.pu * self.pr)
    }
    /// Tokens per ring shard (what one rank attends over after the Ulysses exchange).
    pub fn shard_len(&self) -> usize {
        self.seq / self.pr
    }
    /// Global positions of ring rank `i`'s shard, in local order.
    pub fn ring_shard_positions(&self, i: usize) -> Vec<usize> {
        self.ring_shard(i).collect()
    }
    /// [`ring_shard_positions`](Self::ring_shard_positions) in order, uncollected.
    fn ring_shard(&self, i: usize) -> std::iter::Chain<Range<usize>, Range<usize>> {
        if self.pr == 1 {
            return (0..self.seq).chain(0..0);
        }
        let c = self.seq / (2 * self.pr);
        let j = 2 * self.pr - 1 - i;
        (i * c..(i + 1) * c).chain(j * c..(j + 1) * c)
    }
    /// Global positions of the rank at (ring `i`, Ulysses `r`).
    pub fn rank_positions(&self, i: usize, r: usize) -> Vec<usize> {
        let s = self.local_len();
        // `skip` on ranges jumps: only this rank's positions are made
        self.ring_shard(i).skip(r * s).take(s).collect()
    }
    /// Rows of `global` (`[seq, width]`, row-major) held by (ring `i`, Ulysses `r`).
    pub fn shard_rows<T: Copy>(&self, global: &[T], width: usize, i: usize, r: usize) -> Vec<T> {
        self.rank_positions(i, r)
            .into_iter()
            .flat_map(|p| global[p * width..(p + 1) * width].iter().copied())
            .collect()
    }
    /// Reassembles a global `[seq, width]` array from every rank's rows
    /// (`shards[i * pu + r]` = rows of (ring `i`, Ulysses `r`)).
    pub fn unshard_rows<T: Copy + Default>(&self, shards: &[Vec<T>], width: usize) -> Vec<T> {
        let mut out = vec![T::default(); self.seq * width];
        for i in 0..self.pr {
            for r in 0..self.pu {
                let rows = &shards[i * self.pu + r];
                for (k, p) in self.rank_positions(i, r).into_iter().enumerate() {
                    out[p * width..(p + 1) * width]
                        .copy_from_slice(&rows[k * width..(k + 1) * width]);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn zigzag_layout_round_trips(pr in 1usize..5, pu in 1usize..5, k in 1usize..4) {
            let seq = 2 * pr * pu * k;
            let l = SeqLayout::new(seq, pu, pr).unwrap();
            let global: Vec<u32> = (0..seq as u32 * 3).collect();
            let shards: Vec<Vec<u32>> = (0..pr).flat_map(|i| (0..pu).map(move |r| (i, r)))
                .map(|(i, r)| l.shard_rows(&global, 3, i, r)).collect();
            prop_assert_eq!(l.unshard_rows(&shards, 3), global);
            // every position is held exactly once, and shard order is increasing
            let mut all: Vec<usize> = (0..pr).flat_map(|i| l.ring_shard_positions(i)).collect();
            for i in 0..pr {
                let p = l.ring_shard_positions(i);
                prop_assert!(p.windows(2).all(|w| w[0] < w[1]));
            }
            all.sort();
            prop_assert_eq!(all, (0..seq).collect::<Vec<_>>());
        }
    }

    #[test]
    fn degrees_beyond_counting_are_an_error_not_a_panic() {
        for (pu, pr) in [(1, 1 << 63), (1 << 32, 1 << 32), (0, 1), (0, 2)] {
            match SeqLayout::new(256, pu, pr) {
                Err(crate::error::Error::Config(msg)) => {
                    assert!(msg.contains("at least 1"), "{msg}")
                }
                other => panic!("pu {pu} pr {pr}: expected a configuration error, got {other:?}"),
            }
        }
    }

    #[test]
    fn ring_rank_holds_mirrored_chunks() {
        let l = SeqLayout::new(16, 1, 4).unwrap();
        assert_eq!(l.ring_shard_positions(1), vec![2, 3, 12, 13]);
    }

    #[test]
    fn indivisible_sequence_suggests_one() {
        let e = SeqLayout::new(100, 2, 4).unwrap_err().to_string();
        assert!(
            e.contains("multiple of 2 x ring degree 4 x Ulysses degree 2 = 16"),
            "{e}"
        );
        assert!(e.contains("--seq 96"), "{e}");
    }
}
