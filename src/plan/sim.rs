//! A byte ledger without memory: the planner walks the engine's allocation
//! order through it, acquiring and releasing the engine's buffer sizes, and
//! reads the peak exactly as [`MemoryLedger`](crate::backend::MemoryLedger)
//! would record it (same peak rule, same per-category snapshot at the peak).

use crate::backend::Category;

const N: usize = Category::ALL.len();

fn index(cat: Category) -> usize {
    Category::ALL
        .iter()
        .position(|&c| c == cat)
        .expect("every category is in Category::ALL")
}

/// One simulated allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf {
    pub cat: Category,
    pub bytes: usize,
}

/// Simulated ledger of one rank.
#[derive(Debug, Clone, Default)]
pub struct Sim {
    cur: [usize; N],
    dev: usize,
    peak: usize,
    at_peak: [usize; N],
    host_peak: usize,
    label: &'static str,
    peak_label: &'static str,
    /// Buffers the backend keeps between calls, by name.
    kept: Vec<(&'static str, Buf)>,
}

impl Sim {
    pub fn new() -> Self {
        Self::default()
    }

    /// Names the part of the step that follows (reported with the peak).
    pub fn label(&mut self, l: &'static str) {
        self.label = l;
    }

    pub fn alloc(&mut self, cat: Category, bytes: usize) -> Buf {
        let i = index(cat);
        self.cur[i] += bytes;
        if cat.on_device() {
            self.dev += bytes;
            if self.dev > self.peak {
                self.peak = self.dev;
                self.at_peak = self.cur;
                self.peak_label = self.label;
            }
        } else {
            self.host_peak = self.host_peak.max(self.cur[i]);
        }
        Buf { cat, bytes }
    }

    pub fn free(&mut self, b: Buf) {
        self.cur[index(b.cat)] -= b.bytes;
        if b.cat.on_device() {
            self.dev -= b.bytes;
        }
    }

    /// A buffer the backend keeps between calls and grows when a call needs
    /// more: the old one is released first, then the larger one taken.
    pub fn keep_at_least(&mut self, name: &'static str, cat: Category, bytes: usize) {
        if let Some(i) = self.kept.iter().position(|(n, _)| *n == name) {
            if self.kept[i].1.bytes >= bytes {
                return;
            }
            let (_, old) = self.kept.remove(i);
            self.free(old);
        }
        let b = self.alloc(cat, bytes);
        self.kept.push((name, b));
    }

    /// A buffer the backend keeps between calls and replaces when a call
    /// needs another size: the old one is released first.
    pub fn keep_exactly(&mut self, name: &'static str, cat: Category, bytes: usize) {
        if let Some(i) = self.kept.iter().position(|(n, _)| *n == name) {
            if self.kept[i].1.bytes == bytes {
                return;
            }
            let (_, old) = self.kept.remove(i);
            self.free(old);
        }
        let b = self.alloc(cat, bytes);
        self.kept.push((name, b));
    }

    /// Grows this ledger's kept buffers to `other`'s (what a later pass
    /// starts with, once an earlier one grew them).
    pub fn keep_as(&mut self, other: &Sim) {
        for &(name, b) in &other.kept {
            self.keep_at_least(name, b.cat, b.bytes);
        }
    }

    /// Whether the backend keeps any buffer between calls.
    pub fn keeps_any(&self) -> bool {
        !self.kept.is_empty()
    }

    pub fn free_opt(&mut self, b: Option<Buf>) {
        if let Some(b) = b {
            self.free(b);
        }
    }

    /// Starts a new peak window at the current usage (as `MemoryLedger::reset_peak`).
    pub fn reset_peak(&mut self) {
        self.peak = self.dev;
        self.at_peak = self.cur;
        self.host_peak = self.cur[index(Category::Offload)];
        self.peak_label = self.label;
    }

    pub fn current(&self) -> usize {
        self.dev
    }
    pub fn peak(&self) -> usize {
        self.peak
    }
    pub fn host_peak(&self) -> usize {
        self.host_peak
    }
    pub fn peak_label(&self) -> &'static str {
        self.peak_label
    }
    /// Bytes of each category at the device peak.
    pub fn at_peak(&self) -> Vec<(Category, usize)> {
        Category::ALL
            .iter()
            .map(|&c| (c, self.at_peak[index(c)]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_pass_starts_with_the_kept_buffers() {
        let mut first = Sim::new();
        first.alloc(Category::Weights, 10);
        let mut later = first.clone();
        first.keep_at_least("ws", Category::Workspace, 40);
        first.keep_at_least("ws", Category::Workspace, 70);
        later.keep_as(&first);
        assert_eq!(later.current(), 80);
        later.keep_at_least("ws", Category::Workspace, 50); // already big enough
        assert_eq!(later.current(), 80);
    }

    #[test]
    fn kept_buffers_grow_by_release_then_allocate() {
        let mut sim = Sim::new();
        sim.keep_at_least("ws", Category::Workspace, 100);
        sim.keep_at_least("ws", Category::Workspace, 60); // big enough already
        assert_eq!((sim.current(), sim.peak()), (100, 100));
        sim.keep_at_least("ws", Category::Workspace, 300);
        // the old one goes first, so the peak is the new size alone
        assert_eq!((sim.current(), sim.peak()), (300, 300));
        sim.keep_at_least("other", Category::Workspace, 5);
        assert_eq!(sim.current(), 305);
    }
}
