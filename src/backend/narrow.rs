//! Narrow element formats on the host: BF16 rounded to nearest even and
//! its values, and 8-bit codes given as f32 values (what the CPU
//! reference's cells hold, and what an optimizer's compact state encodes).

use crate::error::{Error, Result};

/// `x` rounded to BF16, to nearest even (NaN stays NaN), as its bits.
pub fn bf16_nearest(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// The value of BF16 bits.
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// 8-bit codes given as f32 values, as bytes; an error for any value that
/// is not an integer in `0..=255`.
pub fn codes_of(values: &[f32]) -> Result<Vec<u8>> {
    values
        .iter()
        .map(|&x| {
            if x.fract() == 0.0 && (0.0..=255.0).contains(&x) {
                Ok(x as u8)
            } else {
                Err(Error::Backend(format!(
                    "an 8-bit tensor takes integers 0..=255, got {x}"
                )))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_must_be_bytes() {
        assert_eq!(codes_of(&[0.0, 255.0, 7.0]).unwrap(), vec![0, 255, 7]);
        for bad in [256.0, -1.0, 0.5, f32::NAN] {
            assert!(codes_of(&[bad]).is_err(), "{bad}");
        }
    }
}
