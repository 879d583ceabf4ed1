//! A CPU tensor's cells: every element an f32 (narrower dtypes stored
//! exactly in them), read and written in place, rounded as a device
//! stores what it writes into a narrower tensor.

use crate::backend::{DType, MatLayout, Tensor, TensorDevice};
use crate::error::Result;

/// Host storage of a CPU tensor.
pub struct CpuStorage(pub(super) Vec<f32>);

/// A CPU tensor's cells.
pub(super) fn data<B: TensorDevice<Storage = CpuStorage>>(t: &Tensor<B>) -> &[f32] {
    &t.storage().0
}
/// A CPU tensor's cells, writable.
pub(super) fn data_mut<B: TensorDevice<Storage = CpuStorage>>(t: &mut Tensor<B>) -> &mut [f32] {
    &mut t.storage_mut().0
}

/// `values` as a tensor of `dtype` holds them: every cell is an f32, the
/// values of a BF16 tensor rounded to BF16 (to nearest even), those of an
/// 8-bit one checked to be its codes (the compact optimizer state; the CPU
/// computes in f32 and stores narrower values exactly).
pub fn stored(dtype: DType, values: &[f32]) -> Result<Vec<f32>> {
    use crate::backend::narrow::{bf16_nearest, bf16_value, codes_of};
    Ok(match dtype {
        DType::F32 => values.to_vec(),
        DType::BF16 => values
            .iter()
            .map(|&x| bf16_value(bf16_nearest(x)))
            .collect(),
        DType::U8 => codes_of(values)?.into_iter().map(f32::from).collect(),
    })
}

/// Rounds the cells of view `l` to BF16 (to nearest even) where `dtype` is
/// BF16, as a device stores what it writes into a BF16 tensor; F32 cells
/// stay as they are.
pub(super) fn round_view(dtype: DType, d: &mut [f32], l: &MatLayout) {
    use crate::backend::narrow::{bf16_nearest, bf16_value};
    if dtype != DType::BF16 {
        return;
    }
    let (rs, cs) = l.strides();
    for i in 0..l.rows {
        for j in 0..l.cols {
            let x = &mut d[l.offset + i * rs + j * cs];
            *x = bf16_value(bf16_nearest(*x));
        }
    }
}

/// The dot product of `a` and `b`.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
