//! AdamW over any parameter store's slots, its state in F32 or in a compact
//! format (`state_format.rs`, `moments.rs`), global-norm gradient clipping,
//! and its learning-rate schedule (`schedule.rs`).

use super::adamw_multi::{AdamWPiece, AdamWSlot};
use super::adamw_step::AdamWStep;
use super::compact_adamw::rounding_key;
use super::ops::AdamWOps;
use crate::backend::{Backend, Category, DType, Tensor, cast};
use crate::error::Result;
use crate::model::{HostUpdate, Unit};
use crate::optim::host::{Fetch, HostSlot, HostStep, host_master, settle_window};
use crate::optim::moments::{Moment, Which};
use crate::optim::optimizer::{Optimizer, StateKind, StateSpec, Update};
use crate::optim::paged::{PagedStep, Resident};
use crate::optim::schedule::{Decay, Schedule};
use crate::optim::settling::state_on_host;
#[cfg(doc)]
use crate::optim::settling::update_order;
use crate::optim::{Lent, MasterWeights, Piece, Slot, StateFormat};
use std::ops::Range;

/// Optimizer hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub min_lr: f32,
    pub warmup: u32,
    pub total_steps: u32,
    /// The schedule's shape after the warm-up (`--schedule`).
    pub decay: Decay,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (0 = off).
    pub clip: f32,
    /// How many units, the last of update order
    /// (`optim::settling::state_on_host`), keep their master weights and
    /// moments (as `state` keeps them) in pinned host memory, updated on
    /// host threads
    /// (`--offload-optimizer`; a training run sets it from its memory
    /// policy, `TrainConfig::optimizer`).
    pub host_units: usize,
    /// Where that host state is updated: by the host's threads, or paged
    /// through the GPU ([`crate::optim::paged`]).
    pub host_update: HostUpdate,
    /// Update each parameter by its own op, then copy each slot's F32
    /// master to its parameters, instead of one [`AdamWOps::adamw_multi`]
    /// over every device slot: the same numbers, more launches (the
    /// reference the multi-tensor update is tested against; no flag sets
    /// it).
    pub per_piece: bool,
    /// How the moments and master weights are kept (`--optim-state`,
    /// `--master-weights`).
    pub state: StateFormat,
    /// The seed of stochastic rounding (the run's `--seed`).
    pub seed: u64,
}

impl AdamWConfig {
    /// The usual LLM settings (betas 0.9 / 0.95, eps 1e-8, weight decay 0.1,
    /// clipping at 1.0) with a warmup + cosine schedule from `lr` to `min_lr`.
    pub fn schedule(lr: f32, min_lr: f32, warmup: u32, total_steps: u32) -> Self {
        AdamWConfig {
            lr,
            min_lr,
            warmup,
            total_steps,
            decay: Decay::Cosine,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clip: 1.0,
            host_units: 0,
            host_update: HostUpdate::Cpu,
            per_piece: false,
            state: StateFormat::default(),
            seed: 0,
        }
    }

    /// These settings with the state of the last `host_units` units of
    /// update order on the host (`--offload-optimizer`), updated where
    /// `host_update` says, and stochastic rounding seeded by `seed` (the
    /// run's).
    pub fn placed(self, host_units: usize, host_update: HostUpdate, seed: u64) -> Self {
        AdamWConfig {
            host_units,
            host_update,
            seed,
            ..self
        }
    }

    /// The factor that clips gradients of global norm `norm` to `clip`.
    pub fn clip_scale(&self, norm: f64) -> f32 {
        if self.clip > 0.0 && norm > self.clip as f64 {
            (self.clip as f64 / norm) as f32
        } else {
            1.0
        }
    }

    /// The learning-rate schedule: linear warm-up to `lr`, then `decay`
    /// down to `min_lr` at `total_steps`.
    pub fn lr_schedule(&self) -> Schedule {
        Schedule {
            decay: self.decay,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup: self.warmup,
            total_steps: self.total_steps,
        }
    }

    /// The learning rate of 1-based `step` ([`Schedule::lr_at`]).
    pub fn lr_at(&self, step: u32) -> f32 {
        self.lr_schedule().lr_at(step)
    }
}

