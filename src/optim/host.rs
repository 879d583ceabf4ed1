//! `--offload-optimizer`: the optimizer state of the last units lives in
//! pinned host memory and their update runs on host threads: F32 master
//! weights and moments, or the compact formats of `--optim-state` (BF16 or
//! 8-bit moments) and `--master-weights none` (the BF16 parameter itself,
//! downloaded beside its gradient and rounded stochastically). Gradients
//! stay on the device through the backward (the global norm needs all of
//! them before any update); then each slot's gradient (F32 or BF16) streams
//! device→host one slot ahead of the host's update of the slot before
//! (BF16 widened exactly on the host), and the updated weights go
//! host→device into the parameter (a master rounded to the compute dtype on
//! the host, to nearest even as the device's cast rounds).
//!
//! The updates are deferred ([`HostStep`]): the optimizer step only fixes
//! the learning rate and the clipping factor, and each unit's slots are
//! updated when the next step's forward asks for the unit
//! ([`super::settling::Settling`]), while the GPU runs the unit before. A
//! gradient is zeroed once its download is done, for the next backward.
//!
//! A slot is one parameter tensor (whole model on every rank) or one unit's
//! shard (FSDP). The per-element arithmetic is the CPU reference's
//! (`optim::adamw::host_adamw`, `optim::adamw::host_compact`), so results
//! equal the on-device optimizer's.

use crate::backend::{
    Backend, Category, ComputePoint, CopyDone, DType, HostValues, HostValuesMut, Tensor, cast,
};
use crate::error::Result;
use crate::model::Unit;
use crate::optim::adamw::adamw_step::AdamWStep;
use crate::optim::adamw::compact_adamw::{MomentCodec, WeightRounding};
use crate::optim::adamw::host_adamw::{adamw_parallel, adamw_parallel_bf16};
use crate::optim::adamw::host_compact::{HostState, update_slot};
use crate::optim::moments::Moment;
use std::ops::Range;

/// One slot's parameter, gradient and host-resident optimizer state, and
/// the updates of its element ranges (ranges of one slot may differ in
/// weight decay: a flat FSDP shard holds norm and matrix weights).
pub struct HostSlot<'a, B: Backend> {
    /// The unit the slot belongs to.
    pub unit: Unit,
    /// `[..]` in the compute dtype, on the device.
    pub param: &'a mut Tensor<B>,
    /// `[..]` F32 or BF16, on the device (zeroed once it is on the host).
    pub grad: &'a mut Tensor<B>,
    /// The F32 master in host memory, `param`'s shape; `None`
    /// (`--master-weights none`): the parameter's own values are updated,
    /// downloaded beside the gradient (BF16 by stochastic rounding).
    pub master: Option<&'a mut Tensor<B>>,
    /// The moments in host memory, in their format.
    pub m: &'a mut Moment<B>,
    pub v: &'a mut Moment<B>,
    pub updates: Vec<(Range<usize>, AdamWStep)>,
    /// Stochastic rounding's key for this slot and step.
    pub rounding_key: u32,
}

impl<B: Backend> HostSlot<'_, B> {
    /// F32 master and moments: the plain update.
    fn is_plain(&self) -> bool {
        self.master.is_some() && self.m.values.dtype() == DType::F32
    }
}

/// A host-resident F32 copy of `param` (the master weights at start).
pub fn host_master<B: Backend>(b: &B, param: &Tensor<B>) -> Result<Tensor<B>> {
    let mut master = b.empty(param.shape(), DType::F32, Category::Offload)?;
    if param.dtype() == DType::F32 {
        let done = b.copy_start(&mut master, param)?;
        b.copy_finish(done)?;
    } else {
        let wide = cast(b, param, DType::F32, Category::Workspace)?;
        let done = b.copy_start(&mut master, &wide)?;
        b.copy_finish(done)?;
    }
    Ok(master)
}

