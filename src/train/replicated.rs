//! The unsharded parameter store: every rank holds the whole model and its
//! gradients (F32, or BF16 weight matrices: `--grad-dtype`); each unit's
//! gradients are summed over the ranks in one F32 bucket as soon as its
//! backward is done, beside the next unit's backward.

use super::config::TrainConfig;
use super::host_weights::{state_sources, weight_sources, weights_from_host, weights_from_saved};
use super::state::{RankModel, Sequence, pass};
use crate::backend::{Backend, Category, DType, MatLayout, Tensor};
use crate::checkpoint::peft::adapter_tensors;
use crate::checkpoint::saved_state::{Moment, SavedState};
use crate::checkpoint::{
    AdapterToSave, ModelFiles, SaveDtype, StateToSave, TensorSource, check_extra_tensors,
    load_hf_model_with, save_adapter_state, save_train_state_as,
};
use crate::comm::Mesh;
use crate::comm::{Pending, ProcessGroup};
use crate::error::{Error, Result};
use crate::model::forward::LossRows;
use crate::model::lora_params::{adapters_to_host, attach_adapter_grads};
use crate::model::weights::TensorId;
use crate::model::{
    BlockGrads, BlockWeights, Decoder, Freeze, GradSpec, HeadView, ModelConfig, ModelGrads,
    ModelWeights, ParamStore, Unit,
};
use crate::optim::settling::{Deferred, Settling};
use crate::optim::{BuildArgs, Lent, Optimizer, Slot, StateKind, Update, slots_through};
use crate::train::lora_base::{BaseModel, LoraSave, resumed_base, run_base, with_base};
use crate::train::lora_run::attach;
use std::collections::HashMap;

/// Whole-model parameters and gradients of one rank.
pub struct ReplicatedStore<'a, B: Backend> {
    pub w: ModelWeights<B>,
    /// Gradients of the trainable parameters ([`GradSpec`]), summed over
    /// `group` unit by unit as the step's backward finishes each.
    pub g: ModelGrads<B>,
    /// Whether each parameter (`ModelWeights::named` order) is trained:
    /// the frozen ones (`--freeze`) have no gradient and no optimizer slot.
    trainable: Vec<bool>,
    group: &'a dyn ProcessGroup<B>,
    /// Uses of the embedding's gradient left in this step (2 when tied).
    embed_uses_left: usize,
    /// The bucket being summed, with the unit it holds.
    reducing: Option<(Unit, Pending<B>)>,
    /// Whether this pass sums each unit's gradients over the group (off for
    /// all but the last sequence of a `--grad-accum` step).
    pub reduce: bool,
}

impl<'a, B: Backend> ReplicatedStore<'a, B> {
    /// A store of `w` with zero gradients, reducing over `group`.
    pub fn new(
        b: &B,
        cfg: &ModelConfig,
        w: ModelWeights<B>,
        group: &'a dyn ProcessGroup<B>,
    ) -> Result<Self> {
        Self::with_grads(b, cfg, w, group, GradSpec::f32(&Freeze::none()))
    }

    /// A store of `w` with zero gradients as `spec` says (none for the
    /// parameters it freezes), reducing over `group`.
    pub fn with_grads(
        b: &B,
        cfg: &ModelConfig,
        w: ModelWeights<B>,
        group: &'a dyn ProcessGroup<B>,
        spec: GradSpec,
    ) -> Result<Self> {
        let mut g = ModelGrads::zeros(b, cfg, spec)?;
        attach_adapter_grads(b, &w, &mut g)?;
        let trainable = trainable_mask(&w, cfg, spec.frozen);
        let mut s = ReplicatedStore {
            w,
            g,
            trainable,
            group,
            embed_uses_left: 0,
            reducing: None,
            reduce: true,
        };
        s.embed_uses_left = s.embed_uses();
        Ok(s)
    }

    fn embed_uses(&self) -> usize {
        1 + usize::from(self.w.lm_head.is_none())
    }

