//! The formats against an independent reference: every code's value from
//! its bit fields in f64, and the encoder against a brute-force nearest
//! search over every finite code.

use super::*;
use proptest::prelude::*;

const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

/// (exponent bits, mantissa bits, bias, has infinities) of a format, as
/// the OCP specification tabulates them.
fn fields(f: Fp8Format) -> (u32, u32, i32, bool) {
    match f {
        Fp8Format::E4M3 => (4, 3, 7, false),
        Fp8Format::E5M2 => (5, 2, 15, true),
    }
}

/// What a code means, read from its bit fields with f64 arithmetic.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Meaning {
    Finite(f64),
    Inf(bool),
    Nan,
}

fn meaning(f: Fp8Format, code: u8) -> Meaning {
    let (eb, mb, bias, has_inf) = fields(f);
    let negative = code >> 7 == 1;
    let e = (code >> mb) & ((1u8 << eb) - 1);
    let m = code & ((1u8 << mb) - 1);
    let all_ones_e = e == (1u8 << eb) - 1;
    if has_inf && all_ones_e {
        return if m == 0 {
            Meaning::Inf(negative)
        } else {
            Meaning::Nan
        };
    }
    if !has_inf && all_ones_e && m == (1u8 << mb) - 1 {
        return Meaning::Nan;
    }
    let frac = m as f64 / 2f64.powi(mb as i32);
    let v = if e == 0 {
        frac * 2f64.powi(1 - bias)
    } else {
        (1.0 + frac) * 2f64.powi(e as i32 - bias)
    };
    Meaning::Finite(if negative { -v } else { v })
}

/// Every finite code with its value, sorted by value (-0 kept out: +0
/// stands for zero).
fn finite_codes(f: Fp8Format) -> Vec<(u8, f64)> {
    let mut v: Vec<(u8, f64)> = (0..=255u8)
        .filter(|&c| c != 0x80)
        .filter_map(|c| match meaning(f, c) {
            Meaning::Finite(x) => Some((c, x)),
            _ => None,
        })
        .collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    v
}

/// The nearest finite code to `x` (ties to the code whose mantissa is
/// even), saturating beyond the largest; by searching every code.
fn brute_encode(f: Fp8Format, x: f32) -> Meaning {
    if x.is_nan() {
        return Meaning::Nan;
    }
    let x = x as f64;
    let codes = finite_codes(f);
    let max = codes.last().map(|c| c.1).unwrap_or(0.0);
    if x.abs() >= max {
        return Meaning::Finite(max.copysign(x));
    }
    let mut best: Option<(u8, f64)> = None;
    for &(c, v) in &codes {
        let better = match best {
            None => true,
            Some((bc, bv)) => {
                let (d, bd) = ((v - x).abs(), (bv - x).abs());
                d < bd || (d == bd && c % 2 == 0 && bc % 2 == 1)
            }
        };
        if better {
            best = Some((c, v));
        }
    }
    let v = best.map(|b| b.1).unwrap_or(0.0);
    // a zero keeps the sign of x
    Meaning::Finite(if v == 0.0 { 0f64.copysign(x) } else { v })
}

fn encoded(f: Fp8Format, x: f32) -> Meaning {
    meaning(f, f.encode(x))
}

fn same(a: Meaning, b: Meaning) -> bool {
    match (a, b) {
        (Meaning::Finite(x), Meaning::Finite(y)) => {
            x == y && x.is_sign_negative() == y.is_sign_negative()
        }
        _ => a == b,
    }
}

#[test]
fn every_code_decodes_as_its_bit_fields_say() {
    for f in FORMATS {
        for c in 0..=255u8 {
            let got = f.decode(c);
            match meaning(f, c) {
                Meaning::Nan => assert!(got.is_nan(), "{f:?} {c:#04x}"),
                Meaning::Inf(neg) => {
                    assert!(got.is_infinite() && got.is_sign_negative() == neg)
                }
                Meaning::Finite(v) => assert_eq!(got as f64, v, "{f:?} {c:#04x}"),
            }
        }
    }
}

