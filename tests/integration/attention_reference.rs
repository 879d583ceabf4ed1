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
            softmax_scale: AttnDims::default_softmax_scale(6),
            precision: upipe::backend::fp8::Precision::Bf16,
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
    use upipe::backend::{
        AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, Backend, Category, DType, GradWrite,
        Tensor,
    };
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
    b.attention_fwd(AttentionFwd {
        q: q.all_rows(),
        k: k.all_rows(),
        v: v.all_rows(),
        mask: &AttnMask::Causal,
        scale: 1.0 / (d as f32).sqrt(),
        o: o.all_rows_mut(),
        lse: lse.all_rows_mut(),
    })
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
            b.attention_bwd(AttentionBwd {
                q: q.all_rows(),
                k: k.rows_view(kr.clone()),
                v: v.rows_view(kr.clone()),
                o: o.all_rows(),
                d_o: d_o.all_rows(),
                lse: lse.all_rows(),
                mask: &AttnMask::Full,
                scale: 1.0 / (d as f32).sqrt(),
                dq: dq.all_rows_mut(),
                dk: dk.rows_view_mut(kr.clone()),
                dv: dv.rows_view_mut(kr.clone()),
                writes: if i == 0 { first } else { AttnGradWrites::ADD },
            })
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

/// One attention call's shape: rows, query heads, kv heads, head dim.
type Geometry = (usize, usize, usize, usize);

/// o, lse, dq, dk and dv of the CPU reference's attention over `s` rows of
/// `q`, `k`, `v` (`[s, hq, d]`, `[s, hkv, d]` twice) under a causal mask at
/// softmax scale `scale`, backward from `d_o` (`[s, hq, d]`).
fn cpu_attention(g: Geometry, x: [&[f32]; 4], scale: f32) -> [Vec<f32>; 5] {
    use upipe::backend::{
        AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, Backend, Category, DType,
    };
    let (s, hq, hkv, d) = g;
    let b = CpuBackend::new();
    let up = |v: &[f32], h: usize| {
        b.from_host(v, &[s, h, d], DType::F32, Category::Workspace)
            .unwrap()
    };
    let (q, k, v, d_o) = (up(x[0], hq), up(x[1], hkv), up(x[2], hkv), up(x[3], hq));
    let z = |shape: &[usize]| b.zeros(shape, DType::F32, Category::Workspace).unwrap();
    let (mut o, mut lse) = (z(&[s, hq, d]), z(&[s, hq]));
    let (mut dq, mut dk, mut dv) = (z(&[s, hq, d]), z(&[s, hkv, d]), z(&[s, hkv, d]));
    let mask = AttnMask::Causal;
    b.attention_fwd(AttentionFwd {
        q: q.all_rows(),
        k: k.all_rows(),
        v: v.all_rows(),
        mask: &mask,
        scale,
        o: o.all_rows_mut(),
        lse: lse.all_rows_mut(),
    })
    .unwrap();
    b.attention_bwd(AttentionBwd {
        q: q.all_rows(),
        k: k.all_rows(),
        v: v.all_rows(),
        o: o.all_rows(),
        d_o: d_o.all_rows(),
        lse: lse.all_rows(),
        mask: &mask,
        scale,
        dq: dq.all_rows_mut(),
        dk: dk.all_rows_mut(),
        dv: dv.all_rows_mut(),
        writes: AttnGradWrites::ADD,
    })
    .unwrap();
    [&o, &lse, &dq, &dk, &dv].map(|t| b.to_host(t).unwrap())
}

