//! A rank's sharded model with its optimizer: how a sharded run starts
//! (random, `--init-from`, `--resume`; a LoRA run's adapters from PEFT's
//! initialisation, `--lora-from` or the checkpoint), steps and saves (a
//! LoRA run's adapter directory beside the checkpoint).

use super::FsdpStore;
use super::adapters::{host_values, values_of};
use crate::backend::{Backend, Category, DType};
use crate::checkpoint::peft::{adapter_from_tensors, read_adapter, write_adapter};
use crate::checkpoint::ranged::RangedModel;
use crate::checkpoint::sharded::{self as ckpt, SavedOptimizer};
use crate::checkpoint::stream::{file_order, write_safetensors};
use crate::checkpoint::{HostTensor, ModelFiles, SaveDtype, TensorSource, check_extra_tensors};
use crate::comm::{Mesh, ProcessGroup};
use crate::error::{Error, Result};
use crate::model::forward::LossRows;
use crate::model::{Decoder, RandomInit, Unit};
use crate::optim::settling::{Deferred, Settling};
use crate::optim::{BuildArgs, Optimizer, StateKind, Update, slots_through};
use crate::train::config::TrainConfig;
use crate::train::lora_base::{BaseModel, LoraSave, resumed_base, run_base, with_base};
use crate::train::replicated::Resumed;
use crate::train::state::{RankModel, Sequence, pass};
use serde_json::Value;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;

/// The unit whose gathered values a save holds (its index, its values on
/// the lead rank).
type HeldUnit = RefCell<Option<(usize, Vec<f32>)>>;

/// FSDP shards and their optimizer.
pub struct Sharded<'a, B: Backend> {
    pub store: FsdpStore<'a, B>,
    pub opt: Box<dyn Optimizer<B>>,
    /// Every rank (checkpoint barriers).
    world: &'a dyn ProcessGroup<B>,
    /// How a checkpoint stores the weights (`--save-dtype`, shard size).
    files: ModelFiles,
    /// A LoRA run's saves: the adapter (PEFT's directory) and the
    /// adapters' optimizer shards only, naming the base.
    lora: Option<LoraSave>,
}

impl<'a, B: Backend> Sharded<'a, B> {
    /// This rank's shards of `cfg`'s model over `group`: random, from an HF
    /// directory (`--init-from`), or resumed from `save_dir` (re-sharded
    /// when it was saved on another world size); each rank reads only the
    /// ranges it owns.
    pub fn open(b: &B, cfg: &TrainConfig, mesh: &'a Mesh<B>) -> Result<(Self, Option<Resumed>)> {
        let model = &cfg.model;
        let (group, replica) = (mesh.shard.as_ref(), mesh.replica.as_ref());
        let resume_dir = cfg.resume_dir();
        let state = resume_dir.as_deref().map(ckpt::read_state).transpose()?;
        let extra = state.as_ref().and_then(|s| s.get("extra").cloned());
        let extra = extra.unwrap_or(Value::Null);
        let base = lora_base(cfg, &extra)?;
        // a LoRA run's base is read from where it came, its adapters from the checkpoint
        let source = match &base {
            Some(BaseModel::Dir(dir)) => Some(dir.as_path()),
            Some(BaseModel::Random { .. }) => None,
            None => resume_dir.as_deref().or(cfg.init_from.as_deref()),
        };
        let seed = match &base {
            Some(BaseModel::Random { seed }) => *seed,
            _ => cfg.seed,
        };
        let adapters = initial_adapters(b, cfg)?;
        let lora = cfg.lora.as_ref().map(|l| &l.config);
        let grads = cfg.grad_spec();
        let store = match source {
            Some(dir) => {
                let hf = RangedModel::open(dir)?;
                for (name, shape) in model.hf_param_shapes() {
                    hf.check(&name, &shape)?;
                }
                // a LoRA checkpoint's adapters are its own (PEFT names), not extras
                let extras = cfg.extra_tensors.beside_adapters(lora.is_some());
                check_extra_tensors(dir, model, hf.names(), extras)?;
                let read = |name: &str, elems: std::ops::Range<usize>| {
                    values_of(&adapters, name, elems.clone())
                        .unwrap_or_else(|| hf.read(name, elems))
                };
                FsdpStore::with_adapters(b, model, group, replica, grads, lora, read)?
            }
            None => {
                let init = RandomInit::new(model, seed);
                let init = |name: &str, elems: std::ops::Range<usize>| {
                    let random = || Ok(init.values(name, elems.clone()));
                    values_of(&adapters, name, elems.clone()).unwrap_or_else(random)
                };
                FsdpStore::with_adapters(b, model, group, replica, grads, lora, init)?
            }
        };
        let mut opt = optimizer(b, cfg, &store)?;
        let lora = base.and_then(|base| LoraSave::of(cfg, base));
        let sharded = |store, opt| Sharded {
            store,
            opt,
            world: mesh.world.as_ref(),
            files: cfg.model_files(),
            lora,
        };
        let (Some(dir), Some(state)) = (cfg.resume_dir(), state) else {
            return Ok((sharded(store, opt), None));
        };
        let mut store = store;
        let dir = dir.as_path();
        cfg.check_resume_freeze(dir, &extra)?;
        cfg.note_state_format(dir, &extra, store.group.rank() == 0);
        restore_state(b, &SavedOptimizer::open(dir)?, &mut store, opt.as_mut())?;
        let resumed = Resumed {
            step: state.get("step").and_then(Value::as_u64).ok_or_else(|| {
                Error::Checkpoint(format!("{}: state.json has no step", dir.display()))
            })?,
            extra,
        };
        Ok((sharded(store, opt), Some(resumed)))
    }

