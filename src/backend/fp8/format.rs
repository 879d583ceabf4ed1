//! The two 8-bit floating-point formats of FP8 training: their codes, the
//! value of each code, and the rounding of an f32 to a code.
//!
//! - [`Fp8Format::E4M3`]: the OCP "e4m3fn" format (1 sign, 4 exponent bits
//!   of bias 7, 3 mantissa bits); no infinities, one NaN pattern per sign
//!   (`S.1111.111`), largest finite ±448.
//! - [`Fp8Format::E5M2`]: IEEE-like (5 exponent bits of bias 15, 2 mantissa
//!   bits) with infinities (`S.11111.00`) and NaNs; largest finite ±57344.
//!
//! [`Fp8Format::encode`] rounds to nearest, ties to the even code, and
//! saturates whatever lies beyond the largest finite value (infinities
//! included) to ±max, as a cast with "satfinite" does on a GPU; NaN stays
//! NaN. Subnormals (exponent field 0) are encoded and decoded exactly.

/// An 8-bit floating-point format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits (weights and activations).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits (gradients).
    E5M2,
}

impl Fp8Format {
    /// Mantissa bits.
    pub fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }
    /// Exponent bias.
    pub fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }
    /// The positive code of the largest finite value.
    pub fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }
    /// The positive NaN code this crate writes.
    pub fn nan_code(self) -> u8 {
        0x7F
    }
    /// The name a user and the run header read (`e4m3`, `e5m2`).
    pub fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// The smallest exponent of a normal value (`1 - bias`).
    fn min_exponent(self) -> i32 {
        1 - self.bias()
    }

    /// The value of `code` (NaN for a NaN code, ±∞ for E5M2's infinities).
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let m_bits = self.mantissa_bits();
        let man = u32::from(code) & ((1 << m_bits) - 1);
        let exp = (u32::from(code) & 0x7F) >> m_bits;
        let top = (1u32 << (7 - m_bits)) - 1;
        match self {
            Fp8Format::E4M3 if exp == top && man == (1 << m_bits) - 1 => return f32::NAN,
            Fp8Format::E5M2 if exp == top && man == 0 => return sign * f32::INFINITY,
            Fp8Format::E5M2 if exp == top => return f32::NAN,
            _ => {}
        }
        let quantum = pow2(self.min_exponent() - m_bits as i32);
        let magnitude = if exp == 0 {
            man as f32 * quantum
        } else {
            ((1 << m_bits) + man) as f32 * pow2(exp as i32 - 1) * quantum
        };
        sign * magnitude
    }

    /// `x` rounded to this format's nearest code (ties to the even code),
    /// saturated to ±max beyond the largest finite value; NaN stays NaN.
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        if x.is_nan() {
            return sign | self.nan_code();
        }
        let a = x.abs();
        if a >= self.max() {
            return sign | self.max_code();
        }
        let m_bits = self.mantissa_bits() as i32;
        // the exponent of a (an f32 subnormal counts as far below the range)
        let e = ((a.to_bits() >> 23) as i32 - 127).max(self.min_exponent());
        let quantum = pow2(e - m_bits);
        // a / quantum and its rounding are exact in f32 (powers of two)
        let n = (a / quantum).round_ties_even() as u32;
        sign | self.code_of(n, e)
    }

    /// The positive code of the value `n · 2^(e - mantissa bits)`, where
    /// `e` is at least the smallest normal exponent and `n < 2^(m+2)`
    /// (a rounding may have carried into the next binade).
    fn code_of(self, n: u32, e: i32) -> u8 {
        let m_bits = self.mantissa_bits();
        let (mut n, mut e) = (n, e);
        if n >= 2 << m_bits {
            n >>= 1;
            e += 1;
        }
        if n < 1 << m_bits {
            // subnormal (only at the smallest exponent) or zero
            return n as u8;
        }
        let exp = (e + self.bias()) as u32;
        ((exp << m_bits) | (n - (1 << m_bits))) as u8
    }

    /// `x` as this format stores it: the value of its code.
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }
}

/// `2^e` as an f32 (`e` within the normal range of f32).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

#[cfg(test)]
#[path = "format_tests.rs"]
mod tests;
