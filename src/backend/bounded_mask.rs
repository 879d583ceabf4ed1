//! [`BoundedMask`]: causal attention with a lower bound per query, the mask
//! of packed documents and of sliding windows (Mistral's `sliding_window`),
//! composed into the same bound, and [`RowPositions`], which sequence
//! positions a call's rows hold.

use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Which sequence positions the rows of one side (queries or keys) of an
/// attention call hold: at most two ascending runs of consecutive
/// positions, one after the other (a zigzag ring shard is chunk `i` then
/// chunk `2P-1-i`; a plain call is one run). Ascending rows make every
/// query's visible keys one contiguous range of rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowPositions {
    /// `(first position, rows)` of each run; the second may be empty.
    runs: [(u32, u32); 2],
}

impl RowPositions {
    /// Rows holding positions `start..start + len`.
    pub fn contiguous(start: usize, len: usize) -> RowPositions {
        RowPositions {
            runs: [(start as u32, len as u32), (0, 0)],
        }
    }

    /// Rows holding `a`, then `b` (`b` starts at or after `a`'s end).
    pub fn two_runs(a: Range<usize>, b: Range<usize>) -> RowPositions {
        debug_assert!(b.is_empty() || a.end <= b.start);
        RowPositions {
            runs: [
                (a.start as u32, a.len() as u32),
                (b.start as u32, b.len() as u32),
            ],
        }
    }

    /// Rows.
    pub fn len(&self) -> usize {
        (self.runs[0].1 + self.runs[1].1) as usize
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sequence position of row `r`.
    pub fn pos(&self, r: usize) -> usize {
        let (a, b) = (self.runs[0], self.runs[1]);
        if r < a.1 as usize {
            a.0 as usize + r
        } else {
            b.0 as usize + (r - a.1 as usize)
        }
    }

    /// The first row whose position is `p` or later (`len()` for none).
    pub fn first_row_at_or_after(&self, p: usize) -> usize {
        let mut base = 0;
        for (start, len) in self.runs {
            let (start, len) = (start as usize, len as usize);
            if p < start + len {
                return base + p.saturating_sub(start);
            }
            base += len;
        }
        base
    }

    /// Rows `rows` of these rows, as their own rows.
    pub fn slice(&self, rows: Range<usize>) -> RowPositions {
        let a_len = self.runs[0].1 as usize;
        let part = |lo: usize, hi: usize, run: (u32, u32)| {
            let (lo, hi) = (lo.min(run.1 as usize), hi.min(run.1 as usize));
            (run.0 + lo as u32, hi.saturating_sub(lo) as u32)
        };
        let first = part(rows.start, rows.end, self.runs[0]);
        let second = part(
            rows.start.saturating_sub(a_len),
            rows.end.saturating_sub(a_len),
            self.runs[1],
        );
        if first.1 == 0 {
            RowPositions {
                runs: [second, (0, 0)],
            }
        } else {
            RowPositions {
                runs: [first, second],
            }
        }
    }
}

/// Causal attention with a lower bound per query: the query at sequence
/// position `p` sees the keys at positions `lo(p)..=p`. For packed
/// documents `lo(p)` is the start of `p`'s document (block-diagonal
/// causal); a sliding window of `w` composes into the same bound,
/// `lo(p) = max(document start, p − w + 1)`: key `j` is visible to query
/// `i` iff `doc_start(i) <= j <= i` and `i − j < w`, transformers'
/// `sliding_window_causal_mask_function` (`kv_idx > q_idx − sliding_window`).
///
/// The bound is kept per sequence position and shared (`Arc`); a call sees
/// it through the positions of its query and key rows ([`RowPositions`]),
/// so a ring block's mask is the sequence's mask with other rows
/// ([`with_rows`](Self::with_rows)), and a sub-block's is a slice of them
/// ([`slice`](Self::slice)).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BoundedMask {
    /// `[seq]` the start of each position's document: nondecreasing, `<= p`.
    starts: Arc<[u32]>,
    /// The sliding window (keys per query, itself included), if any.
    window: Option<u32>,
    /// Positions of the call's query rows.
    q: RowPositions,
    /// Positions of the call's key rows.
    k: RowPositions,
}

