//! `--host-update gpu`: the optimizer state `--offload-optimizer` keeps in
//! pinned host memory, updated on the GPU. Each slot's state (its moments,
//! their 8-bit block scales, an F32 master) is copied to the device a unit
//! ahead of its update, updated there by the multi-tensor kernel that
//! updates state kept on the device (so the numbers are that state's, bit
//! for bit), and copied back behind it. The gradient and the parameter
//! never leave the device. At most two units' state is on the device at
//! once: the unit being updated (or its state on the way back) and the
//! next one on its way in.
//!
//! Like the host's update ([`super::host`]) it is deferred into the next
//! step's forward ([`super::settling`]): a unit's update is queued before
//! the forward of the unit before it, and the next unit's state is copied
//! in beside that forward, whole, so no update waits for a copy.
//!
//! Copies are ordered after the work queued so far (`copy_start`): a
//! staging buffer may reuse device memory that queued work still reads.
//! A unit's state is freed only once the compute stream has waited for its
//! copy back (before the next unit's state is staged), so the memory it
//! leaves is reused after it.

use crate::backend::{Backend, Category, CopyDone, DType, Tensor};
use crate::error::{Error, Result};
use crate::model::Unit;
use crate::optim::adamw::adamw_multi::AdamWSlot;
use crate::optim::adamw::ops::AdamWOps;
use crate::optim::host::HostSlot;
use crate::optim::moments::Moment;
use std::collections::VecDeque;

/// A slot's optimizer state in host memory, as the paged update reads it.
pub struct Resident<'a, B: Backend> {
    /// The unit it belongs to: state is staged a unit at a time.
    pub unit: Unit,
    /// The F32 master; `None` without masters.
    pub master: Option<&'a Tensor<B>>,
    pub m: &'a Moment<B>,
    pub v: &'a Moment<B>,
}

impl<B: Backend> HostSlot<'_, B> {
    /// Its host state, to page in.
    pub fn resident(&self) -> Resident<'_, B> {
        Resident {
            unit: self.unit,
            master: self.master.as_deref(),
            m: self.m,
            v: self.v,
        }
    }
}

/// One slot's state on the device, and the copies in flight into it (in)
/// or out of it (back to the host).
struct Staged<B: Backend> {
    /// The slot's place in the step's update order.
    index: usize,
    master: Option<Tensor<B>>,
    m: Moment<B>,
    v: Moment<B>,
    copies: Vec<CopyDone>,
}

impl<B: Backend> Staged<B> {
    /// Its tensors, in the order of [`Resident::tensors`].
    fn tensors_mut(&mut self) -> impl Iterator<Item = &mut Tensor<B>> {
        let Staged { master, m, v, .. } = self;
        master
            .iter_mut()
            .chain(m.tensors_mut())
            .chain(v.tensors_mut())
    }
}

impl<'a, B: Backend> Resident<'a, B> {
    /// Its tensors: the master where there is one, then m's, then v's.
    fn tensors(&self) -> impl Iterator<Item = &'a Tensor<B>> + use<'a, B> {
        let (m, v) = (self.m, self.v);
        self.master
            .into_iter()
            .chain(m.tensors())
            .chain(v.tensors())
    }
}

/// A step's paged updates still to run, slot by slot in order (the
/// counterpart of [`super::host::HostStep`]).
pub struct PagedStep<B: Backend> {
    /// Slots updated so far.
    next: usize,
    /// The state of slots `next..next + incoming.len()`, on its way to the
    /// device.
    incoming: VecDeque<Staged<B>>,
    /// The last unit's state on its way back to the host.
    outgoing: Vec<Staged<B>>,
}

impl<B: Backend> Default for PagedStep<B> {
    fn default() -> Self {
        PagedStep {
            next: 0,
            incoming: VecDeque::new(),
            outgoing: Vec::new(),
        }
    }
}

impl<B: Backend> PagedStep<B> {
    /// Slots updated so far.
    pub fn done(&self) -> usize {
        self.next
    }

