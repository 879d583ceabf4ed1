//! AdamW with fp32 state, global-norm gradient clipping, and a warmup +
//! cosine learning-rate schedule.

use crate::backend::{AdamWStep, Backend, Category, DType, Tensor, cast};
use crate::error::Result;
use crate::model::{ModelWeights, Unit};
use crate::optim::host::{HostSlot, HostStep, host_master, host_zeros};
use crate::optim::settling::{state_on_host, update_index, update_order};

/// Optimizer hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub min_lr: f32,
    pub warmup: u32,
    pub total_steps: u32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (0 = off).
    pub clip: f32,
    /// How many units, the last of update order
    /// (`optim::settling::state_on_host`), keep their F32 master weights
    /// and moments in pinned host memory, updated on host threads
    /// (`--offload-optimizer`; a training run sets it from its memory
    /// policy, `TrainConfig::adamw`).
    pub host_units: usize,
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
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            clip: 1.0,
            host_units: 0,
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

    /// Linear warmup to `lr`, then cosine decay to `min_lr` at `total_steps` (1-based steps).
    pub fn lr_at(&self, step: u32) -> f32 {
        if self.warmup > 0 && step <= self.warmup {
            return self.lr * step as f32 / self.warmup as f32;
        }
        let span = self.total_steps.saturating_sub(self.warmup).max(1) as f32;
        let t = ((step - self.warmup) as f32 / span).min(1.0);
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f32::consts::PI * t).cos())
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// The step's learning rate.
    pub lr: f32,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied: a step whose loss or gradient norm
    /// is not finite changes no weight and no optimizer state.
    pub applied: bool,
}

impl Update {
    /// Whether a step with this loss (finite or not) and gradient norm may
    /// change the model. Every rank decides alike: both are global.
    pub fn applies(loss_finite: bool, grad_norm: f64) -> bool {
        loss_finite && grad_norm.is_finite()
    }

    pub(crate) fn applied(lr: f32, grad_norm: f64) -> Self {
        Update {
            lr,
            grad_norm,
            applied: true,
        }
    }

    pub(crate) fn skipped(lr: f32, grad_norm: f64) -> Self {
        Update {
            lr,
            grad_norm,
            applied: false,
        }
    }
}

/// Moments and F32 master weights, per parameter tensor in
/// `ModelWeights::named` order: on the device (the master only when the
/// model computes in a lower precision), or for the units
/// `cfg.host_units` names in pinned host memory (master always).
pub struct AdamW<B: Backend> {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor<B>>,
    pub v: Vec<Tensor<B>>,
    master: Vec<Option<Tensor<B>>>,
    /// Whether each tensor's state lives on the host: the tensors of the
    /// last `cfg.host_units` units of update order.
    on_host: Vec<bool>,
    /// The last step's host updates not yet run.
    pending: Option<HostStep<B>>,
}

/// The unit of each tensor of `w`, in `ModelWeights::named` order.
fn tensor_units<B: Backend>(w: &ModelWeights<B>) -> Vec<Unit> {
    Unit::all(w.blocks.len())
        .into_iter()
        .flat_map(|u| std::iter::repeat_n(u, w.unit_named(u).len()))
        .collect()
}

impl<B: Backend> AdamW<B> {
    /// Zero moments for every parameter of `w`: the device's state first,
    /// then the host's, each tensor's master, m and v in turn.
    pub fn new(b: &B, cfg: AdamWConfig, w: &ModelWeights<B>) -> Result<Self> {
        let named = w.named();
        let layers = w.blocks.len();
        let on_host: Vec<bool> = tensor_units(w)
            .into_iter()
            .map(|u| state_on_host(u, layers, cfg.host_units))
            .collect();
        let tensors: Vec<&Tensor<B>> = named.iter().map(|(_, t)| *t).collect();
        let narrow = tensors.iter().any(|t| t.dtype() != DType::F32);
        let (m, v, master) = build_state(b, &tensors, &on_host, narrow)?;
        Ok(AdamW {
            cfg,
            m,
            v,
            master,
            on_host,
            pending: None,
        })
    }

    /// Global gradient norm (gradients must already be reduced over ranks).
    pub fn grad_norm(b: &B, g: &ModelWeights<B>) -> Result<f64> {
        let mut s = 0.0;
        for (_, t) in g.named() {
            s += b.sum_squares(t)?;
        }
        Ok(s.sqrt())
    }

    /// One update at 1-based `step` (none when `loss_finite` is false or
    /// the gradient norm is not finite: [`Update::applies`]). The
    /// device's state is updated now; the host's update is deferred:
    /// [`settle`](Self::settle) runs it (the next step's forward does, unit
    /// by unit), and zeroes each gradient it reads, so the device's
    /// gradients are zeroed here too.
    pub fn step(
        &mut self,
        b: &B,
        w: &mut ModelWeights<B>,
        g: &mut ModelWeights<B>,
        step: u32,
        loss_finite: bool,
    ) -> Result<Update> {
        let norm = Self::grad_norm(b, g)?;
        let clip = self.cfg.clip_scale(norm);
        let lr = self.cfg.lr_at(step);
        let deferred = self.on_host.iter().any(|&h| h);
        if deferred {
            self.settle(b, w, g, usize::MAX)?;
        }
        if !Update::applies(loss_finite, norm) {
            return Ok(Update::skipped(lr, norm));
        }
        let tensors = w.named_mut().into_iter().zip(g.named_mut());
        for (k, ((name, p), (_, grad))) in tensors.enumerate() {
            if self.on_host[k] {
                continue;
            }
            let hp = hyper(&self.cfg, &name, lr, step, clip);
            let n = p.numel();
            let (m, v) = (&mut self.m[k], &mut self.v[k]);
            match self.master[k].as_mut() {
                Some(master) => {
                    b.adamw(master, grad, m, v, 0..n, hp)?;
                    b.copy(p.mat_mut(), master.mat())?;
                }
                None => b.adamw(p, grad, m, v, 0..n, hp)?,
            }
            if deferred {
                b.fill(grad, 0.0)?;
            }
        }
        if deferred {
            self.pending = Some(HostStep::new(b, lr, step, clip)?);
        }
        Ok(Update::applied(lr, norm))
    }
}

