//! [`PackedSampler`]: the training windows of a [`Dataset`] as the model
//! takes them ([`PackedWindow`]), in a deterministic order per seed, for one
//! data-parallel rank, resumable from a [`SamplerState`].
//!
//! `stream` and `documents` visit the windows of [`SequenceSampler`] (the
//! same windows, the same order, the same saved state); `bfd` packs the
//! documents once (`packing.rs`) and visits its windows in an order shuffled
//! from the seed and the epoch, rank `r` of `world` taking every
//! `world`-th, so that one epoch uses every id of every document exactly
//! once (less the last `windows % world` windows of the shuffled order).
//!
//! A window with no counted target (an SFT prompt longer than `--seq`, a
//! stretch of 1-id documents) is passed over: the next one is drawn in its
//! place, so a step's windows always give a loss. The windows passed over
//! are counted in the saved state (`skipped`), so a resumed run draws the
//! same windows and keeps counting; the first is logged with its document.

use super::corpus::{SamplerState, SequenceSampler, rank_share_of_shuffle};
use super::dataset::Dataset;
use super::packing::{PackMode, Piece, best_fit_decreasing, bin_window, cut_window, pieces};
use super::window::PackedWindow;
use crate::error::{Error, Result};
use crate::rng::Rng;
use std::sync::Arc;

/// Windows of a dataset, packed as `--pack` says.
#[derive(Debug, Clone)]
pub struct PackedSampler {
    data: Dataset,
    mode: PackMode,
    order: Order,
    /// Windows with no counted target passed over so far.
    skipped: u64,
}

#[derive(Debug, Clone)]
enum Order {
    /// `stream`, `documents`: windows cut from the stream.
    Cut(SequenceSampler),
    /// `bfd`: windows of packed documents.
    Bins(BinOrder),
}

/// The order `bfd`'s windows are visited in.
#[derive(Debug, Clone)]
struct BinOrder {
    /// `[windows][pieces]`, shared by every rank's copy.
    bins: Arc<Vec<Vec<Piece>>>,
    seq: usize,
    seed: u64,
    rank: usize,
    world: usize,
    state: SamplerState,
    /// The bins this rank takes this epoch, in order.
    order: Vec<usize>,
}

impl PackedSampler {
    /// A sampler of windows of `seq` inputs for data-parallel rank `rank` of `world`.
    pub fn sharded(
        data: impl Into<Dataset>,
        mode: PackMode,
        seq: usize,
        seed: u64,
        rank: usize,
        world: usize,
    ) -> Result<PackedSampler> {
        let data: Dataset = data.into();
        if let Some(mask) = &data.mask
            && !mask.counts_any(0..mask.tokens())
        {
            return crate::config_err!(
                "{}: its loss mask counts no target (every token a prompt), so no window has \
                 anything to train on; tokenize data with answers (assistant turns, completions)",
                data.tokens.name()
            );
        }
        let order = match mode {
            PackMode::Stream | PackMode::Documents => Order::Cut(SequenceSampler::sharded(
                data.tokens.clone(),
                seq,
                seed,
                rank,
                world,
            )?),
            PackMode::Bfd => Order::Bins(BinOrder::new(&data, seq, seed, rank, world)?),
        };
        Ok(PackedSampler {
            data,
            mode,
            order,
            skipped: 0,
        })
    }

    /// The packing.
    pub fn mode(&self) -> PackMode {
        self.mode
    }

    /// Windows this rank takes per epoch.
    pub fn windows_per_epoch(&self) -> usize {
        match &self.order {
            Order::Cut(s) => s.windows_per_epoch(),
            Order::Bins(b) => b.order.len(),
        }
    }

    /// The current position, to store in a checkpoint.
    pub fn state(&self) -> SamplerState {
        let inner = match &self.order {
            Order::Cut(s) => s.state(),
            Order::Bins(b) => b.state,
        };
        SamplerState {
            skipped: self.skipped,
            ..inner
        }
    }

    /// Windows with no counted target passed over so far (resumed runs
    /// included).
    pub fn skipped_windows(&self) -> u64 {
        self.skipped
    }

    /// Moves to a position previously returned by [`PackedSampler::state`].
    pub fn restore(&mut self, state: SamplerState) -> Result<()> {
        self.skipped = state.skipped;
        match &mut self.order {
            Order::Cut(s) => s.restore(state),
            Order::Bins(b) => b.restore(state),
        }
    }