/// AdamW's state of one optimizer, slot by slot ([`Slot`]): moments and
/// F32 master weights on the device (the master only when the model
/// computes in a lower precision), or for the units `cfg.host_units` names
/// in pinned host memory (an F32 master there unless `--master-weights
/// none`), updated on host threads and deferred into the next forward
/// ([`HostStep`]).
pub struct AdamW<B: Backend> {
    pub cfg: AdamWConfig,
    slots: Vec<Slot>,
    m: Vec<Moment<B>>,
    v: Vec<Moment<B>>,
    master: Vec<Option<Tensor<B>>>,
    /// Whether each slot's state lives on the host: the slots of the last
    /// `cfg.host_units` units of update order.
    on_host: Vec<bool>,
    /// The last step's host updates not yet run.
    pending: Option<Pending<B>>,
    /// Whether a step with deferred host updates zeroes the gradients it
    /// reads on the device (a store whose backward adds into gradients
    /// zeroed only when no host update is pending).
    zero_device_grads: bool,
}

impl<B: Backend> AdamW<B> {
    /// Zero moments (and F32 masters) for `slots`, whose current values are
    /// `params` (`[k]`: slot k's tensor), in a model of `layers` blocks: the
    /// device's state first, then the host's, each slot's master, m and v in
    /// turn.
    pub fn new(
        b: &B,
        cfg: AdamWConfig,
        slots: Vec<Slot>,
        params: &[&Tensor<B>],
        layers: usize,
    ) -> Result<Self> {
        let on_host: Vec<bool> = slots
            .iter()
            .map(|s| state_on_host(s.unit, layers, cfg.host_units))
            .collect();
        let narrow = params.iter().any(|t| t.dtype() != DType::F32);
        let device_master = narrow && cfg.state.master == MasterWeights::F32;
        let kept = StateToBuild {
            tensors: params,
            slots: &slots,
            on_host: &on_host,
            format: cfg.state,
            device_master,
        };
        let (m, v, master) = build_state(b, kept)?;
        Ok(AdamW {
            cfg,
            slots,
            m,
            v,
            master,
            on_host,
            pending: None,
            zero_device_grads: false,
        })
    }

    /// A step with deferred host updates also zeroes the device slots'
    /// gradients (as the host's are zeroed once read).
    pub fn zeroing_device_grads(mut self) -> Self {
        self.zero_device_grads = true;
        self
    }

    /// Updates every slot whose state is on the device at `(lr, step,
    /// clip)`: one [`AdamWOps::adamw_multi`] over all of them (with
    /// `cfg.per_piece`, an op per piece and a copy per slot).
    fn update_device_slots(
        &mut self,
        b: &B,
        lent: &mut Lent<'_, B>,
        (lr, step, clip): (f32, u32, f32),
    ) -> Result<()> {
        if lent.params.len() != self.slots.len() || lent.grads.len() != self.slots.len() {
            return Err(crate::Error::Backend(format!(
                "optimizer: {} slots, lent {} parameters and {} gradients",
                self.slots.len(),
                lent.params.len(),
                lent.grads.len()
            )));
        }
        let cfg = &self.cfg;
        let pieces: Vec<Vec<AdamWPiece>> = self
            .slots
            .iter()
            .map(|s| {
                let hp = |p: &Piece| (p.at.clone(), hyper(cfg, &p.name, lr, step, clip));
                s.pieces.iter().map(hp).collect()
            })
            .collect();
        let states = self.master.iter_mut().zip(&mut self.m).zip(&mut self.v);
        let tensors = lent.params.iter_mut().zip(lent.grads.iter_mut());
        let mut update = Vec::new();
        for (k, ((param, grad), ((master, m), v))) in tensors.zip(states).enumerate() {
            if self.on_host[k] {
                continue;
            }
            let param = param.as_deref_mut().ok_or_else(|| busy(k))?;
            let grad = grad.as_deref().ok_or_else(|| busy(k))?;
            let (target, narrow) = match master.as_mut() {
                Some(master) => (master, Some(param)),
                None => (param, None),
            };
            let scales = match (m.scales.as_mut(), v.scales.as_mut()) {
                (Some(ms), Some(vs)) => Some((ms, vs)),
                _ => None,
            };
            update.push(AdamWSlot {
                target,
                grad,
                m: &mut m.values,
                v: &mut v.values,
                narrow,
                pieces: &pieces[k],
                scales,
                rounding_key: rounding_key(cfg.seed, step, k as u32),
            });
        }
        if cfg.per_piece && cfg.state.optimizer_is_plain() {
            update
                .into_iter()
                .try_for_each(|slot| update_per_piece(b, slot))
        } else {
            b.adamw_multi(&mut update)
        }
    }
}