    /// Zeroes every gradient for the next step.
    pub fn zero_grads(&mut self, b: &B) -> Result<()> {
        for (_, t) in self.g.named_mut() {
            b.fill(t, 0.0)?;
        }
        Ok(())
    }

    /// Starts summing `unit`'s gradients over the group in one F32 bucket
    /// (after the previous bucket has come back).
    fn reduce(&mut self, b: &B, unit: Unit) -> Result<()> {
        self.wait_bucket(b)?;
        let grads = self.g.unit_named(unit);
        let numel = grads.iter().map(|(_, t)| t.numel()).sum();
        if numel == 0 {
            return Ok(()); // a frozen unit: nothing to sum
        }
        let mut bucket = b.empty(&[numel], DType::F32, Category::Comm)?;
        let mut off = 0;
        for (_, t) in grads {
            b.copy(bucket.view_mut(flat_block(off, t)), t.mat())?;
            off += t.numel();
        }
        self.reducing = Some((unit, self.group.start_all_reduce(bucket)?));
        Ok(())
    }

    /// Copies the summed bucket back into its unit's gradients.
    fn wait_bucket(&mut self, b: &B) -> Result<()> {
        let Some((unit, pending)) = self.reducing.take() else {
            return Ok(());
        };
        let bucket = pending.wait()?;
        let mut off = 0;
        for (_, t) in self.g.unit_named_mut(unit) {
            let n = t.numel();
            let l = flat_block(off, t);
            b.copy(t.mat_mut(), bucket.view(l))?;
            off += n;
        }
        Ok(())
    }
}

/// Whether each tensor of `w` (`ModelWeights::named` order) is trained
/// under `frozen`: every LoRA adapter is.
pub fn trainable_mask<B: Backend>(
    w: &ModelWeights<B>,
    cfg: &ModelConfig,
    frozen: &Freeze,
) -> Vec<bool> {
    let ids = w.tensors().into_iter().map(|(id, _)| id);
    ids.map(|id| match id {
        TensorId::Base(p) => !frozen.is_frozen(cfg, p),
        TensorId::Adapter(..) => true,
    })
    .collect()
}

/// The `[rows, row_len]` block of a flat buffer at element `off` that holds `t`.
pub fn flat_block<B: Backend>(off: usize, t: &Tensor<B>) -> MatLayout {
    MatLayout::block(off, t.rows(), t.row_len(), t.row_len())
}

impl<B: Backend> ParamStore<B> for ReplicatedStore<'_, B> {
    fn acquire(&mut self, _b: &B, _unit: Unit) -> Result<()> {
        Ok(())
    }
    fn release(&mut self, _unit: Unit) -> Result<()> {
        Ok(())
    }
    fn embed(&self) -> Result<&Tensor<B>> {
        Ok(&self.w.embed)
    }
    fn block(&self, l: usize) -> Result<&BlockWeights<B>> {
        self.w
            .blocks
            .get(l)
            .ok_or_else(|| Error::Config(format!("the model has no block {l}")))
    }
    fn final_norm(&self) -> Result<&Tensor<B>> {
        Ok(&self.w.final_norm)
    }
    fn head(&self) -> Result<&Tensor<B>> {
        Ok(self.w.head())
    }
    fn block_grads(&mut self, _b: &B, l: usize) -> Result<(&BlockWeights<B>, &mut BlockGrads<B>)> {
        match (self.w.blocks.get(l), self.g.blocks.get_mut(l)) {
            (Some(w), Some(g)) => Ok((w, g)),
            _ => Err(Error::Config(format!("the model has no block {l}"))),
        }
    }
    fn head_grads(&mut self, _b: &B) -> Result<HeadView<'_, B>> {
        let ModelGrads {
            embed,
            final_norm,
            lm_head,
            ..
        } = &mut self.g;
        let tied = self.w.lm_head.is_none();
        Ok(HeadView {
            norm: &self.w.final_norm,
            head: self.w.head(),
            d_norm: final_norm.as_mut(),
            d_head: if tied {
                embed.as_mut()
            } else {
                lm_head.as_mut()
            },
        })
    }
    fn embed_grads(&mut self, _b: &B) -> Result<Option<&mut Tensor<B>>> {
        Ok(self.g.embed.as_mut())
    }
    fn grads_done(&mut self, b: &B, unit: Unit) -> Result<()> {
        if unit == Unit::Embed {
            self.embed_uses_left = self.embed_uses_left.saturating_sub(1);
            if self.embed_uses_left > 0 {
                return Ok(());
            }
        }
        if self.reduce && self.group.size() > 1 {
            self.reduce(b, unit)?;
        }
        Ok(())
    }
    fn finish(&mut self, b: &B) -> Result<()> {
        self.wait_bucket(b)?;
        self.embed_uses_left = self.embed_uses();
        Ok(())
    }
}

