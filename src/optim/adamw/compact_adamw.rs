//! AdamW's compact state, element by element: moments kept in F32, in BF16
//! (rounded to nearest even) or as 8-bit block-wise codes, and the weights
//! updated either in an F32 master or, with none, in BF16 by stochastic
//! rounding. This is the arithmetic of every device: the CPU reference
//! runs these functions, and the CUDA kernel (`adamw_compact` in
//! `optim/kernels/adamw_compact.cu`) makes the same IEEE operations in the
//! same order with no fused multiply-add, so the two agree bit for bit.
//!
//! **8-bit moments.** Each piece of a slot is cut into blocks of
//! [`Q8_BLOCK`] elements; a block keeps one F32 scale (the largest
//! magnitude of its moment) and a byte per element: the nearest of a fixed
//! set of levels, relative to the scale. The levels are 8-bit floats (three
//! mantissa bits, `(1 + k/8) · 2^e`), 127 magnitudes and a sign for the
//! first moment (down to 1.9e-5 of the scale), 255 magnitudes for the second
//! (down to 2.9e-10; a positive second moment never rounds to zero, so no
//! update divides by `eps` alone). The top level is exactly 1, so the
//! decoded block maximum is the scale itself and re-encoding decoded values
//! gives the same bytes (a checkpoint keeps decoded values: a resume is
//! bit-exact).
//!
//! **Stochastic rounding.** A BF16 weight without a master is rounded up or
//! down with the probability of its distance (unbiased), drawn from a
//! counter-based hash of the run's seed, the step, the slot and the
//! element: the same draw on every device and on every resume.

use super::adamw_step::AdamWStep;
use crate::backend::narrow::{bf16_nearest, bf16_value};

/// Elements of a piece per 8-bit block (one scale each).
pub const Q8_BLOCK: usize = 256;

/// Magnitude codes of the first moment (a sign bit beside them).
const SIGNED_CODES: u32 = 127;
/// Codes of the second moment.
const UNSIGNED_CODES: u32 = 255;

/// How a tensor of moments holds its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MomentCodec {
    F32,
    /// BF16, rounded to nearest even.
    Bf16,
    /// 8-bit block-wise codes ([`Q8_BLOCK`]) with an F32 scale per block.
    Q8,
}

/// The 8-bit blocks of a piece of `len` elements.
pub fn q8_blocks(len: usize) -> usize {
    len.div_ceil(Q8_BLOCK)
}

/// Level `code` (`0..=codes`) of an 8-bit set whose top code is level 1:
/// `(1 + m/8) · 2^(e - top_e)` with `t = code + 1`, `e = t / 8`, `m = t % 8`.
fn level(code: u32, top_e: u32) -> f32 {
    if code == 0 {
        return 0.0;
    }
    let t = code + 1;
    f32::from_bits(((t >> 3) + 127 - top_e) << 23 | (t & 7) << 20)
}

/// The exponent of the top level's set: the top code's `t / 8`.
fn top_exponent(codes: u32) -> u32 {
    (codes + 1) >> 3
}

/// The nearest level to `x` (in `[0, 1]`) among `0..=codes`, ties to the
/// lower: the number of midpoints between consecutive levels below `x`
/// (0 for zero, negative values and NaN). Level `c >= 1` has the bits `(c + 1 + 8·(127 − top_e)) << 20`
/// (nothing below the top three mantissa bits), so the highest level not
/// above `x` is read off `x`'s bits, and one midpoint decides between it
/// and the next: what a binary search over the midpoints finds (tested
/// below), in a few operations. The GPU kernel reads it the same way
/// (`q8_nearest` in `optim/kernels/adamw_compact.cu`).
fn nearest_level(x: f32, codes: u32) -> u32 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let base = 8 * (127 - top_exponent(codes) as i64) + 1;
    let below = ((x.to_bits() >> 20) as i64 - base).clamp(0, codes as i64) as u32;
    let above = (below + 1).min(codes);
    let top_e = top_exponent(codes);
    let mid = (level(below, top_e) + level(above, top_e)) * 0.5;
    if mid < x { above } else { below }
}

