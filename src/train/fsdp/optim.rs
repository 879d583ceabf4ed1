//! AdamW on the owned shards: the same per-element update, decay rule and
//! schedule as [`crate::train::optim::AdamW`], over each rank's slice of
//! every unit; the gradient norm is the sum of every rank's shard squares.

use super::store::FsdpStore;
use crate::backend::{Backend, Category, DType, Tensor, cast};
use crate::error::{Error, Result};
use crate::train::offload_optim::{HostSlot, HostStep, host_master, host_zeros};
use crate::train::optim::{AdamWConfig, hyper};

/// Moments (and F32 master shards when the model computes in a lower
/// precision), `[shard]` per unit.
pub struct ShardedAdamW<B: Backend> {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor<B>>,
    pub v: Vec<Tensor<B>>,
    pub master: Option<Vec<Tensor<B>>>,
    /// The last step's host updates not yet run (`cfg.offload`).
    pending: Option<HostStep<B>>,
}

impl<B: Backend> ShardedAdamW<B> {
    /// Zero moments (and master copies of the current shards) for `store`.
    pub fn new(b: &B, cfg: AdamWConfig, store: &FsdpStore<'_, B>) -> Result<Self> {
        let shards = store
            .params
            .iter()
            .map(|p| p.as_ref().ok_or_else(busy))
            .collect::<Result<Vec<_>>>()?;
        if cfg.offload {
            return Self::on_host(b, cfg, &shards);
        }
        let z = |t: &Tensor<B>| b.zeros(t.shape(), DType::F32, Category::OptimState);
        let m = shards.iter().map(|t| z(t)).collect::<Result<_>>()?;
        let v = shards.iter().map(|t| z(t)).collect::<Result<_>>()?;
        let master = if b.compute_dtype() != DType::F32 {
            Some(
                shards
                    .iter()
                    .map(|t| cast(b, t, DType::F32, Category::OptimState))
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(ShardedAdamW {
            cfg,
            m,
            v,
            master,
            pending: None,
        })
    }

    /// The state of each shard in host memory: its master, m and v in turn.
    fn on_host(b: &B, cfg: AdamWConfig, shards: &[&Tensor<B>]) -> Result<Self> {
        let (mut m, mut v, mut master) = (Vec::new(), Vec::new(), Vec::new());
        for t in shards {
            master.push(host_master(b, t)?);
            m.push(host_zeros(b, t.shape())?);
            v.push(host_zeros(b, t.shape())?);
        }
        Ok(ShardedAdamW {
            cfg,
            m,
            v,
            master: Some(master),
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

    /// One update at 1-based `step` of every owned shard; returns `(lr,
    /// grad_norm)`. With the state on the host the update is deferred:
    /// [`settle`](Self::settle) runs it (the next forward does, unit by unit).
    pub fn step(&mut self, b: &B, store: &mut FsdpStore<'_, B>, step: u32) -> Result<(f32, f64)> {
        let norm = Self::grad_norm(b, store)?;
        let clip = if self.cfg.clip > 0.0 && norm > self.cfg.clip as f64 {
            (self.cfg.clip as f64 / norm) as f32
        } else {
            1.0
        };
        let lr = self.cfg.lr_at(step);
        if self.cfg.offload {
            self.settle(b, store, usize::MAX)?;
            self.pending = Some(HostStep::new(b, lr, step, clip)?);
            return Ok((lr, norm));
        }
        for (i, layout) in store.layouts.iter().enumerate() {
            let grad = store.grads[i].as_ref().ok_or_else(busy)?;
            let param = store.params[i].as_mut().ok_or_else(busy)?;
            for s in layout.segments(store.rank) {
                let name = &layout.params[s.param].name;
                let hp = hyper(&self.cfg, name, lr, step, clip);
                let elems = s.at..s.at + s.elems.len();
                let target = match self.master.as_mut() {
                    Some(master) => &mut master[i],
                    None => &mut *param,
                };
                b.adamw(target, grad, &mut self.m[i], &mut self.v[i], elems, hp)?;
            }
            if let Some(master) = &self.master {
                b.copy(param.mat_mut(), master[i].mat())?;
            }
        }
        Ok((lr, norm))
    }
}

impl<B: Backend> ShardedAdamW<B> {
    /// Whether a step's host updates are still to run.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Runs the deferred host updates of the units' shards before `upto`
    /// (update order, `train::settling::update_order`: the head, then unit
    /// order; `usize::MAX`: all of them).
    pub fn settle(&mut self, b: &B, store: &mut FsdpStore<'_, B>, upto: usize) -> Result<()> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(());
        };
        let cfg = self.cfg;
        let (lr, step, clip) = (pending.lr, pending.step, pending.clip);
        let rank = store.rank;
        let master = self.master.as_mut().ok_or_else(busy)?;
        let total = master.len();
        let (from, upto) = (pending.done(), upto.min(total));
        let states = master.iter_mut().zip(&mut self.m).zip(&mut self.v);
        let shards = store.params.iter_mut().zip(&mut store.grads);
        let mut units: Vec<_> = store.layouts.iter().zip(shards).zip(states).collect();
        // update order: the head (the last unit) first
        units.rotate_right(1);
        let mut units = units.into_iter().skip(from);
        let mut slots = Vec::new();
        for ((layout, (param, grad)), ((master, m), v)) in
            units.by_ref().take(upto.saturating_sub(from))
        {
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
                master,
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
