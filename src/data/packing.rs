//! `--pack`: how training windows are made from a stream of documents, as
//! pure functions from ids, document index and loss mask to
//! [`PackedWindow`]s.
//!
//! - `stream`: windows of `L + 1` consecutive ids cut from the stream;
//!   attention, positions and targets run across document boundaries.
//! - `documents` (the default): the same windows, but positions restart at
//!   every document start, attention is block-diagonal causal over the
//!   documents, and the target of a document's last id (its EOS), which
//!   would be the next document's first, is not counted.
//! - `bfd`: whole documents packed into windows of `L` by best-fit
//!   decreasing; a document longer than `L` is cut into pieces of `L`
//!   (each a document of its window, the target of a piece's last id the
//!   next piece's first); what no document fills is padding (input 0,
//!   target not counted, a document of its own at the window's end).
//!
//! In every mode a target the loss mask does not count is
//! [`IGNORE`](crate::backend::IGNORE).

use super::doc_index::{DocIndex, LossMask};
use super::tokens::Tokens;
use super::window::PackedWindow;
use crate::backend::IGNORE;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `--pack`: how windows are made from documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PackMode {
    /// Windows cut from the stream, across documents.
    Stream,
    /// Windows cut from the stream, documents kept apart inside them.
    #[default]
    Documents,
    /// Whole documents packed into windows by best-fit decreasing.
    Bfd,
}

impl std::fmt::Display for PackMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PackMode::Stream => "stream",
            PackMode::Documents => "documents",
            PackMode::Bfd => "bfd",
        })
    }
}

/// The window of the `L + 1` ids `ids` that start at id `start` of the
/// stream (`stream` or `documents`; `docs`/`mask` of the whole stream).
pub fn cut_window(
    start: u64,
    ids: &[u32],
    docs: Option<&DocIndex>,
    mask: Option<&LossMask>,
    mode: PackMode,
) -> PackedWindow {
    let seq = ids.len() - 1;
    let mut w = PackedWindow::stream(ids[..seq].to_vec(), ids[1..].to_vec());
    if let Some(mask) = mask {
        for (p, t) in w.targets.iter_mut().enumerate() {
            if !mask.counts(start + p as u64 + 1) {
                *t = IGNORE;
            }
        }
    }
    if let (PackMode::Documents | PackMode::Bfd, Some(docs)) = (mode, docs) {
        // a document starting at offset q in 1..=L: the target of q - 1 is
        // its first id, across the boundary
        for &s in docs.starts_in(start + 1..start + seq as u64 + 1) {
            let q = (s - start) as usize;
            w.targets[q - 1] = IGNORE;
            if q < seq {
                w.doc_starts.push(q as u32);
            }
        }
    }
    w
}

/// A piece of a document: at most `L` of its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Its first id in the stream.
    pub start: u64,
    /// Ids in it (1..=L).
    pub len: u32,
    /// Whether it ends its document (its last id's target is not counted).
    pub ends_document: bool,
}

/// The documents of `docs` cut into pieces of at most `seq` ids, in order.
pub fn pieces(docs: &DocIndex, seq: usize) -> Vec<Piece> {
    let mut out = Vec::with_capacity(docs.len());
    for d in 0..docs.len() {
        let span = docs.span(d);
        let mut at = span.start;
        while at < span.end {
            let len = (span.end - at).min(seq as u64);
            out.push(Piece {
                start: at,
                len: len as u32,
                ends_document: at + len == span.end,
            });
            at += len;
        }
    }
    out
}

/// Best-fit decreasing: `pieces` (each at most `seq` ids) into bins of
/// `seq` ids. The longest first (ties in stream order), each into the bin
/// with the least room that holds it, else a new bin. `[bins][pieces]`.
pub fn best_fit_decreasing(pieces: &[Piece], seq: usize) -> Vec<Vec<Piece>> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(pieces[i].len));
    let mut bins: Vec<Vec<Piece>> = Vec::new();
    // room left → the bins with that much room
    let mut by_room: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for i in order {
        let p = pieces[i];
        let n = p.len as usize;
        let fit = by_room.range(n..).next().map(|(&room, _)| room);
        let (bin, room) = match fit {
            Some(room) => {
                let list = by_room.get_mut(&room).expect("a listed room");
                let bin = list.pop().expect("a non-empty list");
                if list.is_empty() {
                    by_room.remove(&room);
                }
                (bin, room)
            }
            None => {
                bins.push(Vec::new());
                (bins.len() - 1, seq)
            }
        };
        bins[bin].push(p);
        if room > n {
            by_room.entry(room - n).or_default().push(bin);
        }
    }
    bins
}

