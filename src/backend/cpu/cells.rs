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
        DType::F8E4M3 | DType::F8E5M2 => fp8_values(dtype, values)?,
    })
}

/// The values of an FP8 tensor, checked to be values of its format (what
/// `Backend::fp8_quantize` writes, or a device's FP8 tensor read back).
fn fp8_values(dtype: DType, values: &[f32]) -> Result<Vec<f32>> {
    let Some(f) = dtype.fp8_format() else {
        return Ok(values.to_vec());
    };
    for &x in values {
        if !x.is_nan() && f.round(x) != x {
            return Err(crate::Error::Backend(format!(
                "{x} is not a value of FP8 {}: FP8 tensors are written by `fp8_quantize`",
                f.name()
            )));
        }
    }
    Ok(values.to_vec())
}

/// Rounds the cells of view `l` to BF16 (to nearest even) where `dtype` is
/// BF16, or to the FP8 format (unscaled, saturating) of an FP8 dtype, as a
/// device stores what it writes into a narrower tensor; F32 cells stay as
/// they are.
pub(super) fn round_view(dtype: DType, d: &mut [f32], l: &MatLayout) {
    use crate::backend::narrow::{bf16_nearest, bf16_value};
    let round: fn(f32) -> f32 = match dtype {
        DType::BF16 => |x| bf16_value(bf16_nearest(x)),
        DType::F8E4M3 => |x| crate::backend::fp8::Fp8Format::E4M3.round(x),
        DType::F8E5M2 => |x| crate::backend::fp8::Fp8Format::E5M2.round(x),
        DType::F32 | DType::U8 => return,
    };
    let (rs, cs) = l.strides();
    for i in 0..l.rows {
        for j in 0..l.cols {
            let x = &mut d[l.offset + i * rs + j * cs];
            *x = round(*x);
        }
    }
}

/// The dot product of `a` and `b`.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