    /// The next window with a counted target, moving to the next epoch when
    /// this one is used up. Windows with none are passed over and counted;
    /// when a whole epoch's worth in a row count nothing, the last is
    /// returned (the step then fails, naming the data).
    pub fn next_packed(&mut self) -> PackedWindow {
        let mut passed = 0;
        loop {
            let (w, first_id) = self.draw();
            if w.counted() > 0 || passed > self.windows_per_epoch() {
                return w;
            }
            if self.skipped == 0 {
                self.log_first_skip(first_id, w.len());
            }
            self.skipped += 1;
            passed += 1;
        }
    }

    /// The next window as packed, and the stream position of its first id.
    fn draw(&mut self) -> (PackedWindow, u64) {
        let d = &self.data;
        match &mut self.order {
            Order::Cut(s) => {
                let w = s.next_window();
                let (docs, mask) = (d.docs.as_deref(), d.mask.as_ref());
                let start = w.start as u64;
                (cut_window(start, w.tokens, docs, mask, self.mode), start)
            }
            Order::Bins(b) => {
                let next = b.next_bin();
                let bin = &b.bins[next];
                let first = bin.first().map_or(0, |p| p.start);
                (bin_window(bin, &d.tokens, d.mask.as_ref(), b.seq), first)
            }
        }
    }

    /// Says which document the first window passed over came from.
    fn log_first_skip(&self, first_id: u64, seq: usize) {
        let name = self.data.tokens.name();
        let doc = match &self.data.docs {
            Some(docs) => {
                let d = docs.document_of(first_id);
                let span = docs.span(d);
                format!(
                    "document {d} (ids {}..{}, {} tokens)",
                    span.start,
                    span.end,
                    span.end - span.start
                )
            }
            None => format!("ids from {first_id}"),
        };
        tracing::warn!(
            "{name}: a window of --seq {seq} at {doc} holds no counted target (an SFT prompt \
             longer than --seq, or documents of one id): it is passed over, and so is every \
             such window (`skipped_windows` in the metrics); a longer --seq trains on it"
        );
    }
}

impl BinOrder {
    fn new(data: &Dataset, seq: usize, seed: u64, rank: usize, world: usize) -> Result<BinOrder> {
        let Some(docs) = &data.docs else {
            return crate::config_err!(
                "--pack bfd packs whole documents, but {} has no document index: write the data \
                 with `upipe tokenize` (it writes the index IDS.docs beside the ids), or use \
                 --pack stream",
                data.tokens.name()
            );
        };
        if seq == 0 {
            return crate::config_err!("sequence length is 0; use --seq 1 or more");
        }
        let bins = best_fit_decreasing(&pieces(docs, seq), seq);
        if world == 0 || rank >= world || bins.len() < world {
            return crate::config_err!(
                "--pack bfd makes {} windows of {seq} tokens, fewer than the {world} data-parallel \
                 ranks; use a shorter --seq or more data",
                bins.len()
            );
        }
        let mut b = BinOrder {
            bins: Arc::new(bins),
            seq,
            seed,
            rank,
            world,
            state: SamplerState {
                epoch: 0,
                cursor: 0,
                skipped: 0,
            },
            order: Vec::new(),
        };
        b.start_epoch(0);
        Ok(b)
    }

    fn next_bin(&mut self) -> usize {
        if self.state.cursor == self.order.len() {
            self.start_epoch(self.state.epoch + 1);
        }
        self.state.cursor += 1;
        self.order[self.state.cursor - 1]
    }

    fn restore(&mut self, state: SamplerState) -> Result<()> {
        self.start_epoch(state.epoch);
        if state.cursor > self.order.len() {
            return Err(Error::Checkpoint(format!(
                "sampler cursor {} exceeds the {} windows per epoch; the data, --seq or --pack \
                 changed since the checkpoint",
                state.cursor,
                self.order.len()
            )));
        }
        self.state.cursor = state.cursor;
        Ok(())
    }

