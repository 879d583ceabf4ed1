//! Multi-tensor AdamW: every parameter piece of one flat optimizer slot
//! updated by one op ([`Backend::adamw_multi`]), each piece with its own
//! hyper-parameters, the narrow parameters written back in the same pass.
//! Per element the arithmetic is [`Backend::adamw`]'s and the write-back is
//! [`Backend::copy`]'s rounding, so results are bit-identical to a call per
//! piece followed by a copy.

use super::{AdamWStep, Backend, Tensor, check_elems, check_same_numel};
use crate::error::Result;
use std::ops::Range;

/// The tensors of one slot's AdamW update: four (five) of one length, of
/// which only the pieces' elements are read and written.
pub struct AdamWTensors<'a, B: Backend> {
    /// The F32 weights updated in place: the parameters themselves, or
    /// their F32 master copy when the model computes in a lower precision.
    pub target: &'a mut Tensor<B>,
    /// The gradient (F32, or the compute dtype).
    pub grad: &'a Tensor<B>,
    /// First and second moments (F32).
    pub m: &'a mut Tensor<B>,
    pub v: &'a mut Tensor<B>,
    /// The model's parameters when `target` is their master copy: each
    /// updated element is written back in their dtype, rounded as
    /// [`Backend::copy`] rounds (round to nearest even for BF16).
    pub narrow: Option<&'a mut Tensor<B>>,
}

/// One piece of a slot: its elements and the update they get.
pub type AdamWPiece = (Range<usize>, AdamWStep);

/// Checks a multi-tensor update: one length for every tensor, pieces
/// inside it, in ascending order and disjoint (each element is updated at
/// most once, as by one call per piece).
pub fn check_adamw_multi<B: Backend>(t: &AdamWTensors<'_, B>, pieces: &[AdamWPiece]) -> Result<()> {
    const OP: &str = "adamw_multi";
    let target = &*t.target;
    check_same_numel(target, t.grad, OP)?;
    check_same_numel(target, t.m, OP)?;
    check_same_numel(target, t.v, OP)?;
    if let Some(narrow) = t.narrow.as_deref() {
        check_same_numel(target, narrow, OP)?;
    }
    let mut done = 0;
    for (elems, _) in pieces {
        check_elems(elems, target.numel(), OP)?;
        if elems.start < done {
            return Err(crate::Error::Backend(format!(
                "{OP}: piece {elems:?} starts before the previous one ends ({done}); \
                 pieces must be ascending and disjoint"
            )));
        }
        done = elems.end;
    }
    Ok(())
}
