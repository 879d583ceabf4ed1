//! The sharded parameter store (FSDP / ZeRO-3): each rank owns one
//! contiguous shard of every unit's flat buffer (parameters in the compute
//! dtype, F32 gradients). A unit is all-gathered just before use — the next
//! unit of [`Unit::step_order`] prefetched beside the current one's compute,
//! at most two gathered units alive — and freed after; its gradients are
//! reduce-scattered to their owners right after its backward, beside the
//! next unit's backward. A LoRA run's adapters are a unit of their own per
//! block (`adapters.rs`), gathered and reduce-scattered with their block.

use super::adapters::{self, adapter_unit};
use crate::backend::{Backend, Category, DType, MatLayout, Tensor};
use crate::comm::{Pending, ProcessGroup};
use crate::error::{Error, Result};
use crate::model::flat_layout::{Segment, UnitLayout, layouts_with_adapters};
use crate::model::lora::LoraConfig;
use crate::model::{
    BlockGrads, BlockWeights, Freeze, GradSpec, HeadView, ModelConfig, ParamStore, Unit,
};
use crate::optim::{Lent, Piece, Slot};
use std::collections::VecDeque;

/// A gathered unit's parameters, one tensor each.
enum Gathered<B: Backend> {
    Embed(Tensor<B>),
    Block(Box<BlockWeights<B>>),
    /// `model.norm` and `lm_head` (none when tied).
    Head(Tensor<B>, Option<Tensor<B>>),
}

/// The gathers of one unit in flight: its parameters and, for a block of a
/// LoRA run, its adapter unit's.
struct UnitGather<B: Backend> {
    unit: usize,
    base: Pending<B>,
    adapters: Option<(usize, Pending<B>)>,
}

/// A reduce-scatter in flight: the unit, whether it overwrites the owned
/// gradient shard (its first contribution this step) or adds to it.
struct Reducing<B: Backend> {
    unit: usize,
    /// What the received shard does: becomes the unit's gradient shard
    /// (`Take`), is written into it in its dtype (`Write`: the first
    /// contribution to a BF16 shard), or is added to it (`Add`).
    into: ShardWrite,
    pending: Pending<B>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ShardWrite {
    Take,
    Write,
    Add,
}

/// One rank's shards and the step's gathered units and gradients.
pub struct FsdpStore<'a, B: Backend> {
    pub(crate) cfg: ModelConfig,
    /// The adapters each block trains (a LoRA run), whose adapter units
    /// follow the base units in `layouts`.
    pub(crate) lora: Option<LoraConfig>,
    pub(crate) layouts: Vec<UnitLayout>,
    pub(crate) rank: usize,
    pub(crate) group: &'a dyn ProcessGroup<B>,
    /// The same shards in other replicas (HSDP); a group of one without.
    pub(crate) replica: &'a dyn ProcessGroup<B>,
    /// Owned parameter shards `[shard]` (compute dtype); `None` while one
    /// is the send buffer of a gather in flight.
    pub(crate) params: Vec<Option<Tensor<B>>>,
    /// Owned gradient shards `[shard]` (F32, or BF16 with `--grad-dtype
    /// bf16`: reduced in F32, then rounded); `None` while one receives,
    /// and always for a frozen unit.
    pub(crate) grads: Vec<Option<Tensor<B>>>,
    /// Which parameters are frozen (`--freeze`: whole units under FSDP).
    frozen: Freeze,
    /// The dtype of the weight matrices' gradients and of every shard.
    grad_dtype: DType,
    /// Whether each unit is trained (has gradients and an optimizer slot).
    pub(crate) trained: Vec<bool>,
    /// Whether a gradient shard holds a contribution of this step.
    grad_written: Vec<bool>,
    gathered: Vec<Option<Gathered<B>>>,
    prefetch: Option<UnitGather<B>>,
    /// Gathers still to come this step.
    order: VecDeque<Unit>,
    block_g: Option<(usize, BlockGrads<B>)>,
    embed_g: Option<Tensor<B>>,
    head_g: Option<(Tensor<B>, Option<Tensor<B>>)>,
    reducing: Option<Reducing<B>>,
}

