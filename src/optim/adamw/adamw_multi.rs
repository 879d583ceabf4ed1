//! Multi-tensor AdamW's slots: every parameter piece of a step's optimizer
//! slots updated by one op
//! ([`AdamWOps::adamw_multi`](crate::optim::AdamWOps::adamw_multi); a few launches on a
//! GPU), each piece with its own hyper-parameters, the narrow parameters
//! written back in the same pass. Per element the arithmetic is
//! [`AdamWOps::adamw`](crate::optim::AdamWOps::adamw)'s and the write-back
//! is [`Backend::copy`](crate::backend::Backend::copy)'s rounding,
//! so results are bit-identical to a call per piece followed by a copy.

use super::adamw_step::AdamWStep;
use super::compact_adamw::q8_blocks;
use crate::backend::{DType, Tensor, TensorDevice, check_elems, check_same_numel};
use crate::error::{Error, Result};
use std::ops::Range;

/// One slot of a multi-tensor AdamW update: four (five) tensors of one
/// length, of which only the pieces' elements are read and written.
pub struct AdamWSlot<'a, B: TensorDevice> {
    /// The weights updated in place: the F32 parameters themselves, their
    /// F32 master copy when the model computes in a lower precision, or the
    /// BF16 parameters with no master, updated by stochastic rounding
    /// ([`compact_adamw`](super::compact_adamw)).
    pub target: &'a mut Tensor<B>,
    /// The gradient (F32, or the compute dtype).
    pub grad: &'a Tensor<B>,
    /// First and second moments: F32, BF16, or U8 codes with `scales`.
    pub m: &'a mut Tensor<B>,
    pub v: &'a mut Tensor<B>,
    /// 8-bit moments' block scales, `(m's, v's)`, F32 `[blocks]` each: the
    /// blocks of each piece in turn ([`q8_blocks`] of its length). `None`
    /// unless the moments are U8.
    pub scales: Option<(&'a mut Tensor<B>, &'a mut Tensor<B>)>,
    /// The stochastic-rounding key of a BF16 `target` at this step
    /// ([`rounding_key`](super::compact_adamw::rounding_key)).
    pub rounding_key: u32,
    /// The model's parameters when `target` is their master copy: each
    /// updated element is written back in their dtype, rounded as
    /// [`Backend::copy`](crate::backend::Backend::copy) rounds (round to
    /// nearest even for BF16).
    pub narrow: Option<&'a mut Tensor<B>>,
    /// The parameters side by side in the slot, ascending and disjoint.
    pub pieces: &'a [AdamWPiece],
}

/// One piece of a slot: its elements and the update they get.
pub type AdamWPiece = (Range<usize>, AdamWStep);

impl<B: TensorDevice> AdamWSlot<'_, B> {
    /// F32 weights and F32 moments: the plain update (the default state).
    pub fn is_plain(&self) -> bool {
        self.target.dtype() == DType::F32 && self.m.dtype() == DType::F32
    }

    /// Where each piece's 8-bit block scales start, and how many in all.
    pub fn scale_offsets(&self) -> (Vec<usize>, usize) {
        scale_offsets(self.pieces)
    }
}

/// Where each of `pieces`' 8-bit block scales start, and how many in all
/// (the blocks of each piece in turn).
pub fn scale_offsets(pieces: &[AdamWPiece]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let starts = (pieces.iter())
        .map(|(elems, _)| {
            let start = at;
            at += q8_blocks(elems.len());
            start
        })
        .collect();
    (starts, at)
}

/// Checks the state formats of one slot: moments of one dtype, U8 ones with
/// scales of the pieces' blocks, a BF16 target only without a narrow copy.
fn check_formats<B: TensorDevice>(t: &AdamWSlot<'_, B>) -> Result<()> {
    let bad = |what: String| Err(Error::Backend(format!("adamw_multi: {what}")));
    if t.m.dtype() != t.v.dtype() {
        return bad(format!(
            "moments of two dtypes ({:?}, {:?})",
            t.m.dtype(),
            t.v.dtype()
        ));
    }
    match (&t.scales, t.m.dtype()) {
        (Some((ms, vs)), DType::U8) => {
            let (_, blocks) = t.scale_offsets();
            if ms.numel() != blocks || vs.numel() != blocks || ms.dtype() != DType::F32 {
                return bad(format!("8-bit moments need {blocks} F32 block scales each"));
            }
        }
        (None, DType::U8) => return bad("8-bit moments without block scales".into()),
        (Some(_), _) => return bad("block scales beside moments that are not 8-bit".into()),
        (None, _) => {}
    }
    match t.target.dtype() {
        DType::F32 => Ok(()),
        DType::BF16 if t.narrow.is_none() => Ok(()),
        other => bad(format!(
            "weights of {other:?} (with a narrow copy: {})",
            t.narrow.is_some()
        )),
    }
}

