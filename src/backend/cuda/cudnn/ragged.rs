//! Several documents in one cuDNN SDPA call: cuDNN's variable-length
//! ("THD", ragged) layout. A call of packed documents (block-diagonal
//! causal attention, [`BoundedMask::doc_pieces`]) is given as a batch of
//! `b` sequences, one per document, of at most `s_max` rows each: every
//! operand keeps its token rows, and an int32 **ragged offset** table
//! (`[b + 1]`: the element offset of each sequence's first row, then the
//! end) tells cuDNN where each sequence starts; a **padding mask** (row <
//! `seq_len[b]` and column < `seq_len[b]`) hides what lies past a
//! sequence's end. Nothing is copied or padded.
//!
//! The plan key ([`RaggedDims`]) is `b` exactly and `s_max` rounded up to a
//! power of two (at least 128): cuDNN 9.14 does not take sequences of
//! length 0 (NaN rows; the frontend's tests gate them to 9.25), so the
//! batch cannot be padded to a bucket. A run's windows hold a few distinct
//! document counts and its plans are cached (one per key).
//!
//! The tables travel per call in the kept cuDNN workspace: the region is
//! [`table_bytes`]`(sq)` bytes, room for any number of documents a call of
//! `sq` rows can hold (each has a row at least), so what a call allocates
//! depends on its geometry only, never on its documents (the planner counts
//! it without data).

use crate::backend::AttnMask;
use crate::error::{Error, Result};

/// The geometry of a ragged call that a plan is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RaggedDims {
    /// Documents (sequences) in the call.
    pub b: usize,
    /// Rows of the longest, rounded up to a power of two (at least
    /// [`MIN_S_MAX`]).
    pub s_max: usize,
}

/// The smallest `s_max` of a plan (one tile of cuDNN's kernels; the
/// backward on cuDNN 9.14 wants whole 128-row tiles of keys).
pub const MIN_S_MAX: usize = 128;

/// The first cuDNN that runs ragged SDPA with a padding mask forward and
/// backward on Hopper in the form built here: 9.10. Ragged offsets and the
/// padding mask go back to 8.9 (Hopper's fprop and bprop), but the
/// frontend's support checks want 9.6 for a ragged backward with GQA and
/// for the dQ accumulator and softmax sums sized by the tokens
/// (`max_total_seq_len`), and below 9.10 it applies the padding mask a
/// second time after Stats is subtracted and masks with the lowest float
/// instead of −∞; the graphs here are the 9.10 form.
pub const FIRST_RAGGED_VERSION: usize = 91000;

/// The plan geometry of documents of `pieces` rows.
pub fn dims(pieces: &[usize]) -> RaggedDims {
    let longest = pieces.iter().copied().max().unwrap_or(0);
    RaggedDims {
        b: pieces.len(),
        s_max: longest.next_power_of_two().max(MIN_S_MAX),
    }
}

/// The documents' row counts of a call that runs ragged on cuDNN: a
/// documents mask over the call's own contiguous rows, without a sliding
/// window, holding two documents or more (one is plain causal attention).
pub fn call_pieces(mask: &AttnMask) -> Option<Vec<usize>> {
    match mask {
        AttnMask::Bounded(m) => m.doc_pieces().filter(|p| p.len() >= 2),
        AttnMask::Full | AttnMask::Causal => None,
    }
}

/// Entries between the starts of consecutive tables of `b` documents
/// (`b + 1` entries, rounded up to 16 bytes).
fn stride(b: usize) -> usize {
    (b + 1).next_multiple_of(4)
}

/// Bytes of the tables' region of a call of `sq` rows: four tables of
/// `sq + 1` int32 entries (a call holds at most `sq` documents), rounded
/// up to 256 bytes.
pub fn table_bytes(sq: usize) -> usize {
    (4 * stride(sq) * 4).div_ceil(256) * 256
}

/// The four tables of one call, as laid out in the region (int32 entries,
/// each table [`stride`] apart): the documents' lengths (used as both
/// `seq_len_q` and `seq_len_kv`), then the ragged offsets of rows of
/// `row_elems[0]` elements (Q, O, dO, dQ), of `row_elems[1]` (K, V, dK,
/// dV) and of `row_elems[2]` (Stats), each `b + 1` entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    pub b: usize,
    pub entries: Vec<i32>,
}

/// Which table: its entry offset in [`Tables::entries`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    SeqLen = 0,
    QOffsets = 1,
    KvOffsets = 2,
    StatsOffsets = 3,
}