impl BoundedMask {
    /// The mask of a window of `seq` tokens holding documents that start at
    /// `doc_starts` (ascending, the first 0), over the whole window's rows.
    pub fn documents(doc_starts: &[u32], seq: usize) -> Result<BoundedMask> {
        let ascending = doc_starts.windows(2).all(|w| w[0] < w[1]);
        let inside = doc_starts.last().is_none_or(|&l| (l as usize) < seq.max(1));
        if doc_starts.first() != Some(&0) || !ascending || !inside {
            return Err(Error::Config(format!(
                "document starts {doc_starts:?} are not ascending from 0 inside a window of \
                 {seq} tokens; the data's document index is wrong"
            )));
        }
        let mut lo = Vec::with_capacity(seq);
        let mut next = 1;
        let mut start = 0u32;
        for p in 0..seq as u32 {
            if next < doc_starts.len() && doc_starts[next] == p {
                start = p;
                next += 1;
            }
            lo.push(start);
        }
        let all = RowPositions::contiguous(0, seq);
        Ok(BoundedMask {
            starts: lo.into(),
            window: None,
            q: all,
            k: all,
        })
    }

    /// This mask with a sliding window of `window` keys per query (itself
    /// included) within its document; 0 is refused.
    pub fn with_window(self, window: usize) -> Result<BoundedMask> {
        if window == 0 {
            return Err(Error::Config(
                "a sliding window of 0 keys hides every key; use a sliding_window of at least 1 \
                 (or null for none)"
                    .into(),
            ));
        }
        Ok(BoundedMask {
            window: Some(u32::try_from(window).unwrap_or(u32::MAX)),
            ..self
        })
    }

    /// The sliding window, if the mask has one.
    pub fn window(&self) -> Option<usize> {
        self.window.map(|w| w as usize)
    }

    /// Whether the sequence is one document (positions run from 0 over it).
    pub fn one_document(&self) -> bool {
        self.starts.last().is_none_or(|&s| s == 0)
    }

    /// Positions in the sequence the bound is defined over.
    pub fn seq(&self) -> usize {
        self.starts.len()
    }

    /// The start of the document holding sequence position `p` (RoPE
    /// counts positions from it).
    pub fn doc_start_at(&self, p: usize) -> usize {
        self.starts[p] as usize
    }

    /// The first position the query at sequence position `p` sees: its
    /// document's start, or the window's first key if later.
    pub fn lo_at(&self, p: usize) -> usize {
        let start = self.starts[p] as usize;
        match self.window {
            None => start,
            Some(w) => start.max((p + 1).saturating_sub(w as usize)),
        }
    }

    /// Positions of the query rows and of the key rows.
    pub fn rows(&self) -> (RowPositions, RowPositions) {
        (self.q, self.k)
    }

    /// The same sequence mask seen by a call whose rows hold positions `q`
    /// and `k`.
    pub fn with_rows(&self, q: RowPositions, k: RowPositions) -> BoundedMask {
        BoundedMask {
            starts: self.starts.clone(),
            window: self.window,
            q,
            k,
        }
    }

    /// The mask of the sub-block of query rows `q_rows` and key rows `k_rows`.
    pub fn slice(&self, q_rows: Range<usize>, k_rows: Range<usize>) -> BoundedMask {
        self.with_rows(self.q.slice(q_rows), self.k.slice(k_rows))
    }

    /// The key rows query row `q` sees (one contiguous range, maybe empty).
    pub fn visible_keys(&self, q: usize, sk: usize) -> Range<usize> {
        let p = self.q.pos(q);
        let lo = self.k.first_row_at_or_after(self.lo_at(p)).min(sk);
        let hi = self.k.first_row_at_or_after(p + 1).min(sk);
        lo..hi.max(lo)
    }

    /// The smallest and largest bound (`lo`, as a sequence position) over
    /// query rows `rows`, as `min..max + 1`: a kernel skips a tile of keys
    /// wholly before `min` or after the rows' last position, and needs no
    /// per-row bound where `min == max`.
    pub fn lo_range(&self, rows: Range<usize>) -> Range<usize> {
        if rows.is_empty() {
            return 0..0;
        }
        // rows ascend in position and the bound is nondecreasing
        let first = self.lo_at(self.q.pos(rows.start));
        let last = self.lo_at(self.q.pos(rows.end - 1));
        first..last + 1
    }

    /// Checks that the call has the rows this mask describes.
    pub fn check_shape(&self, sq: usize, sk: usize) -> std::result::Result<(), String> {
        if self.q.len() != sq || self.k.len() != sk {
            return Err(format!(
                "a documents mask of {}x{} rows does not fit a call of {sq}x{sk}",
                self.q.len(),
                self.k.len()
            ));
        }
        Ok(())
    }

    /// Query/key pairs the mask allows in the whole call.
    pub fn visible_pairs(&self) -> usize {
        let sk = self.k.len();
        (0..self.q.len())
            .map(|q| self.visible_keys(q, sk).len())
            .sum()
    }

