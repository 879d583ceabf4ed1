//! [`AttnMask`]: which keys each query of an attention call may see.
//!
//! One value carried from where a sequence's mask is known (the decoder,
//! `model::WINDOW_MASK`) through the strategies (`attention/`,
//! which re-exports it: the ring derives each block's mask from the
//! sequence's) down to every kernel ([`Backend::attention_fwd`] /
//! [`attention_bwd`](Backend::attention_bwd)) and the planner's FLOP counts
//! (`model/flops.rs`). Kernels and the planner ask the mask
//! ([`allows`](AttnMask::allows), [`visible_keys`](AttnMask::visible_keys),
//! [`flop_fraction`](AttnMask::flop_fraction)) instead of branching on a flag.
//!
//! [`Backend::attention_fwd`]: super::Backend::attention_fwd
//! [`Backend`]: super::Backend

pub use super::bounded_mask::{BoundedMask, RowPositions};
use std::fmt;
use std::ops::Range;

/// The attention mask of one call (or of one sequence, before a strategy
/// cuts it into calls), in the call's row coordinates: query row `q` of
/// `sq`, key row `k` of `sk`.
///
/// Today's masks:
/// - [`Full`](AttnMask::Full): every query sees every key (bidirectional);
///   the zigzag ring's blocks whose keys all precede their queries.
/// - [`Causal`](AttnMask::Causal): top-left causal, query `q` sees keys
///   `0..=q`; needs `sq == sk`. A one-document window's mask.
/// - [`Bounded`](AttnMask::Bounded): causal with a lower bound per query
///   ([`BoundedMask`]): the query at sequence position `p` sees positions
///   `lo(p)..=p`. Packed documents (block-diagonal causal, `lo` the
///   document's start); a sliding window (Mistral's `sliding_window`)
///   composes into the same bound, `lo(p) = max(document start, p −
///   window + 1)` ([`BoundedMask::with_window`]). The mask holds the
///   bound per sequence position and the positions of the call's rows, so
///   a ring block's mask is the sequence's seen through the block's rows.
///
/// The CPU reference loops over [`visible_keys`](Self::visible_keys); a
/// kernel that cannot run a variant refuses it where it is selected (its
/// match on the mask has no wildcard arm, so the compiler names every such
/// place). The backend takes the mask by reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AttnMask {
    /// Every query sees every key.
    Full,
    /// Query row `q` sees key rows `0..=q` (`sq == sk`).
    Causal,
    /// Causal with a lower bound per query, over the call's rows' positions.
    Bounded(BoundedMask),
}

impl AttnMask {
    /// Whether query row `q` may see key row `k`.
    pub fn allows(&self, q: usize, k: usize) -> bool {
        match self {
            AttnMask::Full => true,
            AttnMask::Causal => k <= q,
            AttnMask::Bounded(m) => m.visible_keys(q, usize::MAX).contains(&k),
        }
    }

    /// The key rows query row `q` sees among `sk` keys: one contiguous range
    /// (empty for none). Kernels loop over it.
    pub fn visible_keys(&self, q: usize, sk: usize) -> Range<usize> {
        match self {
            AttnMask::Full => 0..sk,
            AttnMask::Causal => 0..(q + 1).min(sk),
            AttnMask::Bounded(m) => m.visible_keys(q, sk),
        }
    }

    /// Checks that a call of `sq` query rows over `sk` key rows can carry
    /// this mask: a causal mask is top-left aligned and needs `sq == sk`; a
    /// bounded one has exactly `sq` query and `sk` key rows.
    /// The error says why, for the caller to prefix with the kernel's name.
    pub fn check_shape(&self, sq: usize, sk: usize) -> Result<(), String> {
        match self {
            AttnMask::Full => Ok(()),
            AttnMask::Causal if sq == sk => Ok(()),
            AttnMask::Causal => Err(format!(
                "a causal block needs as many queries as keys ({sq} vs {sk})"
            )),
            AttnMask::Bounded(m) => m.check_shape(sq, sk),
        }
    }

    /// The fraction of a layer's `seq × seq` score matrix that model FLOPs
    /// count as computed over a sequence of `seq` tokens: 1 for
    /// [`Full`](Self::Full); ½ for [`Causal`](Self::Causal), whatever `seq`
    /// (the convention of published model TFLOP/s, which ignores the
    /// diagonal's half). A [`Bounded`](Self::Bounded) mask (over its own
    /// rows, `seq` of them) counts the pairs it allows, less the same half
    /// diagonal: ½ for one document, less for several.
    pub fn flop_fraction(&self, seq: usize) -> f64 {
        match self {
            AttnMask::Full => 1.0,
            AttnMask::Causal => 0.5,
            AttnMask::Bounded(m) => {
                let (sq, sk) = (m.rows().0.len(), m.rows().1.len());
                let _ = seq;
                if sq == 0 || sk == 0 {
                    return 0.0;
                }
                (m.visible_pairs() as f64 - 0.5 * sq as f64) / (sq * sk) as f64
            }
        }
    }

    /// Query/key pairs of an `sq × sk` call this mask allows: the sum of the
    /// rows' [`visible_keys`](Self::visible_keys).
    pub fn visible_pairs(&self, sq: usize, sk: usize) -> usize {
        match self {
            AttnMask::Full | AttnMask::Causal => {
                (0..sq).map(|q| self.visible_keys(q, sk).len()).sum()
            }
            AttnMask::Bounded(m) => m.visible_pairs(),
        }
    }