/// A rank's whole model with its optimizer (training without FSDP).
pub struct Replicated<'a, B: Backend> {
    pub store: ReplicatedStore<'a, B>,
    pub opt: Box<dyn Optimizer<B>>,
    /// How a checkpoint stores the weights (`--save-dtype`, shard size).
    files: ModelFiles,
    /// A LoRA run's saves: the adapter (PEFT's directory) and its state
    /// only, naming the base.
    lora: Option<LoraSave>,
}

/// Where a resumed run continues: the checkpoint's step and caller state.
pub struct Resumed {
    pub step: u64,
    pub extra: serde_json::Value,
}

impl<'a, B: Backend> Replicated<'a, B> {
    /// The model of `cfg` (random, `--init-from`, or resumed from
    /// `save_dir`), reducing gradients over `group`.
    pub fn open(
        b: &B,
        cfg: &TrainConfig,
        group: &'a dyn ProcessGroup<B>,
    ) -> Result<(Self, Option<Resumed>)> {
        let model = &cfg.model;
        if let Some(dir) = cfg.resume_dir() {
            return Self::resume(b, cfg, group, &dir);
        }
        let base = run_base(cfg);
        let mut w = base_weights(b, cfg, &base, cfg.extra_tensors)?;
        if let Some(lora) = &cfg.lora {
            attach(b, &mut w, &lora.initial(model, cfg.seed)?)?;
        }
        let opt = optimizer(b, cfg, &w, &trainable_mask(&w, model, &cfg.freeze))?;
        let store = ReplicatedStore::with_grads(b, model, w, group, cfg.grad_spec())?;
        let (files, lora) = (cfg.model_files(), LoraSave::of(cfg, base));
        Ok((
            Replicated {
                store,
                opt,
                files,
                lora,
            },
            None,
        ))
    }

    /// The model of `cfg` resumed from the checkpoint in `dir` (a LoRA
    /// run's base read again from where it came: `lora_base::resumed_base`).
    fn resume(
        b: &B,
        cfg: &TrainConfig,
        group: &'a dyn ProcessGroup<B>,
        dir: &std::path::Path,
    ) -> Result<(Self, Option<Resumed>)> {
        let model = &cfg.model;
        check_not_sharded(dir)?;
        // headers only: each tensor is read when it is restored
        let saved = SavedState::open(dir)?;
        cfg.check_resume_freeze(dir, &saved.extra)?;
        cfg.note_state_format(dir, &saved.extra, group.rank() == 0);
        // a LoRA checkpoint's adapters are its own (PEFT names), not extras
        let extras = cfg.extra_tensors.beside_adapters(cfg.lora.is_some());
        check_extra_tensors(dir, model, saved.names(), extras)?;
        let base = match &cfg.lora {
            Some(_) => Some(resumed_base(cfg, dir, &saved.extra)?),
            None => None,
        };
        let mut w = match &base {
            Some(base) => base_weights(b, cfg, base, extras)?,
            None => weights_from_saved(b, model, &saved, b.compute_dtype(), Category::Weights)?,
        };
        if let Some(lora) = &cfg.lora {
            // the adapter's factors, small beside the base, read at once
            attach(b, &mut w, &lora.resumed(model, dir, &saved.values()?)?)?;
        }
        let trainable = trainable_mask(&w, model, &cfg.freeze);
        let mut opt = optimizer(b, cfg, &w, &trainable)?;
        restore_optimizer(b, opt.as_mut(), &w, &trainable, &saved)?;
        let store = ReplicatedStore::with_grads(b, model, w, group, cfg.grad_spec())?;
        let resumed = Resumed {
            step: saved.step,
            extra: saved.extra,
        };
        let model = Replicated {
            store,
            opt,
            files: cfg.model_files(),
            lora: base.and_then(|base| LoraSave::of(cfg, base)),
        };
        Ok((model, Some(resumed)))
    }
}