    /// `[2·sq]` the key rows each query row sees, as the CUDA kernels take
    /// them: every row's first key row, then every row's end (row `q` sees
    /// `b[q]..b[sq + q]`). Both halves are nondecreasing in `q` (rows ascend
    /// in position and the bound is nondecreasing), which lets a kernel find a
    /// tile's keys from its first and last rows.
    pub fn row_bounds(&self) -> Vec<u32> {
        let (sq, sk) = (self.q.len(), self.k.len());
        let mut b = vec![0u32; 2 * sq];
        for q in 0..sq {
            let r = self.visible_keys(q, sk);
            b[q] = r.start as u32;
            b[sq + q] = r.end as u32;
        }
        b
    }

    /// The call as a plain causal band, the form cuDNN's SDPA graphs take:
    /// `Some(None)` when it is causal attention over its own rows (query
    /// and key rows the same contiguous positions, inside one document,
    /// any window covering them all), `Some(Some(w))` when it is that
    /// with a window of `w` keys (row `i` sees rows `i − w < j <= i`),
    /// `None` when the call is neither (several documents, a ring block).
    pub fn causal_band(&self) -> Option<Option<usize>> {
        let (q, k) = (self.q, self.k);
        if q != k || q.runs[1].1 != 0 || q.is_empty() {
            return None;
        }
        let (first, len) = (q.runs[0].0 as usize, q.runs[0].1 as usize);
        // starts are nondecreasing: one document iff the last row's starts
        // at or before the first row
        if self.starts[first + len - 1] as usize > first {
            return None;
        }
        Some(self.window.map(|w| w as usize).filter(|&w| w < len))
    }

    /// The call as documents side by side, the form cuDNN's variable-length
    /// ("ragged") SDPA takes: the row count of each document's piece in
    /// order, when the call is causal attention over its own rows (query and
    /// key rows the same contiguous positions, no sliding window); `None`
    /// otherwise (a ring block, a window). A piece is the part of a document
    /// inside the rows: the first may have begun before them, as a row sees
    /// no key before the call's first. O(pieces · log rows).
    pub fn doc_pieces(&self) -> Option<Vec<usize>> {
        let (q, k) = (self.q, self.k);
        if q != k || q.runs[1].1 != 0 || q.is_empty() || self.window.is_some() {
            return None;
        }
        let (first, len) = (q.runs[0].0 as usize, q.runs[0].1 as usize);
        let rows = &self.starts[first..first + len];
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < len {
            // starts are nondecreasing: the piece ends where a later start begins
            let start = rows[at];
            let end = at + rows[at..].partition_point(|&s| s == start);
            pieces.push(end - at);
            at = end;
        }
        Some(pieces)
    }

