//! The CPU reference's FP8 ops: exact emulation. A quantized tensor's cells
//! hold its codes' values (`Fp8Format::round` of the scaled source); the
//! GEMM multiplies those values in f32 (every product of two FP8 values is
//! exact in f32) and scales the sum by the two inverse scales.

use super::CpuBackend;
use super::cells::{data, data_mut};
use super::sgemm::sgemm;
use crate::backend::Tensor;
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8Quantize, amax, quantized, scale_for};
use crate::error::Result;

/// Quantizes the checked view `a.src` to `f` (`Fp8Quantize`).
pub(super) fn quantize(f: Fp8Format, a: Fp8Quantize<'_, CpuBackend>) -> Result<()> {
    let l = a.src.l;
    let (rs, cs) = l.strides();
    let src = data(a.src.t);
    let at = |i: usize, j: usize| src[l.offset + i * rs + j * cs];
    let m = amax(
        (0..l.rows)
            .flat_map(|i| (0..l.cols).map(move |j| (i, j)))
            .map(|(i, j)| at(i, j)),
    );
    let scale = scale_for(m, f);
    // [rows, cols]
    let dst = data_mut(a.dst);
    for i in 0..l.rows {
        for j in 0..l.cols {
            dst[i * l.cols + j] = quantized(at(i, j), scale, f);
        }
    }
    if let Some(t) = a.dst_t {
        // [cols, rows]
        let dt = data_mut(t);
        for i in 0..l.rows {
            for j in 0..l.cols {
                dt[j * l.rows + i] = quantized(at(i, j), scale, f);
            }
        }
    }
    data_mut(a.scale_inv)[0] = 1.0 / scale;
    Ok(())
}

/// The checked FP8 GEMM `a` (`Fp8Gemm`): the f32 GEMM of the operands'
/// values with `alpha · inv_a · inv_b`.
pub(super) fn gemm(a: Fp8Gemm<'_, CpuBackend>) -> Result<()> {
    let inv = |t: &Tensor<CpuBackend>| data(t)[0];
    let alpha = a.alpha * inv(a.a_scale_inv) * inv(a.b_scale_inv);
    sgemm(a.c, a.a, a.b, alpha, a.beta)
}