impl<'a, B: Backend> FsdpStore<'a, B> {
    /// The shards of rank `group.rank()` over `group` (gradients also summed
    /// over `replica`), each parameter's owned elements from
    /// `init(hf_name, elems)` (flattened, row-major); a rehearsing backend
    /// (`Backend::rehearsing`) allocates them unwritten, without `init`.
    pub fn new(
        b: &B,
        cfg: &ModelConfig,
        group: &'a dyn ProcessGroup<B>,
        replica: &'a dyn ProcessGroup<B>,
        init: impl FnMut(&str, std::ops::Range<usize>) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        Self::with_frozen(b, cfg, group, replica, &Freeze::none(), init)
    }

    /// [`new`](Self::new) with the units `frozen` freezes whole kept
    /// without gradient shards (a unit it freezes in part is refused).
    pub fn with_frozen(
        b: &B,
        cfg: &ModelConfig,
        group: &'a dyn ProcessGroup<B>,
        replica: &'a dyn ProcessGroup<B>,
        frozen: &Freeze,
        init: impl FnMut(&str, std::ops::Range<usize>) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        Self::with_adapters(b, cfg, group, replica, GradSpec::f32(frozen), None, init)
    }

    /// [`with_frozen`](Self::with_frozen) with `lora`'s adapters beside
    /// every block: an adapter unit each, trained (its factors' values from
    /// `init` under PEFT's names).
    pub fn with_adapters(
        b: &B,
        cfg: &ModelConfig,
        group: &'a dyn ProcessGroup<B>,
        replica: &'a dyn ProcessGroup<B>,
        grads_spec: GradSpec,
        lora: Option<&LoraConfig>,
        mut init: impl FnMut(&str, std::ops::Range<usize>) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let frozen = grads_spec.frozen;
        check_whole_units(cfg, frozen)?;
        let (world, rank) = (group.size(), group.rank());
        let layouts = layouts_with_adapters(cfg, lora, world);
        let trained: Vec<bool> = layouts
            .iter()
            .map(|u| u.adapters || !frozen.unit_frozen(cfg, u.unit))
            .collect();
        let mut params = Vec::with_capacity(layouts.len());
        let mut grads = Vec::with_capacity(layouts.len());
        let dt = b.compute_dtype();
        for u in &layouts {
            let shard = if b.rehearsing() {
                b.empty(&[u.shard], dt, Category::Weights)?
            } else {
                let host = shard_values(u, rank, &mut init)?;
                b.from_host(&host, &[u.shard], dt, Category::Weights)?
            };
            params.push(Some(shard));
            // a frozen unit has no gradient shard
            let grad = match trained[grads.len()] {
                true => Some(b.zeros(&[u.shard], grads_spec.matrices, Category::Grads)?),
                false => None,
            };
            grads.push(grad);
        }
        let n = layouts.len();
        let mut s = FsdpStore {
            cfg: cfg.clone(),
            lora: lora.cloned(),
            layouts,
            rank,
            group,
            replica,
            params,
            grads,
            frozen: frozen.clone(),
            grad_dtype: grads_spec.matrices,
            trained,
            grad_written: vec![false; n],
            gathered: (0..n).map(|_| None).collect(),
            prefetch: None,
            order: VecDeque::new(),
            block_g: None,
            embed_g: None,
            head_g: None,
            reducing: None,
        };
        s.begin_step(true, 1);
        Ok(s)
    }

    /// Prepares a forward-only pass (evaluation): the gathers to prefetch
    /// are the forward's units, in order; gradients are left as they are.
    pub fn begin_forward(&mut self) {
        let mut order = Unit::step_order(self.cfg.layers, self.cfg.tie_embeddings);
        order.truncate(self.cfg.layers + 2);
        if self.cfg.tie_embeddings {
            order.push(Unit::Embed);
        }
        self.order = order.into();
    }

