//! The scales of an FP8 attention call (cuDNN's fused FP8 SDPA, which
//! takes every operand and output with a per-tensor scale fixed before the
//! kernel runs).
//!
//! The operands (Q, K, V in E4M3, dO in E5M2) are scaled from their own
//! amax, as the linear layers' are ([`scale_for`]). The kernel's outputs
//! and intermediates cannot be: their amax is known only after the call.
//! Instead of keeping an amax history per call ("delayed scaling"), each
//! gets the power of two that fits a bound which holds for any input of
//! those operands (exact arithmetic, widened by each operand's rounding):
//!
//! - P (softmax probabilities) ≤ 1;
//! - O = P·V is a convex combination of V's rows: |O| ≤ amax(V);
//! - dS = P ∘ (dO·Vᵀ − D)·scale with D = rowsum(dO ∘ O):
//!   |dS| ≤ scale·d·amax(dO)·(amax(V) + amax(O)), and the same bounds a
//!   row's Σⱼ|dSᵢⱼ| (P's row sums to 1);
//! - dQ = dS·K: |dQ| ≤ that row bound · amax(K);
//! - dK = dSᵀ·Q, dV = Pᵀ·dO: a column sums at most `sq` rows, so
//!   |dK| ≤ sq · bound(dS) · amax(Q), |dV| ≤ sq · amax(dO).
//!
//! A bound is loose by up to `sq` (dK, dV) or `d` (dS): the outputs are
//! E5M2, whose 32 binades leave room for that, and a power-of-two scale
//! makes the dequantized O exact in BF16 (requantized for the backward,
//! it gives back the same codes).

use super::format::Fp8Format;
use super::scale::scale_for;

/// The largest magnitudes of an attention call's operands (as they are
/// before quantization); `o` is unused (O's scale follows from V's).
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnAmax {
    pub q: f32,
    pub k: f32,
    pub v: f32,
    pub d_o: f32,
    pub o: f32,
}

/// Every scale of an FP8 attention call: the value each tensor is
/// multiplied by before it is rounded to FP8 (its descale is the inverse),
/// and the bounds the derived ones were set from.
#[derive(Debug, Clone, Copy)]
pub struct AttnScales {
    pub q: f32,
    pub k: f32,
    pub v: f32,
    pub d_o: f32,
    /// The probabilities' (E4M3).
    pub s: f32,
    pub o: f32,
    /// dS's (E5M2).
    pub dp: f32,
    pub dq: f32,
    pub dk: f32,
    pub dv: f32,
    pub bound_o: f32,
    pub bound_ds: f32,
    pub bound_dq: f32,
    pub bound_dk: f32,
    pub bound_dv: f32,
}

/// The largest power of two `p` with `bound · p ≤ max` (1 for a zero or
/// non-finite bound).
pub fn pow2_scale(bound: f32, max: f32) -> f32 {
    if !(bound.is_finite() && bound > 0.0) {
        return 1.0;
    }
    let e = (max / bound).log2().floor().clamp(-126.0, 127.0);
    let p = 2f32.powi(e as i32);
    // log2 can round up across a power of two
    if bound * p > max { p / 2.0 } else { p }
}

/// A rounded operand may exceed its amax by one relative step.
fn widened(amax: f32, f: Fp8Format) -> f32 {
    amax * (1.0 + 2f32.powi(-(f.mantissa_bits() as i32)))
}

