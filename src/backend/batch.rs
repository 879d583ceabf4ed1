//! Strided batches of GEMMs ([`super::Backend::gemm_batched`]): problem `i`
//! reads `a` and `b` and writes `c` at their views' offsets plus `i` times a
//! stride. A stride of 0 shares one operand across the batch (the layer's
//! input `x` times every destination's weight rows).

use super::{Backend, Mat, MatLayout, MatMut};
use crate::error::{Error, Result};

/// Element offsets between consecutive problems of a strided batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmBatch {
    /// Number of problems (at least 1).
    pub count: usize,
    pub a: usize,
    pub b: usize,
    pub c: usize,
}

impl GemmBatch {
    /// One problem.
    pub fn single() -> Self {
        GemmBatch {
            count: 1,
            a: 0,
            b: 0,
            c: 0,
        }
    }

    /// Layout `l` of problem `i`.
    pub fn shift(l: MatLayout, stride: usize, i: usize) -> MatLayout {
        MatLayout {
            offset: l.offset + i * stride,
            ..l
        }
    }

    /// Checks that every problem's views lie inside their tensors (`numel`
    /// elements each: a, b, c) and that the outputs follow one another
    /// without overlapping (`c` at least one output's span apart), so the
    /// problems can run at once.
    pub fn check(
        &self,
        (c, a, b): (&MatLayout, &MatLayout, &MatLayout),
        (c_numel, a_numel, b_numel): (usize, usize, usize),
    ) -> Result<()> {
        if self.count == 0 {
            return Err(Error::Backend("a GEMM batch of 0 problems".into()));
        }
        let last = self.count - 1;
        for (name, l, stride, numel) in [
            ("a", a, self.a, a_numel),
            ("b", b, self.b, b_numel),
            ("c", c, self.c, c_numel),
        ] {
            let end = Self::shift(*l, stride, last).extent();
            if end > numel {
                return Err(Error::Backend(format!(
                    "GEMM batch {self:?}: problem {last}'s {name} {l:?} (+{}) ends at element {end} of {numel}",
                    last * stride
                )));
            }
        }
        let span = c.extent() - c.offset;
        if self.count > 1 && self.c < span {
            return Err(Error::Backend(format!(
                "GEMM batch {self:?}: outputs {c:?} span {span} elements, more than their stride {}",
                self.c
            )));
        }
        Ok(())
    }
}

/// [`Backend::gemm_batched`] as one [`Backend::gemm`] per problem.
pub fn gemm_each<B: Backend>(
    backend: &B,
    c: MatMut<'_, B>,
    a: Mat<'_, B>,
    b: Mat<'_, B>,
    batch: GemmBatch,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    batch.check((&c.l, &a.l, &b.l), (c.t.numel(), a.t.numel(), b.t.numel()))?;
    let MatMut { t: ct, l: cl } = c;
    for i in 0..batch.count {
        backend.gemm(
            MatMut {
                t: &mut *ct,
                l: GemmBatch::shift(cl, batch.c, i),
            },
            Mat {
                t: a.t,
                l: GemmBatch::shift(a.l, batch.a, i),
            },
            Mat {
                t: b.t,
                l: GemmBatch::shift(b.l, batch.b, i),
            },
            alpha,
            beta,
        )?;
    }
    Ok(())
}

/// The common stride of `offsets` (`offsets[i] = offsets[0] + i * stride`),
/// if they have one; a single offset has stride 0.
pub fn uniform_stride(offsets: &[usize]) -> Option<usize> {
    let (&first, rest) = offsets.split_first()?;
    let stride = rest.first().map_or(Some(0), |&o| o.checked_sub(first))?;
    offsets
        .iter()
        .enumerate()
        .all(|(i, &o)| o == first + i * stride)
        .then_some(stride)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn outputs_must_not_overlap_and_views_must_fit() {
        let a = MatLayout::row_major(4, 3);
        let b = MatLayout::block(0, 2, 3, 3).t(); // [3, 2]
        let c = MatLayout::row_major(4, 2);
        let batch = GemmBatch {
            count: 3,
            a: 0,
            b: 6,
            c: 8,
        };
        assert!(batch.check((&c, &a, &b), (24, 12, 18)).is_ok());
        // b's last problem ends past its tensor
        assert!(batch.check((&c, &a, &b), (24, 12, 17)).is_err());
        // outputs closer than one output apart
        let close = GemmBatch { c: 7, ..batch };
        assert!(close.check((&c, &a, &b), (24, 12, 18)).is_err());
        let none = GemmBatch { count: 0, ..batch };
        assert!(none.check((&c, &a, &b), (24, 12, 18)).is_err());
        assert!(GemmBatch::single().check((&c, &a, &b), (8, 12, 6)).is_ok());
    }

    #[test]
    fn stride_of_offsets() {
        assert_eq!(uniform_stride(&[]), None);
        assert_eq!(uniform_stride(&[7]), Some(0));
        assert_eq!(uniform_stride(&[3, 3, 3]), Some(0));
        assert_eq!(uniform_stride(&[2, 5, 8]), Some(3));
        assert_eq!(uniform_stride(&[2, 5, 9]), None);
        assert_eq!(uniform_stride(&[5, 2]), None);
    }

    proptest! {
        #[test]
        fn a_progression_has_its_stride(first in 0usize..1000, stride in 0usize..100, n in 1usize..8) {
            let offs: Vec<usize> = (0..n).map(|i| first + i * stride).collect();
            prop_assert_eq!(uniform_stride(&offs), Some(if n == 1 { 0 } else { stride }));
        }
    }
}
