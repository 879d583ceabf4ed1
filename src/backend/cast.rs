//! A tensor in another dtype: borrowed when it already is one, else a
//! converted copy.

use super::memory::Category;
use super::ops::Backend;
use super::tensor::{DType, Tensor, TensorRef};
use crate::error::Result;

/// `t` in `dtype`: borrowed when it already is, else a converted copy (category `Workspace`).
pub fn cast_ref<'a, B: Backend>(b: &B, t: &'a Tensor<B>, dtype: DType) -> Result<TensorRef<'a, B>> {
    if t.dtype() == dtype {
        return Ok(TensorRef::Borrowed(t));
    }
    Ok(TensorRef::Owned(cast(b, t, dtype, Category::Workspace)?))
}

/// A converted copy of `t` in `dtype`.
pub fn cast<B: Backend>(b: &B, t: &Tensor<B>, dtype: DType, cat: Category) -> Result<Tensor<B>> {
    // the copy writes every element: nothing to zero first
    let mut out = b.empty(t.shape(), dtype, cat)?;
    b.copy(out.mat_mut(), t.mat())?;
    Ok(out)
}