    /// Updates `slots`, the slots `done()..done() + slots.len()`, in order,
    /// zeroing each gradient once read; `ahead` is the next unit's slots,
    /// whose state is paged in while the last unit of `slots` is updated
    /// (empty: the step's last slot is among `slots`, and every copy back
    /// has finished on return). As each unit of `slots` begins, the unit
    /// before it is retired and the state of the unit after it is staged.
    pub fn run(
        &mut self,
        b: &B,
        slots: &mut [HostSlot<'_, B>],
        ahead: &[Resident<'_, B>],
    ) -> Result<()> {
        let units: Vec<Unit> = slots
            .iter()
            .map(|s| s.unit)
            .chain(ahead.iter().map(|r| r.unit))
            .collect();
        for k in 0..slots.len() {
            if k == 0 || units[k] != units[k - 1] {
                self.retire(b)?;
                for j in k + self.incoming.len()..staging_end(&units, k) {
                    let host = match slots.get(j) {
                        Some(slot) => slot.resident(),
                        None => ahead[j - slots.len()],
                    };
                    let staged = stage(b, host, self.next + j - k)?;
                    self.incoming.push_back(staged);
                }
            }
            let staged = self.take_incoming()?;
            let staged = update(b, &mut slots[k], staged)?;
            self.outgoing.push(page_out(b, &mut slots[k], staged)?);
            self.next += 1;
        }
        if ahead.is_empty() {
            self.finish(b)?;
        }
        Ok(())
    }

    /// Slot `next`'s state, staged by now.
    fn take_incoming(&mut self) -> Result<Staged<B>> {
        match self.incoming.pop_front() {
            Some(staged) if staged.index == self.next => Ok(staged),
            _ => Err(Error::Backend(format!(
                "paged optimizer update: slot {}'s state was not staged in order",
                self.next
            ))),
        }
    }

    /// Orders the work queued from now on after the last unit's copies back
    /// and frees its device state.
    fn retire(&mut self, b: &B) -> Result<()> {
        for out in self.outgoing.drain(..) {
            for done in out.copies {
                b.copy_wait(done)?;
            }
        }
        Ok(())
    }

    /// Waits on the host for the last copies back: the host state is whole.
    fn finish(&mut self, b: &B) -> Result<()> {
        for out in self.outgoing.drain(..) {
            for done in out.copies {
                b.copy_finish(done)?;
            }
        }
        Ok(())
    }
}

/// The end of what is staged once slot `k` begins its unit: the slots of
/// its unit and of the unit after it (`units`: each slot's unit, in update
/// order, a unit's slots together).
fn staging_end(units: &[Unit], k: usize) -> usize {
    let end_of = |i: usize| i + units[i..].iter().take_while(|&&u| u == units[i]).count();
    let this = end_of(k);
    if this < units.len() {
        end_of(this)
    } else {
        this
    }
}

impl<B: Backend> Clone for Resident<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Resident<'_, B> {}

/// Device tensors for the host state of the slot at `index` in update
/// order, the copies into them started after the work queued so far.
fn stage<B: Backend>(b: &B, host: Resident<'_, B>, index: usize) -> Result<Staged<B>> {
    let master = host
        .master
        .map(|t| b.empty(t.shape(), DType::F32, Category::OptimState))
        .transpose()?;
    let mut staged = Staged {
        index,
        master,
        m: host.m.device_twin(b)?,
        v: host.v.device_twin(b)?,
        copies: Vec::new(),
    };
    let mut copies = Vec::new();
    for (dst, src) in staged.tensors_mut().zip(host.tensors()) {
        copies.push(b.copy_start(dst, src)?);
    }
    staged.copies = copies;
    Ok(staged)
}

/// Slot `slot`'s update on the device, from its state in `staged` once
/// that is in; its gradient is zeroed after.
fn update<B: Backend>(
    b: &B,
    slot: &mut HostSlot<'_, B>,
    mut staged: Staged<B>,
) -> Result<Staged<B>> {
    for done in std::mem::take(&mut staged.copies) {
        b.copy_wait(done)?;
    }
    {
        let Staged { master, m, v, .. } = &mut staged;
        let (target, narrow) = match master.as_mut() {
            Some(master) => (master, Some(&mut *slot.param)),
            None => (&mut *slot.param, None),
        };
        let scales = match (m.scales.as_mut(), v.scales.as_mut()) {
            (Some(ms), Some(vs)) => Some((ms, vs)),
            _ => None,
        };
        let mut one = [AdamWSlot {
            target,
            grad: &*slot.grad,
            m: &mut m.values,
            v: &mut v.values,
            scales,
            rounding_key: slot.rounding_key,
            narrow,
            pieces: &slot.updates,
        }];
        b.adamw_multi(&mut one)?;
    }
    b.fill(slot.grad, 0.0)?;
    Ok(staged)
}

/// Starts copying `staged` back into the slot's host state, after its
/// update.
fn page_out<B: Backend>(
    b: &B,
    slot: &mut HostSlot<'_, B>,
    mut staged: Staged<B>,
) -> Result<Staged<B>> {
    let host = slot
        .master
        .iter_mut()
        .map(|t| &mut **t)
        .chain(slot.m.tensors_mut())
        .chain(slot.v.tensors_mut());
    let mut copies = Vec::new();
    for (dst, src) in host.zip(staged.tensors_mut()) {
        copies.push(b.copy_start(dst, src)?);
    }
    staged.copies = copies;
    Ok(staged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unit_stages_itself_and_the_unit_after_it() {
        let (h, e, b0, b1) = (Unit::Head, Unit::Embed, Unit::Block(0), Unit::Block(1));
        let units = [h, e, e, b0, b0, b0, b1];
        assert_eq!(staging_end(&units, 0), 3);
        assert_eq!(staging_end(&units, 1), 6);
        assert_eq!(staging_end(&units, 3), 7);
        assert_eq!(staging_end(&units, 6), 7);
        assert_eq!(staging_end(&units[..6], 3), 6);
        assert_eq!(staging_end(&[b1], 0), 1);
    }
}