/// The window of one bin of pieces, padded to `seq` ids.
pub fn bin_window(
    bin: &[Piece],
    tokens: &Tokens,
    mask: Option<&LossMask>,
    seq: usize,
) -> PackedWindow {
    let mut w = PackedWindow {
        inputs: Vec::with_capacity(seq),
        targets: Vec::with_capacity(seq),
        doc_starts: Vec::with_capacity(bin.len() + 1),
    };
    let mut ids = Vec::with_capacity(seq + 1);
    for p in bin {
        w.doc_starts.push(w.inputs.len() as u32);
        let end = p.start + p.len as u64 + u64::from(!p.ends_document);
        tokens.read_into(p.start as usize..end as usize, &mut ids);
        let n = p.len as usize;
        w.inputs.extend_from_slice(&ids[..n]);
        for q in 0..n {
            let g = p.start + q as u64 + 1;
            let counted = (q + 1 < n || !p.ends_document) && mask.is_none_or(|m| m.counts(g));
            w.targets.push(if counted { ids[q + 1] } else { IGNORE });
        }
    }
    if w.inputs.len() < seq {
        // padding: a document of its own, nothing counted
        w.doc_starts.push(w.inputs.len() as u32);
        w.inputs.resize(seq, 0);
        w.targets.resize(seq, IGNORE);
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn index(lengths: &[u64]) -> DocIndex {
        let mut starts = Vec::new();
        let mut at = 0;
        for &n in lengths {
            starts.push(at);
            at += n;
        }
        DocIndex::new(starts, at, "test").unwrap()
    }

    #[test]
    fn documents_windows_restart_and_never_target_across() {
        // documents [0,3) [3,5) [5,9); ids equal their index
        let docs = index(&[3, 2, 4]);
        let ids: Vec<u32> = (1..7).collect(); // window starting at id 1, L = 5
        let w = cut_window(1, &ids, Some(&docs), None, PackMode::Documents);
        assert_eq!(w.inputs, [1, 2, 3, 4, 5]);
        assert_eq!(w.doc_starts, [0, 2, 4]);
        // the EOS of a document (ids 2 and 4) is predicted by the id before
        // it; its own target, the next document's first id, is not counted
        assert_eq!(w.targets, [2, IGNORE, 4, IGNORE, 6]);
        assert_eq!(w.positions(), [0, 1, 0, 1, 0]);
        w.validate().unwrap();
        let s = cut_window(1, &ids, Some(&docs), None, PackMode::Stream);
        assert_eq!((s.targets, s.doc_starts), (vec![2, 3, 4, 5, 6], vec![0]));
        // a document starting right after the window: the last target crosses
        let w = cut_window(
            0,
            &ids[..4],
            Some(&index(&[3, 6])),
            None,
            PackMode::Documents,
        );
        assert_eq!((w.targets[2], w.doc_starts.clone()), (IGNORE, vec![0]));
    }

    #[test]
    fn the_loss_mask_ignores_prompt_targets_in_every_mode() {
        let docs = index(&[4, 4]);
        // tokens 0..2 and 4..6 are prompts, the rest answers
        let mask = LossMask::from_flags(&[false, false, true, true, false, false, true, true]);
        let tokens = Tokens::from((0..8).collect::<Vec<u32>>());
        for mode in [PackMode::Stream, PackMode::Documents] {
            let ids = tokens.read(0..8);
            let w = cut_window(0, &ids, Some(&docs), Some(&mask), mode);
            assert_eq!(w.targets[..3], [IGNORE, 2, 3], "{mode}");
            assert_eq!(w.targets[4..], [IGNORE, 6, 7], "{mode}");
        }
        let bins = best_fit_decreasing(&pieces(&docs, 8), 8);
        let w = bin_window(&bins[0], &tokens, Some(&mask), 8);
        assert_eq!(w.targets, [IGNORE, 2, 3, IGNORE, IGNORE, 6, 7, IGNORE]);
    }

    #[test]
    fn bfd_splits_long_documents_and_pads_only_the_rest() {
        let docs = index(&[7, 2, 3]);
        let tokens = Tokens::from((0..12).collect::<Vec<u32>>());
        let p = pieces(&docs, 4);
        assert_eq!(p.iter().map(|p| p.len).collect::<Vec<_>>(), [4, 3, 2, 3]);
        let bins = best_fit_decreasing(&p, 4);
        let windows: Vec<_> = bins
            .iter()
            .map(|b| bin_window(b, &tokens, None, 4))
            .collect();
        // [0..4) is a piece whose last target, id 4, is in the same document
        assert_eq!(windows[0].targets, [1, 2, 3, 4]);
        for w in &windows {
            w.validate().unwrap();
            assert_eq!(w.len(), 4);
        }
        // 4, 3, 3 and 2 ids: no two of the last three fit one window
        assert_eq!(bins.len(), 4);
        assert_eq!(windows[3].doc_starts, [0, 2]);
        assert_eq!(windows[3].targets[1..], [IGNORE, IGNORE, IGNORE]);
    }

    proptest! {
        /// Every id of every document is an input of exactly one window,
        /// no window is over `seq`, and no target crosses a document.
        #[test]
        fn bfd_loses_and_duplicates_no_token(
            lengths in proptest::collection::vec(1u64..40, 1..60),
            seq in 1usize..32,
        ) {
            let docs = index(&lengths);
            let n = docs.tokens() as usize;
            // id i holds i, so each input names its own position
            let tokens = Tokens::from((0..n as u32).collect::<Vec<_>>());
            let bins = best_fit_decreasing(&pieces(&docs, seq), seq);
            let mut seen = vec![0u32; n];
            for b in &bins {
                let used: usize = b.iter().map(|p| p.len as usize).sum();
                prop_assert!(used <= seq);
                let w = bin_window(b, &tokens, None, seq);
                prop_assert!(w.validate().is_ok());
                for (q, &i) in w.inputs[..used].iter().enumerate() {
                    seen[i as usize] += 1;
                    let t = w.targets[q];
                    // a counted target is the next id of the same document
                    if t != IGNORE {
                        prop_assert_eq!(t, i + 1);
                        let d = docs.starts_in(0..u64::from(i) + 1).len() - 1;
                        prop_assert!(docs.span(d).contains(&u64::from(t)));
                    }
                }
                prop_assert!(w.targets[used..].iter().all(|&t| t == IGNORE));
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{:?}", seen);
            // best fit never leaves two bins that one could hold
            let rooms: Vec<usize> = bins.iter().map(|b| b.iter().map(|p| p.len as usize).sum()).collect();
            let lone = rooms.iter().filter(|&&u| u * 2 <= seq).count();
            prop_assert!(lone <= 1, "{:?}", rooms);
        }
    }
}
