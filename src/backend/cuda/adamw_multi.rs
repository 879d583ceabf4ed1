//! `CudaBackend`'s multi-tensor AdamW: the pieces of one slot in one launch
//! of `adamw_multi` (kernels/elementwise.cu) per [`PIECES`] pieces, their
//! table passed by value as a kernel parameter (no upload, no buffer).

use super::kernels::{Args, grid_for, launch};
use super::{BLOCK, CudaBackend, dt, need, ptr};
use crate::backend::adamw_multi::check_adamw_multi;
use crate::backend::{AdamWPiece, AdamWTensors, DType};
use crate::error::Result;

/// Pieces per launch (`ADAMW_PIECES` in kernels/elementwise.cu): a table of
/// 56 bytes a piece, 1.8 KB in all, within every architecture's 4 KB of
/// kernel parameters.
pub const PIECES: usize = 32;

/// The kernel's `AdamWPieces`, as 8-byte words: `start`, `len` and
/// `first_block` (i64 each), then `lr`, `b1`, `b2`, `eps`, `wd`, `bc1`,
/// `bc2`, `grad_scale` (f32 each), every field an array of [`PIECES`].
/// Returns the words and the launch's virtual blocks (`BLOCK` elements of
/// one piece each).
fn piece_table(pieces: &[AdamWPiece]) -> (Vec<u64>, u64) {
    let mut ints = [[0i64; PIECES]; 3];
    let mut floats = [[0f32; PIECES]; 8];
    let mut vblocks = 0u64;
    for (k, (elems, hp)) in pieces.iter().enumerate() {
        ints[0][k] = elems.start as i64;
        ints[1][k] = elems.len() as i64;
        ints[2][k] = vblocks as i64;
        vblocks += elems.len().div_ceil(BLOCK as usize) as u64;
        let (bc1, bc2) = hp.bias_corrections();
        let row = [
            hp.lr,
            hp.beta1,
            hp.beta2,
            hp.eps,
            hp.weight_decay,
            bc1,
            bc2,
            hp.grad_scale,
        ];
        for (field, value) in floats.iter_mut().zip(row) {
            field[k] = value;
        }
    }
    // pieces past the last start at the end: no virtual block is theirs
    ints[2][pieces.len()..].fill(vblocks as i64);
    let mut words: Vec<u64> = ints.iter().flatten().map(|&x| x as u64).collect();
    for field in &floats {
        for pair in field.chunks(2) {
            // two f32 to a word, the first in the low half (little-endian)
            words.push(pair[0].to_bits() as u64 | (pair[1].to_bits() as u64) << 32);
        }
    }
    (words, vblocks)
}

impl CudaBackend {
    pub(super) fn adamw_multi_impl(
        &self,
        t: AdamWTensors<'_, Self>,
        pieces: &[AdamWPiece],
    ) -> Result<()> {
        let _span = self.span("adamw_multi")?;
        check_adamw_multi(&t, pieces)?;
        for (x, what) in [(&*t.target, "target"), (&*t.m, "m"), (&*t.v, "v")] {
            need(x, DType::F32, "adamw_multi", what)?;
        }
        self.bind()?;
        let (narrow, narrow_dt) = match t.narrow.as_deref() {
            Some(q) => (ptr(q), dt(q)),
            None => (0, 0),
        };
        for group in pieces.chunks(PIECES) {
            let (table, vblocks) = piece_table(group);
            if vblocks == 0 {
                continue;
            }
            let args = Args::new()
                .ptr(ptr(t.target))
                .ptr(ptr(t.grad))
                .i32(dt(t.grad))
                .ptr(ptr(t.m))
                .ptr(ptr(t.v))
                .ptr(narrow)
                .i32(narrow_dt)
                .i32(group.len() as i32)
                .i64(vblocks as i64)
                .words(&table);
            let grid = grid_for(vblocks as usize * BLOCK as usize, BLOCK);
            launch(&self.stream, self.kernels.adamw_multi, grid, BLOCK, 0, args)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AdamWStep;

    /// The table's layout: 3 i64 arrays then 8 f32 arrays of `PIECES`, the
    /// virtual blocks counted per piece.
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
        let pieces = [(3..260, hp(0.1)), (260..261, hp(0.0)), (300..812, hp(0.1))];
        let (words, vblocks) = piece_table(&pieces);
        assert_eq!(words.len(), 3 * PIECES + 8 * PIECES / 2);
        assert_eq!(vblocks, 2 + 1 + 2);
        assert_eq!(&words[..3], &[3, 260, 300]);
        assert_eq!(&words[PIECES..PIECES + 3], &[257, 1, 512]);
        let first = &words[2 * PIECES..3 * PIECES];
        assert_eq!(&first[..4], &[0, 2, 3, 5]);
        assert!(first[3..].iter().all(|&b| b == 5));
        let f32_at = |field: usize, k: usize| {
            let w = words[3 * PIECES + field * PIECES / 2 + k / 2];
            f32::from_bits((w >> (32 * (k % 2))) as u32)
        };
        assert_eq!(f32_at(0, 1), 0.5);
        assert_eq!(f32_at(4, 0), 0.1);
        assert_eq!(f32_at(4, 1), 0.0);
        assert_eq!(f32_at(4, 2), 0.1);
        assert_eq!(f32_at(5, 2), hp(0.1).bias_corrections().0);
        assert_eq!(f32_at(7, 2), 0.25);
    }
}