    /// Prepares a step: the gathers to prefetch and, with `fresh_grads`,
    /// gradient shards that the step's first reduce-scatters overwrite
    /// (without it they add: gradient accumulation). `checkpoint_every`:
    /// the decoder's segments (`MemoryPolicy::checkpoint_every`), whose
    /// recompute gathers an earlier segment's blocks again before their
    /// backward.
    pub fn begin_step(&mut self, fresh_grads: bool, checkpoint_every: usize) {
        // no gather for a block below the backward's floor: its backward never runs
        let floor = self.frozen.backward_floor(&self.cfg, self.lora.is_some());
        let (layers, tied) = (self.cfg.layers, self.cfg.tie_embeddings);
        self.order = Unit::step_order_segmented(layers, tied, floor, checkpoint_every).into();
        if fresh_grads {
            self.grad_written.iter_mut().for_each(|w| *w = false);
        }
    }

    fn index(&self, unit: Unit) -> usize {
        unit.index(self.cfg.layers)
    }

    /// The model's decoder blocks.
    pub fn layers(&self) -> usize {
        self.cfg.layers
    }

    /// The units the optimizer has a slot for (the trained ones), by index
    /// into the layouts, in [`Unit::all`] order (a block's adapter unit
    /// right after the block): slot k is unit `slot_units()[k]`.
    pub fn slot_units(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.layouts.len())
            .filter(|&i| self.trained[i])
            .collect();
        let layers = self.cfg.layers;
        v.sort_by_key(|&i| (self.layouts[i].unit.index(layers), self.layouts[i].adapters));
        v
    }

    /// Block `layer`'s adapter unit, if the run has adapters.
    fn adapters_of(&self, unit: Unit) -> Option<usize> {
        match (unit, &self.lora) {
            (Unit::Block(l), Some(_)) => Some(adapter_unit(self.cfg.layers, l)),
            _ => None,
        }
    }

    /// The optimizer's slots: this rank's shard of every trained unit, with
    /// the pieces of the unit's parameters it holds.
    pub fn slots(&self) -> Vec<Slot> {
        let piece = |l: &UnitLayout, s: Segment| Piece {
            name: l.params[s.param].name.clone(),
            at: s.at..s.at + s.elems.len(),
        };
        let slot = |l: &UnitLayout| Slot {
            unit: l.unit,
            pieces: l
                .segments(self.rank)
                .into_iter()
                .map(|s| piece(l, s))
                .collect(),
        };
        let trained = self.slot_units().into_iter();
        trained.map(|i| slot(&self.layouts[i])).collect()
    }

    /// The shards and gradient shards, lent to the optimizer (a unit's
    /// are absent while in a collective).
    pub fn lend(&mut self) -> Lent<'_, B> {
        let order = self.slot_units();
        let mut params: Vec<_> = self.params.iter_mut().map(Some).collect();
        let mut grads: Vec<_> = self.grads.iter_mut().map(Some).collect();
        Lent {
            params: order
                .iter()
                .map(|&i| params[i].take().and_then(Option::as_mut))
                .collect(),
            grads: order
                .iter()
                .map(|&i| grads[i].take().and_then(Option::as_mut))
                .collect(),
        }
    }

    /// The global gradient norm: every rank's sum of squares, gathered and
    /// added in rank order on the host (the same value on every rank).
    pub fn grad_norm(&self, b: &B) -> Result<f64> {
        let mut shards = Vec::new();
        for i in self.slot_units() {
            shards.push(self.grads[i].as_ref().ok_or_else(|| {
                internal("a gradient shard is in a collective at the optimizer step".into())
            })?);
        }
        let own = b.sum_squares_all(&shards)?;
        // f64 carried as two f32 words (high part, rest) so no precision is lost
        let hi = own as f32;
        let lo = (own - hi as f64) as f32;
        let send = b.from_host(&[hi, lo], &[2], DType::F32, Category::Workspace)?;
        let world = self.group.size();
        let mut recv = b.empty(&[2 * world], DType::F32, Category::Workspace)?;
        self.group.all_gather(&send, &mut recv)?;
        let words = b.to_host(&recv)?;
        let total: f64 = words.chunks(2).map(|w| w[0] as f64 + w[1] as f64).sum();
        Ok(total.sqrt())
    }

    /// Starts the all-gather of layout `i`: its shard is the send buffer.
    fn start_one(&mut self, b: &B, i: usize) -> Result<Pending<B>> {
        let send = self.params[i]
            .take()
            .ok_or_else(|| internal(format!("unit {i} is gathered twice at once")))?;
        let recv = b.empty(&[self.layouts[i].padded()], send.dtype(), Category::Comm)?;
        self.group.start_all_gather(send, recv)
    }

    /// Starts the all-gathers of unit `i`: its parameters, then its
    /// adapters' (a block of a LoRA run).
    fn start_gather(&mut self, b: &B, i: usize) -> Result<UnitGather<B>> {
        let base = self.start_one(b, i)?;
        let adapters = match self.adapters_of(self.layouts[i].unit) {
            Some(a) => Some((a, self.start_one(b, a)?)),
            None => None,
        };
        Ok(UnitGather {
            unit: i,
            base,
            adapters,
        })
    }

    /// Waits for a gather that will not be used, taking back its shards.
    fn cancel_gather(&mut self, g: UnitGather<B>) -> Result<()> {
        let adapters = g.adapters.into_iter();
        for (i, p) in std::iter::once((g.unit, g.base)).chain(adapters) {
            self.params[i] = p.wait_all()?.sent.pop();
        }
        Ok(())
    }

    /// Waits for layout `i`'s gather: its shard back, its flat buffer.
    fn wait_one(&mut self, i: usize, pending: Pending<B>) -> Result<Tensor<B>> {
        let mut done = pending.wait_all()?;
        self.params[i] = done.sent.pop();
        done.received
            .pop()
            .ok_or_else(|| internal("an all-gather received nothing".into()))
    }

    /// Waits for unit `g.unit`'s gathers and splits them into parameter
    /// tensors (a block's adapters attached to it).
    fn finish_gather(&mut self, b: &B, g: UnitGather<B>) -> Result<()> {
        let i = g.unit;
        let flat = self.wait_one(i, g.base)?;
        let mut gathered = self.split(b, i, &flat)?;
        drop(flat);
        if let (Some((a, pending)), Gathered::Block(w)) = (g.adapters, &mut gathered) {
            let flat = self.wait_one(a, pending)?;
            let (layout, lora) = (&self.layouts[a], self.lora.as_ref());
            let lora = lora.ok_or_else(|| internal("adapters without a LoRA config".into()))?;
            let l = layout.unit.index(self.cfg.layers) - 1;
            let mut take =
                |name: String, shape: &[usize]| take_param(b, layout, &flat, name, shape);
            adapters::attach_gathered(&self.cfg, lora, l, w, &mut take)?;
        }
        self.gathered[i] = Some(gathered);
        Ok(())
    }

    /// Unit `i`'s parameters split out of its gathered flat buffer.
    fn split(&self, b: &B, i: usize, flat: &Tensor<B>) -> Result<Gathered<B>> {
        let layout = &self.layouts[i];
        let mut take = |name: String, shape: &[usize]| take_param(b, layout, flat, name, shape);
        Ok(match layout.unit {
            Unit::Embed => Gathered::Embed(take(
                "model.embed_tokens.weight".into(),
                &[self.cfg.vocab, self.cfg.hidden],
            )?),
            Unit::Block(l) => {
                Gathered::Block(Box::new(BlockWeights::build_with(&self.cfg, l, &mut take)?))
            }
            Unit::Head => {
                let h = self.cfg.hidden;
                let norm = take("model.norm.weight".into(), &[h])?;
                let head = match self.cfg.tie_embeddings {
                    true => None,
                    false => Some(take("lm_head.weight".into(), &[self.cfg.vocab, h])?),
                };
                Gathered::Head(norm, head)
            }
        })
    }

    /// Gathered units plus the one in flight.
    fn live(&self) -> usize {
        self.gathered.iter().filter(|g| g.is_some()).count() + usize::from(self.prefetch.is_some())
    }

    /// Prefetches the next unit of the step when fewer than two are alive.
    fn maybe_prefetch(&mut self, b: &B) -> Result<()> {
        let Some(&next) = self.order.front() else {
            return Ok(());
        };
        let j = self.index(next);
        if self.live() < 2 && self.gathered[j].is_none() {
            self.prefetch = Some(self.start_gather(b, j)?);
        }
        Ok(())
    }

    /// Hands a finished reduce-scatter's shard to its owner.
    fn wait_reduce(&mut self, b: &B) -> Result<()> {
        let Some(r) = self.reducing.take() else {
            return Ok(());
        };
        let mut recv = r.pending.wait()?;
        // HSDP: each shard is summed over the replicas after the reduce-scatter
        if self.replica.size() > 1 {
            self.replica.all_reduce(&mut recv)?;
        }
        if r.into == ShardWrite::Take {
            self.grads[r.unit] = Some(recv);
        } else {
            let shard = self.grads[r.unit]
                .as_mut()
                .ok_or_else(|| internal("a gradient shard is missing".into()))?;
            match r.into {
                ShardWrite::Write => b.copy(shard.mat_mut(), recv.mat())?,
                _ => b.axpy(shard, 1.0, &recv)?,
            }
        }
        self.grad_written[r.unit] = true;
        Ok(())
    }

    /// Takes the gradients of this use of `unit` out of the step's buffers:
    /// each trained layout's (none of a frozen unit; a block's adapter
    /// unit's after the block's own).
    fn take_grads(&mut self, unit: Unit) -> Result<Vec<(usize, Vec<Tensor<B>>)>> {
        let missing = || internal(format!("no gradients of {unit:?} to reduce"));
        let i = self.index(unit);
        let adapters = self.adapters_of(unit);
        if !self.trained[i] && adapters.is_none() {
            if matches!(unit, Unit::Block(_)) {
                self.block_g = None;
            }
            return Ok(Vec::new());
        }
        Ok(match unit {
            Unit::Embed => vec![(i, vec![self.embed_g.take().ok_or_else(missing)?])],
            Unit::Block(l) => {
                let mut g = match self.block_g.take() {
                    Some((k, g)) if k == l => g,
                    _ => return Err(missing()),
                };
                let lora = self.lora.as_ref();
                let a = match (adapters, lora) {
                    (Some(a), Some(lora)) => Some((a, adapters::take_grads(lora, &mut g)?)),
                    _ => None,
                };
                let base = self.trained[i].then(|| (i, g.into_tensors()));
                base.into_iter().chain(a).collect()
            }
            Unit::Head => {
                let (norm, head) = self.head_g.take().ok_or_else(missing)?;
                vec![(i, std::iter::once(norm).chain(head).collect())]
            }
        })
    }

    /// Starts the reduce-scatter of layout `i`'s gradients `grads` (its
    /// parameters' in order) to their owners, after the one in flight.
    fn reduce_scatter(&mut self, b: &B, i: usize, grads: Vec<Tensor<B>>) -> Result<()> {
        self.wait_reduce(b)?;
        let mut flat = b.zeros(&[self.layouts[i].padded()], DType::F32, Category::Comm)?;
        let mut off = 0;
        for t in grads {
            let l = MatLayout::block(off, t.rows(), t.row_len(), t.row_len());
            b.copy(flat.view_mut(l), t.mat())?;
            off += t.numel();
        }
        // an F32 shard receives its first contribution itself
        let into = match (self.grad_written[i], self.grad_dtype) {
            (false, DType::F32) => ShardWrite::Take,
            (false, _) => ShardWrite::Write,
            (true, _) => ShardWrite::Add,
        };
        let recv = if into == ShardWrite::Take {
            self.grads[i]
                .take()
                .ok_or_else(|| internal("a gradient shard is missing".into()))?
        } else {
            b.empty(&[self.layouts[i].shard], DType::F32, Category::Comm)?
        };
        let pending = self.group.start_reduce_scatter(flat, recv)?;
        self.reducing = Some(Reducing {
            unit: i,
            into,
            pending,
        });
        Ok(())
    }

    /// The gathered unit `i`, or an error naming the decoder's mistake.
    fn gathered(&self, unit: Unit) -> Result<&Gathered<B>> {
        self.gathered[self.index(unit)]
            .as_ref()
            .ok_or_else(|| internal(format!("{unit:?} is used before it is acquired")))
    }
}

