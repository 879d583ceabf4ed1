//! Exact byte accounting for one device: current and peak bytes, in total and
//! per category. Every `Tensor` registers itself here on creation and
//! deregisters on drop, so the numbers are the allocator's, not estimates.

use std::fmt;
use std::sync::Mutex;

/// What a device's allocator holds beside the ledger
/// ([`Backend::pool_report`](crate::backend::Backend::pool_report)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolReport {
    /// The most bytes the pool held from the device since its last reset
    /// (the ledger's peak plus the pool's fragmentation).
    pub reserved_peak: usize,
    /// Device bytes outside the pool when asked: the CUDA context, the
    /// libraries' handles and modules (what a plan's reserve stands for).
    pub outside: usize,
}

/// What an allocation is for. Categories are disjoint and cover every byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    /// Model parameters (and their compute copies).
    Weights,
    /// Parameter and input gradients.
    Grads,
    /// Optimizer state (AdamW moments, fp32 master weights).
    OptimState,
    /// Activations saved from forward for backward.
    Activations,
    /// Transient buffers of one layer or stage.
    Workspace,
    /// Send/receive buffers of collectives.
    Comm,
    /// Checkpointed activations held in host memory (offload).
    Offload,
}

impl Category {
    /// All categories, in display order.
    pub const ALL: [Category; 7] = [
        Category::Weights,
        Category::Grads,
        Category::OptimState,
        Category::Activations,
        Category::Workspace,
        Category::Comm,
        Category::Offload,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Category::Weights => "weights",
            Category::Grads => "grads",
            Category::OptimState => "optim_state",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::Comm => "comm",
            Category::Offload => "offload_host",
        }
    }

    /// Whether this category lives on the device (offloaded bytes live on the host).
    pub fn on_device(self) -> bool {
        self != Category::Offload
    }
}

/// Host bytes plans leave out of the pinned budget for the pool's own
/// slack: the free tails of the 64 MiB chunks that small offloaded tensors
/// share (a step's small tensors fill one or two), as the GPU's reserve is
/// left out of its memory.
pub const PINNED_SLACK: usize = 128 << 20;

/// The pinned-host budget of a run given no `--host-mem`: the host's
/// available memory less a tenth of it (at least 8 GiB, at most 32 GiB) for
/// the OS, the driver and the process's own unpinned memory. Pinned pages
/// cannot be swapped or reclaimed, so a pool that pins nearly all of
/// `MemAvailable` gets the process killed: on a host of 125.8 GiB (125.4
/// available) a run pinning 119.8 GiB was killed, one pinning 111.2 GiB
/// ran (docs/memory.md).
pub fn default_pinned_budget(available: usize) -> usize {
    available.saturating_sub(host_reserve(available))
}

/// What [`default_pinned_budget`] keeps back of `available` host bytes.
pub fn host_reserve(available: usize) -> usize {
    (available / 10).clamp(8 << 30, 32 << 30)
}

const N: usize = Category::ALL.len();

#[derive(Debug, Clone, Default)]
struct Counters {
    current: [usize; N],
    peak_by_cat: [usize; N],
    device_current: usize,
    device_peak: usize,
    /// Per-category bytes at the moment the device peak was reached.
    at_peak: [usize; N],
    host_peak: usize,
    /// The part of the step allocating now ([`MemoryLedger::enter`]).
    part: &'static str,
    /// The part in which the device peak was reached.
    peak_part: &'static str,
}

/// A snapshot of the ledger.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryStats {
    /// Bytes currently allocated on the device.
    pub current: usize,
    /// Highest device bytes since the last `reset_peak`.
    pub peak: usize,
    /// Current bytes per category.
    pub current_by_category: Vec<(Category, usize)>,
    /// Highest bytes of each category on its own since the last reset.
    pub peak_by_category: Vec<(Category, usize)>,
    /// Per-category bytes at the moment of the device peak.
    pub at_peak_by_category: Vec<(Category, usize)>,
    /// Highest host (offload) bytes since the last reset.
    pub host_peak: usize,
    /// The part of the step in which the device peak was reached (as the
    /// engine names its parts, [`MemoryLedger::enter`]; empty if unnamed).
    pub peak_at: &'static str,
}

impl MemoryStats {
    /// Bytes of `cat` at the moment of the device peak.
    pub fn at_peak(&self, cat: Category) -> usize {
        self.at_peak_by_category
            .iter()
            .find(|(c, _)| *c == cat)
            .map_or(0, |(_, b)| *b)
    }
}

/// The current bytes of every category of a ledger ([`MemoryLedger::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerState([usize; N]);

/// Byte ledger of one device (one rank).
#[derive(Debug, Default)]
pub struct MemoryLedger {
    counters: Mutex<Counters>,
}