    /// Shuffles the bins for `epoch` (Fisher-Yates from the seed and the
    /// epoch) and takes this rank's share.
    fn start_epoch(&mut self, epoch: u64) {
        let n = self.bins.len();
        let mut rng = Rng::new(self.seed ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        self.order = rank_share_of_shuffle(n, (self.rank, self.world), &mut rng);
        self.state = SamplerState {
            epoch,
            cursor: 0,
            skipped: 0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::IGNORE;
    use crate::data::doc_index::DocIndex;

    fn dataset(lengths: &[u64]) -> Dataset {
        let mut starts = Vec::new();
        let mut at = 0;
        for &n in lengths {
            starts.push(at);
            at += n;
        }
        // id i holds i + 1: 0 is only padding
        let mut d = Dataset::from((1..=at as u32).collect::<Vec<u32>>());
        d.docs = Some(Arc::new(DocIndex::new(starts, at, "test").unwrap()));
        d
    }

    fn windows(s: &mut PackedSampler, n: usize) -> Vec<PackedWindow> {
        (0..n).map(|_| s.next_packed()).collect()
    }

    #[test]
    fn bfd_is_deterministic_per_seed_and_covers_each_token_once_per_epoch() {
        let lengths: Vec<u64> = (0..40).map(|i| 1 + (i * 7) % 23).collect();
        let data = dataset(&lengths);
        let n = data.len();
        let mut a = PackedSampler::sharded(data.clone(), PackMode::Bfd, 16, 3, 0, 1).unwrap();
        let mut b = PackedSampler::sharded(data.clone(), PackMode::Bfd, 16, 3, 0, 1).unwrap();
        let mut c = PackedSampler::sharded(data.clone(), PackMode::Bfd, 16, 4, 0, 1).unwrap();
        let per = a.windows_per_epoch();
        let wa = windows(&mut a, per);
        assert_eq!(wa, windows(&mut b, per));
        assert_ne!(wa, windows(&mut c, per));
        let mut seen = vec![0u32; n];
        for w in &wa {
            for (&i, &t) in w.inputs.iter().zip(&w.targets) {
                match i {
                    0 => assert_eq!(t, IGNORE, "padding counts no target"),
                    i => seen[i as usize - 1] += 1,
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
        // resume: the same windows from a saved state
        a.next_packed();
        let state = a.state();
        assert_eq!(state.epoch, 1);
        let mut r = PackedSampler::sharded(data, PackMode::Bfd, 16, 3, 0, 1).unwrap();
        r.restore(state).unwrap();
        assert_eq!(windows(&mut a, 30), windows(&mut r, 30));
    }

    #[test]
    fn documents_windows_are_the_streams_with_boundaries_marked() {
        let data = dataset(&[5, 9, 3, 20, 4]);
        let mut s = PackedSampler::sharded(data.clone(), PackMode::Stream, 8, 1, 0, 1).unwrap();
        let mut d = PackedSampler::sharded(data, PackMode::Documents, 8, 1, 0, 1).unwrap();
        for _ in 0..20 {
            let (ws, wd) = (s.next_packed(), d.next_packed());
            assert_eq!(ws.inputs, wd.inputs);
            assert_eq!(ws.doc_starts, [0]);
            for (q, (&ts, &td)) in ws.targets.iter().zip(&wd.targets).enumerate() {
                // a target is dropped exactly where the next id starts a document
                let crosses = [6u32, 15, 18, 38].contains(&ts);
                assert_eq!(td, if crosses { IGNORE } else { ts }, "at {q}");
            }
        }
    }

    /// Windows that count nothing (a prompt longer than the window) are
    /// never returned, in any mode; the count is saved and restored.
    #[test]
    fn windows_with_no_counted_target_are_passed_over_and_counted() {
        use crate::data::doc_index::LossMask;
        let lengths = [3u64, 40, 5, 4];
        let mut data = dataset(&lengths);
        // document 1 is a prompt of 36 ids and an answer of 4
        let flags: Vec<bool> = (0..52).map(|i| !(3..39).contains(&i)).collect();
        data.mask = Some(LossMask::from_flags(&flags));
        for mode in [PackMode::Stream, PackMode::Documents, PackMode::Bfd] {
            let mut s = PackedSampler::sharded(data.clone(), mode, 8, 5, 0, 1).unwrap();
            let drawn = windows(&mut s, 40);
            assert!(drawn.iter().all(|w| w.counted() > 0), "{mode}");
            let skipped = s.skipped_windows();
            assert!(skipped > 0, "{mode}: the prompt's windows were drawn");
            let mut r = PackedSampler::sharded(data.clone(), mode, 8, 5, 0, 1).unwrap();
            r.restore(s.state()).unwrap();
            assert_eq!(r.skipped_windows(), skipped);
            assert_eq!(windows(&mut s, 20), windows(&mut r, 20), "{mode}");
            assert_eq!(r.skipped_windows(), s.skipped_windows());
        }
        // a mask that counts nothing at all is refused, naming the data
        data.mask = Some(LossMask::from_flags(&[false; 52]));
        let e = PackedSampler::sharded(data, PackMode::Bfd, 8, 5, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts no target"), "{e}");
    }

    #[test]
    fn bfd_without_a_document_index_is_refused() {
        let e = PackedSampler::sharded(vec![1u32; 100], PackMode::Bfd, 8, 0, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no document index") && e.contains("upipe tokenize"),
            "{e}"
        );
        let e = PackedSampler::sharded(dataset(&[4, 4]), PackMode::Bfd, 8, 0, 0, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("1 windows") && e.contains("2 data-parallel"),
            "{e}"
        );
    }
}