/// Restores the moments (and masters) of every trained parameter of `w`
/// (`trainable`, in `ModelWeights::named` order) from `saved` into the
/// moments the optimizer made (no second copy at start-up), one tensor at
/// a time.
fn restore_optimizer<B: Backend>(
    b: &B,
    opt: &mut dyn Optimizer<B>,
    w: &ModelWeights<B>,
    trainable: &[bool],
    saved: &SavedState,
) -> Result<()> {
    let named = w.named().into_iter().zip(trainable);
    let slots = named.filter(|(_, t)| **t).map(|(n, _)| n);
    for (k, (name, _)) in slots.enumerate() {
        let dir = saved.dir().display();
        let missing = || Error::Checkpoint(format!("{dir}: no moments of {name}"));
        for (kind, moment) in [
            (StateKind::EXP_AVG, Moment::ExpAvg),
            (StateKind::EXP_AVG_SQ, Moment::ExpAvgSq),
        ] {
            let values = saved.moment(moment, &name)?.ok_or_else(missing)?;
            if !opt.restore(b, k, kind, &values.data)? {
                return Err(missing());
            }
        }
        // the F32 values (masters, or F32 files), not the rounded weights
        if opt.keeps(k, StateKind::MASTER) {
            opt.restore(b, k, StateKind::MASTER, &saved.value(&name)?.data)?;
        }
    }
    Ok(())
}

/// The weights of `base` (an HF directory read with `extras`, or the
/// model's random weights from a seed) on the device.
fn base_weights<B: Backend>(
    b: &B,
    cfg: &TrainConfig,
    base: &BaseModel,
    extras: crate::checkpoint::ExtraTensors,
) -> Result<ModelWeights<B>> {
    let model = &cfg.model;
    match base {
        BaseModel::Dir(dir) => {
            let host = load_hf_model_with(dir, model, extras)?;
            weights_from_host(b, model, &host, b.compute_dtype(), Category::Weights)
        }
        BaseModel::Random { seed } => ModelWeights::random(b, model, *seed),
    }
}

impl<B: Backend> Replicated<'_, B> {
    /// The F32 values a resume continues from, where the weight files do
    /// not hold them: each parameter's master where the optimizer keeps
    /// one, else its value in `params` (already F32) when the files are
    /// narrower; for the parameters in `params` only, each fetched when a
    /// save writes it. `None` when the files hold every value exactly.
    fn masters<'s>(
        &'s self,
        b: &'s B,
        params: &'s [TensorSource<'s>],
    ) -> Option<Vec<TensorSource<'s>>> {
        let slots = self.opt.slots().len();
        let any_kept = (0..slots).any(|k| self.opt.keeps(k, StateKind::MASTER));
        if self.files.dtype == SaveDtype::F32 && !any_kept {
            return None;
        }
        let by_name: HashMap<&str, &TensorSource> =
            params.iter().map(|p| (p.name.as_str(), p)).collect();
        let opt = &*self.opt;
        let mut out = Vec::new();
        let slots = self.store.slot_of_params().into_iter();
        for ((name, _), slot) in self.store.w.named().into_iter().zip(slots) {
            // a LoRA save's `params` are its adapters: the base is not saved
            let Some(&param) = by_name.get(name.as_str()) else {
                continue;
            };
            // a frozen parameter's F32 value is its weight (no master kept)
            let Some(k) = slot else {
                out.push(param.renamed(name));
                continue;
            };
            let fetch = move || match opt.state_values(b, k, StateKind::MASTER)? {
                Some(master) => Ok(master),
                None => param.values(),
            };
            out.push(TensorSource::new(name, param.shape.clone(), fetch));
        }
        Some(out)
    }
}

