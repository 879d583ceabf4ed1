//! Progress inside a long training step: a [`ParamStore`] wrapper that logs,
//! at most every few seconds, which block the step has reached and an
//! estimate of the step's time, so a user at 1M tokens sees it working.

use super::segments::{Segments, Visit};
use super::store::{ParamStore, Unit};
use crate::backend::Backend;
use crate::error::Result;
use std::time::{Duration, Instant};

/// How often progress is logged.
const EVERY: Duration = Duration::from_secs(10);

/// `inner`, logging progress through the step (on the lead rank only).
pub struct Progress<'s, S: ?Sized> {
    inner: &'s mut S,
    layers: usize,
    /// Backward blocks cost this many forward blocks (recompute included).
    bwd_cost: f64,
    /// Blocks whose backward runs (those from `Decoder::backward_floor` up).
    backward_blocks: usize,
    /// Segment checkpointing's blocks a block (`MemoryPolicy::checkpoint_every`).
    every: usize,
    /// Blocks acquired so far: forward ones, then backward ones.
    seen: usize,
    start: Instant,
    last: Instant,
    lead: bool,
}

impl<'s, S: ?Sized> Progress<'s, S> {
    pub fn new(inner: &'s mut S, layers: usize, checkpoint: bool, lead: bool) -> Self {
        let now = Instant::now();
        Progress {
            inner,
            layers,
            bwd_cost: if checkpoint { 3.0 } else { 2.0 },
            backward_blocks: layers,
            every: 1,
            seen: 0,
            start: now,
            last: now,
            lead,
        }
    }

    /// A step whose backward stops after block `floor`
    /// (`Decoder::backward_floor`): the blocks below have no backward.
    pub fn with_backward_floor(mut self, floor: usize) -> Self {
        self.backward_blocks = self.layers.saturating_sub(floor);
        self
    }

    /// A step with segments of `every` blocks (`MemoryPolicy::checkpoint_every`):
    /// its backward also recomputes the forward of earlier segments' blocks.
    pub fn with_checkpoint_every(mut self, every: usize) -> Self {
        self.every = every;
        self
    }

    /// The share of the step's work done after `seen` blocks: a forward or
    /// a segment's recompute of a block costs 1, its backward `bwd_cost`.
    fn done(&self) -> f64 {
        let floor = self.layers - self.backward_blocks;
        let visits = Segments::new(self.layers, floor, self.every).backward_visits();
        let cost = |v: &Visit| match v {
            Visit::Recompute(_) => 1.0,
            Visit::Backward(_) => self.bwd_cost,
        };
        let fwd = self.seen.min(self.layers) as f64;
        let bwd: f64 = visits
            .iter()
            .take(self.seen.saturating_sub(self.layers))
            .map(cost)
            .sum();
        (fwd + bwd) / (self.layers as f64 + visits.iter().map(cost).sum::<f64>())
    }

    fn tick(&mut self, unit: Unit) {
        let Unit::Block(l) = unit else { return };
        self.seen += 1;
        if !self.lead || self.last.elapsed() < EVERY {
            return;
        }
        self.last = Instant::now();
        let t = self.start.elapsed().as_secs_f64();
        let pass = if self.seen <= self.layers {
            "forward"
        } else {
            "backward"
        };
        let done = self.done().max(1e-9);
        tracing::info!(
            "step in progress: {pass} block {}/{} after {t:.0} s (about {:.0} s for the step)",
            l + 1,
            self.layers,
            t / done
        );
    }
}

impl<B: Backend, S: ParamStore<B> + ?Sized> ParamStore<B> for Progress<'_, S> {
    fn acquire(&mut self, b: &B, unit: Unit) -> Result<()> {
        self.tick(unit);
        self.inner.acquire(b, unit)
    }
    super::store::delegate_param_store!(inner);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_done_counts_backward_blocks_as_recompute_plus_backward() {
        let mut unit = ();
        let mut p = Progress::new(&mut unit, 4, true, false);
        assert_eq!(p.done(), 0.0);
        p.seen = 4;
        assert!((p.done() - 0.25).abs() < 1e-12, "forward is 1 of 4 units");
        p.seen = 8;
        assert!((p.done() - 1.0).abs() < 1e-12);
        // a backward that stops after block 2 runs 2 backward blocks
        let mut unit = ();
        let mut p = Progress::new(&mut unit, 4, true, false).with_backward_floor(2);
        p.seen = 6;
        assert!((p.done() - 1.0).abs() < 1e-12);
    }
}