/// The state AdamW keeps per parameter element of a device slot, kept as
/// `format` says: two moments, and an F32 master copy when the parameters
/// are in a lower precision (`narrow`) and `format` keeps masters. A host
/// slot keeps the same moments, and an F32 master unless the format has
/// none, in host memory. (What the planner counts:
/// `plan::trained_state_bytes`.)
pub fn state_specs(format: StateFormat, narrow: bool) -> Vec<StateSpec> {
    let moment = |kind| StateSpec {
        kind,
        dtype: format.moments.dtype(),
    };
    let mut specs = vec![moment(StateKind::EXP_AVG), moment(StateKind::EXP_AVG_SQ)];
    if narrow && format.master == MasterWeights::F32 {
        specs.push(StateSpec {
            kind: StateKind::MASTER,
            dtype: DType::F32,
        });
    }
    specs
}

impl<B: Backend> Optimizer<B> for AdamW<B> {
    /// One update at 1-based `step` (none when `loss_finite` is false or
    /// the gradient norm is not finite: [`Update::applies`]). The device's
    /// slots are updated now; the host's update is deferred:
    /// [`settle`](Optimizer::settle) runs it (the next step's forward does,
    /// unit by unit), zeroing each gradient it reads.
    fn step(
        &mut self,
        b: &B,
        lent: &mut Lent<'_, B>,
        grad_norm: f64,
        step: u32,
        loss_finite: bool,
    ) -> Result<Update> {
        let clip = self.cfg.clip_scale(grad_norm);
        let lr = self.cfg.lr_at(step);
        let deferred = self.on_host.iter().any(|&h| h);
        if deferred {
            self.settle(b, lent, usize::MAX)?;
        }
        if !Update::applies(loss_finite, grad_norm) {
            return Ok(Update::skipped(lr, grad_norm));
        }
        self.update_device_slots(b, lent, (lr, step, clip))?;
        if deferred && self.zero_device_grads {
            for k in (0..self.slots.len()).filter(|&k| !self.on_host[k]) {
                let grad = lent.grads[k].as_deref_mut().ok_or_else(|| busy(k))?;
                b.fill(grad, 0.0)?;
            }
        }
        if deferred {
            let run = match self.cfg.host_update {
                HostUpdate::Cpu => Deferred::Host(HostStep::new(b)?),
                HostUpdate::Gpu => Deferred::Paged(Box::default()),
            };
            self.pending = Some(Pending {
                lr,
                step,
                clip,
                run,
            });
        }
        Ok(Update::applied(lr, grad_norm))
    }

    fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Runs the deferred host updates of the slots before `upto` (in update
    /// order, [`update_order`]: the head's slots, then slot order;
    /// `usize::MAX`: all of them). The slots whose state is on the device,
    /// the first of that order, have none.
    fn settle(&mut self, b: &B, lent: &mut Lent<'_, B>, upto: usize) -> Result<()> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(());
        };
        let cfg = self.cfg;
        let (lr, step, clip) = (pending.lr, pending.step, pending.clip);
        let head = self.slots.iter().filter(|s| s.unit == Unit::Head).count();
        let states = self.master.iter_mut().zip(&mut self.m).zip(&mut self.v);
        let tensors = lent.params.iter_mut().zip(lent.grads.iter_mut());
        let mut due_slots: Vec<_> = self
            .slots
            .iter()
            .enumerate()
            .zip(tensors)
            .zip(states)
            .zip(&self.on_host)
            .filter(|(_, on_host)| **on_host)
            .map(|(t, _)| t)
            .collect();
        let total = due_slots.len();
        let on_device = self.on_host.len() - total;
        // the head's slots are last in slot order, first to update (the
        // head is on the host only when every unit is)
        if on_device == 0 {
            due_slots.rotate_right(head);
        }
        let due = settle_window(total, on_device, pending.run.done(), upto);
        let mut rest = due_slots.into_iter().skip(due.start);
        let mut host_slots = Vec::new();
        for (((k, slot), (param, grad)), ((master, m), v)) in rest.by_ref().take(due.len()) {
            let updates = slot
                .pieces
                .iter()
                .map(|p| (p.at.clone(), hyper(&cfg, &p.name, lr, step, clip)))
                .collect();
            host_slots.push(HostSlot {
                unit: slot.unit,
                param: param.as_deref_mut().ok_or_else(|| busy(k))?,
                grad: grad.as_deref_mut().ok_or_else(|| busy(k))?,
                master: master.as_mut(),
                m,
                v,
                updates,
                rounding_key: rounding_key(cfg.seed, step, k as u32),
            });
        }
        // the next unit's slots: the paged update stages them meanwhile
        let mut next: Vec<NextSlot<'_, B>> = Vec::new();
        for (((k, slot), (param, grad)), ((master, m), v)) in rest {
            if next.first().is_some_and(|n| n.unit != slot.unit) {
                break;
            }
            next.push(NextSlot {
                k,
                unit: slot.unit,
                param: param.as_deref(),
                grad: grad.as_deref(),
                master: master.as_ref(),
                m,
                v,
            });
        }
        pending.run.run(b, &mut host_slots, next)?;
        if pending.run.done() == total {
            self.pending = None;
        }
        Ok(())
    }

    fn slots(&self) -> &[Slot] {
        &self.slots
    }

    fn kinds(&self, slot: usize) -> Vec<StateKind> {
        let mut kinds = vec![StateKind::EXP_AVG, StateKind::EXP_AVG_SQ];
        if self.master.get(slot).is_some_and(Option::is_some) {
            kinds.push(StateKind::MASTER);
        }
        kinds
    }

    fn state_values(&self, b: &B, slot: usize, kind: StateKind) -> Result<Option<Vec<f32>>> {
        let pieces = piece_ranges(&self.slots[slot]);
        Ok(match kind {
            StateKind::EXP_AVG => Some(self.m[slot].to_f32(b, &pieces)?),
            StateKind::EXP_AVG_SQ => Some(self.v[slot].to_f32(b, &pieces)?),
            StateKind::MASTER => match &self.master[slot] {
                Some(t) => Some(b.to_host(t)?),
                None => None,
            },
            _ => None,
        })
    }

