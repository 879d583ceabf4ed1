//! The local reference layer itself is checked against finite differences of
//! `L = sum(y * dy)`, so the oracle every strategy is compared with is right.

use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, run_trial};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::rng::Rng;

fn loss(d: &AttnDims, inputs: &TrialInputs) -> f64 {
    let plan = CpPlan::new(Strategy::Local, d, inputs.seq, 1, 1, None).unwrap();
    let r = run_trial(&plan, d, inputs, CpuBackend::new).unwrap();
    r.y.iter()
        .zip(&inputs.dy)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

#[test]
fn reference_gradients_match_finite_differences() {
    for qk_norm in [false, true] {
        let d = AttnDims {
            hidden: 12,
            heads: 4,
            kv_heads: 2,
            head_dim: 6,
            qk_norm,
            norm_eps: 1e-6,
            rope: RopeConfig {
                theta: 100.0,
                scaling: None,
            },
        };
        let inputs = TrialInputs::random(&d, 7, 3);
        let plan = CpPlan::new(Strategy::Local, &d, inputs.seq, 1, 1, None).unwrap();
        let analytic = run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap();
        let mut rng = Rng::new(11);
        let eps = 1e-2f32;
        // (which tensor: None = x, Some(k) = weight k; analytic gradient)
        let mut targets: Vec<(Option<usize>, &[f32])> = vec![(None, &analytic.dx)];
        for (k, (_, g)) in analytic.grads.iter().enumerate() {
            targets.push((Some(k), g));
        }
        for (which, grad) in targets {
            let scale = grad.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for _ in 0..6 {
                let idx = rng.below(grad.len() as u64) as usize;
                let mut plus = inputs.clone();
                let mut minus = inputs.clone();
                match which {
                    None => {
                        plus.x[idx] += eps;
                        minus.x[idx] -= eps;
                    }
                    Some(k) => {
                        plus.weights[k].2[idx] += eps;
                        minus.weights[k].2[idx] -= eps;
                    }
                }
                let fd = (loss(&d, &plus) - loss(&d, &minus)) / (2.0 * eps as f64);
                let err = (fd - grad[idx] as f64).abs() / scale as f64;
                assert!(
                    err < 1e-2,
                    "qk_norm={qk_norm} tensor {which:?} index {idx}: finite difference {fd} vs analytic {} (scale {scale})",
                    grad[idx]
                );
            }
        }
    }
}
