//! Multi-tensor AdamW of F32 state on a GPU: the pieces of a step's slots
//! in one launch of `adamw_multi` (`optim/kernels/adamw.cu`) per [`PIECES`]
//! pieces, their table (tensor addresses, ranges, hyper-parameters) passed
//! by value as a kernel parameter: no upload, no buffer.

use super::adamw_step::AdamWStep;
use super::slot_layout::{SlotAddrs, SlotPlan};
use crate::backend::cuda::attention::dt_flag;
use crate::backend::fused_update::Launch;
use std::ops::Range;

/// Pieces per launch (`ADAMW_PIECES` in `optim/kernels/adamw.cu`): a table of
/// 108 bytes a piece, 3.4 KB in all, within every architecture's 4 KB of
/// kernel parameters.
pub const PIECES: usize = 32;

/// Threads per block of `adamw_multi`.
pub const BLOCK: u32 = 256;

/// Elements each thread of `adamw_multi` updates (a virtual block is
/// `VEC * BLOCK` elements of one piece).
const VEC: usize = 4;

/// One piece as the kernel sees it: its slot's tensors (device addresses;
/// `q` 0 for none), their dtype flags, its elements and update.
#[derive(Debug, Clone)]
pub struct PieceRef {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    q: u64,
    gdt: i32,
    qdt: i32,
    elems: Range<usize>,
    hp: AdamWStep,
}

impl PieceRef {
    /// Whether every tensor's first element of the piece is aligned for the
    /// kernel's 4-element loads (16 bytes of F32, 8 of BF16); groups of 4
    /// from there stay aligned.
    fn vec_aligned(&self) -> bool {
        let at = |addr: u64, dtype: i32| {
            let size = if dtype == 0 { 4 } else { 2 };
            (addr + (self.elems.start * size) as u64).is_multiple_of((VEC * size) as u64)
        };
        [self.p, self.m, self.v].iter().all(|&a| at(a, 0))
            && at(self.g, self.gdt)
            && (self.q == 0 || at(self.q, self.qdt))
    }
}

/// The kernel's `AdamWPieces` for up to [`PIECES`] pieces, as 8-byte
/// words: `p`, `g`, `m`, `v`, `q` (addresses), `start`, `len`,
/// `first_block` (i64), then `gdt`, `qdt`, `vec` (i32) and `lr`, `b1`,
/// `b2`, `eps`, `wd`, `bc1`, `bc2`, `grad_scale` (f32), each an array of
/// [`PIECES`]. Returns the words and the launch's virtual blocks (`VEC *
/// BLOCK` elements of one piece each).
fn piece_table(pieces: &[PieceRef]) -> (Vec<u64>, u64) {
    let mut wide = [[0u64; PIECES]; 8];
    let mut flags = [[0i32; PIECES]; 3];
    let mut floats = [[0f32; PIECES]; 8];
    let mut vblocks = 0u64;
    for (k, piece) in pieces.iter().enumerate() {
        let hp = &piece.hp;
        let row = [
            piece.p,
            piece.g,
            piece.m,
            piece.v,
            piece.q,
            piece.elems.start as u64,
            piece.elems.len() as u64,
            vblocks,
        ];
        for (field, value) in wide.iter_mut().zip(row) {
            field[k] = value;
        }
        vblocks += piece.elems.len().div_ceil(VEC * BLOCK as usize) as u64;
        flags[0][k] = piece.gdt;
        flags[1][k] = piece.qdt;
        flags[2][k] = piece.vec_aligned() as i32;
        for (field, value) in floats.iter_mut().zip(hp.kernel_scalars()) {
            field[k] = value;
        }
    }
    // pieces past the last start at the end: no virtual block is theirs
    wide[7][pieces.len()..].fill(vblocks);
    let mut words: Vec<u64> = wide.iter().flatten().copied().collect();
    // two 4-byte values to a word, the first in the low half (little-endian)
    let pair = |lo: u32, hi: u32| lo as u64 | (hi as u64) << 32;
    for field in &flags {
        words.extend(field.chunks(2).map(|c| pair(c[0] as u32, c[1] as u32)));
    }
    for field in &floats {
        words.extend(
            field
                .chunks(2)
                .map(|c| pair(c[0].to_bits(), c[1].to_bits())),
        );
    }
    (words, vblocks)
}

/// The non-empty pieces of one plain slot (F32 weights and moments).
pub fn slot_pieces(plan: &SlotPlan<'_>, t: &SlotAddrs) -> Vec<PieceRef> {
    let (q, qdt) = match &t.narrow {
        Some(q) => (q.addr, dt_flag(q.dtype)),
        None => (0, 0),
    };
    (plan.pieces.iter())
        .filter(|(e, _)| !e.is_empty())
        .map(|(elems, hp)| PieceRef {
            p: t.target.addr,
            g: t.grad.addr,
            m: t.m.addr,
            v: t.v.addr,
            q,
            gdt: dt_flag(t.grad.dtype),
            qdt,
            elems: elems.clone(),
            hp: *hp,
        })
        .collect()
}