    /// All-gathers unit `i`'s parameters and returns them by name on the
    /// lead rank (collective; the other ranks get an empty list).
    fn gather_to_host(&self, b: &B, i: usize, lead: bool) -> Result<Vec<(String, HostTensor)>> {
        let host = self.gather_unit(b, i, lead)?;
        if !lead {
            return Ok(Vec::new());
        }
        let params = self.store.layouts[i].params.iter();
        let named = params.map(|p| {
            let t = HostTensor::new(p.shape.clone(), host[p.range()].to_vec())?;
            Ok((p.name.clone(), t))
        });
        named.collect()
    }

    /// All-gathers unit `i` and returns its flat values on the lead rank
    /// (collective; the other ranks get none).
    fn gather_unit(&self, b: &B, i: usize, lead: bool) -> Result<Vec<f32>> {
        let layout = &self.store.layouts[i];
        let shard = self.store.params[i].as_ref().ok_or_else(|| {
            Error::Backend("FSDP: a shard is in a collective while saving".into())
        })?;
        let mut flat = b.empty(&[layout.padded()], shard.dtype(), Category::Comm)?;
        self.store.group.all_gather(shard, &mut flat)?;
        match lead {
            true => b.to_host(&flat),
            false => Ok(Vec::new()),
        }
    }

    /// Makes `held` hold unit `i`'s gathered values ([`Self::gather_unit`]),
    /// dropping the unit it held first.
    fn hold_unit(&self, b: &B, i: usize, lead: bool, held: &HeldUnit) -> Result<()> {
        if held.borrow().as_ref().is_some_and(|(unit, _)| *unit == i) {
            return Ok(());
        }
        *held.borrow_mut() = None;
        let values = self.gather_unit(b, i, lead)?;
        *held.borrow_mut() = Some((i, values));
        Ok(())
    }

    /// Writes the weights as an HF directory, file by file. Each tensor is
    /// fetched when the file reaches it, from its unit gathered when the
    /// unit's first tensor comes (every rank gathers, in the order the lead
    /// rank writes), so the lead rank holds one unit and one tensor.
    fn save_weights(&self, b: &B, dir: &Path, lead: bool) -> Result<()> {
        let layouts = &self.store.layouts;
        let bytes: Vec<usize> = layouts.iter().map(|u| self.files.bytes(u.numel)).collect();
        let groups = ckpt::file_groups(&bytes, self.files.max_file_bytes);
        let mut index = Vec::new();
        for (k, g) in groups.iter().enumerate() {
            let held: HeldUnit = RefCell::new(None);
            let params = g
                .clone()
                .flat_map(|i| layouts[i].params.iter().map(move |p| (i, p)));
            let (units, tensors): (Vec<usize>, Vec<TensorSource>) = params
                .map(|(i, p)| {
                    let held = &held;
                    let fetch = move || {
                        self.hold_unit(b, i, lead, held)?;
                        let held = held.borrow();
                        let values = held.as_ref().map(|(_, v)| &v[..]).unwrap_or_default();
                        Ok(values.get(p.range()).unwrap_or_default().to_vec())
                    };
                    (i, TensorSource::new(&p.name, p.shape.clone(), fetch))
                })
                .unzip();
            if !lead {
                for t in file_order(&tensors) {
                    self.hold_unit(b, units[t], lead, &held)?;
                }
                continue;
            }
            let file = ckpt::weight_file_name(k, groups.len());
            write_safetensors(&dir.join(&file), &tensors, self.files.dtype.safetensors())?;
            index.push((file, tensors.iter().map(|t| t.name.clone()).collect()));
        }
        if lead && groups.len() > 1 {
            ckpt::write_index(dir, &index, bytes.iter().sum())?;
        }
        Ok(())
    }

