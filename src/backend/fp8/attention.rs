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

/// Which of attention's passes run on cuDNN's FP8 graphs (`--precision
/// fp8-attention`: both; `fp8-attention-bwd`: the backward, after a BF16
/// forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Passes {
    pub forward: bool,
    pub backward: bool,
}

impl Fp8Passes {
    /// Whether the forward (`bwd` false) or the backward runs in FP8.
    pub fn runs(self, bwd: bool) -> bool {
        if bwd { self.backward } else { self.forward }
    }

    /// Whether either pass does.
    pub fn any(self) -> bool {
        self.forward || self.backward
    }
}

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
/// non-finite bound): the power of `max / bound`'s exponent, halved where
/// the quotient rounded up across it. Exact f32 steps only, as the device
/// computes it (`fp8_attn_scales`).
pub fn pow2_scale(bound: f32, max: f32) -> f32 {
    if !(bound.is_finite() && bound > 0.0) {
        return 1.0;
    }
    let r = max / bound;
    if !r.is_normal() {
        return if r > 1.0 {
            2f32.powi(127)
        } else {
            2f32.powi(-126)
        };
    }
    let p = f32::from_bits(r.to_bits() & 0x7f80_0000);
    if bound * p > max { p * 0.5 } else { p }
}

/// A rounded operand may exceed its amax by one relative step.
fn widened(amax: f32, f: Fp8Format) -> f32 {
    amax * (1.0 + 2f32.powi(-(f.mantissa_bits() as i32)))
}

/// The amaxes the device recovers from its operands' inverse scales
/// (`1 / scale_for(amax)`, what its quantizer leaves): `inv · max`.
pub fn amax_of_inverse(inv: [f32; 4]) -> AttnAmax {
    let (e4, e5) = (Fp8Format::E4M3.max(), Fp8Format::E5M2.max());
    AttnAmax {
        q: inv[0] * e4,
        k: inv[1] * e4,
        v: inv[2] * e4,
        d_o: inv[3] * e5,
        o: 0.0,
    }
}

/// The scales of a call of `sq` query rows at head dim `d` with softmax
/// scale `scale` (module docs).
pub fn scales(a: &AttnAmax, sq: usize, d: usize, scale: f32) -> AttnScales {
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let (q, k, v) = (widened(a.q, e4), widened(a.k, e4), widened(a.v, e4));
    let d_o = widened(a.d_o, e5);
    let bound_o = widened(v, e4);
    let bound_ds = scale * d as f32 * d_o * (v + bound_o); // left to right, as the device
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

/// One head-dim-`d` causal attention problem on the CPU, token rows
/// `[s, h, d]` (`hq` query heads over `hkv` key/value heads).
pub struct AttnProblem<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub d_o: &'a [f32],
    pub s: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub scale: f32,
}