/// The launches of plain pieces: one `adamw_multi` per [`PIECES`] pieces.
pub fn launches(pieces: &[PieceRef]) -> Vec<Launch> {
    (pieces.chunks(PIECES))
        .map(|group| {
            let (table, vblocks) = piece_table(group);
            Launch {
                function: "adamw_multi",
                threads: vblocks as usize * BLOCK as usize,
                block: BLOCK,
                params: vec![vec![group.len() as u32 as u64], vec![vblocks], table],
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table's layout: 8 arrays of 8-byte words, then 3 of i32 and 8 of
    /// f32, each of `PIECES`; the virtual blocks (1,024 elements each)
    /// counted per piece.
    #[test]
    fn piece_table_lays_out_the_kernels_struct() {
        let hp = |wd| AdamWStep {
            lr: 0.5,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
            step: 2,
            grad_scale: 0.25,
        };
        let piece = |slot: u64, elems: Range<usize>, wd| PieceRef {
            p: slot,
            g: slot + 1,
            m: slot + 2,
            v: slot + 3,
            q: if slot == 100 { 0 } else { slot + 4 },
            gdt: 0,
            qdt: if slot == 100 { 0 } else { 1 },
            elems,
            hp: hp(wd),
        };
        let pieces = [
            piece(100, 3..260, 0.1),
            piece(100, 260..261, 0.0),
            piece(200, 300..1325, 0.1),
        ];
        let (words, vblocks) = piece_table(&pieces);
        assert_eq!(words.len(), 8 * PIECES + 3 * PIECES / 2 + 8 * PIECES / 2);
        assert_eq!(vblocks, 1 + 1 + 2);
        let field = |f: usize| &words[f * PIECES..(f + 1) * PIECES];
        assert_eq!(&field(0)[..3], &[100, 100, 200]);
        assert_eq!(&field(3)[..3], &[103, 103, 203]);
        assert_eq!(&field(4)[..3], &[0, 0, 204]);
        assert_eq!(&field(5)[..3], &[3, 260, 300]);
        assert_eq!(&field(6)[..3], &[257, 1, 1025]);
        assert_eq!(&field(7)[..4], &[0, 1, 2, 4]);
        assert!(field(7)[3..].iter().all(|&b| b == 4));
        let half = |base: usize, f: usize, k: usize| {
            let w = words[base + f * PIECES / 2 + k / 2];
            (w >> (32 * (k % 2))) as u32
        };
        let flag = |f, k| half(8 * PIECES, f, k) as i32;
        assert_eq!((flag(1, 0), flag(1, 1), flag(1, 2)), (0, 0, 1));
        // fake addresses 100.. are not 16-byte aligned
        assert_eq!((flag(2, 0), flag(2, 1), flag(2, 2)), (0, 0, 0));
        let float = |f, k| f32::from_bits(half(8 * PIECES + 3 * PIECES / 2, f, k));
        assert_eq!(float(0, 1), 0.5);
        assert_eq!((float(4, 0), float(4, 1), float(4, 2)), (0.1, 0.0, 0.1));
        assert_eq!(float(5, 2), hp(0.1).bias_corrections().0);
        assert_eq!(float(7, 2), 0.25);
    }

    /// The 4-element path needs each tensor's first element of the piece
    /// aligned to 4 elements: 16 bytes of F32 (p, m, v, an F32 g or q), 8
    /// of BF16.
    #[test]
    fn pieces_take_the_vector_path_only_when_aligned() {
        let hp = AdamWStep {
            lr: 0.5,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
            grad_scale: 1.0,
        };
        let piece = |start: usize, g: u64, gdt: i32, q: u64| PieceRef {
            p: 0x1000,
            g,
            m: 0x2000,
            v: 0x3000,
            q,
            gdt,
            qdt: 1,
            elems: start..start + 64,
            hp,
        };
        assert!(piece(0, 0x4000, 0, 0).vec_aligned());
        assert!(piece(8, 0x4000, 1, 0x5008).vec_aligned());
        // the F32 tensors' first element 8 bytes past a 16-byte boundary
        assert!(!piece(2, 0x4000, 1, 0).vec_aligned());
        // a BF16 gradient 4 bytes past an 8-byte boundary
        assert!(!piece(4, 0x4004, 1, 0).vec_aligned());
        // an F32 gradient 8 bytes past a 16-byte boundary
        assert!(!piece(4, 0x4008, 0, 0).vec_aligned());
        // a BF16 narrow copy 2 bytes off
        assert!(!piece(4, 0x4000, 1, 0x5002).vec_aligned());
    }
}