/// The run's optimizer over every trainable parameter tensor of `w` (one slot each, in
/// `ModelWeights::named` order; `trainable` in that order).
fn optimizer<B: Backend>(
    b: &B,
    cfg: &TrainConfig,
    w: &ModelWeights<B>,
    trainable: &[bool],
) -> Result<Box<dyn Optimizer<B>>> {
    let layers = w.blocks.len();
    let mut slots = Vec::new();
    let mut trains = trainable.iter();
    for unit in Unit::all(layers) {
        for (name, t) in w.unit_named(unit) {
            if *trains.next().unwrap_or(&true) {
                slots.push(Slot::whole(unit, name, t.numel()));
            }
        }
    }
    let named = w.named().into_iter().zip(trainable);
    let params: Vec<&Tensor<B>> = named.filter(|(_, t)| **t).map(|((_, t), _)| t).collect();
    let args = BuildArgs {
        slots,
        params: &params,
        layers,
        zero_device_grads: true,
    };
    crate::optim::build(b, &cfg.optimizer(), args)
}

/// Every trainable parameter (`trainable`, in `ModelWeights::named`
/// order) and its gradient, lent to the optimizer.
fn lend<'s, B: Backend>(
    w: &'s mut ModelWeights<B>,
    g: &'s mut ModelGrads<B>,
    trainable: &[bool],
) -> Lent<'s, B> {
    let params = w.named_mut().into_iter().zip(trainable);
    Lent {
        params: params
            .filter(|(_, t)| **t)
            .map(|((_, p), _)| Some(p))
            .collect(),
        grads: g.named_mut().into_iter().map(|(_, t)| Some(t)).collect(),
    }
}

impl<B: Backend> ReplicatedStore<'_, B> {
    /// Each parameter's optimizer slot (`ModelWeights::named` order; `None`: frozen).
    fn slot_of_params(&self) -> Vec<Option<usize>> {
        let mut next = 0;
        let slot = |&t: &bool| {
            t.then(|| {
                next += 1;
                next - 1
            })
        };
        self.trainable.iter().map(slot).collect()
    }
}

/// The global gradient norm (gradients already reduced over ranks).
fn grad_norm<B: Backend>(b: &B, g: &ModelGrads<B>) -> Result<f64> {
    let grads: Vec<&Tensor<B>> = g.named().into_iter().map(|(_, t)| t).collect();
    Ok(b.sum_squares_all(&grads)?.sqrt())
}

/// A checkpoint written under FSDP resumes under FSDP.
fn check_not_sharded(dir: &std::path::Path) -> Result<()> {
    if crate::checkpoint::sharded::is_sharded(dir) {
        return crate::config_err!(
            "{} holds a sharded (--fsdp on) checkpoint: resume it with --fsdp on",
            dir.display()
        );
    }
    Ok(())
}

impl<'a, B: Backend> Deferred<B, ReplicatedStore<'a, B>> for Box<dyn Optimizer<B>> {
    fn settle_through(
        &mut self,
        b: &B,
        store: &mut ReplicatedStore<'a, B>,
        unit: Unit,
    ) -> Result<()> {
        if !self.has_pending() {
            return Ok(());
        }
        let upto = slots_through(self.slots(), unit, store.w.blocks.len());
        let ReplicatedStore {
            w, g, trainable, ..
        } = store;
        self.settle(b, &mut lend(w, g, trainable), upto)
    }
}