    /// Writes this rank's optimizer shards, each fetched to the host when
    /// the file reaches it.
    fn save_optimizer(&self, b: &B, dir: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        let slot_of = slot_of_units(&self.store);
        let opt = &*self.opt;
        for (i, u) in self.store.layouts.iter().enumerate() {
            let (key, shape) = (u.key(), vec![u.shard]);
            // a frozen unit keeps no optimizer state
            let mut has_master = false;
            if let Some(k) = slot_of[i] {
                for kind in opt.kinds(k) {
                    has_master |= kind == StateKind::MASTER;
                    let fetch = move || Ok(opt.state_values(b, k, kind)?.unwrap_or_default());
                    let name = format!("{}.{key}", kind.name());
                    tensors.push(TensorSource::new(name, shape.clone(), fetch));
                }
            }
            // F32 shards whose weight files are narrower: they are the masters
            if !has_master && self.files.dtype != SaveDtype::F32 {
                let shard = self.store.params[i].as_ref().ok_or_else(|| {
                    Error::Backend("FSDP: a shard is in a collective while saving".into())
                })?;
                let name = format!("{}.{key}", StateKind::MASTER.name());
                tensors.push(TensorSource::new(name, shape, move || b.to_host(shard)));
            }
        }
        let (rank, world) = (self.store.group.rank(), self.store.group.size());
        let path = ckpt::optimizer_file(dir, rank, world);
        write_safetensors(&path, &tensors, SaveDtype::F32.safetensors())
    }

    /// Writes a LoRA run's adapters as a PEFT adapter directory in `dir`
    /// (collective: every rank gathers, the lead rank writes).
    fn save_adapter(&self, b: &B, dir: &Path, lead: bool) -> Result<()> {
        let Some(lora) = &self.lora else {
            return Ok(());
        };
        let mut tensors = BTreeMap::new();
        for (i, u) in self.store.layouts.iter().enumerate() {
            if u.adapters {
                tensors.extend(self.gather_to_host(b, i, lead)?);
            }
        }
        if lead {
            let weights = adapter_from_tensors(&tensors, &lora.config, &self.store.cfg, dir)?;
            write_adapter(dir, &weights, &lora.base_name, self.files.dtype)?;
        }
        Ok(())
    }

    /// Waits until every rank of the group gets here.
    fn barrier(&self, b: &B) -> Result<()> {
        let mut t = b.zeros(&[1], DType::F32, Category::Workspace)?;
        self.world.all_reduce(&mut t)?;
        b.synchronize()
    }
}

impl<'a, B: Backend> Deferred<B, FsdpStore<'a, B>> for Box<dyn Optimizer<B>> {
    fn settle_through(&mut self, b: &B, store: &mut FsdpStore<'a, B>, unit: Unit) -> Result<()> {
        if !self.has_pending() {
            return Ok(());
        }
        let upto = slots_through(self.slots(), unit, store.layers());
        self.settle(b, &mut store.lend(), upto)
    }
}

/// The base of a LoRA run (`None` without adapters): `--init-from` or the
/// seed's random weights, or for a resumed run where its checkpoint (whose
/// caller state is `extra`) says it came from.
fn lora_base(cfg: &TrainConfig, extra: &Value) -> Result<Option<BaseModel>> {
    Ok(match (&cfg.lora, cfg.resume_dir()) {
        (None, _) => None,
        (Some(_), Some(dir)) => Some(resumed_base(cfg, &dir, extra)?),
        (Some(_), None) => Some(run_base(cfg)),
    })
}

/// The adapters a LoRA run starts from by PEFT name (PEFT's initialisation,
/// `--lora-from`'s, or a resumed checkpoint's adapter file, whose masters,
/// where it kept them, the optimizer state then restores); none for a
/// rehearsal (nothing is initialised) or a run without adapters.
fn initial_adapters<B: Backend>(b: &B, cfg: &TrainConfig) -> Result<BTreeMap<String, Vec<f32>>> {
    match (&cfg.lora, cfg.resume_dir()) {
        (_, _) if b.rehearsing() => Ok(BTreeMap::new()),
        (Some(_), Some(dir)) if crate::checkpoint::is_adapter_only(&dir) => {
            Ok(host_values(&read_adapter(&dir, &cfg.model)?.weights))
        }
        (Some(run), None) => Ok(host_values(&run.initial(&cfg.model, cfg.seed)?)),
        _ => Ok(BTreeMap::new()),
    }
}

