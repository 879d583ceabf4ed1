//! The parameter stores' allocations (`train::replicated`,
//! `train::fsdp::store`), driven by the decoder walk's calls in the order
//! `Decoder::forward_backward` makes them.

use super::sim::{Buf, Sim};
use crate::backend::Category::{Comm, Grads, Weights};
use crate::model::flat_layout::layouts_with_adapters;
use crate::model::lora::LoraConfig;
use crate::model::{Freeze, ModelConfig, Unit};
use crate::train::fsdp::UnitLayout;
use crate::train::fsdp::adapters::adapter_unit;
use std::collections::VecDeque;

const F32: usize = 4;

/// What a parameter store allocates when the decoder calls it.
pub trait StoreWalk {
    fn acquire(&mut self, sim: &mut Sim, unit: Unit);
    fn release(&mut self, sim: &mut Sim, unit: Unit);
    fn block_grads(&mut self, sim: &mut Sim, l: usize);
    fn head_grads(&mut self, sim: &mut Sim);
    /// Whether the embedding has a gradient (a frozen one has none, and
    /// the decoder skips its backward).
    fn embed_grads(&mut self, sim: &mut Sim) -> bool;
    fn grads_done(&mut self, sim: &mut Sim, unit: Unit);
    fn finish(&mut self, sim: &mut Sim);
}

/// `ReplicatedStore`: resident gradients; one F32 bucket per unit summed
/// over the ranks (`world` > 1), held until the next unit's bucket starts
/// (none for a unit whose parameters are all frozen).
pub struct ReplicatedWalk {
    layers: usize,
    /// Trainable elements of each unit, in `Unit::all` order.
    numel: Vec<usize>,
    world: usize,
    embed_uses_left: usize,
    /// Whether the embedding is trained.
    embed_trained: bool,
    bucket: Option<Buf>,
}

/// Trainable elements of each unit of `cfg` under `frozen`, in `Unit::all` order.
pub fn trainable_numel(cfg: &ModelConfig, frozen: &Freeze) -> Vec<usize> {
    let mut numel = vec![0; cfg.layers + 2];
    for (p, shape) in cfg.params() {
        if !frozen.is_frozen(cfg, p) {
            numel[p.unit().index(cfg.layers)] += shape.iter().product::<usize>();
        }
    }
    numel
}

/// The elements of each adapter factor of one block (`lora_A` then
/// `lora_B` of each target, in block order: `ModelWeights::tensors`
/// order), none without `lora`.
pub fn adapter_numels(cfg: &ModelConfig, lora: Option<&LoraConfig>) -> Vec<usize> {
    let Some(lora) = lora else {
        return Vec::new();
    };
    let factors = lora
        .targets
        .iter()
        .flat_map(|&t| lora.factor_shapes(cfg, t));
    factors.map(|[r, c]| r * c).collect()
}

/// [`trainable_numel`] with each block's adapters (`lora`), which train.
pub fn trained_numel(cfg: &ModelConfig, frozen: &Freeze, lora: Option<&LoraConfig>) -> Vec<usize> {
    let mut numel = trainable_numel(cfg, frozen);
    let per_block: usize = adapter_numels(cfg, lora).iter().sum();
    for l in 0..cfg.layers {
        numel[Unit::Block(l).index(cfg.layers)] += per_block;
    }
    numel
}

impl ReplicatedWalk {
    /// `reduce`: whether this pass sums the gradients (a step's last
    /// sequence); `lora`: the adapters each block trains.
    pub fn new(
        cfg: &ModelConfig,
        world: usize,
        reduce: bool,
        frozen: &Freeze,
        lora: Option<&LoraConfig>,
    ) -> Self {
        ReplicatedWalk {
            layers: cfg.layers,
            numel: trained_numel(cfg, frozen, lora),
            world: if reduce { world } else { 1 },
            embed_uses_left: 1 + usize::from(cfg.tie_embeddings),
            embed_trained: !frozen.is_frozen(cfg, crate::model::Param::Embed),
            bucket: None,
        }
    }
}

impl StoreWalk for ReplicatedWalk {
    fn acquire(&mut self, _: &mut Sim, _: Unit) {}
    fn release(&mut self, _: &mut Sim, _: Unit) {}
    fn block_grads(&mut self, _: &mut Sim, _: usize) {}
    fn head_grads(&mut self, _: &mut Sim) {}
    fn embed_grads(&mut self, _: &mut Sim) -> bool {
        self.embed_trained
    }
    fn grads_done(&mut self, sim: &mut Sim, unit: Unit) {
        if unit == Unit::Embed {
            self.embed_uses_left -= 1;
            if self.embed_uses_left > 0 {
                return;
            }
        }
        if self.world > 1 && self.numel[unit.index(self.layers)] > 0 {
            sim.free_opt(self.bucket.take());
            self.bucket = Some(sim.alloc(Comm, self.numel[unit.index(self.layers)] * F32));
        }
    }
    fn finish(&mut self, sim: &mut Sim) {
        sim.free_opt(self.bucket.take());
    }
}