impl Tables {
    /// The tables of documents of `pieces` rows, for rows of `row_elems`
    /// elements (Q, KV, Stats); an error when an offset does not fit int32
    /// (`shape_supported` refuses such calls first).
    pub fn new(pieces: &[usize], row_elems: [usize; 3]) -> Result<Tables> {
        let b = pieces.len();
        let s = stride(b);
        let mut entries = vec![0i32; 4 * s];
        let fit = |x: usize| {
            i32::try_from(x).map_err(|_| {
                Error::Backend(format!(
                    "cuDNN ragged SDPA: element offset {x} does not fit int32"
                ))
            })
        };
        let mut row = 0usize;
        for (i, &n) in pieces.iter().enumerate() {
            entries[i] = fit(n)?;
            for (t, e) in row_elems.iter().enumerate() {
                entries[(t + 1) * s + i] = fit(row * e)?;
            }
            row += n;
        }
        for (t, e) in row_elems.iter().enumerate() {
            entries[(t + 1) * s + b] = fit(row * e)?;
        }
        Ok(Tables { b, entries })
    }

    /// Byte offset of `t` in the region.
    pub fn byte_offset(&self, t: Table) -> usize {
        t as usize * stride(self.b) * 4
    }
}

/// Whether element offsets up to `rows · row_elems` fit int32 (the type of
/// cuDNN's ragged offset tables).
pub fn offsets_fit(rows: usize, row_elems: usize) -> bool {
    rows.checked_mul(row_elems)
        .is_some_and(|x| x <= i32::MAX as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BoundedMask;
    use proptest::prelude::*;

    proptest! {
        /// The plan geometry holds every document, is a power of two of at
        /// least 128 rows and under twice the longest (or 128).
        #[test]
        fn dims_hold_the_longest_document(pieces in prop::collection::vec(1usize..5000, 1..40)) {
            let d = dims(&pieces);
            let longest = *pieces.iter().max().unwrap();
            prop_assert_eq!(d.b, pieces.len());
            prop_assert!(d.s_max.is_power_of_two() && d.s_max >= MIN_S_MAX);
            prop_assert!(d.s_max >= longest && d.s_max < 2 * longest.max(MIN_S_MAX));
        }

        /// The tables are the lengths and the prefix sums of the rows times
        /// each operand's row elements, end included, and fit the region of
        /// any call holding these rows.
        #[test]
        fn tables_are_lengths_and_scaled_prefix_sums(
            pieces in prop::collection::vec(1usize..300, 1..30),
            q in 1usize..4096, kv in 1usize..2048, st in 1usize..64,
        ) {
            let t = Tables::new(&pieces, [q, kv, st]).unwrap();
            let b = pieces.len();
            let sq: usize = pieces.iter().sum();
            let at = |tab: Table, i: usize| t.entries[t.byte_offset(tab) / 4 + i] as usize;
            let mut row = 0;
            for (i, &n) in pieces.iter().enumerate() {
                prop_assert_eq!(at(Table::SeqLen, i), n);
                prop_assert_eq!(at(Table::QOffsets, i), row * q);
                prop_assert_eq!(at(Table::KvOffsets, i), row * kv);
                prop_assert_eq!(at(Table::StatsOffsets, i), row * st);
                row += n;
            }
            prop_assert_eq!(at(Table::QOffsets, b), sq * q);
            prop_assert_eq!(at(Table::KvOffsets, b), sq * kv);
            prop_assert_eq!(at(Table::StatsOffsets, b), sq * st);
            prop_assert!(t.entries.len() * 4 <= table_bytes(sq));
            prop_assert!(t.byte_offset(Table::QOffsets).is_multiple_of(16));
        }
    }

    /// A call is ragged when its documents mask covers its own rows with
    /// two documents or more and no window; the pieces are the documents'.
    #[test]
    fn calls_of_several_documents_are_ragged() {
        let m = BoundedMask::documents(&[0, 1, 37, 337], 1337).unwrap();
        let pieces = call_pieces(&AttnMask::Bounded(m.clone())).unwrap();
        assert_eq!(pieces, vec![1, 36, 300, 1000]);
        assert_eq!(dims(&pieces), RaggedDims { b: 4, s_max: 1024 });
        let one = BoundedMask::documents(&[0], 64).unwrap();
        assert_eq!(call_pieces(&AttnMask::Bounded(one)), None);
        let windowed = m.with_window(100).unwrap();
        assert_eq!(call_pieces(&AttnMask::Bounded(windowed)), None);
        assert_eq!(call_pieces(&AttnMask::Causal), None);
        let e = Tables::new(&[1 << 20, 1 << 20], [4096, 8, 1]).unwrap_err();
        assert!(e.to_string().contains("int32"), "{e}");
        assert!(offsets_fit(1 << 18, 4096) && !offsets_fit(1 << 19, 4096));
    }
}