    fn restore(&mut self, b: &B, slot: usize, kind: StateKind, values: &[f32]) -> Result<bool> {
        let pieces = piece_ranges(&self.slots[slot]);
        match kind {
            StateKind::EXP_AVG => self.m[slot].load_f32(b, &pieces, values)?,
            StateKind::EXP_AVG_SQ => self.v[slot].load_f32(b, &pieces, values)?,
            StateKind::MASTER => match &mut self.master[slot] {
                Some(t) => b.upload(t, values)?,
                None => return Ok(false),
            },
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A step's updates of the host's slots, deferred into the next forward:
/// the step's learning rate, 1-based step and gradient multiplier, and
/// where they run.
struct Pending<B: Backend> {
    lr: f32,
    step: u32,
    clip: f32,
    run: Deferred<B>,
}

/// Where deferred updates run (`--host-update`).
enum Deferred<B: Backend> {
    /// On the host's threads.
    Host(HostStep<B>),
    /// Paged through the device.
    Paged(Box<PagedStep<B>>),
}

/// A host slot of the unit after those a settle updates: its tensors on
/// the device (`None` while in a collective) and its state on the host.
struct NextSlot<'a, B: Backend> {
    k: usize,
    unit: Unit,
    param: Option<&'a Tensor<B>>,
    grad: Option<&'a Tensor<B>>,
    master: Option<&'a Tensor<B>>,
    m: &'a Moment<B>,
    v: &'a Moment<B>,
}

impl<B: Backend> Deferred<B> {
    /// Slots updated so far.
    fn done(&self) -> usize {
        match self {
            Deferred::Host(h) => h.done(),
            Deferred::Paged(p) => p.done(),
        }
    }

    /// Updates `slots` in order; meanwhile what the host reads of the first
    /// of `next` (the next unit's slots) is downloaded, or their state paged
    /// in.
    fn run(
        &mut self,
        b: &B,
        slots: &mut [HostSlot<'_, B>],
        next: Vec<NextSlot<'_, B>>,
    ) -> Result<()> {
        match self {
            Deferred::Host(host) => {
                let ahead = match next.into_iter().next() {
                    Some(n) => Some(Fetch {
                        grad: n.grad.ok_or_else(|| busy(n.k))?,
                        param: match n.master {
                            Some(_) => None,
                            None => Some(n.param.ok_or_else(|| busy(n.k))?),
                        },
                    }),
                    None => None,
                };
                host.run(b, slots, ahead)
            }
            Deferred::Paged(paged) => {
                let ahead: Vec<_> = next
                    .into_iter()
                    .map(|n| Resident {
                        unit: n.unit,
                        master: n.master,
                        m: n.m,
                        v: n.v,
                    })
                    .collect();
                paged.run(b, slots, &ahead)
            }
        }
    }
}

/// The element ranges of a slot's pieces (8-bit moments' blocks follow them).
fn piece_ranges(slot: &Slot) -> Vec<Range<usize>> {
    slot.pieces.iter().map(|p| p.at.clone()).collect()
}

/// What [`build_state`] makes state for.
struct StateToBuild<'a, B: Backend> {
    /// Each slot's current parameters (`[k]`: slot k's tensor).
    tensors: &'a [&'a Tensor<B>],
    slots: &'a [Slot],
    /// Whether slot k's state lives on the host.
    on_host: &'a [bool],
    format: StateFormat,
    /// Whether the device's slots keep F32 masters.
    device_master: bool,
}

/// Zero moments (in the format's dtype) and F32 masters for `kept.tensors`,
/// `kept.on_host[k]` saying where tensor k's state lives: the device's
/// first (every m, every v, then with `device_master` the masters), then
/// the host's (masters F32 unless `--master-weights none`), each
/// tensor's master, m and v in turn.
/// Returns `(m, v, master)`.
#[allow(clippy::type_complexity)]
fn build_state<B: Backend>(
    b: &B,
    kept: StateToBuild<'_, B>,
) -> Result<(Vec<Moment<B>>, Vec<Moment<B>>, Vec<Option<Tensor<B>>>)> {
    let StateToBuild {
        tensors,
        slots,
        on_host,
        format,
        device_master,
    } = kept;
    let count = tensors.len();
    let none = || (0..count).map(|_| None).collect::<Vec<Option<Moment<B>>>>();
    let (mut m, mut v) = (none(), none());
    let mut master: Vec<Option<Tensor<B>>> = (0..count).map(|_| None).collect();
    let device: Vec<usize> = (0..count).filter(|&k| !on_host[k]).collect();
    let z = |k: usize, which| {
        let pieces = piece_ranges(&slots[k]);
        Moment::zeros(b, tensors[k].shape(), format.moments, &pieces, which)
    };
    for &k in &device {
        m[k] = Some(z(k, Which::First)?);
    }
    for &k in &device {
        v[k] = Some(z(k, Which::Second)?);
    }
    if device_master {
        for &k in &device {
            master[k] = Some(cast(b, tensors[k], DType::F32, Category::OptimState)?);
        }
    }
    for k in (0..count).filter(|&k| on_host[k]) {
        if format.master == MasterWeights::F32 {
            master[k] = Some(host_master(b, tensors[k])?);
        }
        let pieces = piece_ranges(&slots[k]);
        let zeros =
            |which| Moment::host_zeros(b, tensors[k].shape(), format.moments, &pieces, which);
        m[k] = Some(zeros(Which::First)?);
        v[k] = Some(zeros(Which::Second)?);
    }
    let every = |t: Vec<Option<Moment<B>>>| {
        t.into_iter()
            .map(|t| t.expect("every tensor has moments"))
            .collect()
    };
    Ok((every(m), every(v), master))
}

/// The update [`AdamWOps::adamw_multi`] makes of one slot, made one op at
/// a time: [`AdamWOps::adamw`] per piece, then the master copied whole to the
/// narrow parameters (`AdamWConfig::per_piece`).
fn update_per_piece<B: Backend>(b: &B, t: AdamWSlot<'_, B>) -> Result<()> {
    for (elems, hp) in t.pieces {
        b.adamw(t.target, t.grad, t.m, t.v, elems.clone(), *hp)?;
    }
    if let Some(narrow) = t.narrow {
        b.copy(narrow.mat_mut(), t.target.mat())?;
    }
    Ok(())
}

fn busy(slot: usize) -> crate::Error {
    crate::Error::Backend(format!(
        "optimizer: slot {slot}'s parameter or gradient is still in a collective"
    ))
}

/// The update of parameter `name` at 1-based `step` with learning rate `lr`
/// and gradient multiplier `clip`: no weight decay on norm weights or
/// biases (as the HF Trainer and most recipes leave them).
pub fn hyper(cfg: &AdamWConfig, name: &str, lr: f32, step: u32, clip: f32) -> AdamWStep {
    AdamWStep {
        lr,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        weight_decay: if name.ends_with("norm.weight") || name.ends_with(".bias") {
            0.0
        } else {
            cfg.weight_decay
        },
        step,
        grad_scale: clip,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_min() {
        let c = AdamWConfig::schedule(1.0, 0.1, 10, 110);
        assert!((c.lr_at(5) - 0.5).abs() < 1e-6);
        assert!((c.lr_at(10) - 1.0).abs() < 1e-6);
        assert!((c.lr_at(60) - 0.55).abs() < 1e-5);
        assert!((c.lr_at(110) - 0.1).abs() < 1e-6);
        assert!((c.lr_at(500) - 0.1).abs() < 1e-6);
    }

    /// Three updates of the CPU reference with `--betas 0.5,0.8 --eps 0.3`
    /// against AdamW's formula written out in f64: the betas and eps of the
    /// config reach the update, and other ones give another update.
    #[test]
    fn betas_and_eps_change_the_update_as_adamws_formula_says() {
        use crate::backend::cpu::CpuBackend;
        let b = CpuBackend::new();
        let cfg = AdamWConfig {
            beta1: 0.5,
            beta2: 0.8,
            eps: 0.3,
            weight_decay: 0.1,
            ..AdamWConfig::schedule(0.01, 0.01, 0, 3)
        };
        let grads = [[0.5f32, -2.0, 0.25], [1.0, 0.5, -0.75], [-0.25, 1.5, 2.0]];
        let run = |cfg: &AdamWConfig| {
            let t = |d: &[f32]| b.from_host(d, &[3], DType::F32, Category::Weights).unwrap();
            let (mut p, mut m, mut v) = (t(&[1.0, -0.5, 0.2]), t(&[0.0; 3]), t(&[0.0; 3]));
            for (k, g) in grads.iter().enumerate() {
                let step = k as u32 + 1;
                let hp = hyper(cfg, "w.weight", cfg.lr_at(step), step, 1.0);
                b.adamw(&mut p, &t(g), &mut m, &mut v, 0..3, hp).unwrap();
            }
            b.to_host(&p).unwrap()
        };
        let got = run(&cfg);
        let (b1, b2, eps, lr, wd) = (0.5f64, 0.8f64, 0.3f64, 0.01f64, 0.1f64);
        let mut want = [1.0f64, -0.5, 0.2];
        let (mut m, mut v) = ([0f64; 3], [0f64; 3]);
        for (k, g) in grads.iter().enumerate() {
            let t = k as i32 + 1;
            for i in 0..3 {
                let g = g[i] as f64;
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                want[i] -= lr * (mh / (vh.sqrt() + eps) + wd * want[i]);
            }
        }
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        let usual = run(&AdamWConfig::schedule(0.01, 0.01, 0, 3));
        assert!(
            usual.iter().zip(&got).all(|(a, b)| (a - b).abs() > 1e-4),
            "other betas/eps, other update: {usual:?} {got:?}"
        );
    }
}
