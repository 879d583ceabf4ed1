//! AdamW on the owned shards: the same per-element update, decay rule and
//! schedule as [`crate::optim::AdamW`], over each rank's slice of
//! every unit; the gradient norm is the sum of every rank's shard squares.

use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::{Error, Result};
use crate::optim::host::{HostSlot, HostStep};
use crate::optim::settling::state_on_host;
use crate::optim::{AdamWConfig, Update, build_state, hyper};
use crate::train::fsdp::FsdpStore;

/// Moments and F32 master shards, `[shard]` per unit: on the device (the
/// master only when the model computes in a lower precision), or for the
/// units `cfg.host_units` names in pinned host memory (master always).
pub struct ShardedAdamW<B: Backend> {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor<B>>,
    pub v: Vec<Tensor<B>>,
    pub master: Vec<Option<Tensor<B>>>,
    /// Whether each unit's state lives on the host.
    on_host: Vec<bool>,
    /// The last step's host updates not yet run.
    pending: Option<HostStep<B>>,
}

impl<B: Backend> ShardedAdamW<B> {
    /// Zero moments (and master copies of the current shards) for `store`:
    /// the device's state first, then the host's, each shard's master, m
    /// and v in turn.
    pub fn new(b: &B, cfg: AdamWConfig, store: &FsdpStore<'_, B>) -> Result<Self> {
        let shards = store
            .params
            .iter()
            .map(|p| p.as_ref().ok_or_else(busy))
            .collect::<Result<Vec<_>>>()?;
        let layers = store.layers();
        let on_host: Vec<bool> = store
            .layouts
            .iter()
            .map(|u| state_on_host(u.unit, layers, cfg.host_units))
            .collect();
        let narrow = b.compute_dtype() != DType::F32;
        let (m, v, master) = build_state(b, &shards, &on_host, narrow)?;
        Ok(ShardedAdamW {
            cfg,
            m,
            v,
            master,
            on_host,
            pending: None,
        })
    }

    /// The global gradient norm: every rank's sum of squares, gathered and
    /// added in rank order on the host (the same value on every rank).
    pub fn grad_norm(b: &B, store: &FsdpStore<'_, B>) -> Result<f64> {
        let mut own = 0.0f64;
        for g in &store.grads {
            own += b.sum_squares(g.as_ref().ok_or_else(busy)?)?;
        }
        // f64 carried as two f32 words (high part, rest) so no precision is lost
        let hi = own as f32;
        let lo = (own - hi as f64) as f32;
        let send = b.from_host(&[hi, lo], &[2], DType::F32, Category::Workspace)?;
        let world = store.group.size();
        let mut recv = b.empty(&[2 * world], DType::F32, Category::Workspace)?;
        store.group.all_gather(&send, &mut recv)?;
        let words = b.to_host(&recv)?;
        let total: f64 = words.chunks(2).map(|w| w[0] as f64 + w[1] as f64).sum();
        Ok(total.sqrt())
    }

    /// One update at 1-based `step` of every owned shard (none when
    /// `loss_finite` is false or the global gradient norm is not finite:
    /// `Update::applies`). The device's shards are updated now; the host's update
    /// is deferred: [`settle`](Self::settle) runs it (the next forward
    /// does, unit by unit).
    pub fn step(
        &mut self,
        b: &B,
        store: &mut FsdpStore<'_, B>,
        step: u32,
        loss_finite: bool,
    ) -> Result<Update> {
        let norm = Self::grad_norm(b, store)?;
        let clip = self.cfg.clip_scale(norm);
        let lr = self.cfg.lr_at(step);
        let deferred = self.on_host.iter().any(|&h| h);
        if deferred {
            self.settle(b, store, usize::MAX)?;
        }
        if !Update::applies(loss_finite, norm) {
            return Ok(Update::skipped(lr, norm));
        }
        for (i, layout) in store.layouts.iter().enumerate() {
            if self.on_host[i] {
                continue;
            }
            let grad = store.grads[i].as_ref().ok_or_else(busy)?;
            let param = store.params[i].as_mut().ok_or_else(busy)?;
            for s in layout.segments(store.rank) {
                let name = &layout.params[s.param].name;
                let hp = hyper(&self.cfg, name, lr, step, clip);
                let elems = s.at..s.at + s.elems.len();
                let target = match self.master[i].as_mut() {
                    Some(master) => master,
                    None => &mut *param,
                };
                b.adamw(target, grad, &mut self.m[i], &mut self.v[i], elems, hp)?;
            }
            if let Some(master) = &self.master[i] {
                b.copy(param.mat_mut(), master.mat())?;
            }
        }
        if deferred {
            self.pending = Some(HostStep::new(b, lr, step, clip)?);
        }
        Ok(Update::applied(lr, norm))
    }
}

impl<B: Backend> ShardedAdamW<B> {
    /// Whether a step's host updates are still to run.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Runs the deferred host updates of the units' shards before `upto`
    /// (update order, `optim::settling::update_order`: the head, then unit
    /// order; `usize::MAX`: all of them). The units whose state is on the
    /// device, the first of that order, have none.
    pub fn settle(&mut self, b: &B, store: &mut FsdpStore<'_, B>, upto: usize) -> Result<()> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(());
        };
        let cfg = self.cfg;
        let (lr, step, clip) = (pending.lr, pending.step, pending.clip);
        let rank = store.rank;
        let states = self.master.iter_mut().zip(&mut self.m).zip(&mut self.v);
        let shards = store.params.iter_mut().zip(&mut store.grads);
        let mut units: Vec<_> = store
            .layouts
            .iter()
            .zip(shards)
            .zip(states)
            .zip(&self.on_host)
            .filter(|(_, on_host)| **on_host)
            .map(|(u, _)| u)
            .collect();
        let total = units.len();
        let on_device = self.on_host.len() - total;
        // update order: the head (the last unit) first, when it is on the host
        if on_device == 0 {
            units.rotate_right(1);
        }
        let due = pending.window(total, on_device, upto);
        let mut units = units.into_iter().skip(due.start);
        let mut slots = Vec::new();
        for ((layout, (param, grad)), ((master, m), v)) in units.by_ref().take(due.len()) {
            let updates = layout
                .segments(rank)
                .into_iter()
                .map(|s| {
                    let name = &layout.params[s.param].name;
                    (
                        s.at..s.at + s.elems.len(),
                        hyper(&cfg, name, lr, step, clip),
                    )
                })
                .collect();
            slots.push(HostSlot {
                param: param.as_mut().ok_or_else(busy)?,
                grad: grad.as_mut().ok_or_else(busy)?,
                master: master.as_mut().ok_or_else(busy)?,
                m,
                v,
                updates,
            });
        }
        // the gradient after them, downloaded meanwhile
        let ahead = units.next().and_then(|((_, (_, grad)), _)| grad.as_ref());
        pending.run(b, &mut slots, ahead)?;
        if pending.done() == total {
            self.pending = None;
        }
        Ok(())
    }
}

fn busy() -> Error {
    Error::Backend("FSDP: a shard is still in a collective when the optimizer runs".into())
}
