//! AdamW of compact state (`compact_adamw.rs`) on a GPU: the pieces of a
//! step's compact slots in one launch of `adamw_compact`
//! (`optim/kernels/adamw_compact.cu`) per [`PIECES`] pieces, a block of
//! [`THREADS`] threads per [`Q8_BLOCK`] elements of a piece (two elements
//! a thread), the piece table passed by value as a kernel parameter.

use super::adamw_multi::scale_offsets;
use super::adamw_step::AdamWStep;
use super::compact_adamw::{Q8_BLOCK, q8_blocks};
use super::slot_layout::{SlotAddrs, SlotPlan};
use crate::backend::cuda::attention::dt_flag;
use crate::backend::fused_update::{DeviceTensor, Launch};
use std::ops::Range;

/// Pieces per launch (`COMPACT_PIECES` in `optim/kernels/adamw_compact.cu`): 132
/// bytes a piece, 3.1 KB in all, within the 4 KB of kernel parameters.
const PIECES: usize = 24;

/// Threads of a block (`COMPACT_THREADS`), which updates one [`Q8_BLOCK`]
/// of a piece: two elements a thread, so that each thread has two loads of
/// each tensor in flight at 32 registers (a full SM), and the block's two
/// maxima cost one pair of barriers. On one H100 the update of Llama3-8B's
/// 8-bit state took 124 ms against 148 ms a thread per element (256), 151 ms
/// with four elements a thread (64 threads, 62 registers).
const THREADS: usize = 128;
const _: () = assert!(
    Q8_BLOCK.is_multiple_of(THREADS),
    "a thread's elements are whole"
);

/// One piece as the kernel sees it: device addresses (0 for none), dtype
/// flags, its elements, its rounding key and update.
#[derive(Debug, Clone)]
pub struct PieceRef {
    ptrs: [u64; 7],
    flags: [i32; 4],
    key: u32,
    elems: Range<usize>,
    hp: AdamWStep,
}

/// The kernel's `CompactPieces` as 8-byte words: seven address arrays
/// (`p g m v ms vs q`), `start len first_block` (i64), then `pdt gdt mdt
/// qdt` (i32), `key` (u32) and `lr b1 b2 eps wd bc1 bc2 grad_scale` (f32),
/// each an array of [`PIECES`]. Returns the words and the virtual blocks.
fn piece_table(pieces: &[PieceRef]) -> (Vec<u64>, u64) {
    let mut wide = [[0u64; PIECES]; 10];
    let mut narrow = [[0u32; PIECES]; 13];
    let mut vblocks = 0u64;
    for (k, piece) in pieces.iter().enumerate() {
        for (f, &p) in piece.ptrs.iter().enumerate() {
            wide[f][k] = p;
        }
        wide[7][k] = piece.elems.start as u64;
        wide[8][k] = piece.elems.len() as u64;
        wide[9][k] = vblocks;
        vblocks += q8_blocks(piece.elems.len()) as u64;
        for (f, &flag) in piece.flags.iter().enumerate() {
            narrow[f][k] = flag as u32;
        }
        narrow[4][k] = piece.key;
        for (f, x) in piece.hp.kernel_scalars().into_iter().enumerate() {
            narrow[5 + f][k] = x.to_bits();
        }
    }
    // pieces past the last start at the end: no virtual block is theirs
    wide[9][pieces.len()..].fill(vblocks);
    let mut words: Vec<u64> = wide.iter().flatten().copied().collect();
    let pair = |c: &[u32]| c[0] as u64 | (c[1] as u64) << 32;
    for field in &narrow {
        words.extend(field.chunks(2).map(pair));
    }
    (words, vblocks)
}

/// The non-empty pieces of one compact slot.
pub fn slot_pieces(plan: &SlotPlan<'_>, t: &SlotAddrs) -> Vec<PieceRef> {
    let (starts, _) = scale_offsets(plan.pieces);
    let scale_at = |t: Option<&DeviceTensor>, at: usize| t.map_or(0, |t| t.addr + (at * 4) as u64);
    let (ms, vs) = match &t.scales {
        Some((ms, vs)) => (Some(ms), Some(vs)),
        None => (None, None),
    };
    let (q, qdt) = match &t.narrow {
        Some(q) => (q.addr, dt_flag(q.dtype)),
        None => (0, 0),
    };
    (plan.pieces.iter())
        .zip(starts)
        .filter(|((e, _), _)| !e.is_empty())
        .map(|((elems, hp), at)| PieceRef {
            ptrs: [
                t.target.addr,
                t.grad.addr,
                t.m.addr,
                t.v.addr,
                scale_at(ms, at),
                scale_at(vs, at),
                q,
            ],
            flags: [
                dt_flag(t.target.dtype),
                dt_flag(t.grad.dtype),
                dt_flag(t.m.dtype),
                qdt,
            ],
            key: plan.rounding_key,
            elems: elems.clone(),
            hp: *hp,
        })
        .collect()
}

/// The launches of compact pieces: one `adamw_compact` per [`PIECES`]
/// pieces, a block of [`THREADS`] threads per [`Q8_BLOCK`] elements of a
/// piece.
pub fn launches(pieces: &[PieceRef]) -> Vec<Launch> {
    (pieces.chunks(PIECES))
        .map(|group| {
            let (table, vblocks) = piece_table(group);
            Launch {
                function: "adamw_compact",
                threads: vblocks as usize * THREADS,
                block: THREADS as u32,
                params: vec![vec![group.len() as u32 as u64], vec![vblocks], table],
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's layout: 10 arrays of 8-byte words, then 13 of 4-byte
    /// values, each of `PIECES`; a virtual block per 256 elements of a
    /// piece.
    #[test]
    fn piece_table_lays_out_the_kernels_struct() {
        let hp = AdamWStep {
            lr: 0.5,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 2,
            grad_scale: 0.25,
        };
        let piece = |base: u64, elems: Range<usize>, key| PieceRef {
            ptrs: [base, base + 1, base + 2, base + 3, base + 4, base + 5, 0],
            flags: [1, 0, 2, 0],
            key,
            elems,
            hp,
        };
        let (words, vblocks) = piece_table(&[piece(100, 0..300, 7), piece(200, 300..301, 9)]);
        assert_eq!(words.len(), 10 * PIECES + 13 * PIECES / 2);
        assert_eq!(vblocks, 2 + 1);
        assert!(words.len() * 8 + 16 <= 4096);
        let field = |f: usize| &words[f * PIECES..(f + 1) * PIECES];
        assert_eq!(&field(0)[..2], &[100, 200]);
        assert_eq!(&field(4)[..2], &[104, 204]);
        assert_eq!(&field(7)[..2], &[0, 300]);
        assert_eq!(&field(8)[..2], &[300, 1]);
        assert_eq!(&field(9)[..3], &[0, 2, 3]);
        let half = |f: usize, k: usize| {
            let w = words[10 * PIECES + f * PIECES / 2 + k / 2];
            (w >> (32 * (k % 2))) as u32
        };
        assert_eq!((half(0, 0), half(2, 1)), (1, 2));
        assert_eq!((half(4, 0), half(4, 1)), (7, 9));
        assert_eq!(f32::from_bits(half(5, 1)), 0.5);
        assert_eq!(f32::from_bits(half(12, 0)), 0.25);
    }
}