impl<B: Backend> RankModel<B> for Replicated<'_, B> {
    fn forward_backward(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        seq: Sequence<'_>,
    ) -> Result<f64> {
        let micro = seq.micro;
        // the last step's pending host updates zero each gradient they read
        if micro.first && !self.opt.has_pending() {
            self.store.zero_grads(b)?;
        }
        // sequences before the step's last only accumulate: one reduction per step
        self.store.reduce = micro.last;
        let mut store = Settling::new(&mut self.store, &mut self.opt, decoder.cfg.layers);
        pass(b, (decoder, mesh), &mut store, seq)
    }

    fn optimizer_step(&mut self, b: &B, step: u32, loss_finite: bool) -> Result<Update> {
        let norm = grad_norm(b, &self.store.g)?;
        let ReplicatedStore {
            w, g, trainable, ..
        } = &mut self.store;
        self.opt
            .step(b, &mut lend(w, g, trainable), norm, step, loss_finite)
    }

    fn settle(&mut self, b: &B) -> Result<()> {
        let ReplicatedStore {
            w, g, trainable, ..
        } = &mut self.store;
        self.opt.settle(b, &mut lend(w, g, trainable), usize::MAX)
    }

    fn forward_loss(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        rows: LossRows<'_>,
    ) -> Result<Vec<f64>> {
        decoder.forward_loss(b, mesh, &self.store.w, rows)
    }

    fn forward_logit_rows(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        ids: &[u32],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        decoder.forward_logit_rows(b, mesh, &self.store.w, ids, rows)
    }

    fn save(
        &mut self,
        b: &B,
        dir: &std::path::Path,
        step: u64,
        extra: &serde_json::Value,
        lead: bool,
    ) -> Result<()> {
        self.settle(b)?;
        if !lead {
            return Ok(());
        }
        if let Some(lora) = &self.lora {
            return self.save_adapter(b, dir, step, extra, lora);
        }
        // each tensor is fetched to the host when its file is written
        let w = &self.store.w;
        let slots = self.store.slot_of_params();
        let params = weight_sources(b, w);
        let masters = self.masters(b, &params);
        let opt = &*self.opt;
        let adam_m = state_sources(b, w, &slots, opt, StateKind::EXP_AVG);
        let adam_v = state_sources(b, w, &slots, opt, StateKind::EXP_AVG_SQ);
        let state = StateToSave {
            step,
            params: &params,
            adam_m: &adam_m,
            adam_v: &adam_v,
            masters: masters.as_deref(),
            extra,
        };
        save_train_state_as(dir, &state, self.files)
    }
}

impl<B: Backend> Replicated<'_, B> {
    /// A LoRA run's checkpoint: the adapter, its moments and masters, and
    /// `state.json` naming the base; no base weight is written.
    fn save_adapter(
        &self,
        b: &B,
        dir: &std::path::Path,
        step: u64,
        extra: &serde_json::Value,
        lora: &LoraSave,
    ) -> Result<()> {
        let w = &self.store.w;
        let slots = self.store.slot_of_params();
        let adapters = adapters_to_host(b, w, &lora.config)?;
        let factors = adapter_tensors(&adapters)?;
        let params: Vec<TensorSource> = (factors.iter())
            .map(|(n, t)| TensorSource::host(n, &t.shape, &t.data))
            .collect();
        let masters = self.masters(b, &params);
        let extra = with_base(extra, &lora.base);
        let opt = &*self.opt;
        let adam_m = state_sources(b, w, &slots, opt, StateKind::EXP_AVG);
        let adam_v = state_sources(b, w, &slots, opt, StateKind::EXP_AVG_SQ);
        let state = StateToSave {
            step,
            params: &params,
            adam_m: &adam_m,
            adam_v: &adam_v,
            masters: masters.as_deref(),
            extra: &extra,
        };
        let adapter = AdapterToSave {
            weights: &adapters,
            base: &lora.base_name,
            dtype: self.files.dtype,
        };
        save_adapter_state(dir, &state, &adapter)
    }
}
