//! AdamW with fp32 state, global-norm gradient clipping, and a warmup +
//! cosine learning-rate schedule.

use crate::backend::{AdamWStep, Backend, Category, DType, Tensor, cast};
use crate::error::Result;
use crate::model::{ModelWeights, Unit};
use crate::train::offload_optim::{HostSlot, HostStep, host_master, host_zeros};
use crate::train::settling::{update_index, update_order};

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
    /// Keep the F32 master weights and moments in pinned host memory and
    /// update them on host threads (`--offload-optimizer`; a training run
    /// sets it from its memory policy, `TrainConfig::adamw`).
    pub offload: bool,
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
            offload: false,
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

/// Moments (and fp32 master weights when the model computes in a lower
/// precision, or always when they live on the host: `cfg.offload`).
pub struct AdamW<B: Backend> {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor<B>>,
    pub v: Vec<Tensor<B>>,
    master: Option<Vec<Tensor<B>>>,
    /// The last step's host updates not yet run (`cfg.offload`).
    pending: Option<HostStep<B>>,
}

impl<B: Backend> AdamW<B> {
    /// Zero moments for every parameter of `w`.
    pub fn new(b: &B, cfg: AdamWConfig, w: &ModelWeights<B>) -> Result<Self> {
        let named = w.named();
        if cfg.offload {
            return Self::on_host(b, cfg, &named);
        }
        let z = |t: &Tensor<B>| b.zeros(t.shape(), DType::F32, Category::OptimState);
        let m = named.iter().map(|(_, t)| z(t)).collect::<Result<_>>()?;
        let v = named.iter().map(|(_, t)| z(t)).collect::<Result<_>>()?;
        let master = if named.iter().any(|(_, t)| t.dtype() != DType::F32) {
            Some(
                named
                    .iter()
                    .map(|(_, t)| cast(b, t, DType::F32, Category::OptimState))
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(AdamW {
            cfg,
            m,
            v,
            master,
            pending: None,
        })
    }

    /// The state in host memory, each parameter's master, m and v in turn.
    fn on_host(b: &B, cfg: AdamWConfig, named: &[(String, &Tensor<B>)]) -> Result<Self> {
        let (mut m, mut v, mut master) = (Vec::new(), Vec::new(), Vec::new());
        for (_, t) in named {
            master.push(host_master(b, t)?);
            m.push(host_zeros(b, t.shape())?);
            v.push(host_zeros(b, t.shape())?);
        }
        Ok(AdamW {
            cfg,
            m,
            v,
            master: Some(master),
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

    /// One update at 1-based `step`; returns `(lr, grad_norm)`. With the
    /// state on the host the update is deferred: [`settle`](Self::settle)
    /// runs it (the next step's forward does, unit by unit).
    pub fn step(
        &mut self,
        b: &B,
        w: &mut ModelWeights<B>,
        g: &mut ModelWeights<B>,
        step: u32,
    ) -> Result<(f32, f64)> {
        let norm = Self::grad_norm(b, g)?;
        let clip = if self.cfg.clip > 0.0 && norm > self.cfg.clip as f64 {
            (self.cfg.clip as f64 / norm) as f32
        } else {
            1.0
        };
        let lr = self.cfg.lr_at(step);
        if self.cfg.offload {
            self.settle(b, w, g, usize::MAX)?;
            self.pending = Some(HostStep::new(b, lr, step, clip)?);
            return Ok((lr, norm));
        }
        let grads = g.named();
        for (k, (name, p)) in w.named_mut().into_iter().enumerate() {
            let hp = hyper(&self.cfg, &name, lr, step, clip);
            match self.master.as_mut() {
                Some(master) => {
                    let n = master[k].numel();
                    b.adamw(
                        &mut master[k],
                        grads[k].1,
                        &mut self.m[k],
                        &mut self.v[k],
                        0..n,
                        hp,
                    )?;
                    b.copy(p.mat_mut(), master[k].mat())?;
                }
                None => {
                    let n = p.numel();
                    b.adamw(p, grads[k].1, &mut self.m[k], &mut self.v[k], 0..n, hp)?
                }
            }
        }
        Ok((lr, norm))
    }
}

impl<B: Backend> AdamW<B> {
    /// Whether a step's host updates are still to run.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Runs the deferred host updates of the tensors before `upto` (in
    /// update order, [`update_order`]: the head's tensors, then
    /// `ModelWeights::named` order; `usize::MAX`: all of them).
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
        let master = self.master.as_mut().ok_or_else(no_master)?;
        let total = master.len();
        let (from, upto) = (pending.done(), upto.min(total));
        let head = w.unit_named(Unit::Head).len();
        let mut tensors: Vec<_> = w
            .named_mut()
            .into_iter()
            .zip(g.named_mut())
            .zip(master.iter_mut().zip(&mut self.m).zip(&mut self.v))
            .collect();
        // the head's tensors are last in `named` order, first to update
        tensors.rotate_right(head);
        let mut tensors = tensors.into_iter().skip(from);
        let mut slots: Vec<HostSlot<'_, B>> = tensors
            .by_ref()
            .take(upto.saturating_sub(from))
            .map(|(((name, param), (_, grad)), ((master, m), v))| HostSlot {
                updates: vec![(0..param.numel(), hyper(&cfg, &name, lr, step, clip))],
                param,
                grad,
                master,
                m,
                v,
            })
            .collect();
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