/// The first moment's byte for `m` in a block of largest magnitude `scale`:
/// the sign in bit 7, the nearest magnitude level below it.
pub fn q8_encode_signed(m: f32, scale: f32) -> u8 {
    if scale == 0.0 {
        return 0;
    }
    let mag = nearest_level(m.abs() / scale, SIGNED_CODES);
    let sign = if m < 0.0 && mag > 0 { 0x80 } else { 0 };
    (sign | mag) as u8
}

/// The value of a first-moment byte in a block of scale `scale`.
pub fn q8_decode_signed(code: u8, scale: f32) -> f32 {
    let v = level(u32::from(code & 0x7f), top_exponent(SIGNED_CODES)) * scale;
    if code & 0x80 != 0 { -v } else { v }
}

/// The second moment's byte for `v >= 0` in a block of largest value
/// `scale`: the nearest level, at least the smallest for a positive `v`.
pub fn q8_encode_unsigned(v: f32, scale: f32) -> u8 {
    if scale == 0.0 {
        return 0;
    }
    let c = nearest_level(v / scale, UNSIGNED_CODES);
    (if v > 0.0 { c.max(1) } else { c }) as u8
}

/// The value of a second-moment byte in a block of scale `scale`.
pub fn q8_decode_unsigned(code: u8, scale: f32) -> f32 {
    level(u32::from(code), top_exponent(UNSIGNED_CODES)) * scale
}

/// A 32-bit mix with good avalanche (Wellons' "lowbias32").
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The stochastic-rounding key of slot `slot` at 1-based `step` of a run
/// seeded `seed`: computed on the host, one per slot and step.
pub fn rounding_key(seed: u64, step: u32, slot: u32) -> u32 {
    let s = mix32(seed as u32 ^ mix32((seed >> 32) as u32));
    mix32(mix32(s ^ step) ^ slot.wrapping_mul(0x9e37_79b9))
}

/// The 16 random bits element `i` of a slot is rounded with under `key`.
pub fn rounding_bits(key: u32, i: u32) -> u32 {
    mix32(mix32(i ^ key) ^ key.rotate_left(16)) & 0xffff
}

/// `x` rounded to BF16 stochastically with the 16 random bits `r`: up (in
/// magnitude) with probability (the dropped bits) / 2^16. Values that are
/// not finite, and those that would round up to infinity, are truncated
/// instead.
pub fn bf16_stochastic(x: f32, r: u32) -> u16 {
    if !x.is_finite() {
        return bf16_nearest(x);
    }
    let bits = x.to_bits();
    let up = (bits.wrapping_add(r & 0xffff) >> 16) as u16;
    if up & 0x7f80 == 0x7f80 {
        (bits >> 16) as u16
    } else {
        up
    }
}

/// One AdamW update of one element: `(w, m, v)` after, in the operations
/// and order of `host_adamw::adamw_serial`.
pub fn adam_elem(w: f32, g: f32, m: f32, v: f32, hp: &AdamWStep, bc: (f32, f32)) -> [f32; 3] {
    let gi = g * hp.grad_scale;
    let m = hp.beta1 * m + (1.0 - hp.beta1) * gi;
    let v = hp.beta2 * v + (1.0 - hp.beta2) * gi * gi;
    let mh = m / bc.0;
    let vh = v / bc.1;
    let w = w - hp.lr * (mh / (vh.sqrt() + hp.eps) + hp.weight_decay * w);
    [w, m, v]
}

/// One tensor of moments as the CPU holds it: values (F32 or BF16) or codes
/// (Q8), each an f32, and for Q8 the scales of the piece's blocks.
pub struct MomentsMut<'a> {
    pub codec: MomentCodec,
    pub values: &'a mut [f32],
    pub scales: &'a mut [f32],
}

/// How the weights of a piece are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRounding {
    /// An F32 master, kept exactly.
    F32,
    /// BF16 weights with no master: stochastic rounding under this key.
    Stochastic(u32),
}