#[test]
fn published_constants() {
    assert_eq!(Fp8Format::E4M3.decode(Fp8Format::E4M3.max_code()), 448.0);
    assert_eq!(Fp8Format::E5M2.decode(Fp8Format::E5M2.max_code()), 57344.0);
    assert_eq!(Fp8Format::E4M3.decode(1), 2f32.powi(-9));
    assert_eq!(Fp8Format::E5M2.decode(1), 2f32.powi(-16));
    assert!(Fp8Format::E4M3.decode(0x7F).is_nan() && Fp8Format::E4M3.decode(0xFF).is_nan());
    assert_eq!(Fp8Format::E5M2.decode(0x7C), f32::INFINITY);
    assert_eq!(Fp8Format::E5M2.decode(0xFC), f32::NEG_INFINITY);
    // e4m3fn has no infinity: 0x78 is 256
    assert_eq!(Fp8Format::E4M3.decode(0x78), 256.0);
    for f in FORMATS {
        assert_eq!(f.max(), f.decode(f.max_code()));
        let codes = finite_codes(f);
        assert_eq!(codes.last().unwrap().1, f.max() as f64);
    }
}

#[test]
fn every_code_value_encodes_to_itself() {
    for f in FORMATS {
        for c in 0..=255u8 {
            let v = f.decode(c);
            if v.is_finite() {
                assert_eq!(f.encode(v), c, "{f:?} {c:#04x} = {v}");
            }
        }
    }
}

#[test]
fn midpoints_round_to_the_even_code() {
    for f in FORMATS {
        let codes = finite_codes(f);
        for w in codes.windows(2) {
            let ((c0, v0), (c1, v1)) = (w[0], w[1]);
            let mid = (v0 + v1) / 2.0;
            // every midpoint of two fp8 values is exact in f32
            assert_eq!(mid as f32 as f64, mid);
            let want = if c0 % 2 == 0 { v0 } else { v1 };
            let _ = c1;
            let got = f.decode(f.encode(mid as f32)) as f64;
            assert_eq!(got, want, "{f:?} midpoint {mid} of {v0} and {v1}");
            assert!(same(encoded(f, mid as f32), brute_encode(f, mid as f32)));
            // just off the midpoint rounds to the nearer side
            let below = f32::from_bits((mid as f32).to_bits() - 1);
            let above = f32::from_bits((mid as f32).to_bits() + 1);
            for x in [below, above] {
                assert!(same(encoded(f, x), brute_encode(f, x)), "{f:?} {x}");
            }
        }
    }
}

#[test]
fn saturates_beyond_max_and_keeps_nan() {
    for f in FORMATS {
        for x in [f.max() * 1.01, f.max() * 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(f.decode(f.encode(x)), f.max(), "{f:?} {x}");
            assert_eq!(f.decode(f.encode(-x)), -f.max(), "{f:?} {x}");
        }
        assert!(f.decode(f.encode(f32::NAN)).is_nan());
        assert!(f.decode(f.encode(-f32::NAN)).is_nan());
    }
}

#[test]
fn tiny_values_and_subnormals() {
    for f in FORMATS {
        let smallest = f.decode(1);
        let xs = [
            0.0,
            -0.0,
            f32::from_bits(1),
            f32::MIN_POSITIVE,
            smallest / 2.0,
            smallest / 2.0 * 1.0001,
            smallest * 0.49,
            smallest * 1.5,
            smallest * 2.5,
            smallest * 3.5,
            smallest * 7.5,
        ];
        for x in xs {
            for x in [x, -x] {
                assert!(same(encoded(f, x), brute_encode(f, x)), "{f:?} {x:e}");
            }
        }
    }
}

proptest! {
    #[test]
    fn random_floats_match_the_brute_force_search(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        for f in FORMATS {
            prop_assert!(same(encoded(f, x), brute_encode(f, x)), "{:?} {:e}", f, x);
        }
    }

    #[test]
    fn in_range_floats_match_the_brute_force_search(x in -60000.0f32..60000.0) {
        for f in FORMATS {
            prop_assert!(same(encoded(f, x), brute_encode(f, x)), "{:?} {}", f, x);
        }
    }

    #[test]
    fn rounding_is_monotone_and_idempotent(a in -500.0f32..500.0, b in -500.0f32..500.0) {
        for f in FORMATS {
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(f.round(lo) <= f.round(hi));
            prop_assert_eq!(f.round(f.round(a)), f.round(a));
        }
    }
}
