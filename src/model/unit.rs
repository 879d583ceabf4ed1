//! A unit of parameters (the embedding, a block, the final norm + LM head):
//! what a parameter store hands the decoder at once and FSDP gathers at
//! once, and the order a step visits them in.

use super::segments::{Segments, Visit};

/// A unit of parameters: what FSDP gathers at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// `model.embed_tokens` (also the LM head when the embeddings are tied).
    Embed,
    /// Decoder block `l`.
    Block(usize),
    /// `model.norm` and `lm_head` (the final norm only when tied).
    Head,
}

impl Unit {
    /// Every unit of a `layers`-block model, in model order.
    pub fn all(layers: usize) -> Vec<Unit> {
        let mut v = vec![Unit::Embed];
        v.extend((0..layers).map(Unit::Block));
        v.push(Unit::Head);
        v
    }

    /// Position in [`Unit::all`].
    pub fn index(self, layers: usize) -> usize {
        match self {
            Unit::Embed => 0,
            Unit::Block(l) => 1 + l,
            Unit::Head => layers + 1,
        }
    }

    /// The units one step gathers, in the order it uses them: forward
    /// (embedding, blocks, head — and the embedding again as a tied head),
    /// then backward (blocks in reverse; the embedding's backward needs no
    /// parameters).
    pub fn step_order(layers: usize, tied: bool) -> Vec<Unit> {
        Self::step_order_to(layers, tied, 0)
    }

    /// [`Unit::step_order`] of a step whose backward stops after block
    /// `floor` (`Freeze::backward_floor`): the blocks below it are used in
    /// the forward only.
    pub fn step_order_to(layers: usize, tied: bool, floor: usize) -> Vec<Unit> {
        Self::step_order_segmented(layers, tied, floor, 1)
    }

    /// [`Unit::step_order_to`] under segment checkpointing of `every`
    /// blocks (`model::segments`): the backward also uses each earlier
    /// segment's blocks but its last for their recompute, before the
    /// segment's backward.
    pub fn step_order_segmented(
        layers: usize,
        tied: bool,
        floor: usize,
        every: usize,
    ) -> Vec<Unit> {
        let mut v = vec![Unit::Embed];
        v.extend((0..layers).map(Unit::Block));
        v.push(Unit::Head);
        if tied {
            v.push(Unit::Embed);
        }
        let segments = Segments::new(layers, floor, every);
        v.extend(
            segments
                .backward_visits()
                .into_iter()
                .map(|visit| match visit {
                    Visit::Recompute(l) | Visit::Backward(l) => Unit::Block(l),
                }),
        );
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_order_visits_every_block_twice_and_a_tied_embedding_twice() {
        let untied = Unit::step_order(3, false);
        assert_eq!(untied.len(), 2 + 2 * 3);
        assert_eq!(untied[..5].to_vec(), Unit::all(3));
        assert_eq!(
            untied[5..].to_vec(),
            vec![Unit::Block(2), Unit::Block(1), Unit::Block(0)]
        );
        let tied = Unit::step_order(3, true);
        assert_eq!(tied[5], Unit::Embed);
        let stopped = Unit::step_order_to(3, false, 2);
        assert_eq!(stopped[..5].to_vec(), Unit::all(3));
        assert_eq!(stopped[5..].to_vec(), vec![Unit::Block(2)]);
        assert_eq!(Unit::step_order_to(3, false, 3).len(), 5);
        // segments of 2 over 3 blocks: [0,2) [2,3); block 0 runs again
        let segmented = Unit::step_order_segmented(3, false, 0, 2);
        let blocks = |ls: &[usize]| ls.iter().map(|&l| Unit::Block(l)).collect::<Vec<_>>();
        assert_eq!(segmented[5..].to_vec(), blocks(&[2, 0, 1, 0]));
        for (i, u) in Unit::all(4).into_iter().enumerate() {
            assert_eq!(u.index(4), i);
        }
    }
}