/// Checks one slot of a multi-tensor update: one length for every tensor,
/// pieces inside it, in ascending order and disjoint (each element is
/// updated at most once, as by one call per piece).
pub fn check_adamw_slot<B: TensorDevice>(t: &AdamWSlot<'_, B>) -> Result<()> {
    const OP: &str = "adamw_multi";
    let target = &*t.target;
    check_same_numel(target, t.grad, OP)?;
    check_same_numel(target, t.m, OP)?;
    check_same_numel(target, t.v, OP)?;
    if let Some(narrow) = t.narrow.as_deref() {
        check_same_numel(target, narrow, OP)?;
    }
    let mut done = 0;
    for (elems, _) in t.pieces {
        check_elems(elems, target.numel(), OP)?;
        if elems.start < done {
            return Err(crate::Error::Backend(format!(
                "{OP}: piece {elems:?} starts before the previous one ends ({done}); \
                 pieces must be ascending and disjoint"
            )));
        }
        done = elems.end;
    }
    check_formats(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Category, DType};
    use crate::optim::AdamWOps;

    fn hp(step: u32, weight_decay: f32) -> AdamWStep {
        AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
            step,
            grad_scale: 0.75,
        }
    }

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
    }

    /// Five steps of one `adamw_multi` over two slots per step against
    /// `adamw` per piece and a copy: the same bits in the pieces (odd
    /// lengths, one not at 0, weight decays of their own), the gaps between
    /// them untouched.
    #[test]
    fn one_pass_equals_a_call_per_piece_and_a_copy() {
        let b = CpuBackend::new();
        let slots = [
            (301, vec![3..120, 120..121, 140..301]),
            (77, vec![0..40, 40..77]),
        ];
        let t = |d: &[f32]| {
            b.from_host(d, &[d.len()], DType::F32, Category::Weights)
                .unwrap()
        };
        // [target, m, v, narrow] of each slot, twice
        let state = || -> Vec<[Tensor<CpuBackend>; 4]> {
            slots
                .iter()
                .map(|(n, _)| {
                    [
                        t(&values(*n, 0.0)),
                        t(&vec![0.0; *n]),
                        t(&vec![0.0; *n]),
                        t(&values(*n, 9.0)),
                    ]
                })
                .collect()
        };
        let (mut one, mut multi) = (state(), state());
        for step in 1..=5 {
            let grads: Vec<_> = slots
                .iter()
                .map(|(n, _)| t(&values(*n, step as f32 * 2.5)))
                .collect();
            let pieces: Vec<Vec<AdamWPiece>> = slots
                .iter()
                .map(|(_, ranges)| {
                    let wd = [0.1, 0.0, 0.2].into_iter().cycle();
                    ranges
                        .iter()
                        .zip(wd)
                        .map(|(r, wd)| (r.clone(), hp(step, wd)))
                        .collect()
                })
                .collect();
            for (([p, m, v, q], grad), pieces) in one.iter_mut().zip(&grads).zip(&pieces) {
                for (r, h) in pieces {
                    b.adamw(p, grad, m, v, r.clone(), *h).unwrap();
                    let (mut qh, ph) = (b.to_host(q).unwrap(), b.to_host(p).unwrap());
                    qh[r.clone()].copy_from_slice(&ph[r.clone()]);
                    *q = t(&qh);
                }
            }
            let mut update: Vec<AdamWSlot<'_, CpuBackend>> = multi
                .iter_mut()
                .zip(&grads)
                .zip(&pieces)
                .map(|(([p, m, v, q], grad), pieces)| AdamWSlot {
                    target: p,
                    grad,
                    m,
                    v,
                    narrow: Some(q),
                    pieces,
                    scales: None,
                    rounding_key: 0,
                })
                .collect();
            b.adamw_multi(&mut update).unwrap();
        }
        for (a, c) in one.iter().zip(&multi) {
            for (x, y, what) in a
                .iter()
                .zip(c)
                .zip(["target", "m", "v", "narrow"])
                .map(|((x, y), w)| (x, y, w))
            {
                let (x, y) = (b.to_host(x).unwrap(), b.to_host(y).unwrap());
                assert!(
                    x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}"
                );
            }
        }
        let (p, q) = (
            b.to_host(&multi[0][0]).unwrap(),
            b.to_host(&multi[0][3]).unwrap(),
        );
        let (p0, q0) = (values(301, 0.0), values(301, 9.0));
        assert_eq!(p[..3], p0[..3], "before the first piece");
        assert_eq!(p[121..140], p0[121..140], "between pieces");
        assert_eq!(q[121..140], q0[121..140], "narrow between pieces");
        assert_ne!(p[3], p0[3], "the first piece is updated");
        assert_ne!(
            b.to_host(&multi[1][3]).unwrap()[76],
            values(77, 9.0)[76],
            "the second slot"
        );
    }

    /// Overlapping or unordered pieces, pieces past the end and tensors of
    /// other lengths are errors.
    #[test]
    fn bad_pieces_and_lengths_are_errors() {
        let b = CpuBackend::new();
        let z = |n: usize| b.zeros(&[n], DType::F32, Category::Weights).unwrap();
        let (mut p, g, mut m, mut v) = (z(10), z(10), z(10), z(10));
        let mut short = z(9);
        let mut run = |pieces: &[AdamWPiece], narrow: Option<&mut Tensor<CpuBackend>>| {
            let slot = AdamWSlot {
                target: &mut p,
                grad: &g,
                m: &mut m,
                v: &mut v,
                narrow,
                pieces,
                scales: None,
                rounding_key: 0,
            };
            b.adamw_multi(&mut [slot])
        };
        assert!(run(&[(0..4, hp(1, 0.1)), (4..10, hp(1, 0.0))], None).is_ok());
        assert!(run(&[(0..5, hp(1, 0.1)), (4..10, hp(1, 0.0))], None).is_err());
        assert!(run(&[(5..10, hp(1, 0.1)), (0..5, hp(1, 0.0))], None).is_err());
        assert!(run(&[(5..11, hp(1, 0.1))], None).is_err());
        assert!(run(&[(0..9, hp(1, 0.1))], Some(&mut short)).is_err());
    }
}