impl MemoryLedger {
    /// A new, empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an allocation.
    pub fn acquire(&self, cat: Category, bytes: usize) {
        let mut c = self.counters.lock().expect("memory ledger poisoned");
        let i = cat.index();
        c.current[i] += bytes;
        c.peak_by_cat[i] = c.peak_by_cat[i].max(c.current[i]);
        if cat.on_device() {
            c.device_current += bytes;
            if c.device_current > c.device_peak {
                c.device_peak = c.device_current;
                c.at_peak = c.current;
                c.peak_part = c.part;
            }
        } else {
            c.host_peak = c.host_peak.max(c.current[i]);
        }
    }

    /// Names the part of the step whose allocations follow (`"forward:
    /// attention"`, ...): the stats say in which part the peak was reached.
    /// The decoder and the trainer name their parts as the memory planner
    /// reports them.
    pub fn enter(&self, part: &'static str) {
        self.counters.lock().expect("memory ledger poisoned").part = part;
    }

    /// Records a release.
    pub fn release(&self, cat: Category, bytes: usize) {
        let mut c = self.counters.lock().expect("memory ledger poisoned");
        let i = cat.index();
        c.current[i] -= bytes;
        if cat.on_device() {
            c.device_current -= bytes;
        }
    }

    /// Starts a new peak window at the current usage.
    pub fn reset_peak(&self) {
        let mut c = self.counters.lock().expect("memory ledger poisoned");
        c.device_peak = c.device_current;
        c.at_peak = c.current;
        c.peak_by_cat = c.current;
        c.host_peak = c.current[Category::Offload.index()];
        c.peak_part = c.part;
    }

    /// Bytes currently allocated on the device.
    pub fn current(&self) -> usize {
        self.counters
            .lock()
            .expect("memory ledger poisoned")
            .device_current
    }

    /// Peak device bytes since the last reset.
    pub fn peak(&self) -> usize {
        self.counters
            .lock()
            .expect("memory ledger poisoned")
            .device_peak
    }

    /// Current bytes of one category.
    pub fn current_of(&self, cat: Category) -> usize {
        self.counters
            .lock()
            .expect("memory ledger poisoned")
            .current[cat.index()]
    }

    /// The bytes of every category now. Two stretches of a step that run
    /// the same code from equal states allocate alike; a stretch that ends
    /// in the state it began in leaves nothing behind for the next.
    pub fn state(&self) -> LedgerState {
        LedgerState(
            self.counters
                .lock()
                .expect("memory ledger poisoned")
                .current,
        )
    }

    /// A consistent snapshot.
    pub fn stats(&self) -> MemoryStats {
        let c = self
            .counters
            .lock()
            .expect("memory ledger poisoned")
            .clone();
        let zip = |a: &[usize; N]| Category::ALL.iter().map(|&k| (k, a[k.index()])).collect();
        MemoryStats {
            current: c.device_current,
            peak: c.device_peak,
            current_by_category: zip(&c.current),
            peak_by_category: zip(&c.peak_by_cat),
            at_peak_by_category: zip(&c.at_peak),
            host_peak: c.host_peak,
            peak_at: c.peak_part,
        }
    }
}

/// Human-readable bytes (binary units).
pub struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        const K: f64 = 1024.0;
        if b >= K * K * K {
            write!(f, "{:.2} GiB", b / (K * K * K))
        } else if b >= K * K {
            write!(f, "{:.2} MiB", b / (K * K))
        } else if b >= K {
            write!(f, "{:.1} KiB", b / K)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pinned_budget_keeps_a_bounded_share_back() {
        const GIB: usize = 1 << 30;
        // a 128 GiB host (125.5 GiB available): a tenth, 12.55 GiB, is kept
        let avail = 125 * GIB + GIB / 2;
        assert_eq!(default_pinned_budget(avail), avail - avail / 10);
        // small hosts keep 8 GiB, or everything below it
        assert_eq!(default_pinned_budget(40 * GIB), 32 * GIB);
        assert_eq!(default_pinned_budget(6 * GIB), 0);
        // large hosts keep 32 GiB
        assert_eq!(default_pinned_budget(2048 * GIB), 2016 * GIB);
        for a in (0..4096).map(|k| k * GIB / 3) {
            let r = host_reserve(a);
            assert!((8 * GIB..=32 * GIB).contains(&r));
            assert!(default_pinned_budget(a) + r >= a);
            assert!(default_pinned_budget(a) <= a);
        }
    }

    #[test]
    fn peak_tracks_high_water_and_categories_at_peak() {
        let l = MemoryLedger::new();
        l.acquire(Category::Weights, 100);
        l.acquire(Category::Workspace, 50);
        l.release(Category::Workspace, 50);
        l.acquire(Category::Comm, 20);
        let s = l.stats();
        assert_eq!(s.current, 120);
        assert_eq!(s.peak, 150);
        assert_eq!(s.at_peak(Category::Workspace), 50);
        assert_eq!(s.at_peak(Category::Comm), 0);
        l.reset_peak();
        assert_eq!(l.peak(), 120);
        l.acquire(Category::Offload, 1000);
        assert_eq!(l.peak(), 120, "host bytes are not device bytes");
        assert_eq!(l.stats().host_peak, 1000);
    }
}
