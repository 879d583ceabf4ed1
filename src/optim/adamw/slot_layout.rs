//! How an AdamW slot's tensors lie in a fused update's slot
//! ([`UpdateSlot`](crate::backend::UpdateSlot)): written `[target, m, v]`,
//! then `[m's scales, v's scales]` with 8-bit moments, then the narrow
//! copy if any; read `[grad]`. [`SlotPlan`] is what the kernel knows of a
//! slot besides its tensors; [`SlotCells`] and [`SlotAddrs`] are its
//! tensors by role, on the host and on a GPU.

use super::adamw_multi::{AdamWPiece, AdamWSlot};
use crate::backend::fused_update::{DeviceSlot, DeviceTensor, HostCells, HostCellsMut, HostSlot};
use crate::backend::{DType, TensorDevice};
use crate::error::{Error, Result};

/// One slot as AdamW's kernel sees it besides its tensors.
#[derive(Debug, Clone, Copy)]
pub struct SlotPlan<'p> {
    /// The parameters side by side in the slot, ascending and disjoint.
    pub pieces: &'p [AdamWPiece],
    /// The stochastic-rounding key of a BF16 target at this step.
    pub rounding_key: u32,
    /// Whether the moments are 8-bit, with block scales.
    pub scales: bool,
    /// Whether a narrow copy of the target is written.
    pub narrow: bool,
}

impl<'p> SlotPlan<'p> {
    /// The plan of `slot`.
    pub fn of<B: TensorDevice>(slot: &AdamWSlot<'p, B>) -> Self {
        SlotPlan {
            pieces: slot.pieces,
            rounding_key: slot.rounding_key,
            scales: slot.scales.is_some(),
            narrow: slot.narrow.is_some(),
        }
    }

    /// How many tensors the slot writes.
    fn written(&self) -> usize {
        3 + 2 * self.scales as usize + self.narrow as usize
    }

    fn mismatch(&self, written: usize, read: usize) -> Error {
        Error::Backend(format!(
            "adamw: a slot of {written} written and {read} read tensors for a plan of {} and 1",
            self.written()
        ))
    }
}

/// A slot's tensors by role ([`SlotCells`] on the host, [`SlotAddrs`] on a
/// GPU).
pub struct ByRole<W, R> {
    pub target: W,
    pub m: W,
    pub v: W,
    /// 8-bit moments' block scales, `(m's, v's)`.
    pub scales: Option<(W, W)>,
    pub narrow: Option<W>,
    pub grad: R,
}

/// A slot's host cells by role.
pub type SlotCells<'s> = ByRole<HostCellsMut<'s>, HostCells<'s>>;
/// A slot's device tensors by role.
pub type SlotAddrs = ByRole<DeviceTensor, DeviceTensor>;

impl<W, R> ByRole<W, R> {
    /// The tensors `written`, `read` of a slot laid out as `plan` says.
    fn of(plan: &SlotPlan<'_>, written: Vec<W>, read: Vec<R>) -> Result<Self> {
        if written.len() != plan.written() || read.len() != 1 {
            return Err(plan.mismatch(written.len(), read.len()));
        }
        let mut w = written.into_iter();
        let mut next = || w.next().expect("counted above");
        let (target, m, v) = (next(), next(), next());
        let scales = plan.scales.then(|| (next(), next()));
        let narrow = plan.narrow.then(&mut next);
        let grad = read.into_iter().next().expect("counted above");
        Ok(ByRole {
            target,
            m,
            v,
            scales,
            narrow,
            grad,
        })
    }
}

impl<'s> SlotCells<'s> {
    /// A host slot's cells by role.
    pub fn lay_out(plan: &SlotPlan<'_>, slot: HostSlot<'s>) -> Result<Self> {
        ByRole::of(plan, slot.written, slot.read)
    }

    /// F32 weights and F32 moments: the plain update.
    pub fn is_plain(&self) -> bool {
        self.target.dtype == DType::F32 && self.m.dtype == DType::F32
    }
}

impl SlotAddrs {
    /// A device slot's tensors by role.
    pub fn lay_out(plan: &SlotPlan<'_>, slot: &DeviceSlot) -> Result<Self> {
        ByRole::of(plan, slot.written.clone(), slot.read.clone())
    }

    /// F32 weights and F32 moments: the plain update.
    pub fn is_plain(&self) -> bool {
        self.target.dtype == DType::F32 && self.m.dtype == DType::F32
    }
}