/// Under FSDP a unit is trained or frozen whole: its gradients are one
/// flat buffer, reduce-scattered to the shards the optimizer updates.
pub fn check_whole_units(cfg: &ModelConfig, frozen: &Freeze) -> Result<()> {
    match frozen.split_unit(cfg) {
        None => Ok(()),
        Some(unit) => crate::config_err!(
            "--freeze {frozen} freezes part of {} under --fsdp on, which shards, reduces and \
             updates whole units (the embedding, each block, the final norm with the LM head): \
             freeze whole units (embeddings, blocks:A-B; `head` and `norms` only together with \
             every block), or use --fsdp off",
            crate::model::flat_layout::unit_key(unit)
        ),
    }
}

/// Parameter `name` of `layout`, `shape`d, copied out of its gathered flat
/// buffer.
fn take_param<B: Backend>(
    b: &B,
    layout: &UnitLayout,
    flat: &Tensor<B>,
    name: String,
    shape: &[usize],
) -> Result<Tensor<B>> {
    let slot = layout
        .params
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| internal(format!("{name} is not in its unit")))?;
    let mut t = b.empty(shape, flat.dtype(), Category::Weights)?;
    let l = MatLayout::block(slot.offset, t.rows(), t.row_len(), t.row_len());
    b.copy(t.mat_mut(), flat.view(l))?;
    Ok(t)
}