/// The host slots to update when everything through item `upto` of update
/// order must be settled, as positions among the `on_host` slots: the
/// `on_device` items come first in update order (updated at the step), and
/// the first `done` host slots are already updated. Empty when nothing new
/// is due.
pub fn settle_window(on_host: usize, on_device: usize, done: usize, upto: usize) -> Range<usize> {
    let end = upto.saturating_sub(on_device).min(on_host);
    done..end.max(done)
}

/// An optimizer step whose host updates are still to run, slot by slot in
/// order: slot k+1's gradient is on its way to the host while the host
/// updates slot k.
pub struct HostStep<B: Backend> {
    /// The end of the step's backward: gradient downloads follow it, not
    /// the next forward's work queued since.
    grads_final: ComputePoint,
    /// The first slot not yet updated.
    next: usize,
    /// Slot `next`'s gradient (and parameter) on its way to the host.
    inflight: Option<Download<B>>,
    /// The last slot's parameter on its way to the device, from this
    /// pinned buffer.
    uploading: Option<(Tensor<B>, CopyDone)>,
}

/// What the host reads of a slot on the device: its gradient and, without
/// a master, its parameter.
pub struct Fetch<'a, B: Backend> {
    pub grad: &'a Tensor<B>,
    pub param: Option<&'a Tensor<B>>,
}

impl<B: Backend> Clone for Fetch<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Fetch<'_, B> {}

impl<B: Backend> HostSlot<'_, B> {
    /// What the host reads of this slot.
    pub fn fetch(&self) -> Fetch<'_, B> {
        Fetch {
            grad: self.grad,
            param: self.master.is_none().then_some(&*self.param),
        }
    }
}

/// A slot's [`Fetch`] on its way into host buffers.
struct Download<B: Backend> {
    grad: (Tensor<B>, CopyDone),
    param: Option<(Tensor<B>, CopyDone)>,
}

impl<B: Backend> HostStep<B> {
    /// The step's updates, pending from the work queued so far (the
    /// step's backward, whose gradients they read).
    pub fn new(b: &B) -> Result<Self> {
        Ok(HostStep {
            grads_final: b.compute_point()?,
            next: 0,
            inflight: None,
            uploading: None,
        })
    }

    /// Slots updated so far.
    pub fn done(&self) -> usize {
        self.next
    }

