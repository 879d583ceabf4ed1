//! The allocations of `--offload-optimizer` (`train::offload_optim`): the
//! host-resident state as it is built, and a step's gradient downloads
//! (one slot ahead) and parameter uploads, which run in the next step's
//! forward ahead of each unit (`train::settling`).

use super::sim::{Buf, Sim};
use super::store_walk::StoreWalk;
use crate::backend::Category::{Offload, Workspace};
use crate::model::{ModelConfig, Unit};
use crate::train::fsdp::model_layouts;
use crate::train::settling::next_in_forward;

const F32: usize = 4;

/// Elements of every parameter tensor, in `ModelWeights::named` order.
pub fn tensor_numels(cfg: &ModelConfig) -> Vec<usize> {
    model_layouts(cfg, 1)
        .iter()
        .flat_map(|u| u.params.iter().map(|p| p.numel()))
        .collect()
}

/// Each slot's F32 master (through a device F32 copy when the compute
/// dtype of `ab` bytes is narrower), then its two moments, in host memory.
pub fn host_state(sim: &mut Sim, slots: &[usize], ab: usize) {
    for &n in slots {
        sim.alloc(Offload, n * F32);
        if ab != F32 {
            let wide = sim.alloc(Workspace, n * F32);
            sim.free(wide);
        }
        sim.alloc(Offload, n * F32);
        sim.alloc(Offload, n * F32);
    }
}

/// For each unit (`Unit::all` order), the optimizer slots through it:
/// parameter tensors, or with FSDP one shard per unit.
pub fn slot_ends(cfg: &ModelConfig, fsdp: bool) -> Vec<usize> {
    let mut end = 0;
    model_layouts(cfg, 1)
        .iter()
        .map(|u| {
            end += if fsdp { 1 } else { u.params.len() };
            end
        })
        .collect()
}

/// A step's host updates still to run: slot k+1's gradient downloaded
/// while slot k is updated; each updated master goes back through a device
/// F32 buffer when the compute dtype (`ab` bytes) is narrower.
pub struct PendingStep<'s> {
    slots: &'s [usize],
    ends: &'s [usize],
    ab: usize,
    next: usize,
    inflight: Option<Buf>,
}

impl<'s> PendingStep<'s> {
    pub fn new(slots: &'s [usize], ends: &'s [usize], ab: usize) -> Self {
        PendingStep {
            slots,
            ends,
            ab,
            next: 0,
            inflight: None,
        }
    }

    /// Updates the slots through unit `unit_index`'s; whether all are done.
    fn settle_through(&mut self, sim: &mut Sim, unit_index: usize) -> bool {
        let upto = self.ends[unit_index].min(self.slots.len());
        while self.next < upto {
            let k = self.next;
            let grad = match self.inflight.take() {
                Some(g) => g,
                None => sim.alloc(Offload, self.slots[k] * F32),
            };
            self.inflight = self.slots.get(k + 1).map(|&m| sim.alloc(Offload, m * F32));
            sim.free(grad);
            if self.ab != F32 {
                let wide = sim.alloc(Workspace, self.slots[k] * F32);
                sim.free(wide);
            }
            self.next += 1;
        }
        self.next == self.slots.len()
    }
}

/// `inner`, with the last step's pending host updates run ahead of each
/// unit the forward acquires (as `train::settling::Settling` runs them).
pub struct SettlingWalk<'a, 's> {
    pub inner: &'a mut dyn StoreWalk,
    pub pending: &'a mut Option<PendingStep<'s>>,
    pub layers: usize,
}

impl StoreWalk for SettlingWalk<'_, '_> {
    fn acquire(&mut self, sim: &mut Sim, unit: Unit) {
        if let Some(p) = self.pending.as_mut() {
            let through = next_in_forward(unit, self.layers).index(self.layers);
            if p.settle_through(sim, through) {
                *self.pending = None;
            }
        }
        self.inner.acquire(sim, unit);
    }
    fn release(&mut self, sim: &mut Sim, unit: Unit) {
        self.inner.release(sim, unit);
    }
    fn block_grads(&mut self, sim: &mut Sim, l: usize) {
        self.inner.block_grads(sim, l);
    }
    fn head_grads(&mut self, sim: &mut Sim) {
        self.inner.head_grads(sim);
    }
    fn embed_grads(&mut self, sim: &mut Sim) {
        self.inner.embed_grads(sim);
    }
    fn grads_done(&mut self, sim: &mut Sim, unit: Unit) {
        self.inner.grads_done(sim, unit);
    }
    fn finish(&mut self, sim: &mut Sim) {
        self.inner.finish(sim);
    }
}