/// `FsdpStore`: gathers (one prefetched while fewer than two units are
/// alive; a block's adapter unit with the block), per-parameter tensors of
/// the gathered units, the step's full gradients and reduce-scatter buffers.
pub struct FsdpWalk {
    cfg: ModelConfig,
    /// The units' layouts, each block's adapter unit after the base units
    /// (a LoRA run).
    layouts: Vec<UnitLayout>,
    /// Whether each layout is trained (FSDP freezes whole units; adapters train).
    trained: Vec<bool>,
    /// Whether the blocks have adapter units.
    adapters: bool,
    /// Compute-dtype bytes per element.
    ab: usize,
    gathered: Vec<Option<Vec<Buf>>>,
    /// The gather in flight: its unit and receive buffers (the block's,
    /// then its adapters').
    prefetch: Option<(usize, Vec<Buf>)>,
    order: VecDeque<Unit>,
    /// A block's gradients: its parameters' (when trained), its adapters'.
    block_g: Option<(Vec<Buf>, Vec<Buf>)>,
    embed_g: Option<Buf>,
    head_g: Option<Vec<Buf>>,
    grad_written: Vec<bool>,
    /// The reduce-scatter in flight: its flat send buffer and, when it adds
    /// into the shard, its receive buffer.
    reducing: Option<(Buf, Option<Buf>)>,
}

impl FsdpWalk {
    /// `fresh`: the step's first sequence (its reduce-scatters overwrite the
    /// gradient shards; later ones add through a receive buffer).
    /// `lora`: the adapters each block trains.
    pub fn new(
        cfg: &ModelConfig,
        world: usize,
        ab: usize,
        fresh: bool,
        frozen: &Freeze,
        lora: Option<&LoraConfig>,
    ) -> Self {
        let layouts = layouts_with_adapters(cfg, lora, world);
        let n = layouts.len();
        let floor = frozen.backward_floor(cfg, lora.is_some());
        FsdpWalk {
            cfg: cfg.clone(),
            trained: trained_layouts(cfg, &layouts, frozen),
            adapters: lora.is_some(),
            layouts,
            ab,
            gathered: vec![None; n],
            prefetch: None,
            order: Unit::step_order_to(cfg.layers, cfg.tie_embeddings, floor).into(),
            block_g: None,
            embed_g: None,
            head_g: None,
            grad_written: vec![!fresh; n],
            reducing: None,
        }
    }

    /// The resident shards (`FsdpStore::new`, `AdamW::new` over its slots): parameters
    /// (with `lora`, each block's adapter unit's too), F32 gradients of the
    /// units `frozen` leaves trained and of the adapter units, and
    /// `optim_elems` F32 elements of optimizer state on the device (every
    /// state of the units that keep theirs there).
    pub fn resident(
        cfg: &ModelConfig,
        world: usize,
        ab: usize,
        optim_elems: usize,
        frozen: &Freeze,
        lora: Option<&LoraConfig>,
        sim: &mut Sim,
    ) {
        let layouts = layouts_with_adapters(cfg, lora, world);
        let shard: usize = layouts.iter().map(|u| u.shard).sum();
        sim.alloc(Weights, shard * ab);
        let trained = trained_layouts(cfg, &layouts, frozen);
        let trained = layouts.iter().zip(trained).filter(|(_, t)| *t);
        sim.alloc(Grads, trained.map(|(u, _)| u.shard).sum::<usize>() * F32);
        if optim_elems > 0 {
            sim.alloc(crate::backend::Category::OptimState, optim_elems * F32);
        }
    }

    fn index(&self, u: Unit) -> usize {
        u.index(self.cfg.layers)
    }

    /// Block `l`'s adapter unit, if the blocks have adapters.
    fn adapters_of(&self, unit: Unit) -> Option<usize> {
        match unit {
            Unit::Block(l) if self.adapters => Some(adapter_unit(self.cfg.layers, l)),
            _ => None,
        }
    }

    /// The receive buffers of unit `i`'s gathers (its adapters' after it).
    fn start_gather(&self, sim: &mut Sim, i: usize) -> Vec<Buf> {
        let adapters = self.adapters_of(self.layouts[i].unit);
        let units = std::iter::once(i).chain(adapters);
        units
            .map(|j| sim.alloc(Comm, self.layouts[j].padded() * self.ab))
            .collect()
    }

    /// The reduce-scatter of layout `i`'s gradients `grads`, after the one
    /// in flight.
    fn reduce(&mut self, sim: &mut Sim, i: usize, grads: Vec<Buf>) {
        self.wait_reduce(sim);
        let flat = sim.alloc(Comm, self.layouts[i].padded() * F32);
        for g in grads {
            sim.free(g);
        }
        let recv = if self.grad_written[i] {
            Some(sim.alloc(Comm, self.layouts[i].shard * F32))
        } else {
            None
        };
        self.grad_written[i] = true;
        self.reducing = Some((flat, recv));
    }