/// Zero moments and F32 masters for `tensors`, `on_host[k]` saying where
/// tensor k's state lives: the device's first (every m, every v, then with
/// `device_master` the masters), then the host's, each tensor's master, m
/// and v in turn (the planner walks this order). Returns `(m, v, master)`.
#[allow(clippy::type_complexity)]
pub(crate) fn build_state<B: Backend>(
    b: &B,
    tensors: &[&Tensor<B>],
    on_host: &[bool],
    device_master: bool,
) -> Result<(Vec<Tensor<B>>, Vec<Tensor<B>>, Vec<Option<Tensor<B>>>)> {
    let count = tensors.len();
    let none = || (0..count).map(|_| None).collect::<Vec<Option<Tensor<B>>>>();
    let (mut m, mut v, mut master) = (none(), none(), none());
    let device: Vec<usize> = (0..count).filter(|&k| !on_host[k]).collect();
    let z = |t: &Tensor<B>| b.zeros(t.shape(), DType::F32, Category::OptimState);
    for &k in &device {
        m[k] = Some(z(tensors[k])?);
    }
    for &k in &device {
        v[k] = Some(z(tensors[k])?);
    }
    if device_master {
        for &k in &device {
            master[k] = Some(cast(b, tensors[k], DType::F32, Category::OptimState)?);
        }
    }
    for k in (0..count).filter(|&k| on_host[k]) {
        master[k] = Some(host_master(b, tensors[k])?);
        m[k] = Some(host_zeros(b, tensors[k].shape())?);
        v[k] = Some(host_zeros(b, tensors[k].shape())?);
    }
    let every = |t: Vec<Option<Tensor<B>>>| {
        t.into_iter()
            .map(|t| t.expect("every tensor has moments"))
            .collect()
    };
    Ok((every(m), every(v), master))
}

impl<B: Backend> AdamW<B> {
    /// Whether a step's host updates are still to run.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Runs the deferred host updates of the tensors before `upto` (in
    /// update order, [`update_order`]: the head's tensors, then
    /// `ModelWeights::named` order; `usize::MAX`: all of them). The
    /// tensors whose state is on the device, the first of that order, have
    /// none.
    pub fn settle(
        &mut self,
        b: &B,
        w: &mut ModelWeights<B>,
        g: &mut ModelWeights<B>,
        upto: usize,
    ) -> Result<()> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(());
        };
        let cfg = self.cfg;
        let (lr, step, clip) = (pending.lr, pending.step, pending.clip);
        let head = w.unit_named(Unit::Head).len();
        let mut tensors: Vec<_> = w
            .named_mut()
            .into_iter()
            .zip(g.named_mut())
            .zip(self.master.iter_mut().zip(&mut self.m).zip(&mut self.v))
            .zip(&self.on_host)
            .filter(|(_, on_host)| **on_host)
            .map(|(t, _)| t)
            .collect();
        let total = tensors.len();
        let on_device = self.on_host.len() - total;
        // the head's tensors are last in `named` order, first to update (the
        // head is on the host only when every unit is)
        if on_device == 0 {
            tensors.rotate_right(head);
        }
        let due = pending.window(total, on_device, upto);
        let mut tensors = tensors.into_iter().skip(due.start);
        let mut slots = Vec::new();
        for (((name, param), (_, grad)), ((master, m), v)) in tensors.by_ref().take(due.len()) {
            slots.push(HostSlot {
                updates: vec![(0..param.numel(), hyper(&cfg, &name, lr, step, clip))],
                param,
                grad,
                master: master.as_mut().ok_or_else(no_master)?,
                m,
                v,
            });
        }
        let ahead = tensors.next().map(|((_, (_, grad)), _)| grad);
        pending.run(b, &mut slots, ahead.as_deref())?;
        if pending.done() == total {
            self.pending = None;
        }
        Ok(())
    }
}

/// The tensors of every unit up to and including `unit` in update order
/// ([`update_order`]).
pub fn tensors_through<B: Backend>(w: &ModelWeights<B>, unit: Unit) -> usize {
    let layers = w.blocks.len();
    update_order(layers)
        .into_iter()
        .take(update_index(unit, layers) + 1)
        .map(|u| w.unit_named(u).len())
        .sum()
}

fn no_master() -> crate::Error {
    crate::Error::Backend("AdamW: host-resident state without master weights".into())
}

/// The update of parameter `name` at 1-based `step` with learning rate `lr`
/// and gradient multiplier `clip`: no weight decay on norm weights.
pub fn hyper(cfg: &AdamWConfig, name: &str, lr: f32, step: u32, clip: f32) -> AdamWStep {
    AdamWStep {
        lr,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        weight_decay: if name.ends_with("norm.weight") {
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
}