/// Uploads a checkpoint's optimizer state into this rank's `opt`: the
/// moments, and the F32 masters into the optimizer's, or into the shards
/// themselves where they are F32 and the weight files were narrower.
fn restore_state<B: Backend>(
    b: &B,
    saved: &SavedOptimizer,
    store: &mut FsdpStore<'_, B>,
    opt: &mut dyn Optimizer<B>,
) -> Result<()> {
    let rank = store.group.rank();
    let slot_of = slot_of_units(store);
    for (i, u) in store.layouts.iter().enumerate() {
        // the kinds the optimizer keeps (a frozen unit: none, nor any
        // saved), and masters wherever the checkpoint has them
        let mut kinds = slot_of[i].map_or_else(Vec::new, |k| opt.kinds(k));
        kinds.retain(|&kind| kind != StateKind::MASTER);
        kinds.push(StateKind::MASTER);
        for kind in kinds {
            if kind == StateKind::MASTER && !saved.has_master(u) {
                continue;
            }
            let values = || saved.shard(kind.name(), u, rank);
            let kept = slot_of[i].filter(|&k| opt.keeps(k, kind));
            match kept {
                Some(k) => {
                    opt.restore(b, k, kind, &values()?)?;
                }
                None if kind == StateKind::MASTER => {
                    let shard = store.params[i].as_mut().ok_or_else(|| {
                        Error::Backend("FSDP: a shard is in a collective at start-up".into())
                    })?;
                    b.upload(shard, &values()?)?;
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// Each unit's optimizer slot (`None`: frozen), by index in `Unit::all` order.
fn slot_of_units<B: Backend>(store: &FsdpStore<'_, B>) -> Vec<Option<usize>> {
    let mut slot = vec![None; store.layouts.len()];
    for (k, i) in store.slot_units().into_iter().enumerate() {
        slot[i] = Some(k);
    }
    slot
}

/// The run's optimizer over the rank's shards of trained units (zero
/// moments, F32 masters of the current shards when they are in a lower precision).
fn optimizer<B: Backend>(
    b: &B,
    cfg: &TrainConfig,
    store: &FsdpStore<'_, B>,
) -> Result<Box<dyn Optimizer<B>>> {
    let busy = || Error::Backend("FSDP: a shard is in a collective at start-up".into());
    let shards = store
        .slot_units()
        .into_iter()
        .map(|i| store.params[i].as_ref().ok_or_else(busy))
        .collect::<Result<Vec<_>>>()?;
    let args = BuildArgs {
        slots: store.slots(),
        params: &shards,
        layers: store.layers(),
        zero_device_grads: false,
    };
    crate::optim::build(b, &cfg.optimizer(), args)
}

impl<B: Backend> RankModel<B> for Sharded<'_, B> {
    fn forward_backward(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        seq: Sequence<'_>,
    ) -> Result<f64> {
        let micro = seq.micro;
        // each sequence's reduce-scatter adds into the shards (ZeRO-3's way:
        // no rank ever holds the whole model's gradients)
        let every = decoder.policy.checkpoint_every;
        self.store.begin_step(micro.first, every);
        let mut store = Settling::new(&mut self.store, &mut self.opt, decoder.cfg.layers);
        pass(b, (decoder, mesh), &mut store, seq)
    }

    fn optimizer_step(&mut self, b: &B, step: u32, loss_finite: bool) -> Result<Update> {
        let norm = self.store.grad_norm(b)?;
        self.opt
            .step(b, &mut self.store.lend(), norm, step, loss_finite)
    }

    fn settle(&mut self, b: &B) -> Result<()> {
        self.opt.settle(b, &mut self.store.lend(), usize::MAX)
    }

    fn forward_loss(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        rows: LossRows<'_>,
    ) -> Result<Vec<f64>> {
        // the optimizer's pending updates are settled before an evaluation
        self.store.begin_forward();
        decoder.forward_loss_units(b, mesh, &mut self.store, rows)
    }

    fn forward_logit_rows(
        &mut self,
        b: &B,
        decoder: &Decoder<B>,
        mesh: &Mesh<B>,
        ids: &[u32],
        rows: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        self.store.begin_forward();
        decoder.forward_logit_rows_units(b, mesh, &mut self.store, ids, rows)
    }

    fn save(&mut self, b: &B, dir: &Path, step: u64, extra: &Value, lead: bool) -> Result<()> {
        self.settle(b)?;
        if lead {
            ckpt::begin_write(dir)?;
        }
        self.barrier(b)?;
        // a LoRA checkpoint holds the adapter, not the base it names
        if self.lora.is_none() {
            self.save_weights(b, dir, lead)?;
        }
        // replicas hold the same shards: the first one writes them
        if self.store.replica.rank() == 0 {
            self.save_optimizer(b, dir)?;
        }
        self.save_adapter(b, dir, lead)?;
        // every rank's files are complete before state.json marks the checkpoint
        self.barrier(b)?;
        if lead {
            let extra = match &self.lora {
                Some(lora) => with_base(extra, &lora.base),
                None => extra.clone(),
            };
            ckpt::write_state(dir, step, self.store.group.size(), &extra)?;
        }
        self.barrier(b)
    }
}