    /// Updates `slots`, the slots `done()..done() + slots.len()`, in order,
    /// zeroing each gradient once it is on the host; `ahead` is what the
    /// host reads of the next slot, downloaded while the last of them is
    /// updated.
    pub fn run(
        &mut self,
        b: &B,
        slots: &mut [HostSlot<'_, B>],
        ahead: Option<Fetch<'_, B>>,
    ) -> Result<()> {
        for k in 0..slots.len() {
            let (at, grads_final) = ((&*slots, k, ahead), &self.grads_final);
            let download = |what| download(b, grads_final, what);
            let fetched = one_ahead(&mut self.inflight, at, HostSlot::fetch, download)?;
            let (grad, mut param) = fetched.finish(b)?;
            let slot = &mut slots[k];
            b.fill(slot.grad, 0.0)?;
            // a rehearsal computes nothing (and touches no host page)
            if !b.rehearsing() {
                update(b, slot, &grad, param.as_mut())?;
            }
            drop(grad);
            match (param, slot.master.as_deref()) {
                (Some(values), _) => self.upload_values(b, slot.param, values)?,
                (None, Some(master)) => self.upload(b, slot.param, master)?,
                (None, None) => return Err(no_weights()),
            }
            self.next += 1;
        }
        if ahead.is_none() {
            // the step's last slot
            self.finish_upload(b)?;
        }
        Ok(())
    }
}

/// Slot `k`'s transfer: the one started a slot earlier (`in_flight`) or
/// started now; before it is returned the next slot's (slot `k + 1`, or
/// `ahead` after the last of `slots`) is started, so that it overlaps slot
/// `k`'s update: the pipeline of [`HostStep`], the host's threads' update.
pub(super) fn one_ahead<'s, S, A: Copy, T>(
    in_flight: &mut Option<T>,
    (slots, k, ahead): (&'s [S], usize, Option<A>),
    what: impl Fn(&'s S) -> A,
    mut start: impl FnMut(A) -> Result<T>,
) -> Result<T> {
    let this = match in_flight.take() {
        Some(t) => t,
        None => start(what(&slots[k]))?,
    };
    if let Some(next) = slots.get(k + 1).map(&what).or(ahead) {
        *in_flight = Some(start(next)?);
    }
    Ok(this)
}

/// Starts copying what the host reads of a slot into fresh host buffers,
/// after the backward that wrote the gradient (`grads_final`, not after
/// the forward queued since).
fn download<B: Backend>(
    b: &B,
    grads_final: &ComputePoint,
    what: Fetch<'_, B>,
) -> Result<Download<B>> {
    let start = |t: &Tensor<B>| -> Result<(Tensor<B>, CopyDone)> {
        let mut host = b.empty(t.shape(), t.dtype(), Category::Offload)?;
        let done = b.copy_start_from(&mut host, t, grads_final)?;
        Ok((host, done))
    };
    Ok(Download {
        grad: start(what.grad)?,
        param: what.param.map(start).transpose()?,
    })
}

impl<B: Backend> Download<B> {
    /// The host buffers, once their copies are done.
    fn finish(self, b: &B) -> Result<(Tensor<B>, Option<Tensor<B>>)> {
        let (grad, done) = self.grad;
        b.copy_finish(done)?;
        let param = match self.param {
            Some((param, done)) => {
                b.copy_finish(done)?;
                Some(param)
            }
            None => None,
        };
        Ok((grad, param))
    }
}

/// The host's AdamW update of one slot from its downloaded gradient (and,
/// without a master, its downloaded parameter `param`, updated in place).
fn update<B: Backend>(
    b: &B,
    slot: &mut HostSlot<'_, B>,
    grad: &Tensor<B>,
    param: Option<&mut Tensor<B>>,
) -> Result<()> {
    if slot.is_plain() {
        return update_plain(b, slot, grad);
    }
    let g = b.host_values(grad)?;
    let (w, dtype) = match (slot.master.as_deref_mut(), param) {
        (Some(master), _) => (b.host_values_mut(master)?, DType::F32),
        (None, Some(param)) => {
            let dtype = param.dtype();
            (b.host_values_mut(param)?, dtype)
        }
        (None, None) => return Err(no_weights()),
    };
    let rounding = match dtype {
        DType::BF16 => WeightRounding::Stochastic(slot.rounding_key),
        _ => WeightRounding::F32,
    };
    let codec = match slot.m.values.dtype() {
        DType::F32 => MomentCodec::F32,
        DType::BF16 => MomentCodec::Bf16,
        _ => MomentCodec::Q8,
    };
    let (m, m_scales) = host_moment(b, slot.m)?;
    let (v, v_scales) = host_moment(b, slot.v)?;
    let state = HostState {
        w,
        rounding,
        g,
        codec,
        m,
        m_scales,
        v,
        v_scales,
    };
    update_slot(state, &slot.updates);
    Ok(())
}

/// A moment's values (or codes) and block scales (empty unless 8-bit) in
/// host memory.
fn host_moment<'t, B: Backend>(
    b: &B,
    moment: &'t mut Moment<B>,
) -> Result<(HostValuesMut<'t>, &'t mut [f32])> {
    let Moment { values, scales, .. } = moment;
    let scales: &mut [f32] = match scales {
        Some(s) => b.host_f32_mut(s)?,
        None => &mut [],
    };
    Ok((b.host_values_mut(values)?, scales))
}

/// The F32 update: master and moments F32, over the host's threads.
fn update_plain<B: Backend>(b: &B, slot: &mut HostSlot<'_, B>, grad: &Tensor<B>) -> Result<()> {
    let g = b.host_values(grad)?;
    let master = b.host_f32_mut(slot.master.as_deref_mut().ok_or_else(no_weights)?)?;
    let m = b.host_f32_mut(&mut slot.m.values)?;
    let v = b.host_f32_mut(&mut slot.v.values)?;
    for (r, hp) in &slot.updates {
        let r = r.clone();
        let (p, m, v) = (&mut master[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
        match g {
            HostValues::F32(g) => adamw_parallel(p, &g[r], m, v, *hp),
            HostValues::Bf16(bits) => adamw_parallel_bf16(p, &bits[r], m, v, *hp),
        }
    }
    Ok(())
}

fn no_weights() -> crate::Error {
    crate::Error::Backend("host AdamW: a slot with neither a master nor its parameter".into())
}

impl<B: Backend> HostStep<B> {
    /// `param = master`: a direct copy for F32 parameters; else cast to the
    /// parameter's dtype on the host (round to nearest even, as the
    /// device's cast rounds) into a pinned buffer that is copied into the
    /// parameter. The copy follows the backward, not the forward queued
    /// since (nothing has read the parameter since the backward); the
    /// buffer lives until the next upload, or the step's last, has waited
    /// for it.
    fn upload(&mut self, b: &B, param: &mut Tensor<B>, master: &Tensor<B>) -> Result<()> {
        if param.dtype() == DType::F32 {
            let done = b.copy_start_from(param, master, &self.grads_final)?;
            return b.copy_wait(done);
        }
        self.finish_upload(b)?;
        let mut narrow = b.empty(param.shape(), param.dtype(), Category::Offload)?;
        if !b.rehearsing() {
            let master = b.host_f32(master)?;
            match b.host_values_mut(&mut narrow)? {
                HostValuesMut::Bf16(bits) => to_bf16(master, bits),
                // the CPU's cells: BF16 values
                HostValuesMut::F32(cells) => {
                    use crate::backend::narrow::{bf16_nearest, bf16_value};
                    for (c, &x) in cells.iter_mut().zip(master) {
                        *c = bf16_value(bf16_nearest(x));
                    }
                }
                HostValuesMut::U8(_) => return Err(no_weights()),
            }
        }
        self.upload_values(b, param, narrow)
    }

    /// `param = values`, a host buffer of the parameter's dtype (updated
    /// in place without a master, or a master's rounding), kept until the
    /// next upload, or the step's last, has waited for its copy.
    fn upload_values(&mut self, b: &B, param: &mut Tensor<B>, values: Tensor<B>) -> Result<()> {
        self.finish_upload(b)?;
        let done = b.copy_start_from(param, &values, &self.grads_final)?;
        b.copy_order(&done)?;
        self.uploading = Some((values, done));
        Ok(())
    }

    /// Waits for the upload in flight, freeing its buffer.
    fn finish_upload(&mut self, b: &B) -> Result<()> {
        match self.uploading.take() {
            Some((narrow, done)) => {
                b.copy_finish(done)?;
                drop(narrow);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// `dst = src` rounded to bf16 (nearest even; NaN stays NaN), over the
/// host's threads.
fn to_bf16(src: &[f32], dst: &mut [u16]) {
    use rayon::prelude::*;
    dst.par_chunks_mut(1 << 16)
        .zip(src.par_chunks(1 << 16))
        .for_each(|(d, s)| {
            for (d, &x) in d.iter_mut().zip(s) {
                *d = half::bf16::from_f32(x).to_bits();
            }
        });
}

#[cfg(test)]
mod tests {
    use super::settle_window;
    use proptest::prelude::*;

    proptest! {
        /// Settling through ever later items updates every host slot once,
        /// in order, none before its item is due.
        #[test]
        fn settles_cover_the_host_slots_once_in_order(
            on_host in 0usize..12,
            on_device in 0usize..12,
            mut uptos in proptest::collection::vec(0usize..30, 0..8),
        ) {
            uptos.sort_unstable();
            uptos.push(on_host + on_device);
            let mut done = 0;
            for upto in uptos {
                let due = settle_window(on_host, on_device, done, upto);
                prop_assert_eq!(due.start, done);
                prop_assert!(due.end <= on_host);
                // host slot k is item on_device + k of update order
                prop_assert!(due.end == done || on_device + due.end <= upto);
                done = due.end;
            }
            prop_assert_eq!(done, on_host);
        }
    }
}