/// One piece's update on host slices: `w` (the piece's weights: F32, or
/// BF16 values with [`WeightRounding::Stochastic`]), `g` its gradient,
/// `first` the piece's first element in the slot (the rounding draws'
/// counter).
pub struct PieceUpdate<'a> {
    pub w: &'a mut [f32],
    pub rounding: WeightRounding,
    pub first: usize,
    pub g: &'a [f32],
    pub m: MomentsMut<'a>,
    pub v: MomentsMut<'a>,
    pub hp: AdamWStep,
}

/// Runs one piece's update, block by block ([`Q8_BLOCK`] elements).
pub fn update_piece(u: PieceUpdate<'_>) {
    let bc = u.hp.bias_corrections();
    let blocks = u.w.len().div_ceil(Q8_BLOCK);
    let (mut m_new, mut v_new) = ([0f32; Q8_BLOCK], [0f32; Q8_BLOCK]);
    for b in 0..blocks {
        let r = b * Q8_BLOCK..((b + 1) * Q8_BLOCK).min(u.w.len());
        for (j, i) in r.clone().enumerate() {
            let m = decode(&u.m, i, b, true);
            let v = decode(&u.v, i, b, false);
            let [w, m, v] = adam_elem(u.w[i], u.g[i], m, v, &u.hp, bc);
            u.w[i] = match u.rounding {
                WeightRounding::F32 => w,
                WeightRounding::Stochastic(key) => {
                    let r = rounding_bits(key, (u.first + i) as u32);
                    bf16_value(bf16_stochastic(w, r))
                }
            };
            (m_new[j], v_new[j]) = (m, v);
        }
        let m_scale = u.m.scales.get_mut(b);
        encode(u.m.values, m_scale, u.m.codec, r.clone(), &m_new, true);
        encode(
            u.v.values,
            u.v.scales.get_mut(b),
            u.v.codec,
            r,
            &v_new,
            false,
        );
    }
}

/// Element `i` (in block `b`) of `t`.
fn decode(t: &MomentsMut<'_>, i: usize, b: usize, signed: bool) -> f32 {
    match t.codec {
        MomentCodec::F32 | MomentCodec::Bf16 => t.values[i],
        MomentCodec::Q8 if signed => q8_decode_signed(t.values[i] as u8, t.scales[b]),
        MomentCodec::Q8 => q8_decode_unsigned(t.values[i] as u8, t.scales[b]),
    }
}

/// Stores a block (elements `r`) of new moments `new` in `codec`; Q8
/// writes the block's scale into `scale`.
fn encode(
    values: &mut [f32],
    scale: Option<&mut f32>,
    codec: MomentCodec,
    r: std::ops::Range<usize>,
    new: &[f32],
    signed: bool,
) {
    let new = &new[..r.len()];
    match codec {
        MomentCodec::F32 => values[r].copy_from_slice(new),
        MomentCodec::Bf16 => {
            for (x, &n) in values[r].iter_mut().zip(new) {
                *x = bf16_value(bf16_nearest(n));
            }
        }
        MomentCodec::Q8 => {
            let scale_value = new.iter().fold(0f32, |a, x| a.max(x.abs()));
            if let Some(s) = scale {
                *s = scale_value;
            }
            let scale = scale_value;
            for (x, &n) in values[r].iter_mut().zip(new) {
                let code = if signed {
                    q8_encode_signed(n, scale)
                } else {
                    q8_encode_unsigned(n, scale)
                };
                *x = f32::from(code);
            }
        }
    }
}

/// Encodes the F32 moments `values` of a piece in place as Q8 codes and
/// their blocks' `scales` (restoring a checkpoint's decoded values).
pub fn q8_encode_piece(values: &mut [f32], scales: &mut [f32], signed: bool) {
    for (b, scale) in scales.iter_mut().enumerate() {
        let r = b * Q8_BLOCK..((b + 1) * Q8_BLOCK).min(values.len());
        let new: Vec<f32> = values[r.clone()].to_vec();
        encode(values, Some(scale), MomentCodec::Q8, r, &new, signed);
    }
}