    /// Whether no query of an `sq × sk` call sees any key: a block nothing
    /// need be computed for (a ring block of other documents).
    pub fn hides_all(&self, sq: usize, sk: usize) -> bool {
        match self {
            AttnMask::Full | AttnMask::Causal => sq == 0 || sk == 0,
            AttnMask::Bounded(m) => m.hides_all(),
        }
    }

    /// The mask's name in logs and tables: `full`, `causal`, `documents`,
    /// `sliding window`, `documents+window`.
    pub fn name(&self) -> &'static str {
        match self {
            AttnMask::Full => "full",
            AttnMask::Causal => "causal",
            AttnMask::Bounded(m) => match (m.window().is_some(), m.one_document()) {
                (false, _) => "documents",
                (true, true) => "sliding window",
                (true, false) => "documents+window",
            },
        }
    }
}

impl fmt::Display for AttnMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASKS: [AttnMask; 2] = [AttnMask::Full, AttnMask::Causal];

    /// `visible_keys` is exactly the set `allows` admits, row by row.
    #[test]
    fn visible_keys_are_the_allowed_keys() {
        for mask in MASKS {
            for s in 0..7 {
                for q in 0..s {
                    let want: Vec<usize> = (0..s).filter(|&k| mask.allows(q, k)).collect();
                    let got: Vec<usize> = mask.visible_keys(q, s).collect();
                    assert_eq!(got, want, "{mask} q={q} s={s}");
                }
            }
        }
    }

    #[test]
    fn causal_sees_the_past_and_itself() {
        let m = AttnMask::Causal;
        assert!(m.allows(3, 0) && m.allows(3, 3) && !m.allows(3, 4));
        assert_eq!(m.visible_keys(0, 5), 0..1);
        assert_eq!(m.visible_keys(4, 5), 0..5);
        assert_eq!(m.visible_pairs(4, 4), 10);
        assert!(AttnMask::Full.allows(0, 9));
        assert_eq!(AttnMask::Full.visible_pairs(3, 5), 15);
    }

    #[test]
    fn only_causal_needs_a_square_block() {
        assert!(AttnMask::Causal.check_shape(4, 4).is_ok());
        let e = AttnMask::Causal.check_shape(4, 8).unwrap_err();
        assert_eq!(e, "a causal block needs as many queries as keys (4 vs 8)");
        assert!(AttnMask::Full.check_shape(4, 8).is_ok());
    }

    /// The FLOP fraction is the allowed share of the square, up to the
    /// causal diagonal's half row the convention leaves out.
    #[test]
    fn flop_fraction_is_the_allowed_share() {
        for s in [1usize, 2, 16, 1000] {
            let exact = AttnMask::Causal.visible_pairs(s, s) as f64 / (s * s) as f64;
            let diagonal = 0.5 / s as f64;
            assert!((AttnMask::Causal.flop_fraction(s) - (exact - diagonal)).abs() < 1e-12);
            assert_eq!(AttnMask::Full.flop_fraction(s), 1.0);
        }
    }

    /// One document is the causal mask, in pairs and in FLOPs.
    #[test]
    fn one_document_is_causal() {
        for s in [1usize, 5, 16] {
            let m = AttnMask::Bounded(BoundedMask::documents(&[0], s).unwrap());
            for q in 0..s {
                assert_eq!(m.visible_keys(q, s), AttnMask::Causal.visible_keys(q, s));
            }
            assert_eq!(m.flop_fraction(s), AttnMask::Causal.flop_fraction(s));
            assert!(m.check_shape(s, s).is_ok() && m.check_shape(s, s + 1).is_err());
        }
        let two = AttnMask::Bounded(BoundedMask::documents(&[0, 8], 16).unwrap());
        assert_eq!(two.flop_fraction(16), 0.25);
        assert_eq!(two.name(), "documents");
        assert!(two.allows(9, 8) && !two.allows(9, 7) && !two.allows(3, 4));
    }

    /// A sliding window of `w` over one document counts its band, by
    /// formula: `Σ_p min(p + 1, w)` pairs, less the half diagonal; with
    /// documents, each document's band.
    #[test]
    fn a_window_counts_its_band() {
        let band = |s: usize, w: usize| match s <= w {
            true => s * (s + 1) / 2,
            false => w * (w + 1) / 2 + (s - w) * w,
        };
        for (s, w) in [
            (16usize, 4usize),
            (1000, 100),
            (4096, 4096),
            (100, 1),
            (7, 9),
        ] {
            let m = BoundedMask::documents(&[0], s)
                .unwrap()
                .with_window(w)
                .unwrap();
            let m = AttnMask::Bounded(m);
            let want = (band(s, w) as f64 - 0.5 * s as f64) / (s * s) as f64;
            assert!((m.flop_fraction(s) - want).abs() < 1e-12, "s={s} w={w}");
            assert_eq!(m.visible_pairs(s, s), band(s, w));
            assert_eq!(m.name(), "sliding window");
        }
        let docs = BoundedMask::documents(&[0, 10], 30)
            .unwrap()
            .with_window(4)
            .unwrap();
        let docs = AttnMask::Bounded(docs);
        assert_eq!(docs.visible_pairs(30, 30), band(10, 4) + band(20, 4));
        assert_eq!(docs.name(), "documents+window");
    }

    #[test]
    fn names() {
        assert_eq!(AttnMask::Causal.to_string(), "causal");
        assert_eq!(AttnMask::Full.to_string(), "full");
    }
}
