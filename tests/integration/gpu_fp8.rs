//! The CUDA FP8 ops against the CPU emulation: the quantization's codes,
//! transposed copy and inverse scale bit for bit, and cuBLASLt's FP8 GEMM
//! of each linear role within f32 accumulation order and the BF16 output's
//! rounding; a whole linear GEMM (`linear_gemm`) likewise. Skipped (with a
//! printed message) without a CUDA GPU of compute capability 8.9 or above.

use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::fp8::{Fp8Quantize, LinearGemm, LinearRole, Precision, linear_gemm};
use upipe::backend::{Backend, Category, DType, MatLayout};
use upipe::rng::Rng;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => match b.supports_fp8() {
            Ok(()) => Some(b),
            Err(e) => {
                eprintln!("SKIP gpu_fp8: {e}");
                None
            }
        },
        Err(e) => {
            eprintln!("SKIP gpu_fp8: no usable CUDA GPU ({e})");
            None
        }
    }
}

/// `x` as BF16 holds it (what both devices read).
fn bf16(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// Codes and inverse scale of a `[rows, cols]` BF16 matrix (a block of a
/// wider one from element `offset`, as the engine's views are), or of its
/// transpose (`[cols, rows]`, column-major, as a weight gradient reads its
/// operands), on `b`; then the codes and their transpose of a second call
/// that asks for both.
fn quantized<B: Backend>(
    b: &B,
    x: &[f32],
    (rows, cols, ld, offset, transpose): (usize, usize, usize, usize, bool),
    dtype: DType,
) -> [Vec<f32>; 4] {
    let src = b
        .from_host(x, &[x.len()], b.compute_dtype(), Category::Workspace)
        .unwrap();
    let view = || {
        let v = src.view(MatLayout::block(offset, rows, cols, ld));
        if transpose { v.t() } else { v }
    };
    let (rows, cols) = if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let mut q = b.empty(&[rows, cols], dtype, Category::Workspace).unwrap();
    let mut q2 = b.empty(&[rows, cols], dtype, Category::Workspace).unwrap();
    let mut qt = b.empty(&[cols, rows], dtype, Category::Workspace).unwrap();
    let mut s = b.empty(&[1], DType::F32, Category::Workspace).unwrap();
    let args = Fp8Quantize {
        src: view(),
        dst: &mut q,
        dst_t: None,
        scale_inv: &mut s,
    };
    b.fp8_quantize(args).unwrap();
    let mut s2 = b.empty(&[1], DType::F32, Category::Workspace).unwrap();
    let args = Fp8Quantize {
        src: view(),
        dst: &mut q2,
        dst_t: Some(&mut qt),
        scale_inv: &mut s2,
    };
    b.fp8_quantize(args).unwrap();
    assert_eq!(b.to_host(&s).unwrap(), b.to_host(&s2).unwrap());
    [q, q2, qt, s].map(|t| b.to_host(&t).unwrap())
}

#[test]
fn gpu_fp8_quantize_equals_the_cpu_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(3);
    // partial tiles; many tiles and amax blocks; whole vectors and tiles
    // at 16-byte aligned rows (the vector paths, row- and column-major), and
    // the same shape off that alignment
    let shapes = [
        (37, 53, 60, 1),
        (1200, 517, 520, 1),
        (256, 192, 200, 0),
        (256, 192, 200, 8),
        (256, 192, 200, 1),
    ];
    for (rows, cols, ld, offset) in shapes {
        for (dtype, std) in [
            (DType::F8E4M3, 3.0),
            (DType::F8E5M2, 1e-3),
            (DType::F8E4M3, 0.0),
        ] {
            let x = bf16(&rng.normal_vec(rows * ld + offset, std));
            for transpose in [false, true] {
                let shape = (rows, cols, ld, offset, transpose);
                let want = quantized(&cpu, &x, shape, dtype);
                let got = quantized(&gpu, &x, shape, dtype);
                for (w, g) in want.iter().zip(&got) {
                    let same = w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dtype:?} std {std} {shape:?}: GPU quantization differs from the CPU's"
                    );
                }
            }
        }
    }
}