/// Decodes a piece's Q8 codes (as f32) with its blocks' scales.
pub fn q8_decode_piece(codes: &[f32], scales: &[f32], signed: bool) -> Vec<f32> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let s = scales[i / Q8_BLOCK];
            if signed {
                q8_decode_signed(c as u8, s)
            } else {
                q8_decode_unsigned(c as u8, s)
            }
        })
        .collect()
}

/// The hyper-parameters of the compact update's tests at `step`.
#[cfg(test)]
pub(crate) fn test_hp(step: u32) -> AdamWStep {
    AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale: 0.8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn hp(step: u32) -> AdamWStep {
        test_hp(step)
    }

    /// Values over many magnitudes, both signs, some zeros.
    fn spread(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 17 {
                0 => 0.0,
                _ => (rng.normal() * 10f64.powf(rng.uniform() * 8.0 - 6.0)) as f32,
            })
            .collect()
    }

    /// Every level of a set, written out from the definition independently.
    fn levels(codes: u32, top_e: i32) -> Vec<f32> {
        let mut out = vec![0.0];
        for c in 1..=codes {
            let t = c as i32 + 1;
            out.push((1.0 + (t % 8) as f32 / 8.0) * 2f32.powi(t / 8 - top_e));
        }
        out
    }

    /// The nearest level by scanning them all (ties to the lower).
    fn scan_nearest(x: f32, levels: &[f32]) -> u32 {
        let mut best = 0;
        for (c, l) in levels.iter().enumerate() {
            if (x - l).abs() < (x - levels[best]).abs() {
                best = c;
            }
        }
        best as u32
    }

    #[test]
    fn levels_rise_to_exactly_one() {
        for (codes, top_e) in [(SIGNED_CODES, 16), (UNSIGNED_CODES, 32)] {
            let want = levels(codes, top_e);
            let got: Vec<f32> = (0..=codes).map(|c| level(c, top_e as u32)).collect();
            assert_eq!(got, want);
            assert!(got.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(*got.last().unwrap(), 1.0);
        }
    }

    /// The binary search over the midpoints (the GPU kernel's `q8_nearest`).
    fn searched_nearest(x: f32, codes: u32) -> u32 {
        let top_e = top_exponent(codes);
        let (mut lo, mut hi) = (0u32, codes);
        while lo < hi {
            let j = (lo + hi) / 2;
            let mid = (level(j, top_e) + level(j + 1, top_e)) * 0.5;
            if mid < x {
                lo = j + 1;
            } else {
                hi = j;
            }
        }
        lo
    }

    /// The nearest level read off the bits equals the binary search's at
    /// every level and midpoint, one ulp either side of each, over a sweep
    /// of every 61st float in `[0, 1.01]`, and at ±0, a negative value,
    /// subnormals, values past 1, infinity and NaN.
    #[test]
    fn the_nearest_level_is_the_binary_searchs() {
        for codes in [SIGNED_CODES, UNSIGNED_CODES] {
            let top_e = top_exponent(codes);
            let mut xs: Vec<f32> = vec![0.0, -0.0, -1.0, f32::from_bits(1), 1e-40, 1.0, 1.5];
            xs.extend([f32::INFINITY, f32::MAX, f32::NAN]);
            for c in 0..codes {
                let mid = (level(c, top_e) + level(c + 1, top_e)) * 0.5;
                for y in [level(c, top_e), mid] {
                    xs.extend([y, y.next_down(), y.next_up()]);
                }
            }
            xs.extend((0..1.01f32.to_bits()).step_by(61).map(f32::from_bits));
            for x in xs {
                assert_eq!(
                    nearest_level(x, codes),
                    searched_nearest(x, codes),
                    "x = {x:e}"
                );
            }
        }
    }

    #[test]
    fn the_binary_search_finds_the_nearest_level_as_a_scan_does() {
        let mut rng = Rng::new(81);
        for (codes, top_e) in [(SIGNED_CODES, 16), (UNSIGNED_CODES, 32)] {
            let all = levels(codes, top_e);
            // random values, every level and every midpoint (a tie)
            let mut xs: Vec<f32> = (0..4000).map(|_| rng.uniform().powi(6) as f32).collect();
            xs.extend(all.iter().copied());
            xs.extend(all.windows(2).map(|w| (w[0] + w[1]) * 0.5));
            for x in xs {
                assert_eq!(searched_nearest(x, codes), scan_nearest(x, &all), "x = {x}");
            }
        }
    }

    /// A block's round trip: each value within half a level step (1/16 of
    /// it) or, below the smallest level, within that level of the scale; a
    /// positive second moment stays positive; decoding then encoding again
    /// gives the same bytes.
    #[test]
    fn q8_round_trip_error_is_bounded_per_block_and_reencoding_is_exact() {
        let mut rng = Rng::new(82);
        for signed in [true, false] {
            let mut values = spread(&mut rng, 3 * Q8_BLOCK + 45);
            if !signed {
                values.iter_mut().for_each(|x| *x = *x * *x);
            }
            let mut codes = values.clone();
            let mut scales = vec![0.0; q8_blocks(values.len())];
            q8_encode_piece(&mut codes, &mut scales, signed);
            let back = q8_decode_piece(&codes, &scales, signed);
            let smallest = if signed { level(1, 16) } else { level(1, 32) };
            for (i, (&x, &y)) in values.iter().zip(&back).enumerate() {
                let s = scales[i / Q8_BLOCK];
                let bound = (x.abs() / 16.0).max(smallest * s) * 1.0001;
                assert!((x - y).abs() <= bound, "{i}: {x} -> {y} (scale {s})");
                if !signed && x > 0.0 {
                    assert!(y > 0.0, "{i}: {x} decoded to zero");
                }
            }
            let mut again = back.clone();
            let mut scales_again = vec![0.0; scales.len()];
            q8_encode_piece(&mut again, &mut scales_again, signed);
            assert_eq!(again, codes);
            assert_eq!(scales_again, scales);
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let mut rng = Rng::new(83);
        for _ in 0..20 {
            let x = (rng.normal() * 10f64.powf(rng.uniform() * 6.0 - 3.0)) as f32;
            let down = bf16_value((x.to_bits() >> 16) as u16);
            let up = bf16_value(((x.to_bits() >> 16) + 1) as u16);
            let n = 20_000;
            let mut sum = 0f64;
            for step in 0..n {
                let r = rounding_bits(rounding_key(7, step, 3), 11);
                let y = bf16_value(bf16_stochastic(x, r));
                assert!(y == down || y == up, "{x} -> {y}");
                sum += y as f64;
            }
            let mean = sum / n as f64;
            // a Bernoulli draw between down and up: sd <= (up - down) / 2
            let se = (up - down).abs() as f64 / 2.0 / (n as f64).sqrt();
            assert!(
                (mean - x as f64).abs() < 4.0 * se,
                "{x}: mean {mean} (se {se})"
            );
        }
        // values already in BF16 stay as they are
        for x in [1.0f32, -0.5, 3.140625, 0.0] {
            assert_eq!(bf16_stochastic(x, 0xffff), bf16_nearest(x));
        }
        // and different slots, steps and elements draw differently
        let draws: std::collections::BTreeSet<u32> = (0..64)
            .map(|k| rounding_bits(rounding_key(1, 1 + k % 4, k / 16), k % 16))
            .collect();
        assert!(draws.len() > 60);
    }

    fn moments<'a>(
        codec: MomentCodec,
        values: &'a mut [f32],
        scales: &'a mut [f32],
    ) -> MomentsMut<'a> {
        MomentsMut {
            codec,
            values,
            scales,
        }
    }

    /// F32 moments and weights: the update is `adamw_serial`'s, bit for bit.
    #[test]
    fn f32_state_updates_as_the_reference_adamw() {
        let mut rng = Rng::new(84);
        let n = 700;
        let (w0, g) = (spread(&mut rng, n), spread(&mut rng, n));
        let (mut w1, mut m1, mut v1) = (w0.clone(), vec![0.0; n], vec![0.0; n]);
        let (mut w2, mut m2, mut v2) = (w0.clone(), vec![0.0; n], vec![0.0; n]);
        for step in 1..=3 {
            super::super::host_adamw::adamw_serial(&mut w1, &g, &mut m1, &mut v1, hp(step));
            update_piece(PieceUpdate {
                w: &mut w2,
                rounding: WeightRounding::F32,
                first: 0,
                g: &g,
                m: moments(MomentCodec::F32, &mut m2, &mut []),
                v: moments(MomentCodec::F32, &mut v2, &mut []),
                hp: hp(step),
            });
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&w1), bits(&w2));
        assert_eq!(bits(&m1), bits(&m2));
        assert_eq!(bits(&v1), bits(&v2));
    }

    /// Compact moments against the reference made another way: the F32
    /// update of the decoded state, then the new moments rounded (BF16 by
    /// `half`, Q8 by scanning the levels), the weights rounded by the draw.
    #[test]
    fn compact_state_updates_as_the_f32_update_of_its_decoded_values() {
        let mut rng = Rng::new(85);
        let n = 2 * Q8_BLOCK + 77;
        let g = spread(&mut rng, n);
        for codec in [MomentCodec::Bf16, MomentCodec::Q8] {
            let w0: Vec<f32> = spread(&mut rng, n)
                .iter()
                .map(|&x| bf16_value(bf16_nearest(x)))
                .collect();
            let (mut w, mut m, mut v) = (w0.clone(), vec![0.0; n], vec![0.0; n]);
            let blocks = if codec == MomentCodec::Q8 {
                q8_blocks(n)
            } else {
                0
            };
            let (mut ms, mut vs) = (vec![0.0; blocks], vec![0.0; blocks]);
            let (mut rw, mut rm, mut rv) = (w0.clone(), vec![0.0; n], vec![0.0; n]);
            for step in 1..=3 {
                let key = rounding_key(5, step, 2);
                update_piece(PieceUpdate {
                    w: &mut w,
                    rounding: WeightRounding::Stochastic(key),
                    first: 10,
                    g: &g,
                    m: moments(codec, &mut m, &mut ms),
                    v: moments(codec, &mut v, &mut vs),
                    hp: hp(step),
                });
                let mut f = rw.clone();
                super::super::host_adamw::adamw_serial(&mut f, &g, &mut rm, &mut rv, hp(step));
                for i in 0..n {
                    rw[i] = bf16_value(bf16_stochastic(f[i], rounding_bits(key, 10 + i as u32)));
                }
                reference_round(codec, &mut rm, true);
                reference_round(codec, &mut rv, false);
                let decoded = |x: &[f32], s: &[f32], signed| match codec {
                    MomentCodec::Q8 => q8_decode_piece(x, s, signed),
                    _ => x.to_vec(),
                };
                assert_eq!(w, rw, "{codec:?} step {step}");
                assert_eq!(decoded(&m, &ms, true), rm, "{codec:?} step {step}");
                assert_eq!(decoded(&v, &vs, false), rv, "{codec:?} step {step}");
            }
            assert!(w.iter().zip(&w0).filter(|(a, b)| a != b).count() > n / 2);
        }
    }

    /// Rounds moments in place as their codec keeps them, independently of
    /// `encode`.
    fn reference_round(codec: MomentCodec, x: &mut [f32], signed: bool) {
        match codec {
            MomentCodec::F32 => {}
            MomentCodec::Bf16 => x
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
            MomentCodec::Q8 => {
                let all = if signed {
                    levels(127, 16)
                } else {
                    levels(255, 32)
                };
                for block in x.chunks_mut(Q8_BLOCK) {
                    let s = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for v in block.iter_mut() {
                        if s == 0.0 {
                            *v = 0.0;
                            continue;
                        }
                        let mut c = scan_nearest(v.abs() / s, &all);
                        if !signed && *v > 0.0 {
                            c = c.max(1);
                        }
                        let y = all[c as usize] * s;
                        *v = if *v < 0.0 { -y } else { y };
                    }
                }
            }
        }
    }
}
