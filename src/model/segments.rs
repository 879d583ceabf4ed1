//! Segment checkpointing (`--checkpoint-every k`): which blocks keep their
//! input from forward to backward, and the order in which a step's
//! backward visits blocks, recomputing or differentiating them.
//!
//! The blocks whose backward runs (`floor..layers`, `Freeze::backward_floor`
//! below) fall into segments of `every` blocks from `floor` on (the last
//! one may be shorter). The forward keeps the input of each segment's
//! first block only, except in the last segment, whose blocks all keep
//! theirs (its backward comes first: no recompute rebuilds them). Before
//! the backward of an earlier segment, its forward runs again from the
//! kept input through all its blocks but the last, rebuilding the inner
//! blocks' inputs, which live only until their own backward. So at most
//! about `segments + every` block inputs are alive at once instead of one
//! per block, for one more forward of every block of an earlier segment
//! but its last. `every = 1` is one checkpoint per block, as without
//! segments.

/// One visit of a block by a step's backward, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// The block's forward again, rebuilding the next block's input.
    Recompute(usize),
    /// The block's backward.
    Backward(usize),
}

/// The segments of a model's trained blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segments {
    layers: usize,
    floor: usize,
    every: usize,
}

impl Segments {
    /// Segments of `every` blocks (at least 1) over blocks `floor..layers`.
    pub fn new(layers: usize, floor: usize, every: usize) -> Self {
        Segments {
            layers,
            floor: floor.min(layers),
            every: every.max(1),
        }
    }

    /// The first block of the segment holding block `l` (`l ≥ floor`).
    pub fn start_of(&self, l: usize) -> usize {
        self.floor + (l - self.floor) / self.every * self.every
    }

    /// The first block of the last segment (`layers` when no block trains).
    pub fn last_start(&self) -> usize {
        match self.layers > self.floor {
            true => self.start_of(self.layers - 1),
            false => self.layers,
        }
    }

    /// Whether block `l` keeps its input from forward: a trained block that
    /// starts a segment or lies in the last one.
    pub fn keeps_input(&self, l: usize) -> bool {
        l >= self.floor && (l >= self.last_start() || (l - self.floor).is_multiple_of(self.every))
    }

    /// Whether block `l` lies in the last segment, whose blocks keep
    /// everything their policy keeps from forward.
    pub fn in_last(&self, l: usize) -> bool {
        l >= self.last_start()
    }

    /// Whether the backward runs block `l`'s forward again (a block of an
    /// earlier segment but its last): what the forward keeps of it besides
    /// its input, that recompute keeps instead.
    pub fn recomputes(&self, l: usize) -> bool {
        l >= self.floor && !self.in_last(l) && (l - self.floor) % self.every != self.every - 1
    }

    /// The block forwards a step recomputes to rebuild inner inputs: every
    /// block of an earlier segment but its last.
    pub fn recomputed_blocks(&self) -> usize {
        (self.last_start() - self.floor) / self.every * (self.every - 1)
    }

    /// The block inputs kept from forward.
    pub fn kept_inputs(&self) -> usize {
        (self.floor..self.layers)
            .filter(|&l| self.keeps_input(l))
            .count()
    }

    /// The blocks a step's backward visits, in order: the last segment's
    /// backward, then for each earlier segment its recompute (its first
    /// block to its last but one) and its backward (last block first).
    pub fn backward_visits(&self) -> Vec<Visit> {
        let mut v = Vec::new();
        let mut end = self.layers;
        while end > self.floor {
            let start = self.start_of(end - 1);
            if end <= self.last_start() {
                v.extend((start..end - 1).map(Visit::Recompute));
            }
            v.extend((start..end).rev().map(Visit::Backward));
            end = start;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_a_segment_keeps_every_input_and_recomputes_nothing() {
        let s = Segments::new(5, 0, 1);
        assert!((0..5).all(|l| s.keeps_input(l)));
        assert_eq!(s.recomputed_blocks(), 0);
        let back: Vec<Visit> = (0..5).rev().map(Visit::Backward).collect();
        assert_eq!(s.backward_visits(), back);
    }

    #[test]
    fn segments_keep_their_first_input_and_the_last_segment_all() {
        // blocks 1..8 trained, segments [1,4) [4,7) [7,8)
        let s = Segments::new(8, 1, 3);
        let kept: Vec<usize> = (0..8).filter(|&l| s.keeps_input(l)).collect();
        assert_eq!(kept, [1, 4, 7]);
        assert_eq!((s.last_start(), s.kept_inputs()), (7, 3));
        assert_eq!(s.recomputed_blocks(), 4);
        let rerun: Vec<usize> = (0..8).filter(|&l| s.recomputes(l)).collect();
        assert_eq!(rerun, [1, 2, 4, 5]);
        use Visit::*;
        let want = [
            Backward(7),
            Recompute(4),
            Recompute(5),
            Backward(6),
            Backward(5),
            Backward(4),
            Recompute(1),
            Recompute(2),
            Backward(3),
            Backward(2),
            Backward(1),
        ];
        assert_eq!(s.backward_visits(), want);
        // one segment of every block: all kept, nothing recomputed
        let one = Segments::new(4, 0, 9);
        assert!((0..4).all(|l| one.keeps_input(l)));
        assert_eq!(one.recomputed_blocks(), 0);
        // nothing trained
        let none = Segments::new(3, 3, 2);
        assert_eq!((none.kept_inputs(), none.backward_visits()), (0, vec![]));
    }

    #[test]
    fn every_trained_block_is_differentiated_once() {
        for layers in 0..9 {
            for floor in 0..=layers {
                for every in 1..11 {
                    let s = Segments::new(layers, floor, every);
                    let visits = s.backward_visits();
                    let back: Vec<usize> = visits
                        .iter()
                        .filter_map(|v| match v {
                            Visit::Backward(l) => Some(*l),
                            _ => None,
                        })
                        .collect();
                    let want: Vec<usize> = (floor..layers).rev().collect();
                    assert_eq!(back, want);
                    let recomputed = visits.len() - back.len();
                    assert_eq!(recomputed, s.recomputed_blocks());
                    let rerun = (0..layers).filter(|&l| s.recomputes(l)).count();
                    assert_eq!(rerun, recomputed);
                }
            }
        }
    }
}
