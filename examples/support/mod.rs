//! Shared by the GPU check examples (`flash_check`, `cudnn_check`): seeded
//! bf16-representable inputs and the relative error they report.

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