/// One linear GEMM of `role` on `b`: `c [m, n] += a @ b`, BF16 operands.
fn linear<B: Backend>(
    b: &B,
    role: LinearRole,
    host: [&[f32]; 3],
    (m, k, n): (usize, usize, usize),
) -> Vec<f32> {
    let dt = b.compute_dtype();
    let a = b
        .from_host(host[0], &[m, k], dt, Category::Workspace)
        .unwrap();
    let w = b
        .from_host(host[1], &[n, k], dt, Category::Workspace)
        .unwrap();
    let mut c = b
        .from_host(host[2], &[m, n], dt, Category::Workspace)
        .unwrap();
    let g = LinearGemm::new(role, c.mat_mut(), a.mat(), w.mat().t()).accumulate();
    linear_gemm(b, Precision::Fp8, g).unwrap();
    b.to_host(&c).unwrap()
}

#[test]
fn gpu_fp8_gemm_equals_the_cpu_emulation() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    let (m, k, n) = (64, 128, 96);
    for role in [
        LinearRole::Forward,
        LinearRole::InputGrad,
        LinearRole::WeightGrad,
    ] {
        let a = bf16(&rng.normal_vec(m * k, 1.0));
        let w = bf16(&rng.normal_vec(n * k, 0.05));
        let c = bf16(&rng.normal_vec(m * n, 0.5));
        let want = linear(&cpu, role, [&a, &w, &c], (m, k, n));
        let got = linear(&gpu, role, [&a, &w, &c], (m, k, n));
        let scale = want.iter().fold(0f32, |s, v| s.max(v.abs()));
        let worst = want
            .iter()
            .zip(&got)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        // the GPU writes BF16 (8 bits of mantissa); the CPU F32
        assert!(worst <= scale / 128.0, "{role:?}: {worst} against {scale}");
    }
}

/// `sqrt(Σ (a − b)²) / sqrt(Σ b²)`.
fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

/// cuDNN's FP8 attention through the backend (`set_attention_fp8`) against
/// the CPU emulation of the same arithmetic (`fp8::attention::emulate_passes`):
/// O, LSE and the gradients (added into F32 and BF16 buffers holding
/// values, or overwritten) within FP8's resolution, GQA and MHA, with both
/// passes in FP8 (`fp8-attention`) and the backward alone after a BF16
/// forward (`fp8-attention-bwd`). Skipped where cuDNN or its FP8 graphs are
/// not available.
#[test]
fn fp8_attention_tracks_the_emulation() {
    use upipe::backend::fp8::Fp8Passes;
    let Some(mut b) = gpu() else { return };
    b.set_attn_kernel(upipe::backend::cuda::cudnn::AttnKernel::Cudnn);
    if let Err(e) = b.cudnn_sdpa() {
        eprintln!("SKIP fp8_attention_tracks_the_emulation: {e}");
        return;
    }
    for forward in [true, false] {
        let passes = Fp8Passes {
            forward,
            backward: true,
        };
        b.set_attention_fp8(passes);
        for (s, hq, hkv) in [(256, 4, 1), (384, 2, 2)] {
            attention_case(&b, passes, s, hq, hkv);
        }
    }
}