/// Naive causal attention in f64 at softmax scale `scale`, forward and
/// backward: o, lse, dq, dk, dv as [`cpu_attention`] returns them.
fn naive_attention(g: Geometry, x: [&[f32]; 4], scale: f64) -> [Vec<f64>; 5] {
    let (s, hq, hkv, d) = g;
    let at = |v: &[f32], h: usize, heads: usize, i: usize| -> Vec<f64> {
        v[(i * heads + h) * d..][..d]
            .iter()
            .map(|&e| e as f64)
            .collect()
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut out = [
        vec![0.0; s * hq * d],
        vec![0.0; s * hq],
        vec![0.0; s * hq * d],
        vec![0.0; s * hkv * d],
        vec![0.0; s * hkv * d],
    ];
    for h in 0..hq {
        let kh = h / (hq / hkv);
        for i in 0..s {
            let (q, d_o) = (at(x[0], h, hq, i), at(x[3], h, hq, i));
            let keys: Vec<_> = (0..=i).map(|j| at(x[1], kh, hkv, j)).collect();
            let vals: Vec<_> = (0..=i).map(|j| at(x[2], kh, hkv, j)).collect();
            let scores: Vec<f64> = keys.iter().map(|k| scale * dot(&q, k)).collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + scores.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            let p: Vec<f64> = scores.iter().map(|x| (x - lse).exp()).collect();
            let o: Vec<f64> = (0..d)
                .map(|e| p.iter().zip(&vals).map(|(p, v)| p * v[e]).sum())
                .collect();
            let delta = dot(&d_o, &o);
            for (j, (k, v)) in keys.iter().zip(&vals).enumerate() {
                let ds = p[j] * (dot(&d_o, v) - delta) * scale;
                for e in 0..d {
                    out[2][(i * hq + h) * d + e] += ds * k[e];
                    out[3][(j * hkv + kh) * d + e] += ds * q[e];
                    out[4][(j * hkv + kh) * d + e] += p[j] * d_o[e];
                }
            }
            out[0][(i * hq + h) * d..][..d].copy_from_slice(&o);
            out[1][i * hq + h] = lse;
        }
    }
    out
}

/// The softmax scale flows into the CPU reference's attention: at a scale
/// `c` times the default (`c` a power of two, so the scaled queries are
/// exact), forward and backward equal the default's on queries multiplied
/// by `c` (dq times `c`) within 1e-6; at any scale, Gemma 3's included
/// (`168^-0.5` for heads of 128, not `1/sqrt(d)`), they equal a naive f64
/// softmax.
#[test]
fn a_softmax_scale_is_the_default_on_scaled_queries() {
    let g @ (s, hq, hkv, d) = (23, 4, 2, 16);
    let mut rng = Rng::new(29);
    let q = rng.normal_vec(s * hq * d, 1.0);
    let (k, v) = (
        rng.normal_vec(s * hkv * d, 1.0),
        rng.normal_vec(s * hkv * d, 1.0),
    );
    let d_o = rng.normal_vec(s * hq * d, 1.0);
    let default = 1.0 / (d as f32).sqrt();
    let names = ["o", "lse", "dq", "dk", "dv"];
    for scale in [0.125f32, 0.5, 168f32.powf(-0.5), 0.4] {
        let got = cpu_attention(g, [&q, &k, &v, &d_o], scale);
        let c = scale * (d as f32).sqrt();
        if c.log2().fract() == 0.0 {
            let q_c: Vec<f32> = q.iter().map(|x| x * c).collect();
            let mut want = cpu_attention(g, [&q_c, &k, &v, &d_o], default);
            want[2].iter_mut().for_each(|x| *x *= c);
            for (n, name) in names.iter().enumerate() {
                for (i, (a, b)) in got[n].iter().zip(&want[n]).enumerate() {
                    let tol = 1e-6 * b.abs().max(1.0);
                    assert!((a - b).abs() <= tol, "{name}[{i}] at {scale}: {a} vs {b}");
                }
            }
        }
        let naive = naive_attention(g, [&q, &k, &v, &d_o], scale as f64);
        for (n, name) in names.iter().enumerate() {
            for (i, (a, b)) in got[n].iter().zip(&naive[n]).enumerate() {
                let (a, tol) = (*a as f64, 1e-5 * b.abs().max(1.0));
                assert!(
                    (a - b).abs() <= tol,
                    "{name}[{i}] at {scale}: {a} vs naive {b}"
                );
            }
        }
    }
}

/// A malformed attention call is refused alike by every device: the CPU
/// reference and a rehearsal of it both refuse an `o` of the wrong rows, a
/// `v` unlike `k`, an F32-less LSE and a scale that is not positive,
/// through the one check of the call's descriptor.
#[test]
fn every_device_refuses_a_malformed_attention_call_alike() {
    use upipe::backend::rehearsal::Rehearsal;
    use upipe::backend::{AttentionFwd, AttnMask, Backend, Category, DType};
    fn refusals<B: Backend>(b: &B) -> Vec<String> {
        let (s, hq, hkv, d) = (6, 4, 2, 8);
        let t = |shape: &[usize], dt| b.zeros(shape, dt, Category::Workspace).unwrap();
        let (q, k, v) = (
            t(&[s, hq, d], DType::F32),
            t(&[s, hkv, d], DType::F32),
            t(&[s, hkv, d], DType::F32),
        );
        let v_wide = t(&[s, hq, d], DType::F32);
        let mut cases = Vec::new();
        // (v, o rows, lse dtype, scale)
        for (v, o_rows, lse_dt, scale) in [
            (&v, s - 1, DType::F32, 0.5),
            (&v_wide, s, DType::F32, 0.5),
            (&v, s, DType::BF16, 0.5),
            (&v, s, DType::F32, 0.0),
            (&v, s, DType::F32, f32::NAN),
        ] {
            let mut o = t(&[s, hq, d], DType::F32);
            let mut lse = t(&[s, hq], lse_dt);
            let e = b.attention_fwd(AttentionFwd {
                q: q.all_rows(),
                k: k.all_rows(),
                v: v.all_rows(),
                mask: &AttnMask::Full,
                scale,
                o: o.rows_view_mut(0..o_rows),
                lse: lse.all_rows_mut(),
            });
            cases.push(e.unwrap_err().to_string());
        }
        cases
    }
    let cpu = refusals(&CpuBackend::new());
    assert_eq!(cpu, refusals(&Rehearsal::on(CpuBackend::new())));
    assert!(cpu[0].contains("o has 5 rows"), "{}", cpu[0]);
}
