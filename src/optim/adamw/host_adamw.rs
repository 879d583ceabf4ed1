//! AdamW on host memory: the per-element update of the CPU reference (and
//! of `--offload-optimizer`, whose optimizer state lives in pinned host
//! memory), split over threads. Every element's arithmetic is the same
//! whatever the split, so results are bit-identical to one thread.

use super::adamw_step::AdamWStep;
use rayon::prelude::*;

/// Elements per task: large enough to amortise scheduling, small enough to
/// spread one tensor over every core.
const CHUNK: usize = 1 << 16;

/// One AdamW update of `param` with `grad`, moments `m`, `v` (four slices
/// of one length), on the calling thread.
pub fn adamw_serial(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], hp: AdamWStep) {
    let (bc1, bc2) = hp.bias_corrections();
    for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m).zip(v) {
        let gi = g * hp.grad_scale;
        *m = hp.beta1 * *m + (1.0 - hp.beta1) * gi;
        *v = hp.beta2 * *v + (1.0 - hp.beta2) * gi * gi;
        let mh = *m / bc1;
        let vh = *v / bc2;
        *p -= hp.lr * (mh / (vh.sqrt() + hp.eps) + hp.weight_decay * *p);
    }
}

/// [`adamw_serial`] over the host's threads (rayon's pool).
pub fn adamw_parallel(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: AdamWStep,
) {
    param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_serial(p, g, m, v, hp));
}

/// [`adamw_parallel`] with a BF16 gradient (`bits`), each task widening
/// its chunk exactly: bit-identical to the F32 update of the same values.
pub fn adamw_parallel_bf16(
    param: &mut [f32],
    bits: &[u16],
    m: &mut [f32],
    v: &mut [f32],
    hp: AdamWStep,
) {
    param
        .par_chunks_mut(CHUNK)
        .zip(bits.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            let g: Vec<f32> = g
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect();
            adamw_serial(p, &g, m, v, hp)
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(step: u32) -> AdamWStep {
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 0.7,
        }
    }

    #[test]
    fn threads_change_no_bit() {
        let n = 3 * CHUNK + 17;
        let init = |k: usize| {
            (0..n)
                .map(|i| ((i * k) % 97) as f32 / 50.0 - 0.9)
                .collect::<Vec<_>>()
        };
        let grad = init(7);
        let (mut p1, mut m1, mut v1) = (init(3), vec![0.0; n], vec![0.0; n]);
        let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
        for step in 1..=3 {
            adamw_serial(&mut p1, &grad, &mut m1, &mut v1, hp(step));
            adamw_parallel(&mut p2, &grad, &mut m2, &mut v2, hp(step));
        }
        assert!(p1.iter().zip(&p2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(m1.iter().zip(&m2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(v1.iter().zip(&v2).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(p1.iter().zip(init(3)).any(|(a, b)| *a != b));
    }

    #[test]
    fn a_bf16_gradient_updates_as_its_f32_values_do() {
        let n = 2 * CHUNK + 5;
        // BF16 gradients of both signs, tiny and large, and their F32 values
        let bits: Vec<u16> = (0..n)
            .map(|i| (i as u16).wrapping_mul(40503) & 0xbf7f)
            .collect();
        let grad: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert!(grad.iter().all(|g| g.is_finite()) && grad.iter().any(|g| *g < 0.0));
        let p0: Vec<f32> = (0..n).map(|i| (i % 13) as f32 / 7.0 - 0.8).collect();
        let (mut p1, mut m1, mut v1) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
        let (mut p2, mut m2, mut v2) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
        for step in 1..=2 {
            adamw_serial(&mut p1, &grad, &mut m1, &mut v1, hp(step));
            adamw_parallel_bf16(&mut p2, &bits, &mut m2, &mut v2, hp(step));
        }
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&p1, &p2) && same(&m1, &m2) && same(&v1, &v2));
        assert!(!same(&p1, &p0));
    }
}
