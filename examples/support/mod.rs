//! Shared by the check examples (`flash_check`, `cudnn_check`,
//! `cudnn_fp8_check`, `fp8_attention_error`): seeded inputs and the
//! relative errors they report.

#![allow(dead_code)] // each example uses part of it

use half::bf16;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Deterministic uniform(-1, 1) generator (xorshift).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` uniform values in (-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    /// bf16-representable values (so both sides see identical inputs).
    pub fn vec_bf16(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(self.next() * scale).to_f32())
            .collect()
    }
}

/// max |got - want| / max |want| (a NaN anywhere is an infinite error).
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let (mut max_diff, mut max_ref) = (0.0f32, 0.0f32);
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        max_diff = if d.is_nan() {
            f32::INFINITY
        } else {
            max_diff.max(d)
        };
        max_ref = max_ref.max(b.abs());
    }
    max_diff / max_ref.max(1e-20)
}

/// ‖got − want‖₂ / ‖want‖₂.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let num: f32 = got.iter().zip(want).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = want.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}