/// One causal problem of `s` tokens, `hq` query over `hkv` key/value heads
/// of dim 128 through `b`'s attention with `passes` in FP8, against the
/// emulation: each FP8 output closer to it than half of FP8's own error
/// from exact attention; a BF16 forward's O within BF16's error of exact.
fn attention_case(
    b: &CudaBackend,
    passes: upipe::backend::fp8::Fp8Passes,
    s: usize,
    hq: usize,
    hkv: usize,
) {
    use upipe::backend::fp8::attention::{AttnProblem, device_scales, emulate_passes, exact};
    use upipe::backend::{AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, GradWrite};
    let d = 128;
    let mut r = Rng::new(s as u64);
    let mut draw = |n: usize, a: f32| {
        bf16(
            &(0..n)
                .map(|_| (r.uniform() as f32 * 2.0 - 1.0) * a)
                .collect::<Vec<_>>(),
        )
    };
    let (q, k, v) = (
        draw(s * hq * d, 2.0),
        draw(s * hkv * d, 2.0),
        draw(s * hkv * d, 1.0),
    );
    let d_o = draw(s * hq * d, 1e-3);
    let scale = 1.0 / (d as f32).sqrt();
    let problem = AttnProblem {
        q: &q,
        k: &k,
        v: &v,
        d_o: &d_o,
        s,
        hq,
        hkv,
        d,
        scale,
    };
    let want = emulate_passes(&problem, &device_scales(&problem), passes);
    let exact = exact(&problem);
    // the GPU's FP8 attention is the emulated arithmetic: it stays
    // closer to the emulation than FP8's own rounding takes either
    // from exact attention
    let check = |name: &str, got: &[f32], want: &[f32], exact: &[f32]| {
        let (e, own) = (rel_l2(got, want), rel_l2(want, exact));
        eprintln!(
            "{passes:?} s {s} hq {hq} hkv {hkv}: {name} rel-L2 {e:.2e} to the emulation, \
             {own:.2e} FP8's own"
        );
        assert!(e < 0.5 * own, "{name}: {e} against FP8's own {own}");
    };
    let up = |x: &[f32], h: usize| {
        b.from_host(x, &[s, h, d], DType::BF16, Category::Activations)
            .unwrap()
    };
    let (tq, tk, tv, tdo) = (up(&q, hq), up(&k, hkv), up(&v, hkv), up(&d_o, hq));
    let mut o = b
        .zeros(&[s, hq, d], DType::BF16, Category::Activations)
        .unwrap();
    let mut lse = b
        .zeros(&[s, hq], DType::F32, Category::Activations)
        .unwrap();
    b.attention_fwd(AttentionFwd {
        q: tq.all_rows(),
        k: tk.all_rows(),
        v: tv.all_rows(),
        mask: &AttnMask::Causal,
        scale,
        o: o.all_rows_mut(),
        lse: lse.all_rows_mut(),
    })
    .unwrap();
    let got_o = b.to_host(&o).unwrap();
    if passes.forward {
        check("O", &got_o, &want.o, &exact.o);
    } else {
        let e = rel_l2(&got_o, &exact.o);
        assert!(e < 1e-2, "BF16 forward's O: {e} from exact");
    }
    assert!(rel_l2(&b.to_host(&lse).unwrap(), &want.lse) < 1e-3);
    // dQ added into F32 holding 1.0, dK and dV overwritten in BF16
    let mut dq = b
        .from_host(
            &vec![1.0; s * hq * d],
            &[s, hq, d],
            DType::F32,
            Category::Grads,
        )
        .unwrap();
    let g = |h| {
        b.from_host(
            &vec![7.0; s * h * d],
            &[s, h, d],
            DType::BF16,
            Category::Grads,
        )
        .unwrap()
    };
    let (mut dk, mut dv) = (g(hkv), g(hkv));
    b.attention_bwd(AttentionBwd {
        q: tq.all_rows(),
        k: tk.all_rows(),
        v: tv.all_rows(),
        o: o.all_rows(),
        d_o: tdo.all_rows(),
        lse: lse.all_rows(),
        mask: &AttnMask::Causal,
        scale,
        dq: dq.all_rows_mut(),
        dk: dk.all_rows_mut(),
        dv: dv.all_rows_mut(),
        writes: AttnGradWrites {
            dq: GradWrite::Add,
            dkv: GradWrite::Overwrite,
        },
    })
    .unwrap();
    let dq: Vec<f32> = b.to_host(&dq).unwrap().iter().map(|x| x - 1.0).collect();
    check("dQ", &dq, &want.dq, &exact.dq);
    check("dK", &b.to_host(&dk).unwrap(), &want.dk, &exact.dk);
    check("dV", &b.to_host(&dv).unwrap(), &want.dv, &exact.dv);
}
