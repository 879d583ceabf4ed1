//! Offsets inside a fixed arena (pure index math, no memory): the NCCL
//! exchange window and the pinned host pool lay out their blocks with it.
//!
//! NCCL's copy-engine all-to-all writes each chunk straight into the peer's
//! receive buffer at the *same offset* in the peer's registered window as the
//! sender's own receive buffer has in its window (a "symmetric" window). The
//! ranks of a group run the same exchanges in the same order, so an
//! allocator whose answer depends only on the sequence of requests gives every
//! rank the same offsets: [`ArenaMap`] is first-fit over a free list with
//! coalescing, deterministic by construction.
//!
//! Freed ranges are reusable at once (host order). That is safe for the same
//! reason the stream-ordered pool is: every later user of a range is ordered
//! after the compute stream's work queued before the free (kernels on the
//! compute stream itself; transfers on the communication stream wait for a
//! compute-stream event recorded when they are issued; a peer's copy engine
//! waits for this rank's "ready" signal, which NCCL sends from that stream).

use std::collections::BTreeMap;

/// Free and used ranges of an arena of `capacity` bytes; every range starts
/// on a multiple of `align`.
#[derive(Debug, Clone)]
pub struct ArenaMap {
    capacity: usize,
    align: usize,
    /// Free ranges: offset → length (disjoint, never adjacent).
    free: BTreeMap<usize, usize>,
    /// Bytes handed out and not yet given back.
    used: usize,
    /// The most `used` has been.
    high: usize,
}

impl ArenaMap {
    /// An empty arena. `align` must be a power of two; the capacity is
    /// rounded down to it.
    pub fn new(capacity: usize, align: usize) -> ArenaMap {
        assert!(align.is_power_of_two(), "arena alignment {align}");
        let capacity = capacity / align * align;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        ArenaMap {
            capacity,
            align,
            free,
            used: 0,
            high: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes handed out and not yet given back (rounded up to the alignment).
    pub fn used(&self) -> usize {
        self.used
    }

    /// The most bytes ever handed out at once: what the arena must hold
    /// for the requests it has seen.
    pub fn high(&self) -> usize {
        self.high
    }

    /// `bytes` rounded up to the alignment (at least one unit).
    fn rounded(&self, bytes: usize) -> usize {
        bytes.max(1).div_ceil(self.align) * self.align
    }

    /// The lowest offset with `bytes` free after it, now taken; `None` when
    /// no free range is large enough.
    pub fn take(&mut self, bytes: usize) -> Option<usize> {
        let want = self.rounded(bytes);
        let (&off, &len) = self.free.iter().find(|&(_, &len)| len >= want)?;
        self.free.remove(&off);
        if len > want {
            self.free.insert(off + want, len - want);
        }
        self.used += want;
        self.high = self.high.max(self.used);
        Some(off)
    }

    /// Gives back the range `take(bytes)` returned at `offset`, merging it
    /// with free neighbours.
    pub fn give(&mut self, offset: usize, bytes: usize) {
        let mut off = offset;
        let mut len = self.rounded(bytes);
        debug_assert!(off + len <= self.capacity, "range outside the arena");
        self.used -= len;
        if let Some((&prev, &plen)) = self.free.range(..off).next_back()
            && prev + plen == off
        {
            self.free.remove(&prev);
            off = prev;
            len += plen;
        }
        if let Some(&nlen) = self.free.get(&(off + len)) {
            self.free.remove(&(off + len));
            len += nlen;
        }
        self.free.insert(off, len);
    }

    /// Free ranges, lowest offset first (for tests and diagnostics).
    pub fn free_ranges(&self) -> Vec<(usize, usize)> {
        self.free.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_fit_reuses_the_lowest_hole() {
        let mut a = ArenaMap::new(1000, 8);
        assert_eq!(a.capacity(), 1000);
        let x = a.take(100).unwrap();
        let y = a.take(100).unwrap();
        let z = a.take(100).unwrap();
        assert_eq!((x, y, z), (0, 104, 208));
        a.give(y, 100);
        // a smaller request lands in the hole, a larger one after z
        assert_eq!(a.take(50), Some(104));
        assert_eq!(a.take(200), Some(312));
        assert_eq!(a.take(1000), None);
        // x, z, the 56-byte hole's request and the 200: the most at once
        assert_eq!(a.high(), 104 + 104 + 56 + 200);
    }

    #[test]
    fn giving_everything_back_leaves_one_free_range() {
        let mut a = ArenaMap::new(4096, 256);
        let offs: Vec<_> = [300, 10, 700, 256]
            .iter()
            .map(|&b| (a.take(b).unwrap(), b))
            .collect();
        for &(o, b) in offs.iter().rev().step_by(2).chain(offs.iter().step_by(2)) {
            a.give(o, b);
        }
        assert_eq!(a.used(), 0);
        assert_eq!(a.free_ranges(), vec![(0, 4096)]);
    }

    proptest! {
        /// Live ranges never overlap, stay aligned and inside the arena; the
        /// used count matches them; after freeing all, the arena is whole.
        /// The same request sequence gives the same offsets (what keeps
        /// ranks' windows symmetric).
        #[test]
        fn live_ranges_are_disjoint_and_deterministic(
            ops in proptest::collection::vec((any::<bool>(), 1usize..5000, any::<prop::sample::Index>()), 1..80)
        ) {
            let run = || {
                let mut a = ArenaMap::new(1 << 16, 64);
                let mut live: Vec<(usize, usize)> = Vec::new();
                let mut trace = Vec::new();
                for (alloc, bytes, pick) in &ops {
                    if *alloc || live.is_empty() {
                        let got = a.take(*bytes);
                        trace.push(got);
                        if let Some(o) = got {
                            live.push((o, *bytes));
                        }
                    } else {
                        let (o, b) = live.swap_remove(pick.index(live.len()));
                        a.give(o, b);
                    }
                    let mut spans: Vec<_> = live.iter().map(|&(o, b)| (o, o + b.div_ceil(64) * 64)).collect();
                    spans.sort();
                    for w in spans.windows(2) {
                        prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
                    }
                    for &(s, e) in &spans {
                        prop_assert!(s % 64 == 0 && e <= a.capacity());
                    }
                    prop_assert_eq!(a.used(), spans.iter().map(|(s, e)| e - s).sum::<usize>());
                    prop_assert!(a.high() >= a.used());
                }
                for (o, b) in live.drain(..) {
                    a.give(o, b);
                }
                prop_assert_eq!(a.free_ranges(), vec![(0, 1 << 16)]);
                Ok(trace)
            };
            let first = run()?;
            prop_assert_eq!(first, run()?);
        }
    }
}