/// What [`emulate`] returns: O, the LSE (`[s, hq]`, natural log), dQ, dK,
/// dV, each dequantized to f32.
pub struct AttnOutputs {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// The FP8 attention arithmetic on the CPU, step by step as the fused
/// kernels compute it (module docs of `cudnn::sdpa_fp8`; the forward's
/// probabilities rounded before their normalization, as flash attention
/// keeps them, the backward's after it): operands rounded
/// with their scales, the scales of [`scales`] from the inverse scales
/// the device's quantizer leaves, f32 math between the roundings of P, O,
/// dS and the gradients. The fused kernels accumulate in another order, so
/// a value near a rounding boundary may land one code apart: the oracle of
/// the GPU's FP8 attention within FP8's resolution, not to the bit.
pub fn emulate(p: &AttnProblem<'_>) -> AttnOutputs {
    emulate_with(p, &device_scales(p))
}

/// The scales the device sets for `p`: from its operands' inverse scales
/// (`1 / scale_for(amax)`, what the quantizer leaves).
pub fn device_scales(p: &AttnProblem<'_>) -> AttnScales {
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let am = |x: &[f32]| super::scale::amax(x.iter().copied());
    let inv = |x: &[f32], f: Fp8Format| 1.0 / scale_for(am(x), f);
    let inv = [inv(p.q, e4), inv(p.k, e4), inv(p.v, e4), inv(p.d_o, e5)];
    scales(&amax_of_inverse(inv), p.s, p.d, p.scale)
}

/// [`emulate`] with the scales `f` (for comparing scale rules).
pub fn emulate_with(p: &AttnProblem<'_>, f: &AttnScales) -> AttnOutputs {
    let both = Fp8Passes {
        forward: true,
        backward: true,
    };
    emulate_passes(p, f, both)
}

/// [`emulate_with`] where only `passes` run in FP8: a pass that does not
/// is exact f32 attention (`fp8-attention-bwd`: the exact forward's O and
/// LSE feed the FP8 backward, as the BF16 forward's do on the device).
pub fn emulate_passes(p: &AttnProblem<'_>, f: &AttnScales, passes: Fp8Passes) -> AttnOutputs {
    let plain = (!passes.forward || !passes.backward).then(|| exact(p));
    let ops = Quantized::of(p, f);
    let (o, lse) = match (passes.forward, &plain) {
        (false, Some(e)) => (e.o.clone(), e.lse.clone()),
        _ => forward_fp8(p, &ops, f),
    };
    let (dq, dk, dv) = match (passes.backward, plain) {
        (false, Some(e)) => (e.dq, e.dk, e.dv),
        _ => backward_fp8(p, &ops, f, &o, &lse),
    };
    AttnOutputs { o, lse, dq, dk, dv }
}

/// The operands rounded with their scales, dequantized: round(x · scale) /
/// scale.
struct Quantized {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
}

impl Quantized {
    fn of(p: &AttnProblem<'_>, f: &AttnScales) -> Quantized {
        let deq = |x: &[f32], sc: f32, fmt: Fp8Format| -> Vec<f32> {
            let i = 1.0 / sc;
            x.iter().map(|&v| fmt.round(v * sc) * i).collect()
        };
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        Quantized {
            q: deq(p.q, f.q, e4),
            k: deq(p.k, f.k, e4),
            v: deq(p.v, f.v, e4),
            d_o: deq(p.d_o, f.d_o, e5),
        }
    }
}

/// `x` rounded to `fmt` under `scale`, dequantized.
fn round(x: f32, scale: f32, fmt: Fp8Format) -> f32 {
    fmt.round(x * scale) / scale
}

/// Head `h`'s row `i` of the scores against the keys up to it (causal):
/// `(q·k) · scale`, f32.
fn scores(p: &AttnProblem<'_>, x: &Quantized, h: usize, i: usize) -> Vec<f32> {
    let (d, kh) = (p.d, h / (p.hq / p.hkv));
    let qi = (i * p.hq + h) * d;
    (0..=i)
        .map(|j| {
            let kj = (j * p.hkv + kh) * d;
            let dot: f32 = (0..d).map(|c| x.q[qi + c] * x.k[kj + c]).sum();
            dot * p.scale
        })
        .collect()
}

/// The FP8 forward: O (`[s, hq, d]`, rounded to E4M3) and the LSE. The
/// probabilities are rounded before their normalization, as flash
/// attention keeps them (exp(s − max) ≤ 1, the row's sum in f32).
fn forward_fp8(p: &AttnProblem<'_>, x: &Quantized, f: &AttnScales) -> (Vec<f32>, Vec<f32>) {
    let (s, d, hq, hkv) = (p.s, p.d, p.hq, p.hkv);
    let e4 = Fp8Format::E4M3;
    let (mut out, mut lses) = (vec![0f32; s * hq * d], vec![0f32; s * hq]);
    for h in 0..hq {
        let kh = h / (hq / hkv);
        for i in 0..s {
            let sc = scores(p, x, h, i);
            let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = sc.iter().map(|v| (v - m).exp()).sum();
            lses[i * hq + h] = m + z.ln();
            let mut o = vec![0f32; d];
            for (j, &v) in sc.iter().enumerate() {
                let w = round((v - m).exp(), f.s, e4);
                let vj = (j * hkv + kh) * d;
                for (oc, &vc) in o.iter_mut().zip(&x.v[vj..vj + d]) {
                    *oc += w * vc;
                }
            }
            let qi = (i * hq + h) * d;
            for (dst, &oc) in out[qi..qi + d].iter_mut().zip(&o) {
                *dst = round(oc / z, f.o, e4);
            }
        }
    }
    (out, lses)
}

/// The FP8 backward from the forward's `o` (requantized to E4M3, as the
/// device does) and `lse`: dQ, dK, dV rounded to E5M2. The probabilities
/// are recomputed normalized (exp(s − LSE)) and rounded to E4M3 for dV;
/// dS is rounded to E5M2.
fn backward_fp8(
    p: &AttnProblem<'_>,
    x: &Quantized,
    f: &AttnScales,
    o: &[f32],
    lse: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (s, d, hq, hkv) = (p.s, p.d, p.hq, p.hkv);
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let o: Vec<f32> = o.iter().map(|&v| round(v, f.o, e4)).collect();
    let dot = |a: &[f32], i: usize, b: &[f32], j: usize| -> f32 {
        (0..d).map(|c| a[i + c] * b[j + c]).sum()
    };
    // f32 sums before the gradients' rounding
    let mut dq = vec![0f32; s * hq * d];
    let (mut dk, mut dv) = (vec![0f32; s * hkv * d], vec![0f32; s * hkv * d]);
    for h in 0..hq {
        let kh = h / (hq / hkv);
        for i in 0..s {
            let qi = (i * hq + h) * d;
            let l = lse[i * hq + h];
            let di = dot(&x.d_o, qi, &o, qi);
            for (j, v) in scores(p, x, h, i).into_iter().enumerate() {
                let (kj, pj) = ((j * hkv + kh) * d, (v - l).exp());
                let ds = round(pj * (dot(&x.d_o, qi, &x.v, kj) - di) * p.scale, f.dp, e5);
                let p8 = round(pj, f.s, e4);
                for c in 0..d {
                    dq[qi + c] += ds * x.k[kj + c];
                    dk[kj + c] += ds * x.q[qi + c];
                    dv[kj + c] += p8 * x.d_o[qi + c];
                }
            }
        }
    }
    let fin = |g: Vec<f32>, sc: f32| g.into_iter().map(|v| round(v, sc, e5)).collect();
    (fin(dq, f.dq), fin(dk, f.dk), fin(dv, f.dv))
}

/// Causal attention and its gradients in f32, no roundings (what the
/// emulation's roundings are measured against).
pub fn exact(p: &AttnProblem<'_>) -> AttnOutputs {
    let (s, d, hq, hkv) = (p.s, p.d, p.hq, p.hkv);
    let at = |h: usize, t: usize, heads: usize| (t * heads + h) * d;
    let dot = |a: &[f32], i: usize, b: &[f32], j: usize| -> f32 {
        (0..d).map(|c| a[i + c] * b[j + c]).sum()
    };
    let mut o = AttnOutputs {
        o: vec![0.0; s * hq * d],
        lse: vec![0.0; s * hq],
        dq: vec![0.0; s * hq * d],
        dk: vec![0.0; s * hkv * d],
        dv: vec![0.0; s * hkv * d],
    };
    for h in 0..hq {
        let kh = h / (hq / hkv);
        for i in 0..s {
            let qi = at(h, i, hq);
            let sc: Vec<f32> = (0..=i)
                .map(|j| dot(p.q, qi, p.k, at(kh, j, hkv)) * p.scale)
                .collect();
            let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = m + sc.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
            o.lse[i * hq + h] = lse;
            let prob: Vec<f32> = sc.iter().map(|x| (x - lse).exp()).collect();
            for (j, &w) in prob.iter().enumerate() {
                for c in 0..d {
                    o.o[qi + c] += w * p.v[at(kh, j, hkv) + c];
                }
            }
            let di = dot(p.d_o, qi, &o.o, qi);
            for (j, &pj) in prob.iter().enumerate() {
                let kj = at(kh, j, hkv);
                let ds = pj * (dot(p.d_o, qi, p.v, kj) - di) * p.scale;
                for c in 0..d {
                    o.dq[qi + c] += ds * p.k[kj + c];
                    o.dk[kj + c] += ds * p.q[qi + c];
                    o.dv[kj + c] += pj * p.d_o[qi + c];
                }
            }
        }
    }
    o
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

    /// The emulation stays within FP8's resolution of the exact f32
    /// attention (O within E4M3's, the gradients within E5M2's), and its
    /// LSE (of FP8 scores) within a few percent.
    #[test]
    fn emulation_tracks_exact_attention() {
        let (s, hq, hkv, d) = (24, 4, 2, 16);
        let mut x = 0x2545f4914f6cdd1du64;
        let mut r = |n: usize, a: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
                })
                .collect()
        };
        let (q, k, v, d_o) = (
            r(s * hq * d, 2.0),
            r(s * hkv * d, 2.0),
            r(s * hkv * d, 1.0),
            r(s * hq * d, 1e-3),
        );
        let p = AttnProblem {
            q: &q,
            k: &k,
            v: &v,
            d_o: &d_o,
            s,
            hq,
            hkv,
            d,
            scale: 0.25,
        };
        let got = emulate(&p);
        // the exact one: the same loops without roundings
        let exact = exact(&p);
        let rel = |a: &[f32], b: &[f32]| -> f32 {
            let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
            let den: f32 = b.iter().map(|y| y * y).sum();
            (num / den).sqrt()
        };
        assert!(rel(&got.o, &exact.o) < 0.06, "O {}", rel(&got.o, &exact.o));
        assert!(rel(&got.lse, &exact.lse) < 0.05);
        for (name, a, b) in [
            ("dQ", &got.dq, &exact.dq),
            ("dK", &got.dk, &exact.dk),
            ("dV", &got.dv, &exact.dv),
        ] {
            assert!(rel(a, b) < 0.15, "{name} {}", rel(a, b));
        }
        // the backward alone in FP8: the exact forward's O and LSE, FP8
        // gradients (the rounding errors of both passes' gradients are
        // of one size, not the same values)
        let bwd = Fp8Passes {
            forward: false,
            backward: true,
        };
        let alone = emulate_passes(&p, &device_scales(&p), bwd);
        assert_eq!((&alone.o, &alone.lse), (&exact.o, &exact.lse));
        for (name, a, both, b) in [
            ("dQ", &alone.dq, &got.dq, &exact.dq),
            ("dK", &alone.dk, &got.dk, &exact.dk),
            ("dV", &alone.dv, &got.dv, &exact.dv),
        ] {
            let e = rel(a, b);
            assert!(e > 1e-3 && e < 0.15, "{name} {e}");
            assert!(a != both, "{name}: the forward's O changed nothing");
        }
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
                let m = (0..=i)
                    .map(|j| dot(&q, i, &k, j) * scale)
                    .fold(f32::MIN, f32::max);
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
