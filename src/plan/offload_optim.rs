//! `--offload-optimizer` (`optim::host`): how many units keep
//! their optimizer state on the host, `auto` (the fewest that make the
//! step fit), and the allocations: the host-resident state as it is built,
//! and a step's gradient downloads (one slot ahead) and parameter uploads,
//! which run in the next step's forward ahead of each unit
//! (`optim::settling`).

use super::sim::{Buf, Sim};
use super::store_walk::StoreWalk;
use super::{StepSpec, predict_step};
use crate::backend::Category::{Offload, Workspace};
use crate::error::Result;
use crate::model::lora::LoraConfig;
use crate::model::{Freeze, MemoryPolicy, ModelConfig, Unit};
use crate::optim::settling::{next_in_forward, state_on_host, update_index, update_order};
use crate::train::fsdp::{UnitLayout, model_layouts};

const F32: usize = 4;

/// The `--offload-optimizer` choice: units (the embedding, each block, the
/// head) whose F32 master weights and moments live in host memory, the
/// last ones of update order (`MemoryPolicy::offload_optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerOffload {
    /// The fewest units that make the step fit the device budget beside
    /// everything else the run decided ([`optimizer_auto`]).
    Auto,
    /// Every unit.
    All,
    /// The last N units (`none`: 0).
    Units(usize),
}

impl std::fmt::Display for OptimizerOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptimizerOffload::Auto => f.write_str("auto"),
            OptimizerOffload::All => f.write_str("all"),
            OptimizerOffload::Units(0) => f.write_str("none"),
            OptimizerOffload::Units(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for OptimizerOffload {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(OptimizerOffload::Auto),
            "all" | "true" => Ok(OptimizerOffload::All),
            "none" | "false" => Ok(OptimizerOffload::Units(0)),
            n => n.parse().map(OptimizerOffload::Units).map_err(|_| {
                crate::Error::Config(format!(
                    "--offload-optimizer {n}: use all (the flag alone), a number of units \
                     (the last blocks first, then the embedding and the head), auto, or none"
                ))
            }),
        }
    }
}

impl OptimizerOffload {
    /// The units of a `layers`-block model on the host before any budget
    /// is known: `auto` starts from every unit (the most room for the
    /// choices resolved before it).
    pub fn units(self, layers: usize) -> usize {
        match self {
            OptimizerOffload::Auto | OptimizerOffload::All => MemoryPolicy::optimizer_units(layers),
            OptimizerOffload::Units(n) => n,
        }
    }

    /// The units on the host in a step of `spec` (its
    /// `policy.offload_optimizer` is ignored) with `budget` device bytes
    /// per rank (`None`: unknown; `auto` then keeps every unit's state on
    /// the host). A number above the model's units is an error naming the
    /// fix.
    pub fn resolve(self, spec: &StepSpec, budget: Option<usize>) -> Result<usize> {
        let layers = spec.model.layers;
        let n = match (self, budget) {
            (OptimizerOffload::Auto, Some(b)) if spec.optimizer => optimizer_auto(spec, b)?,
            (OptimizerOffload::Auto, _) if !spec.optimizer => 0,
            (choice, _) => choice.units(layers),
        };
        let mut policy = spec.policy;
        policy.offload_optimizer = n;
        policy.validate_for(layers)?;
        Ok(n)
    }
}

/// The fewest units whose optimizer state on the host brings the step's
/// predicted device peak within `budget`; every unit when even that does
/// not (the preflight then reports the closest run). Each unit moved to
/// the host takes its state off the device, so the peak falls with the
/// count: the search bisects.
pub fn optimizer_auto(spec: &StepSpec, budget: usize) -> Result<usize> {
    let all = MemoryPolicy::optimizer_units(spec.model.layers);
    let fits = |n: usize| -> Result<bool> {
        let mut s = spec.clone();
        s.policy.offload_optimizer = n;
        Ok(predict_step(&s)?.rank_bytes(s.device) <= budget)
    };
    if fits(0)? {
        return Ok(0);
    }
    if !fits(all)? {
        return Ok(all);
    }
    // fits(lo) is false, fits(hi) true
    let (mut lo, mut hi) = (0, all);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

/// The optimizer's slots of each unit, in model order: the elements of
/// each trainable parameter tensor (`ModelWeights::named` order: a block's
/// LoRA factors, `lora`, after its base tensors), or with `fsdp` the unit's
/// shard over `shard_world` ranks (a block's adapter unit's shard after
/// it); none for what `frozen` freezes.
pub fn unit_slots(
    cfg: &ModelConfig,
    fsdp: bool,
    shard_world: usize,
    frozen: &Freeze,
    lora: Option<&LoraConfig>,
) -> Vec<(Unit, Vec<usize>)> {
    let adapters = super::store_walk::adapter_numels(cfg, lora);
    let world = if fsdp { shard_world } else { 1 };
    let params = cfg.params();
    model_layouts(cfg, world)
        .iter()
        .map(|u| {
            let trained = params
                .iter()
                .filter(|(p, _)| p.unit() == u.unit)
                .map(|(p, shape)| (!frozen.is_frozen(cfg, *p), shape.iter().product::<usize>()));
            let mut slots: Vec<usize> = match fsdp {
                true if frozen.unit_frozen(cfg, u.unit) => vec![],
                true => vec![u.shard],
                false => trained.filter(|(t, _)| *t).map(|(_, n)| n).collect(),
            };
            match (u.unit, lora) {
                // FSDP: the block's adapter unit, one shard (`FsdpStore::slots`)
                (Unit::Block(l), Some(lora)) if fsdp => {
                    slots.push(UnitLayout::adapters(cfg, lora, l, world).shard)
                }
                (Unit::Block(_), _) => slots.extend_from_slice(&adapters),
                _ => {}
            }
            (u.unit, slots)
        })
        .collect()
}

/// Where the optimizer's state of `units` (from [`unit_slots`]) lives when
/// the last `host_units` units of update order keep theirs on the host:
/// `(elements per state on the device, host slots in model order)`.
pub fn split_state(
    units: &[(Unit, Vec<usize>)],
    layers: usize,
    host_units: usize,
) -> (usize, Vec<usize>) {
    let mut device = 0;
    let mut host = Vec::new();
    for (u, slots) in units {
        match state_on_host(*u, layers, host_units) {
            true => host.extend_from_slice(slots),
            false => device += slots.iter().sum::<usize>(),
        }
    }
    (device, host)
}

/// Each host slot's F32 master (through a device F32 copy when the compute
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

/// The host slots of `units` (from [`unit_slots`]) in the order a deferred
/// step updates them (`optim::settling::update_order`: the head's first),
/// and for each unit in that order the host slots through it.
pub fn update_slots(
    units: &[(Unit, Vec<usize>)],
    layers: usize,
    host_units: usize,
) -> (Vec<usize>, Vec<usize>) {
    let mut ordered = Vec::new();
    let ends = update_order(layers)
        .into_iter()
        .map(|u| {
            if state_on_host(u, layers, host_units) {
                ordered.extend_from_slice(&units[u.index(layers)].1);
            }
            ordered.len()
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
/// unit the forward acquires (as `optim::settling::Settling` runs them).
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
    fn embed_grads(&mut self, sim: &mut Sim) -> bool {
        self.inner.embed_grads(sim)
    }
    fn grads_done(&mut self, sim: &mut Sim, unit: Unit) {
        self.inner.grads_done(sim, unit);
    }
    fn finish(&mut self, sim: &mut Sim) {
        self.inner.finish(sim);
    }
}
