//! `--offload-optimizer`: the F32 master weights and both AdamW moments live
//! in pinned host memory and the update runs on host threads. Gradients stay
//! on the device through the backward (the global norm needs all of them
//! before any update); then each slot's gradient (F32 or BF16) streams
//! device→host one slot ahead of the host's update of the slot before
//! (BF16 widened exactly on the host), and the updated
//! master goes host→device into the parameter (rounded to the compute dtype
//! on the host, to nearest even as the device's cast rounds).
//!
//! The updates are deferred ([`HostStep`]): the optimizer step only fixes
//! the learning rate and the clipping factor, and each unit's slots are
//! updated when the next step's forward asks for the unit
//! ([`super::settling::Settling`]), while the GPU runs the unit before. A
//! gradient is zeroed once its download is done, for the next backward.
//!
//! A slot is one parameter tensor (whole model on every rank) or one unit's
//! shard (FSDP). The per-element arithmetic is the CPU reference's
//! (`optim::adamw::host_adamw`), so results equal the on-device optimizer's.

use crate::backend::{Backend, Category, ComputePoint, CopyDone, DType, HostValues, Tensor, cast};
use crate::error::Result;
use crate::optim::adamw::adamw_step::AdamWStep;
use crate::optim::adamw::host_adamw::{adamw_parallel, adamw_parallel_bf16};
use std::ops::Range;

/// One slot's parameter, gradient and host-resident optimizer state, and
/// the updates of its element ranges (ranges of one slot may differ in
/// weight decay: a flat FSDP shard holds norm and matrix weights).
pub struct HostSlot<'a, B: Backend> {
    /// `[..]` in the compute dtype, on the device.
    pub param: &'a mut Tensor<B>,
    /// `[..]` F32, on the device (zeroed once it is on the host).
    pub grad: &'a mut Tensor<B>,
    /// F32 master, first and second moments: host memory, `param`'s shape.
    pub master: &'a mut Tensor<B>,
    pub m: &'a mut Tensor<B>,
    pub v: &'a mut Tensor<B>,
    pub updates: Vec<(Range<usize>, AdamWStep)>,
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

/// A zero F32 tensor of `shape` in host memory (a moment).
pub fn host_zeros<B: Backend>(b: &B, shape: &[usize]) -> Result<Tensor<B>> {
    let mut t = b.empty(shape, DType::F32, Category::Offload)?;
    if !b.rehearsing() {
        b.host_f32_mut(&mut t)?.fill(0.0);
    }
    Ok(t)
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
    /// The step's learning rate, 1-based step and gradient multiplier.
    pub lr: f32,
    pub step: u32,
    pub clip: f32,
    /// The end of the step's backward: gradient downloads follow it, not
    /// the next forward's work queued since.
    grads_final: ComputePoint,
    /// The first slot not yet updated.
    next: usize,
    /// Slot `next`'s gradient on its way to the host.
    inflight: Option<(Tensor<B>, CopyDone)>,
    /// The last slot's parameter on its way to the device, from this
    /// pinned buffer.
    uploading: Option<(Tensor<B>, CopyDone)>,
}

impl<B: Backend> HostStep<B> {
    /// The step's updates, pending from the work queued so far (the
    /// step's backward, whose gradients they read).
    pub fn new(b: &B, lr: f32, step: u32, clip: f32) -> Result<Self> {
        Ok(HostStep {
            lr,
            step,
            clip,
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

    /// The host slots a settle through item `upto` of update order runs
    /// ([`settle_window`]), of `on_host` slots behind `on_device` items.
    pub fn window(&self, on_host: usize, on_device: usize, upto: usize) -> Range<usize> {
        settle_window(on_host, on_device, self.next, upto)
    }

    /// Updates `slots`, the slots `done()..done() + slots.len()`, in order,
    /// zeroing each gradient once it is on the host; `ahead` is the next
    /// slot's gradient, downloaded while the last of them is updated.
    pub fn run(
        &mut self,
        b: &B,
        slots: &mut [HostSlot<'_, B>],
        ahead: Option<&Tensor<B>>,
    ) -> Result<()> {
        for k in 0..slots.len() {
            let (grad, done) = match self.inflight.take() {
                Some(x) => x,
                None => self.download(b, slots[k].grad)?,
            };
            let next = match slots.get(k + 1) {
                Some(s) => Some(&*s.grad),
                None => ahead,
            };
            if let Some(g) = next {
                self.inflight = Some(self.download(b, g)?);
            }
            b.copy_finish(done)?;
            let slot = &mut slots[k];
            b.fill(slot.grad, 0.0)?;
            // a rehearsal computes nothing (and touches no host page)
            if !b.rehearsing() {
                update(b, slot, &grad)?;
            }
            drop(grad);
            self.upload(b, slot.param, slot.master)?;
            self.next += 1;
        }
        if ahead.is_none() {
            // the step's last slot
            self.finish_upload(b)?;
        }
        Ok(())
    }
}

impl<B: Backend> HostStep<B> {
    /// Starts copying `grad` into a fresh host buffer, after the backward
    /// that wrote it (not after the forward queued since).
    fn download(&self, b: &B, grad: &Tensor<B>) -> Result<(Tensor<B>, CopyDone)> {
        let mut host = b.empty(grad.shape(), grad.dtype(), Category::Offload)?;
        let done = b.copy_start_from(&mut host, grad, &self.grads_final)?;
        Ok((host, done))
    }
}

/// The host's AdamW update of one slot from its downloaded gradient.
fn update<B: Backend>(b: &B, slot: &mut HostSlot<'_, B>, grad: &Tensor<B>) -> Result<()> {
    let g = b.host_values(grad)?;
    let master = b.host_f32_mut(slot.master)?;
    let m = b.host_f32_mut(slot.m)?;
    let v = b.host_f32_mut(slot.v)?;
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
            to_bf16(b.host_f32(master)?, b.host_bf16_mut(&mut narrow)?);
        }
        let done = b.copy_start_from(param, &narrow, &self.grads_final)?;
        b.copy_order(&done)?;
        self.uploading = Some((narrow, done));
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