fn internal(why: String) -> Error {
    Error::Backend(format!("FSDP: {why}"))
}

/// Rank `rank`'s shard of unit layout `u`, each owned range from
/// `init(hf_name, elems)` (the padding zero).
fn shard_values(
    u: &UnitLayout,
    rank: usize,
    init: &mut impl FnMut(&str, std::ops::Range<usize>) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let mut host = vec![0.0f32; u.shard];
    for s in u.segments(rank) {
        let p = &u.params[s.param];
        let v = init(&p.name, s.elems.clone())?;
        if v.len() != s.elems.len() {
            return Err(Error::Checkpoint(format!(
                "{}: {} values for elements {:?}",
                p.name,
                v.len(),
                s.elems
            )));
        }
        host[s.at..s.at + v.len()].copy_from_slice(&v);
    }
    Ok(host)
}

fn zeros_f32<B: Backend>(b: &B, shape: &[usize]) -> Result<Tensor<B>> {
    b.zeros(shape, DType::F32, Category::Grads)
}

impl<B: Backend> ParamStore<B> for FsdpStore<'_, B> {
    fn acquire(&mut self, b: &B, unit: Unit) -> Result<()> {
        let i = self.index(unit);
        if self.gathered[i].is_some() {
            return Err(internal(format!("{unit:?} is acquired twice")));
        }
        if let Some(pos) = self.order.iter().position(|u| *u == unit) {
            self.order.drain(..=pos);
        }
        let pending = match self.prefetch.take() {
            Some(g) if g.unit == i => g,
            Some(g) => {
                // not the unit expected next: put that one back
                self.cancel_gather(g)?;
                self.start_gather(b, i)?
            }
            None => self.start_gather(b, i)?,
        };
        self.finish_gather(b, pending)?;
        self.maybe_prefetch(b)
    }

    fn release(&mut self, unit: Unit) -> Result<()> {
        let i = self.index(unit);
        if self.gathered[i].take().is_none() {
            return Err(internal(format!("{unit:?} is released but not acquired")));
        }
        Ok(())
    }

    fn embed(&self) -> Result<&Tensor<B>> {
        match self.gathered(Unit::Embed)? {
            Gathered::Embed(t) => Ok(t),
            _ => Err(internal("the embedding unit holds another unit".into())),
        }
    }

    fn block(&self, l: usize) -> Result<&BlockWeights<B>> {
        match self.gathered(Unit::Block(l))? {
            Gathered::Block(w) => Ok(w),
            _ => Err(internal(format!("block {l} holds another unit"))),
        }
    }

    fn final_norm(&self) -> Result<&Tensor<B>> {
        match self.gathered(Unit::Head)? {
            Gathered::Head(norm, _) => Ok(norm),
            _ => Err(internal("the head unit holds another unit".into())),
        }
    }

    fn head(&self) -> Result<&Tensor<B>> {
        match self.gathered(Unit::Head)? {
            Gathered::Head(_, Some(head)) => Ok(head),
            Gathered::Head(_, None) => self.embed(),
            _ => Err(internal("the head unit holds another unit".into())),
        }
    }

    fn block_grads(&mut self, b: &B, l: usize) -> Result<(&BlockWeights<B>, &mut BlockGrads<B>)> {
        if !matches!(&self.block_g, Some((k, _)) if *k == l) {
            if self.block_g.is_some() {
                return Err(internal(format!(
                    "block {l}'s gradients start before the last block's are reduced"
                )));
            }
            let i = self.index(Unit::Block(l));
            let spec = GradSpec {
                frozen: &self.frozen,
                matrices: self.grad_dtype,
            };
            let mut g = BlockGrads::zeros(b, &self.cfg, l, spec)?;
            if let Some(Gathered::Block(w)) = &self.gathered[i] {
                adapters::attach_grads(b, w, &mut g)?;
            }
            self.block_g = Some((l, g));
        }
        let i = self.index(Unit::Block(l));
        match (&self.gathered[i], &mut self.block_g) {
            (Some(Gathered::Block(w)), Some((_, g))) => Ok((w, g)),
            _ => Err(internal(format!("block {l} is used before it is acquired"))),
        }
    }

    fn head_grads(&mut self, b: &B) -> Result<HeadView<'_, B>> {
        let (v, h) = (self.cfg.vocab, self.cfg.hidden);
        let tied = self.cfg.tie_embeddings;
        let (ih, ie) = (self.index(Unit::Head), self.index(Unit::Embed));
        // a frozen unit's gradients are never allocated
        if self.trained[ih] && self.head_g.is_none() {
            let head = if tied {
                None
            } else {
                Some(b.zeros(&[v, h], self.grad_dtype, Category::Grads)?)
            };
            self.head_g = Some((zeros_f32(b, &[h])?, head));
        }
        if tied && self.trained[ie] && self.embed_g.is_none() {
            self.embed_g = Some(zeros_f32(b, &[v, h])?);
        }
        let Some(Gathered::Head(norm, head)) = &self.gathered[ih] else {
            return Err(internal("the head is used before it is acquired".into()));
        };
        let (d_norm, d_own_head) = match &mut self.head_g {
            Some((n, h)) => (Some(n), h.as_mut()),
            None => (None, None),
        };
        let (head, d_head) = match head {
            Some(w) => (w, d_own_head),
            None => match &self.gathered[ie] {
                Some(Gathered::Embed(w)) => (w, self.embed_g.as_mut()),
                _ => return Err(internal("a tied head needs the embedding acquired".into())),
            },
        };
        Ok(HeadView {
            norm,
            head,
            d_norm,
            d_head,
        })
    }

    fn embed_grads(&mut self, b: &B) -> Result<Option<&mut Tensor<B>>> {
        if !self.trained[self.index(Unit::Embed)] {
            return Ok(None);
        }
        if self.embed_g.is_none() {
            self.embed_g = Some(zeros_f32(b, &[self.cfg.vocab, self.cfg.hidden])?);
        }
        Ok(self.embed_g.as_mut())
    }

    fn grads_done(&mut self, b: &B, unit: Unit) -> Result<()> {
        // a frozen unit (without adapters): nothing reduce-scattered
        for (i, grads) in self.take_grads(unit)? {
            self.reduce_scatter(b, i, grads)?;
        }
        Ok(())
    }

    fn finish(&mut self, b: &B) -> Result<()> {
        self.wait_reduce(b)?;
        if self.live() > 0 || self.block_g.is_some() || self.embed_g.is_some() {
            return Err(internal(
                "the step ended with units or gradients still held".into(),
            ));
        }
        Ok(())
    }
}
