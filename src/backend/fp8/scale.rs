//! Tensor-wise scaling: one f32 scale per tensor, computed from the tensor
//! itself ("current scaling"), so that its largest magnitude lands on the
//! format's largest finite value.
//!
//! Why one scale per tensor: cuBLASLt's FP8 matmul on Hopper takes one
//! scale per operand natively (`CUBLASLT_MATMUL_DESC_A_SCALE_POINTER`,
//! `..._B_SCALE_POINTER`: a device pointer to one f32), so a tensor-wise
//! scale costs the GEMM nothing; finer (row- or block-wise) scales would
//! need the product rescaled outside the library.
//!
//! A tensor is stored as its codes `q = encode(x · scale)` and its
//! *inverse* scale `1 / scale`, which is what the GEMM multiplies by
//! (`c = alpha · inv_a · inv_b · Σ qa·qb + beta · c`).

use super::format::Fp8Format;

/// The largest magnitude of `values`: NaN when any value is NaN, ∞ when
/// any is infinite, 0 for none.
pub fn amax(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut m = 0.0f32;
    for x in values {
        if x.is_nan() {
            return f32::NAN;
        }
        m = m.max(x.abs());
    }
    m
}

/// The scale of a tensor of largest magnitude `amax` in `format`:
/// `format.max() / amax`; 1 for an all-zero tensor; NaN for a tensor with
/// a non-finite value (so the product is NaN and the step's non-finite
/// guard skips it, as an unscaled GEMM would propagate it); the largest
/// finite f32 where the quotient overflows (a tensor of tiny values).
pub fn scale_for(amax: f32, format: Fp8Format) -> f32 {
    if !amax.is_finite() {
        return f32::NAN;
    }
    if amax == 0.0 {
        return 1.0;
    }
    let s = format.max() / amax;
    if s.is_finite() { s } else { f32::MAX }
}

/// The value a device stores for `x` scaled by `scale`: the decoded code
/// of `x · scale` (the CPU reference keeps these values in its cells).
pub fn quantized(x: f32, scale: f32, format: Fp8Format) -> f32 {
    format.round(x * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amax_reads_magnitudes_and_poisons() {
        assert_eq!(amax([1.0, -3.0, 2.0]), 3.0);
        assert_eq!(amax([]), 0.0);
        assert!(amax([1.0, f32::NAN, 2.0]).is_nan());
        assert_eq!(amax([1.0, f32::NEG_INFINITY]), f32::INFINITY);
    }

    #[test]
    fn scale_maps_amax_to_the_format_max() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            assert_eq!(scale_for(0.0, f), 1.0);
            assert!(scale_for(f32::NAN, f).is_nan());
            assert!(scale_for(f32::INFINITY, f).is_nan());
            assert_eq!(scale_for(f32::from_bits(1), f), f32::MAX);
            for a in [1e-3f32, 0.7, 1.0, 3.5, 1e4] {
                let s = scale_for(a, f);
                assert_eq!(s, f.max() / a);
                // the largest element never saturates past max
                assert!(quantized(a, s, f).abs() <= f.max());
                assert!((quantized(a, s, f) - f.max()).abs() <= f.max() * 0.07);
            }
        }
    }
}
