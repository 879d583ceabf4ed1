//! The allocations of `--offload-optimizer` (`train::offload_optim`): the
//! host-resident state as it is built, and a step's gradient downloads
//! (one slot ahead) and parameter uploads, which run in the next step's
//! forward ahead of each unit (`train::settling`).

use super::sim::{Buf, Sim};
use super::store_walk::StoreWalk;
use crate::backend::Category::{Offload, Workspace};
use crate::model::{ModelConfig, Unit};
use crate::train::fsdp::model_layouts;
use crate::train::settling::{next_in_forward, update_index, update_order};

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

/// `slots` (tensors in `ModelWeights::named` order, or one shard per unit)
/// in the order a deferred step updates them (`train::settling::
/// update_order`: the head's first), and for each unit in that order the
/// slots through it.
pub fn update_slots(cfg: &ModelConfig, fsdp: bool, slots: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let per_unit: Vec<usize> = model_layouts(cfg, 1)
        .iter()
        .map(|u| if fsdp { 1 } else { u.params.len() })
        .collect();
    let head = *per_unit.last().expect("a model has a head unit");
    let mut ordered = slots.to_vec();
    ordered.rotate_right(head);
    let mut end = 0;
    let ends = update_order(cfg.layers)
        .into_iter()
        .map(|u| {
            end += per_unit[u.index(cfg.layers)];
            end
        })
        .collect();
    (ordered, ends)
}

/// A step's host updates still to run (`slots` and `ends` from
/// [`update_slots`]): slot k+1's gradient downloaded
/// while slot k is updated; each updated master goes back directly, or
/// when the compute dtype (`ab` bytes) is narrower through a pinned buffer
/// of that dtype, which lives until the next slot's upload.
pub struct PendingStep<'s> {
    slots: &'s [usize],
    ends: &'s [usize],
    ab: usize,
    next: usize,
    inflight: Option<Buf>,
    uploading: Option<Buf>,
}

impl<'s> PendingStep<'s> {
    pub fn new(slots: &'s [usize], ends: &'s [usize], ab: usize) -> Self {
        PendingStep {
            slots,
            ends,
            ab,
            next: 0,
            inflight: None,
            uploading: None,
        }
    }

    /// Updates the slots through `unit`'s (in update order); whether all
    /// are done.
    fn settle_through(&mut self, sim: &mut Sim, unit: Unit, layers: usize) -> bool {
        let upto = self.ends[update_index(unit, layers)].min(self.slots.len());
        while self.next < upto {
            let k = self.next;
            let grad = match self.inflight.take() {
                Some(g) => g,
                None => sim.alloc(Offload, self.slots[k] * F32),
            };
            self.inflight = self.slots.get(k + 1).map(|&m| sim.alloc(Offload, m * F32));
            sim.free(grad);
            if self.ab != F32 {
                sim.free_opt(self.uploading.take());
                self.uploading = Some(sim.alloc(Offload, self.slots[k] * self.ab));
            }
            self.next += 1;
        }
        let done = self.next == self.slots.len();
        if done {
            sim.free_opt(self.uploading.take());
        }
        done
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
            let through = next_in_forward(unit, self.layers);
            if p.settle_through(sim, through, self.layers) {
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
