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
            norm: upipe::backend::RmsNorm::plain(1e-6),
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

/// The CPU reference's gradient writes: overwriting (into unfilled buffers,
/// which the CPU fills with NaN) gives what adding into zeros gives, for a
/// whole-range call and for key blocks where the first block overwrites and
/// the rest add (as ring attention's steps do).
#[test]
fn overwritten_gradients_equal_gradients_added_into_zeros() {
    use upipe::backend::{AttnGradWrites, AttnMask, Backend, Category, DType, GradWrite, Tensor};
    let b = CpuBackend::new();
    let (s, hq, hkv, d) = (37, 4, 2, 8);
    let mut rng = Rng::new(11);
    let mut t = |shape: &[usize]| {
        let n = shape.iter().product();
        b.from_host(
            &rng.normal_vec(n, 1.0),
            shape,
            DType::F32,
            Category::Workspace,
        )
        .unwrap()
    };
    let (q, k, v, d_o) = (
        t(&[s, hq, d]),
        t(&[s, hkv, d]),
        t(&[s, hkv, d]),
        t(&[s, hq, d]),
    );
    let mut o = b
        .zeros(&[s, hq, d], DType::F32, Category::Workspace)
        .unwrap();
    let mut lse = b.zeros(&[s, hq], DType::F32, Category::Workspace).unwrap();
    b.attention_fwd(
        q.all_rows(),
        k.all_rows(),
        v.all_rows(),
        &AttnMask::Causal,
        o.all_rows_mut(),
        lse.all_rows_mut(),
    )
    .unwrap();
    let overwrite = AttnGradWrites {
        dq: GradWrite::Overwrite,
        dkv: GradWrite::Overwrite,
    };
    // (writes of the first key block, key blocks) -> dq, dk, dv
    let grads = |first: AttnGradWrites, unfilled: bool, blocks: &[std::ops::Range<usize>]| {
        let buf = |shape: &[usize]| -> Tensor<CpuBackend> {
            if unfilled {
                b.empty(shape, DType::F32, Category::Workspace).unwrap()
            } else {
                b.zeros(shape, DType::F32, Category::Workspace).unwrap()
            }
        };
        let (mut dq, mut dk, mut dv) = (buf(&[s, hq, d]), buf(&[s, hkv, d]), buf(&[s, hkv, d]));
        for (i, kr) in blocks.iter().enumerate() {
            b.attention_bwd(
                q.all_rows(),
                k.rows_view(kr.clone()),
                v.rows_view(kr.clone()),
                o.all_rows(),
                d_o.all_rows(),
                lse.all_rows(),
                &AttnMask::Full,
                dq.all_rows_mut(),
                dk.rows_view_mut(kr.clone()),
                dv.rows_view_mut(kr.clone()),
                if i == 0 { first } else { AttnGradWrites::ADD },
            )
            .unwrap();
        }
        [dq, dk, dv].map(|g| b.to_host(&g).unwrap())
    };
    #[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
    let splits = [vec![0..s], vec![0..s / 2, s / 2..s]];
    for blocks in splits {
        let want = grads(AttnGradWrites::ADD, false, &blocks);
        // dk/dv rows outside the first block are written by the later ones
        let got = grads(overwrite, blocks.len() == 1, &blocks);
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.iter().all(|x| x.is_finite()),
                "an element was never written"
            );
            assert_eq!(g, w, "blocks {blocks:?}");
        }
    }
}