/// The scales of a call of `sq` query rows at head dim `d` with softmax
/// scale `scale` (module docs).
pub fn scales(a: &AttnAmax, sq: usize, d: usize, scale: f32) -> AttnScales {
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let (q, k, v) = (widened(a.q, e4), widened(a.k, e4), widened(a.v, e4));
    let d_o = widened(a.d_o, e5);
    let bound_o = widened(v, e4);
    let bound_ds = scale * d as f32 * d_o * (v + bound_o);
    let bound_dq = widened(bound_ds, e5) * k;
    let bound_dk = sq as f32 * widened(bound_ds, e5) * q;
    let bound_dv = sq as f32 * widened(1.0, e4) * d_o;
    AttnScales {
        q: scale_for(a.q, e4),
        k: scale_for(a.k, e4),
        v: scale_for(a.v, e4),
        d_o: scale_for(a.d_o, e5),
        s: pow2_scale(1.0, e4.max()),
        o: pow2_scale(bound_o, e4.max()),
        dp: pow2_scale(bound_ds, e5.max()),
        dq: pow2_scale(bound_dq, e5.max()),
        dk: pow2_scale(bound_dk, e5.max()),
        dv: pow2_scale(bound_dv, e5.max()),
        bound_o,
        bound_ds,
        bound_dq,
        bound_dk,
        bound_dv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_scale_is_the_largest_power_that_fits() {
        for bound in [1e-6f32, 0.3, 1.0, 1.5, 448.0, 3e4, 1e9] {
            for max in [448.0f32, 57344.0] {
                let p = pow2_scale(bound, max);
                assert_eq!(p.log2().fract(), 0.0, "{p} is a power of two");
                assert!(bound * p <= max);
                assert!(bound * p * 2.0 > max, "{bound} {max} {p}");
            }
        }
        assert_eq!(pow2_scale(0.0, 448.0), 1.0);
        assert_eq!(pow2_scale(f32::NAN, 448.0), 1.0);
    }

    #[test]
    fn probabilities_fill_e4m3_to_256() {
        let f = scales(&AttnAmax::default(), 16, 128, 0.088);
        assert_eq!(f.s, 256.0);
    }

    /// Outputs of random attention problems stay inside their bounds.
    #[test]
    fn bounds_hold_on_small_problems() {
        let (sq, d) = (12, 8);
        let mut x = 0x9e3779b97f4a7c15u64;
        let mut r = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for round in 0..20 {
            let amp = 1.0 + round as f32;
            let draw = |r: &mut dyn FnMut() -> f32, n: usize, a: f32| -> Vec<f32> {
                (0..n).map(|_| r() * a).collect()
            };
            let (q, k, v, d_o) = (
                draw(&mut r, sq * d, amp),
                draw(&mut r, sq * d, amp),
                draw(&mut r, sq * d, 1.0),
                draw(&mut r, sq * d, 1e-2),
            );
            let scale = 1.0 / (d as f32).sqrt();
            let dot = |a: &[f32], i: usize, b: &[f32], j: usize| -> f32 {
                (0..d).map(|c| a[i * d + c] * b[j * d + c]).sum()
            };
            // causal softmax, O, D, dS, dQ, dK, dV in f32
            let mut p = vec![0f32; sq * sq];
            for i in 0..sq {
                let m = (0..=i).map(|j| dot(&q, i, &k, j) * scale).fold(f32::MIN, f32::max);
                let z: f32 = (0..=i).map(|j| (dot(&q, i, &k, j) * scale - m).exp()).sum();
                for j in 0..=i {
                    p[i * sq + j] = (dot(&q, i, &k, j) * scale - m).exp() / z;
                }
            }
            let mat = |a: &[f32], b: &[f32], t: bool| -> Vec<f32> {
                let mut c = vec![0f32; sq * d];
                for i in 0..sq {
                    for j in 0..sq {
                        let w = if t { a[j * sq + i] } else { a[i * sq + j] };
                        for e in 0..d {
                            c[i * d + e] += w * b[j * d + e];
                        }
                    }
                }
                c
            };
            let o = mat(&p, &v, false);
            let mut ds = vec![0f32; sq * sq];
            for i in 0..sq {
                let di = dot(&d_o, i, &o, i);
                for j in 0..=i {
                    ds[i * sq + j] = p[i * sq + j] * (dot(&d_o, i, &v, j) - di) * scale;
                }
            }
            let (dq, dk, dv) = (mat(&ds, &k, false), mat(&ds, &q, true), mat(&p, &d_o, true));
            let am = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let a = AttnAmax {
                q: am(&q),
                k: am(&k),
                v: am(&v),
                d_o: am(&d_o),
                o: 0.0,
            };
            let f = scales(&a, sq, d, scale);
            assert!(am(&o) <= f.bound_o);
            assert!(am(&ds) <= f.bound_ds);
            assert!(am(&dq) <= f.bound_dq);
            assert!(am(&dk) <= f.bound_dk);
            assert!(am(&dv) <= f.bound_dv);
        }
    }
}
