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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Category, DType};

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

    /// Five steps of one `adamw_multi` per step against `adamw` per piece
    /// and a copy: the same bits in the pieces (odd lengths, one not at 0,
    /// weight decays of their own), the gaps between them untouched.
    #[test]
    fn one_pass_equals_a_call_per_piece_and_a_copy() {
        let b = CpuBackend::new();
        let n = 301;
        let ranges = [3..120, 120..121, 140..301];
        let values =
            |seed: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect() };
        let t = |d: &[f32]| b.from_host(d, &[n], DType::F32, Category::Weights).unwrap();
        let state = || {
            [
                t(&values(0.0)),
                t(&[0.0; 301]),
                t(&[0.0; 301]),
                t(&values(9.0)),
            ]
        };
        let ([mut p1, mut m1, mut v1, mut q1], [mut p2, mut m2, mut v2, mut q2]) =
            (state(), state());
        for step in 1..=5 {
            let grad = t(&values(step as f32 * 2.5));
            let pieces: Vec<AdamWPiece> = ranges
                .iter()
                .zip([0.1, 0.0, 0.2])
                .map(|(r, wd)| (r.clone(), hp(step, wd)))
                .collect();
            for (r, h) in &pieces {
                b.adamw(&mut p1, &grad, &mut m1, &mut v1, r.clone(), *h)
                    .unwrap();
                let (q, p) = (b.to_host(&q1).unwrap(), b.to_host(&p1).unwrap());
                let mut q = q;
                q[r.clone()].copy_from_slice(&p[r.clone()]);
                q1 = t(&q);
            }
            let multi = AdamWTensors {
                target: &mut p2,
                grad: &grad,
                m: &mut m2,
                v: &mut v2,
                narrow: Some(&mut q2),
            };
            b.adamw_multi(multi, &pieces).unwrap();
        }
        for (x, y, what) in [
            (&p1, &p2, "target"),
            (&m1, &m2, "m"),
            (&v1, &v2, "v"),
            (&q1, &q2, "narrow"),
        ] {
            let (x, y) = (b.to_host(x).unwrap(), b.to_host(y).unwrap());
            assert!(
                x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}"
            );
        }
        let (p, q) = (b.to_host(&p2).unwrap(), b.to_host(&q2).unwrap());
        assert_eq!(p[..3], values(0.0)[..3], "before the first piece");
        assert_eq!(p[121..140], values(0.0)[121..140], "between pieces");
        assert_eq!(q[121..140], values(9.0)[121..140], "narrow between pieces");
        assert_ne!(p[3], values(0.0)[3], "the first piece is updated");
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
            let t = AdamWTensors {
                target: &mut p,
                grad: &g,
                m: &mut m,
                v: &mut v,
                narrow,
            };
            b.adamw_multi(t, pieces)
        };
        assert!(run(&[(0..4, hp(1, 0.1)), (4..10, hp(1, 0.0))], None).is_ok());
        assert!(run(&[(0..5, hp(1, 0.1)), (4..10, hp(1, 0.0))], None).is_err());
        assert!(run(&[(5..10, hp(1, 0.1)), (0..5, hp(1, 0.0))], None).is_err());
        assert!(run(&[(5..11, hp(1, 0.1))], None).is_err());
        assert!(run(&[(0..9, hp(1, 0.1))], Some(&mut short)).is_err());
    }
}
