//! AdamW's ops on any backend ([`AdamWOps`]): the slots checked here, then
//! run by the backend's one optimizer op, [`Backend::fused_update`], with
//! AdamW's kernels (`kernel.rs`).

use super::adamw_multi::{AdamWSlot, check_adamw_slot};
use super::adamw_step::AdamWStep;
use super::kernel::{MultiKernel, PieceKernel};
use super::slot_layout::SlotPlan;
use crate::backend::{Backend, Tensor, TensorDevice, UpdateSlot, check_elems, check_same_numel};
use crate::error::Result;
use std::ops::Range;

/// AdamW's updates, on every backend.
pub trait AdamWOps: Backend {
    /// One AdamW update of elements `elems` of `param` (f32) with `grad`,
    /// moments `m`, `v` (f32): four tensors of one length, of which only
    /// that range is read and written (a flat FSDP shard holds parameters
    /// with different weight decay side by side).
    fn adamw(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        elems: Range<usize>,
        hp: AdamWStep,
    ) -> Result<()> {
        for t in [grad, &*m, &*v] {
            check_same_numel(param, t, "adamw")?;
        }
        check_elems(&elems, param.numel(), "adamw")?;
        let slot = UpdateSlot {
            written: vec![param, m, v],
            read: vec![grad],
        };
        self.fused_update(&PieceKernel { elems, hp }, &mut [slot])
    }

    /// [`adamw`](AdamWOps::adamw) of every piece of `slots` in one op (a
    /// launch per 32 pieces on a GPU), each piece its elements and
    /// hyper-parameters; for a slot with `narrow`, each updated element of
    /// its `target` also written there in its dtype (as
    /// [`copy`](Backend::copy) rounds). Bit-identical to a call per piece
    /// followed by that copy of the pieces' elements. Each slot's pieces
    /// ascending and disjoint ([`check_adamw_slot`]).
    fn adamw_multi(&self, slots: &mut [AdamWSlot<'_, Self>]) -> Result<()> {
        for slot in slots.iter() {
            check_adamw_slot(slot)?;
        }
        let kernel = MultiKernel {
            slots: slots.iter().map(SlotPlan::of).collect(),
        };
        let mut update: Vec<_> = slots.iter_mut().map(lend).collect();
        self.fused_update(&kernel, &mut update)
    }
}

impl<B: Backend> AdamWOps for B {}

/// A slot's tensors as a fused update takes them ([`SlotPlan`]'s layout).
fn lend<'s, B: TensorDevice>(slot: &'s mut AdamWSlot<'_, B>) -> UpdateSlot<'s, B> {
    let mut written: Vec<&'s mut Tensor<B>> = vec![slot.target, slot.m, slot.v];
    if let Some((ms, vs)) = slot.scales.as_mut() {
        written.extend([&mut **ms, &mut **vs]);
    }
    if let Some(narrow) = slot.narrow.as_deref_mut() {
        written.push(narrow);
    }
    UpdateSlot {
        written,
        read: vec![slot.grad],
    }
}