    fn live(&self) -> usize {
        self.gathered.iter().filter(|g| g.is_some()).count() + usize::from(self.prefetch.is_some())
    }

    fn wait_reduce(&mut self, sim: &mut Sim) {
        if let Some((flat, recv)) = self.reducing.take() {
            sim.free(flat);
            sim.free_opt(recv);
        }
    }

    fn grads(&self, sim: &mut Sim, numels: impl IntoIterator<Item = usize>) -> Vec<Buf> {
        numels
            .into_iter()
            .map(|n| sim.alloc(Grads, n * F32))
            .collect()
    }
}

/// Whether each of `layouts` is trained: an adapter unit always, a base
/// unit unless `frozen` freezes it.
fn trained_layouts(cfg: &ModelConfig, layouts: &[UnitLayout], frozen: &Freeze) -> Vec<bool> {
    let trained = |u: &UnitLayout| u.adapters || !frozen.unit_frozen(cfg, u.unit);
    layouts.iter().map(trained).collect()
}

impl StoreWalk for FsdpWalk {
    fn acquire(&mut self, sim: &mut Sim, unit: Unit) {
        let i = self.index(unit);
        if let Some(pos) = self.order.iter().position(|u| *u == unit) {
            self.order.drain(..=pos);
        }
        let recv = match self.prefetch.take() {
            Some((j, b)) if j == i => b,
            Some((_, b)) => {
                b.into_iter().for_each(|b| sim.free(b));
                self.start_gather(sim, i)
            }
            None => self.start_gather(sim, i),
        };
        // each gathered flat buffer split into its parameters, then freed
        let units = std::iter::once(i).chain(self.adapters_of(unit));
        let mut params = Vec::new();
        for (j, flat) in units.zip(recv) {
            let layout = &self.layouts[j];
            params.extend(
                layout
                    .params
                    .iter()
                    .map(|p| sim.alloc(Weights, p.numel() * self.ab)),
            );
            sim.free(flat);
        }
        self.gathered[i] = Some(params);
        if let Some(&next) = self.order.front() {
            let j = self.index(next);
            if self.live() < 2 && self.gathered[j].is_none() {
                let b = self.start_gather(sim, j);
                self.prefetch = Some((j, b));
            }
        }
    }

    fn release(&mut self, sim: &mut Sim, unit: Unit) {
        let i = self.index(unit);
        for b in self.gathered[i].take().into_iter().flatten() {
            sim.free(b);
        }
    }

    fn block_grads(&mut self, sim: &mut Sim, l: usize) {
        let i = self.index(Unit::Block(l));
        let adapters = self.adapters_of(Unit::Block(l));
        if self.block_g.is_none() && (self.trained[i] || adapters.is_some()) {
            let numels = |j: usize| self.layouts[j].params.iter().map(|p| p.numel()).collect();
            let base: Vec<usize> = if self.trained[i] { numels(i) } else { vec![] };
            let base = self.grads(sim, base);
            let lora: Vec<usize> = adapters.map(numels).unwrap_or_default();
            let lora = self.grads(sim, lora);
            self.block_g = Some((base, lora));
        }
    }

    fn head_grads(&mut self, sim: &mut Sim) {
        let (v, h) = (self.cfg.vocab, self.cfg.hidden);
        let tied = self.cfg.tie_embeddings;
        let (ih, ie) = (self.index(Unit::Head), self.index(Unit::Embed));
        if self.head_g.is_none() && self.trained[ih] {
            let head = if tied { vec![] } else { vec![v * h] };
            let mut g = self.grads(sim, head);
            g.extend(self.grads(sim, [h]));
            self.head_g = Some(g);
        }
        if tied && self.trained[ie] && self.embed_g.is_none() {
            self.embed_g = Some(sim.alloc(Grads, v * h * F32));
        }
    }

    fn embed_grads(&mut self, sim: &mut Sim) -> bool {
        if !self.trained[self.index(Unit::Embed)] {
            return false;
        }
        if self.embed_g.is_none() {
            self.embed_g = Some(sim.alloc(Grads, self.cfg.vocab * self.cfg.hidden * F32));
        }
        true
    }

    fn grads_done(&mut self, sim: &mut Sim, unit: Unit) {
        let i = self.index(unit);
        let (grads, lora): (Vec<Buf>, Vec<Buf>) = match unit {
            Unit::Embed => (self.embed_g.take().into_iter().collect(), vec![]),
            Unit::Block(_) => self.block_g.take().unwrap_or_default(),
            Unit::Head => (self.head_g.take().unwrap_or_default(), vec![]),
        };
        // a frozen unit: nothing reduce-scattered
        if self.trained[i] {
            self.reduce(sim, i, grads);
        }
        if let Some(a) = self.adapters_of(unit) {
            self.reduce(sim, a, lora);
        }
    }

    fn finish(&mut self, sim: &mut Sim) {
        self.wait_reduce(sim);
    }
}