    /// Whether no query of the call sees any key (a ring block to skip).
    pub fn hides_all(&self) -> bool {
        let sk = self.k.len();
        (0..self.q.len()).all(|q| self.visible_keys(q, sk).is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_bound_each_query_by_its_document_start() {
        let m = BoundedMask::documents(&[0, 2, 5], 6).unwrap();
        let keys: Vec<_> = (0..6).map(|q| m.visible_keys(q, 6)).collect();
        assert_eq!(keys, vec![0..1, 0..2, 2..3, 2..4, 2..5, 5..6]);
        assert_eq!(m.visible_pairs(), 1 + 2 + 1 + 2 + 3 + 1);
        assert_eq!(m.lo_range(1..4), 0..3);
        assert!(BoundedMask::documents(&[1], 4).is_err());
        assert!(BoundedMask::documents(&[0, 4], 4).is_err());
        assert!(BoundedMask::documents(&[0, 2, 2], 4).is_err());
    }

    /// The kernels' row bounds equal `visible_keys` and never decrease, for
    /// whole windows and for ring blocks of two runs.
    #[test]
    fn row_bounds_are_the_visible_keys_and_ascend() {
        let m = BoundedMask::documents(&[0, 1, 5, 6, 13], 16).unwrap();
        let blocks = [
            m.clone(),
            m.with_rows(
                RowPositions::two_runs(2..6, 10..14),
                RowPositions::two_runs(0..4, 12..16),
            ),
            m.with_rows(
                RowPositions::contiguous(8, 8),
                RowPositions::contiguous(0, 8),
            ),
            m.slice(3..9, 0..16),
        ];
        for blk in blocks {
            let (q, k) = blk.rows();
            let (sq, sk) = (q.len(), k.len());
            let b = blk.row_bounds();
            for r in 0..sq {
                let want = blk.visible_keys(r, sk);
                assert_eq!(
                    b[r] as usize..b[sq + r] as usize,
                    want,
                    "row {r} of {blk:?}"
                );
                if r > 0 {
                    assert!(b[r] >= b[r - 1] && b[sq + r] >= b[sq + r - 1], "row {r}");
                }
            }
        }
    }

    /// `causal_band` is the mask itself wherever it answers: every query
    /// sees exactly rows `i − w < j <= i` (or `0..=i`), for whole windows,
    /// slices of them and ring blocks; calls spanning documents or ring
    /// shards answer `None`.
    #[test]
    fn causal_band_is_the_mask_where_it_answers() {
        let mut rng = crate::rng::Rng::new(7);
        let (mut bands, mut nones) = (0, 0);
        for case in 0..200 {
            let seq = 2 + rng.below(24) as usize;
            let starts = if case % 2 == 0 {
                vec![0]
            } else {
                random_starts(&mut rng, seq)
            };
            let window = 1 + rng.below(seq as u64 + 2) as usize;
            let m = BoundedMask::documents(&starts, seq).unwrap();
            let m = if case % 3 == 0 {
                m
            } else {
                m.with_window(window).unwrap()
            };
            let a = rng.below(seq as u64) as usize;
            let b = a + 1 + rng.below((seq - a) as u64) as usize;
            let half = seq / 2;
            let calls = [
                m.clone(),
                m.slice(a..b, a..b),
                m.slice(a..b, 0..b),
                m.with_rows(
                    RowPositions::two_runs(0..half / 2, half..half + half / 2),
                    RowPositions::two_runs(0..half / 2, half..half + half / 2),
                ),
            ];
            for c in calls {
                let (q, k) = c.rows();
                let Some(w) = c.causal_band() else {
                    nones += 1;
                    continue;
                };
                bands += 1;
                assert_eq!(q.len(), k.len());
                for i in 0..q.len() {
                    let lo = w.map_or(0, |w| (i + 1).saturating_sub(w));
                    assert_eq!(c.visible_keys(i, k.len()), lo..i + 1, "case {case}: {c:?}");
                }
            }
        }
        assert!(bands > 100 && nones > 100, "{bands} bands, {nones} others");
    }

    /// transformers' sliding-window causal mask over documents, by its
    /// definition: key `j` is visible to query `i` iff it is in `i`'s
    /// document, not after `i`, and `i − j < window`.
    fn brute_allows(starts: &[u32], window: usize, i: usize, j: usize) -> bool {
        let doc = |p: usize| starts.iter().rposition(|&s| s as usize <= p).unwrap();
        doc(i) == doc(j) && j <= i && i - j < window
    }

    /// Random ascending document starts from 0 inside `seq`.
    fn random_starts(rng: &mut crate::rng::Rng, seq: usize) -> Vec<u32> {
        let mut starts = vec![0u32];
        for p in 1..seq {
            if rng.below(5) == 0 {
                starts.push(p as u32);
            }
        }
        starts
    }

    /// The windowed mask equals the brute-force definition for every query
    /// and key row, over lengths, windows (1, shorter than a document,
    /// longer than the sequence), document starts, whole windows and the
    /// zigzag ring's blocks (two runs of positions) and their slices; the
    /// kernels' row bounds stay nondecreasing.
    #[test]
    fn windowed_mask_equals_brute_force() {
        let mut rng = crate::rng::Rng::new(34);
        for case in 0..120 {
            let p = 1 + rng.below(4) as usize;
            let half = 1 + rng.below(6) as usize;
            let seq = 2 * p * half;
            let window = match case % 4 {
                0 => 1,
                1 => seq + 3,
                _ => 1 + rng.below(seq as u64) as usize,
            };
            let starts = if case % 3 == 0 {
                vec![0]
            } else {
                random_starts(&mut rng, seq)
            };
            let m = BoundedMask::documents(&starts, seq)
                .unwrap()
                .with_window(window)
                .unwrap();
            assert_eq!(m.window(), Some(window));
            let shard = |r: usize| {
                if p == 1 {
                    RowPositions::contiguous(0, seq)
                } else {
                    let j = 2 * p - 1 - r;
                    RowPositions::two_runs(r * half..(r + 1) * half, j * half..(j + 1) * half)
                }
            };
            let mut blocks = vec![m.clone()];
            for i in 0..p {
                for src in 0..p {
                    let blk = m.with_rows(shard(i), shard(src));
                    blocks.push(blk.slice(half.min(1)..2 * half, 0..half));
                    blocks.push(blk);
                }
            }
            for blk in blocks {
                let (q, k) = blk.rows();
                let (sq, sk) = (q.len(), k.len());
                let bounds = blk.row_bounds();
                let mut pairs = 0;
                for r in 0..sq {
                    let want: Vec<usize> = (0..sk)
                        .filter(|&c| brute_allows(&starts, window, q.pos(r), k.pos(c)))
                        .collect();
                    let got: Vec<usize> = blk.visible_keys(r, sk).collect();
                    assert_eq!(got, want, "case {case} row {r} of {blk:?}");
                    pairs += want.len();
                    if r > 0 {
                        assert!(bounds[r] >= bounds[r - 1] && bounds[sq + r] >= bounds[sq + r - 1]);
                    }
                }
                assert_eq!(blk.visible_pairs(), pairs);
                assert_eq!(blk.hides_all(), pairs == 0);
            }
        }
    }

    /// RoPE counts from the document's start, not from the window's.
    #[test]
    fn a_window_bounds_keys_not_positions() {
        let m = BoundedMask::documents(&[0, 10], 20)
            .unwrap()
            .with_window(4)
            .unwrap();
        assert_eq!((m.lo_at(8), m.doc_start_at(8)), (5, 0));
        assert_eq!((m.lo_at(11), m.doc_start_at(11)), (10, 10));
        assert_eq!((m.lo_at(19), m.doc_start_at(19)), (16, 10));
        assert!(!m.one_document());
        let e = BoundedMask::documents(&[0], 8).unwrap().with_window(0);
        assert!(e.unwrap_err().to_string().contains("sliding window of 0"));
    }

    /// Rows in two runs see the keys whose positions the bound admits.
    #[test]
    fn two_runs_see_through_positions() {
        let m = BoundedMask::documents(&[0, 3, 7], 12).unwrap();
        let rows = RowPositions::two_runs(2..4, 8..10);
        let blk = m.with_rows(rows, rows);
        for q in 0..4 {
            let qp = rows.pos(q);
            let want: Vec<usize> = (0..4)
                .filter(|&k| rows.pos(k) <= qp && rows.pos(k) >= m.lo_at(qp))
                .collect();
            let got: Vec<usize> = blk.visible_keys(q, 4).collect();
            assert_eq!(got, want, "q={q}");
        }
        assert_eq!(rows.slice(1..3), RowPositions::two_runs(3..4, 8..9));
        assert_eq!(rows.slice(2..4), RowPositions::contiguous(8, 2));
        assert_eq!(rows.first_row_at_or_after(5), 2);
        assert_eq!(rows.first_row_at_or_after(11), 4);
        // keys 8, 9 after query 2 or 3, none visible
        let later = m.with_rows(
            RowPositions::contiguous(2, 2),
            RowPositions::contiguous(8, 2),
        );
        assert!(later.hides_all());
    }

    /// `doc_pieces` tiles the call's rows, and each piece is causal
    /// attention over its own rows (what cuDNN's ragged call computes):
    /// for random documents, any contiguous slice of rows (a piece may
    /// begin before the call), with and without a window (`None` then), and
    /// on ring blocks of two runs (`None`).
    #[test]
    fn doc_pieces_are_causal_blocks_tiling_the_rows() {
        let mut rng = crate::rng::Rng::new(91);
        for _ in 0..200 {
            let seq = 1 + rng.below(60) as usize;
            let m = BoundedMask::documents(&random_starts(&mut rng, seq), seq).unwrap();
            let lo = rng.below(seq as u64) as usize;
            let hi = lo + 1 + rng.below((seq - lo) as u64) as usize;
            let rows = RowPositions::contiguous(lo, hi - lo);
            let call = m.with_rows(rows, rows);
            let pieces = call.doc_pieces().expect("one run of rows");
            assert_eq!(pieces.iter().sum::<usize>(), hi - lo);
            assert!(pieces.iter().all(|&n| n > 0));
            let mut first = 0;
            for n in pieces {
                for q in first..first + n {
                    assert_eq!(
                        call.visible_keys(q, hi - lo),
                        first..q + 1,
                        "rows {lo}..{hi}"
                    );
                }
                first += n;
            }
            assert_eq!(call.clone().with_window(3).unwrap().doc_pieces(), None);
        }
        let m = BoundedMask::documents(&[0, 3, 7], 12).unwrap();
        let ring = RowPositions::two_runs(2..4, 8..10);
        assert_eq!(m.with_rows(ring, ring).doc_pieces(), None);
        assert_eq!(m.doc_pieces(), Some(vec![3, 4, 5]));
        let mid = RowPositions::contiguous(5, 7);
        assert_eq!(m.with_rows(mid, mid).doc_pieces(), Some(vec![2, 5]));
    }
}
