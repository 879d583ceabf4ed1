//! Every CUDA backend op against the CPU reference on fresh random inputs.
//! Skipped (with a printed message) when no CUDA driver or GPU is present.
//!
//! Inputs are rounded to bf16 once and the same values are given to both
//! backends; the check is max|gpu - cpu| / max|cpu| <= 1e-2.

use std::sync::OnceLock;
use upipe::Error;
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::backend::cuda::{AttentionKernels, CudaBackend};
use upipe::backend::{
    AddRmsNormFwd, AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, Backend, Category, DType,
    GatedAct, GradWrite, IGNORE, LseMerge, MatLayout, RmsNorm, RmsNormBwd, RmsNormFwd, RopeRotate,
    Tensor,
};
use upipe::optim::{AdamWOps, AdamWSlot, AdamWStep};

const TOL: f64 = 1e-2;

/// Gemma's norm: each weight scales as `1 + w`.
const GEMMA_NORM: RmsNorm = RmsNorm {
    eps: 1e-6,
    weight_offset: 1.0,
};

fn gpu() -> Option<&'static CudaBackend> {
    static B: OnceLock<Option<CudaBackend>> = OnceLock::new();
    B.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIP gpu_backend: no usable CUDA GPU ({e})");
            None
        }
    })
    .as_ref()
}

/// xorshift64*, seeded from the clock (printed, so a failure can be replayed with UPIPE_TEST_SEED).
struct Rng(u64);
impl Rng {
    fn new(tag: &str) -> Rng {
        let seed = std::env::var("UPIPE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        eprintln!("{tag}: seed {seed}");
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-scale, scale).
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % n as u64) as u32
    }
}

fn round(v: &[f32], dt: DType) -> Vec<f32> {
    match dt {
        DType::F32 => v.to_vec(),
        DType::BF16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        DType::U8 => v.iter().map(|&x| x.round().clamp(0.0, 255.0)).collect(),
        DType::F8E4M3 | DType::F8E5M2 => {
            let f = dt.fp8_format().unwrap();
            v.iter().map(|&x| f.round(x)).collect()
        }
    }
}

/// The same (dtype-rounded) data on both backends.
fn pair(
    g: &CudaBackend,
    c: &CpuBackend,
    data: &[f32],
    shape: &[usize],
    dt: DType,
) -> (Tensor<CudaBackend>, Tensor<CpuBackend>) {
    let r = round(data, dt);
    (
        g.from_host(&r, shape, dt, Category::Workspace).unwrap(),
        c.from_host(&r, shape, DType::F32, Category::Workspace)
            .unwrap(),
    )
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let mut diff = 0f64;
    let mut max = 0f64;
    for (&a, &b) in got.iter().zip(want) {
        assert!(
            a.is_finite() || !b.is_finite(),
            "non-finite result {a} where reference is {b}"
        );
        diff = diff.max((a as f64 - b as f64).abs());
        max = max.max((b as f64).abs());
    }
    if max == 0.0 { diff } else { diff / max }
}

fn check(
    name: &str,
    g: &CudaBackend,
    gt: &Tensor<CudaBackend>,
    c: &CpuBackend,
    ct: &Tensor<CpuBackend>,
) {
    close(name, &g.to_host(gt).unwrap(), &c.to_host(ct).unwrap());
}

#[test]
fn gemm_all_transposes_bf16_into_f32_and_bf16() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("gemm");
    let (m, k, n) = (96, 136, 72);
    for ta in [false, true] {
        for tb in [false, true] {
            // a lives in a wider buffer (ld > cols) at an aligned offset.
            let lda = if ta { m + 8 } else { k + 8 };
            let la0 = if ta {
                MatLayout::block(16, k, m, lda).t()
            } else {
                MatLayout::block(16, m, k, lda)
            };
            let lb0 = if tb {
                MatLayout::block(0, n, k, k).t()
            } else {
                MatLayout::block(0, k, n, n)
            };
            let (ga, ca) = pair(
                g,
                &c,
                &rng.vec(16 + lda * k.max(m), 1.0),
                &[16 + lda * k.max(m)],
                DType::BF16,
            );
            let (gb, cb) = pair(g, &c, &rng.vec(k * n, 1.0), &[k * n], DType::BF16);
            // f32 output, beta = 1 accumulation (the weight-gradient case), inside a wider buffer.
            let ldc = n + 8;
            let lc = MatLayout::block(ldc, m, n, ldc);
            let init = rng.vec(ldc * (m + 1), 1.0);
            let (mut gc, mut cc) = pair(g, &c, &init, &[ldc * (m + 1)], DType::F32);
            g.gemm(gc.view_mut(lc), ga.view(la0), gb.view(lb0), 0.5, 1.0)
                .unwrap();
            c.gemm(cc.view_mut(lc), ca.view(la0), cb.view(lb0), 0.5, 1.0)
                .unwrap();
            check(
                &format!("gemm bf16->f32 beta=1 ta={ta} tb={tb}"),
                g,
                &gc,
                &c,
                &cc,
            );
            // bf16 output, beta = 0.
            let (mut gc2, mut cc2) = pair(g, &c, &rng.vec(m * n, 1.0), &[m, n], DType::BF16);
            g.gemm(gc2.mat_mut(), ga.view(la0), gb.view(lb0), 1.0, 0.0)
                .unwrap();
            c.gemm(cc2.mat_mut(), ca.view(la0), cb.view(lb0), 1.0, 0.0)
                .unwrap();
            check(
                &format!("gemm bf16->bf16 ta={ta} tb={tb}"),
                g,
                &gc2,
                &c,
                &cc2,
            );
        }
    }
    assert!(g.gemm_plans() >= 8, "plans are cached per problem");
}

/// `UPIPE_GEMM_ALGO=fastest`: a problem's first call that overwrites its
/// output times the heuristic's algorithms and keeps one; an accumulating
/// call before it runs the first algorithm and tunes nothing. Every result
/// equals the CPU reference.
#[test]
fn gemm_tuned_by_timing_gives_the_reference_results() {
    if gpu().is_none() {
        return;
    }
    let mut g = CudaBackend::new(0).unwrap();
    g.set_gemm_pick(upipe::backend::cuda::tuning::GemmPick::Fastest);
    let g = &g;
    let c = CpuBackend::new();
    let mut rng = Rng::new("gemm_tuned");
    let (m, k, n) = (1024, 512, 768);
    let (ga, ca) = pair(g, &c, &rng.vec(m * k, 1.0), &[m, k], DType::BF16);
    let (gb, cb) = pair(g, &c, &rng.vec(n * k, 1.0), &[n, k], DType::BF16);
    let (mut gc, mut cc) = pair(g, &c, &rng.vec(m * n, 1.0), &[m, n], DType::F32);
    // beta = 1 first: accumulates with the first algorithm, tunes nothing;
    // then the beta = 0 call tunes, and an accumulating call runs its pick
    for (i, beta) in [1.0, 0.0, 1.0].into_iter().enumerate() {
        g.gemm(gc.mat_mut(), ga.mat(), gb.mat().t(), 0.5, beta)
            .unwrap();
        c.gemm(cc.mat_mut(), ca.mat(), cb.mat().t(), 0.5, beta)
            .unwrap();
        check(
            &format!("tuned gemm, call {i}, beta={beta}"),
            g,
            &gc,
            &c,
            &cc,
        );
        if i == 0 {
            assert_eq!(g.gemm_tuned_plans(), 0);
        }
    }
    assert_eq!(
        g.gemm_tuned_plans(),
        1,
        "the beta = 0 call tuned its problem"
    );
}

#[test]
fn gemm_f32_and_odd_shapes() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("gemm_f32");
    let (m, k, n) = (33, 65, 17);
    let (ga, ca) = pair(g, &c, &rng.vec(m * k, 1.0), &[m, k], DType::F32);
    let (gb, cb) = pair(g, &c, &rng.vec(n * k, 1.0), &[n, k], DType::F32);
    let (mut gc, mut cc) = pair(g, &c, &rng.vec(m * n, 1.0), &[m, n], DType::F32);
    g.gemm(gc.mat_mut(), ga.mat(), gb.mat().t(), 1.0, 0.0)
        .unwrap();
    c.gemm(cc.mat_mut(), ca.mat(), cb.mat().t(), 1.0, 0.0)
        .unwrap();
    check("gemm f32 x f32^T", g, &gc, &c, &cc);
    // bf16 with odd sizes (2-byte aligned rows).
    let (ga, ca) = pair(g, &c, &rng.vec(m * k, 1.0), &[m, k], DType::BF16);
    let (gb, cb) = pair(g, &c, &rng.vec(k * n, 1.0), &[k, n], DType::BF16);
    let (mut gc, mut cc) = pair(g, &c, &rng.vec(m * n, 1.0), &[m, n], DType::F32);
    g.gemm(gc.mat_mut(), ga.mat(), gb.mat(), 1.0, 0.0).unwrap();
    c.gemm(cc.mat_mut(), ca.mat(), cb.mat(), 1.0, 0.0).unwrap();
    check("gemm bf16 odd", g, &gc, &c, &cc);
    // k = 0 scales c by beta.
    let (ga0, ca0) = pair(g, &c, &[], &[m, 0], DType::BF16);
    let (gb0, cb0) = pair(g, &c, &[], &[0, n], DType::BF16);
    g.gemm(gc.mat_mut(), ga0.mat(), gb0.mat(), 1.0, 0.5)
        .unwrap();
    c.gemm(cc.mat_mut(), ca0.mat(), cb0.mat(), 1.0, 0.5)
        .unwrap();
    check("gemm k=0", g, &gc, &c, &cc);
    // mismatched dtypes are an error, not a wrong answer.
    assert!(
        g.gemm(gc.mat_mut(), ga.mat(), gc_like(g, k, n).mat(), 1.0, 0.0)
            .is_err()
    );
}

fn gc_like(g: &CudaBackend, r: usize, cols: usize) -> Tensor<CudaBackend> {
    g.zeros(&[r, cols], DType::F32, Category::Workspace)
        .unwrap()
}

#[test]
fn copy_fill_axpy_sum_squares() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("copy");
    let (r, cols) = (37, 53);
    // bf16 transposed view -> f32 block of a wider buffer.
    let (gs, cs) = pair(g, &c, &rng.vec(r * cols, 2.0), &[cols, r], DType::BF16);
    let (mut gd, mut cd) = pair(
        g,
        &c,
        &rng.vec((r + 2) * (cols + 3), 1.0),
        &[r + 2, cols + 3],
        DType::F32,
    );
    let ld = MatLayout::block(cols + 3 + 1, r, cols, cols + 3);
    g.copy(gd.view_mut(ld), gs.mat().t()).unwrap();
    c.copy(cd.view_mut(ld), cs.mat().t()).unwrap();
    check("copy bf16^T -> f32 block", g, &gd, &c, &cd);
    // f32 -> bf16.
    let (mut gb, mut cb) = pair(
        g,
        &c,
        &vec![0.0; (r + 2) * (cols + 3)],
        &[r + 2, cols + 3],
        DType::BF16,
    );
    g.copy(gb.mat_mut(), gd.mat()).unwrap();
    c.copy(cb.mat_mut(), cd.mat()).unwrap();
    check("copy f32 -> bf16", g, &gb, &c, &cb);

    let fresh = rng.vec((r + 2) * (cols + 3), 1.0);
    g.upload(&mut gb, &fresh).unwrap();
    c.upload(&mut cb, &round(&fresh, DType::BF16)).unwrap();
    check("upload bf16", g, &gb, &c, &cb);
    assert!(
        g.upload(&mut gb, &fresh[1..]).is_err(),
        "upload checks the length"
    );

    g.fill(&mut gb, 0.375).unwrap();
    c.fill(&mut cb, 0.375).unwrap();
    check("fill", g, &gb, &c, &cb);

    // 4099: element by element; 4096 (bf16 both): 8 per load
    for n in [4099, 4096] {
        let (gx, cx) = pair(g, &c, &rng.vec(n, 1.0), &[n], DType::BF16);
        for ydt in [DType::F32, DType::BF16] {
            let (mut gy, mut cy) = pair(g, &c, &rng.vec(n, 1.0), &[n], ydt);
            g.axpy(&mut gy, -0.75, &gx).unwrap();
            c.axpy(&mut cy, -0.75, &cx).unwrap();
            check(&format!("axpy n={n} y={ydt:?}"), g, &gy, &c, &cy);
        }
    }
    let big = rng.vec(1 << 20, 1.0);
    let (gbig, cbig) = pair(g, &c, &big, &[1 << 20], DType::BF16);
    let (sg, sc) = (g.sum_squares(&gbig).unwrap(), c.sum_squares(&cbig).unwrap());
    eprintln!("sum_squares {sg} vs {sc}");
    assert!(((sg - sc) / sc).abs() < 1e-5, "sum_squares {sg} vs {sc}");
    // several tensors, one sync: bf16, f32 and empty ones, as a gradient norm reads them
    let (mut gf, cf) = pair(g, &c, &rng.vec(3001, 2.0), &[3001], DType::F32);
    let (ge, ce) = pair(g, &c, &[], &[0], DType::F32);
    let sg = g.sum_squares_all(&[&gbig, &ge, &gf]).unwrap();
    let sc = c.sum_squares(&cbig).unwrap() + c.sum_squares(&cf).unwrap();
    assert_eq!(c.sum_squares_all(&[&cbig, &ce, &cf]).unwrap(), sc);
    assert!(
        ((sg - sc) / sc).abs() < 1e-5,
        "sum_squares_all {sg} vs {sc}"
    );
    // a zero fill goes through the driver's memset
    g.fill(&mut gf, 0.0).unwrap();
    assert!(g.to_host(&gf).unwrap().iter().all(|&v| v.to_bits() == 0));
}

/// The q/k/v bias ops as the staged engine calls them: a head range's bias
/// row added to a block of a wider packed buffer, and its gradient (the
/// block's column sums) added into an F32 slice of the bias gradient; bf16
/// and f32 activations, a bias row of 2 heads out of 5, rows past a block of
/// 32 warps' stride; a bf16 block aligned for 8-element moves and one that
/// is not. Against the CPU.
#[test]
fn bias_rows_and_their_gradient_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("bias");
    let (d, heads, rows, wide) = (24, 5, 1037, 3 * 2 * 24);
    let bias_row = MatLayout::block(2 * d, 1, 2 * d, 2 * d);
    for (dt, skew) in [(DType::BF16, 0), (DType::BF16, 3), (DType::F32, 0)] {
        let block = MatLayout::block(2 * 24 + 7 * wide + skew, rows, 2 * d, wide);
        let (gb, cb) = pair(g, &c, &rng.vec(heads * d, 1.0), &[heads * d], dt);
        let n = (rows + 8) * wide;
        let (mut gx, mut cx) = pair(g, &c, &rng.vec(n, 1.0), &[rows + 8, wide], dt);
        g.add_bias_rows(gx.view_mut(block), gb.view(bias_row))
            .unwrap();
        c.add_bias_rows(cx.view_mut(block), cb.view(bias_row))
            .unwrap();
        check(
            &format!("add_bias_rows {dt:?} skew {skew}"),
            g,
            &gx,
            &c,
            &cx,
        );
        let (mut gdb, mut cdb) = pair(g, &c, &rng.vec(heads * d, 1.0), &[heads * d], DType::F32);
        g.bias_grad(gdb.view_mut(bias_row), gx.view(block)).unwrap();
        c.bias_grad(cdb.view_mut(bias_row), cx.view(block)).unwrap();
        check(&format!("bias_grad {dt:?} skew {skew}"), g, &gdb, &c, &cdb);
    }
    let block = MatLayout::block(2 * 24 + 7 * wide, rows, 2 * d, wide);
    let (gb, _) = pair(g, &c, &rng.vec(heads * d, 1.0), &[heads * d], DType::F32);
    let n = (rows + 8) * wide;
    let (mut gx, _) = pair(g, &c, &rng.vec(n, 1.0), &[rows + 8, wide], DType::F32);
    let narrow = MatLayout::block(0, 1, d, d);
    assert!(
        g.add_bias_rows(gx.view_mut(block), gb.view(narrow))
            .is_err(),
        "widths differ"
    );
}

/// Copies the attention layer makes most (head blocks of wide rows, casts of
/// gradients) take 16-byte vector paths when rows are aligned; misaligned
/// views take the element path. Both against the CPU.
#[test]
fn vector_copies_and_casts_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("vector copies");
    let (r, wide) = (37, 512);
    for (sdt, ddt) in [
        (DType::BF16, DType::BF16),
        (DType::F32, DType::F32),
        (DType::F32, DType::BF16),
        (DType::BF16, DType::F32),
    ] {
        let (gs, cs) = pair(g, &c, &rng.vec(r * wide, 1.0), &[r, wide], sdt);
        // (source column, destination column, columns): aligned head blocks,
        // then a block starting one element off (element path)
        for (sc, dc, cols) in [(128, 0, 128), (256, 64, 64), (1, 3, 64)] {
            let (mut gd, mut cd) = pair(g, &c, &rng.vec(r * 192, 1.0), &[r, 192], ddt);
            let from = MatLayout::block(sc, r, cols, wide);
            let to = MatLayout::block(dc, r, cols, 192);
            g.copy(gd.view_mut(to), gs.view(from)).unwrap();
            c.copy(cd.view_mut(to), cs.view(from)).unwrap();
            check(
                &format!("copy {sdt:?}->{ddt:?} cols {sc}..+{cols} -> {dc}"),
                g,
                &gd,
                &c,
                &cd,
            );
        }
    }
}

/// The bits of a tensor's values (bf16 widened to f32 exactly).
fn bits<B: Backend>(b: &B, t: &Tensor<B>) -> Vec<u32> {
    b.to_host(t).unwrap().iter().map(|x| x.to_bits()).collect()
}

/// The residual add fused into RMSNorm equals the unfused CUDA ops bit for
/// bit in bf16: `add_rms_norm_fwd` = `axpy` then `rms_norm_fwd` (the sum and
/// the norm), `rms_norm_bwd_add` = `rms_norm_bwd` into a temporary then
/// `axpy` (dx, with and without dw). dw is compared to 1e-5 only: its
/// cross-block atomic adds make its order vary from run to run, fused or
/// not. Row widths of 8-wide loads (2048, 896, 1000), element by element
/// (1001), dw too wide for shared memory (12000), more rows than the
/// backward's blocks (1100); and against the CPU's fused ops.
#[test]
fn fused_residual_norms_equal_the_unfused_ops() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("fused-norm");
    let bf = DType::BF16;
    for ((n, dim), norm) in [
        (9, 2048),
        (33, 896),
        (5, 1000),
        (7, 1001),
        (3, 12000),
        (1100, 512),
    ]
    .into_iter()
    .flat_map(|d| [RmsNorm::plain(1e-5), GEMMA_NORM].map(|m| (d, m)))
    {
        let tag = format!("n={n} dim={dim} offset={}", norm.weight_offset);
        let (gx, cx) = pair(g, &c, &rng.vec(n * dim, 3.0), &[n, dim], bf);
        let (gy, cy) = pair(g, &c, &rng.vec(n * dim, 2.0), &[n, dim], bf);
        let (gw, cw) = pair(g, &c, &rng.vec(dim, 1.0), &[dim], bf);
        let copy = |t: &Tensor<CudaBackend>| upipe::backend::cast(g, t, bf, Category::Workspace);
        let mut x1 = copy(&gx).unwrap();
        let mut out1 = g.zeros(&[n, dim], bf, Category::Workspace).unwrap();
        g.axpy(&mut x1, 1.0, &gy).unwrap();
        g.rms_norm_fwd(RmsNormFwd {
            x: &x1,
            w: &gw,
            norm,
            y: &mut out1,
        })
        .unwrap();
        let mut x2 = copy(&gx).unwrap();
        let mut out2 = g.zeros(&[n, dim], bf, Category::Workspace).unwrap();
        g.add_rms_norm_fwd(AddRmsNormFwd {
            x: &mut x2,
            y: &gy,
            w: &gw,
            norm,
            out: &mut out2,
        })
        .unwrap();
        assert_eq!(bits(g, &x1), bits(g, &x2), "add_rms_norm_fwd {tag}: sum");
        assert_eq!(
            bits(g, &out1),
            bits(g, &out2),
            "add_rms_norm_fwd {tag}: norm"
        );
        let mut cx2 = upipe::backend::cast(&c, &cx, DType::F32, Category::Workspace).unwrap();
        let mut cout = c.zeros(&[n, dim], DType::F32, Category::Workspace).unwrap();
        c.add_rms_norm_fwd(AddRmsNormFwd {
            x: &mut cx2,
            y: &cy,
            w: &cw,
            norm,
            out: &mut cout,
        })
        .unwrap();
        check(
            &format!("add_rms_norm_fwd {tag} vs cpu"),
            g,
            &out2,
            &c,
            &cout,
        );

        let (gdy, cdy) = pair(g, &c, &rng.vec(n * dim, 1.0), &[n, dim], bf);
        let (gres, cres) = pair(g, &c, &rng.vec(n * dim, 1.0), &[n, dim], bf);
        let dw0 = rng.vec(dim, 1.0);
        for with_dw in [true, false] {
            let (mut dw1, _) = pair(g, &c, &dw0, &[dim], DType::F32);
            let (mut dw2, mut cdw) = pair(g, &c, &dw0, &[dim], DType::F32);
            let mut t = g.zeros(&[n, dim], bf, Category::Workspace).unwrap();
            g.rms_norm_bwd(RmsNormBwd {
                x: &gx,
                w: &gw,
                dy: &gdy,
                norm,
                dx: &mut t,
                dw: with_dw.then_some(&mut dw1),
            })
            .unwrap();
            let mut dx1 = copy(&gres).unwrap();
            g.axpy(&mut dx1, 1.0, &t).unwrap();
            let mut dx2 = copy(&gres).unwrap();
            g.rms_norm_bwd_add(RmsNormBwd {
                x: &gx,
                w: &gw,
                dy: &gdy,
                norm,
                dx: &mut dx2,
                dw: with_dw.then_some(&mut dw2),
            })
            .unwrap();
            let what = format!("rms_norm_bwd_add {tag} dw={with_dw}");
            assert_eq!(bits(g, &dx1), bits(g, &dx2), "{what}: dx");
            let e = rel_err(&g.to_host(&dw2).unwrap(), &g.to_host(&dw1).unwrap());
            assert!(e <= 1e-5, "{what}: dw rel err {e:e}");
            let mut cdx = upipe::backend::cast(&c, &cres, DType::F32, Category::Workspace).unwrap();
            c.rms_norm_bwd_add(RmsNormBwd {
                x: &cx,
                w: &cw,
                dy: &cdy,
                norm,
                dx: &mut cdx,
                dw: with_dw.then_some(&mut cdw),
            })
            .unwrap();
            check(&format!("{what} vs cpu"), g, &dx2, &c, &cdx);
            check(&format!("{what} dw vs cpu"), g, &dw2, &c, &cdw);
        }
    }
}

#[test]
fn rms_norm_rope_gated_act() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("norm");
    // Shapes: one block per row; rows > blocks (row striding); dim too big for
    // shared dw; a dim that is no multiple of 8 (element by element, the others
    // move 8 bf16 per load).
    // the plain norm and Gemma's `1 + w`
    let norms = [RmsNorm::plain(1e-5), GEMMA_NORM];
    let shapes = [(19, 1000), (3000, 512), (5, 12000), (7, 1001)];
    for ((n, dim), norm) in shapes.into_iter().flat_map(|d| norms.map(|m| (d, m))) {
        let tag = format!("n={n} dim={dim} offset={}", norm.weight_offset);
        let (gx, cx) = pair(g, &c, &rng.vec(n * dim, 3.0), &[n, dim], DType::BF16);
        let (gw, cw) = pair(g, &c, &rng.vec(dim, 1.0), &[dim], DType::BF16);
        let (mut gy, mut cy) = pair(g, &c, &vec![0.0; n * dim], &[n, dim], DType::BF16);
        g.rms_norm_fwd(RmsNormFwd {
            x: &gx,
            w: &gw,
            norm,
            y: &mut gy,
        })
        .unwrap();
        c.rms_norm_fwd(RmsNormFwd {
            x: &cx,
            w: &cw,
            norm,
            y: &mut cy,
        })
        .unwrap();
        check(&format!("rms_norm_fwd {tag}"), g, &gy, &c, &cy);
        let (gdy, cdy) = pair(g, &c, &rng.vec(n * dim, 1.0), &[n, dim], DType::BF16);
        let (mut gdx, mut cdx) = pair(g, &c, &vec![0.0; n * dim], &[n, dim], DType::BF16);
        let dw0 = rng.vec(dim, 1.0);
        let (mut gdw, mut cdw) = pair(g, &c, &dw0, &[dim], DType::F32);
        g.rms_norm_bwd(RmsNormBwd {
            x: &gx,
            w: &gw,
            dy: &gdy,
            norm,
            dx: &mut gdx,
            dw: Some(&mut gdw),
        })
        .unwrap();
        c.rms_norm_bwd(RmsNormBwd {
            x: &cx,
            w: &cw,
            dy: &cdy,
            norm,
            dx: &mut cdx,
            dw: Some(&mut cdw),
        })
        .unwrap();
        check(&format!("rms_norm_bwd dx {tag}"), g, &gdx, &c, &cdx);
        check(
            &format!("rms_norm_bwd dw (accumulated) {tag}"),
            g,
            &gdw,
            &c,
            &cdw,
        );
        // a frozen norm weight (`dw: None`): the same dx, no dw written
        let (mut gdx2, _) = pair(g, &c, &vec![0.0; n * dim], &[n, dim], DType::BF16);
        g.rms_norm_bwd(RmsNormBwd {
            x: &gx,
            w: &gw,
            dy: &gdy,
            norm,
            dx: &mut gdx2,
            dw: None,
        })
        .unwrap();
        assert_eq!(
            g.to_host(&gdx2).unwrap(),
            g.to_host(&gdx).unwrap(),
            "rms_norm_bwd without dw {tag}: dx differs"
        );
    }

    // head dims 64 and 128: 8 pairs per thread; 12: pair by pair
    for (s, h, d) in [(23, 3, 64), (9, 2, 128), (11, 3, 12)] {
        let ang: Vec<f32> = rng.vec(s * d / 2, 3.0);
        let cos: Vec<f32> = ang.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin()).collect();
        let (gcos, ccos) = pair(g, &c, &cos, &[s, d / 2], DType::F32);
        let (gsin, csin) = pair(g, &c, &sin, &[s, d / 2], DType::F32);
        let (mut gq, mut cq) = pair(g, &c, &rng.vec(s * h * d, 1.0), &[s, h, d], DType::BF16);
        for inverse in [false, true] {
            g.rope(RopeRotate {
                x: &mut gq,
                cos: &gcos,
                sin: &gsin,
                inverse,
            })
            .unwrap();
            c.rope(RopeRotate {
                x: &mut cq,
                cos: &ccos,
                sin: &csin,
                inverse,
            })
            .unwrap();
            check(&format!("rope d={d} inverse={inverse}"), g, &gq, &c, &cq);
        }
    }

    // 5000: 8 bf16 per load; 5001: element by element
    for (m, act) in [5000, 5001]
        .into_iter()
        .flat_map(|m| [(m, GatedAct::Silu), (m, GatedAct::GeluTanh)])
    {
        let (gg, cg) = pair(g, &c, &rng.vec(m, 4.0), &[m], DType::BF16);
        let (gu, cu) = pair(g, &c, &rng.vec(m, 2.0), &[m], DType::BF16);
        let (mut go, mut co) = pair(g, &c, &vec![0.0; m], &[m], DType::BF16);
        g.gated_act_fwd(act, &gg, &gu, &mut go).unwrap();
        c.gated_act_fwd(act, &cg, &cu, &mut co).unwrap();
        check(&format!("gated_act_fwd {act:?} {m}"), g, &go, &c, &co);
        let (gd, cd) = pair(g, &c, &rng.vec(m, 1.0), &[m], DType::BF16);
        let (mut gdg, mut cdg) = pair(g, &c, &vec![0.0; m], &[m], DType::BF16);
        let (mut gdu, mut cdu) = pair(g, &c, &vec![0.0; m], &[m], DType::BF16);
        g.gated_act_bwd(act, &gg, &gu, &gd, &mut gdg, &mut gdu)
            .unwrap();
        c.gated_act_bwd(act, &cg, &cu, &cd, &mut cdg, &mut cdu)
            .unwrap();
        check(
            &format!("gated_act_bwd dgate {act:?} {m}"),
            g,
            &gdg,
            &c,
            &cdg,
        );
        check(&format!("gated_act_bwd dup {act:?} {m}"), g, &gdu, &c, &cdu);
    }
}

#[test]
fn embedding_cross_entropy_adamw() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("embed");
    let (vocab, hidden, n) = (301, 96, 77);
    let ids: Vec<u32> = (0..n).map(|_| rng.below(vocab as u32)).collect();
    let (gt, ct) = pair(
        g,
        &c,
        &rng.vec(vocab * hidden, 1.0),
        &[vocab, hidden],
        DType::BF16,
    );
    // unscaled, and Gemma 3 1B's √1152 (not a bf16 value: the products round)
    for scale in [1.0, 1152f32.sqrt()] {
        let (mut go, mut co) = pair(g, &c, &vec![0.0; n * hidden], &[n, hidden], DType::BF16);
        g.embedding_fwd(&gt, &ids, scale, &mut go).unwrap();
        c.embedding_fwd(&ct, &ids, scale, &mut co).unwrap();
        check("embedding_fwd", g, &go, &c, &co);
        let (gdo, cdo) = pair(g, &c, &rng.vec(n * hidden, 1.0), &[n, hidden], DType::BF16);
        let (mut gdt, mut cdt) = pair(
            g,
            &c,
            &rng.vec(vocab * hidden, 1.0),
            &[vocab, hidden],
            DType::F32,
        );
        g.embedding_bwd(&gdo, &ids, scale, &mut gdt).unwrap();
        c.embedding_bwd(&cdo, &ids, scale, &mut cdt).unwrap();
        check("embedding_bwd", g, &gdt, &c, &cdt);
    }
    match g.embedding_fwd(
        &gt,
        &[vocab as u32],
        1.0,
        &mut g
            .zeros(&[1, hidden], DType::BF16, Category::Workspace)
            .unwrap(),
    ) {
        Err(Error::Config(_)) => {}
        other => panic!("out-of-vocabulary id must be a Config error, got {other:?}"),
    }

    // 1543: element by element; 2056 (a multiple of 8): 8 bf16 per load
    for v in [1543, 2056] {
        let rows = 21;
        let mut targets: Vec<u32> = (0..rows).map(|_| rng.below(v as u32)).collect();
        targets[3] = IGNORE;
        targets[5] = v as u32 - 1;
        // in place: the gradient overwrites the logits
        let (mut gdl, mut cdl) = pair(g, &c, &rng.vec(rows * v, 6.0), &[rows, v], DType::BF16);
        let (mut gls, mut cls) = pair(g, &c, &[1.5], &[1], DType::F32);
        g.cross_entropy(&mut gdl, &targets, 0.25, &mut gls).unwrap();
        c.cross_entropy(&mut cdl, &targets, 0.25, &mut cls).unwrap();
        check(&format!("cross_entropy dlogits v {v}"), g, &gdl, &c, &cdl);
        check(&format!("cross_entropy loss_sum v {v}"), g, &gls, &c, &cls);
        let dl = g.to_host(&gdl).unwrap();
        assert!(
            dl[3 * v..4 * v].iter().all(|&x| x == 0.0),
            "ignored row has zero gradient"
        );
    }

    let np = 10_007;
    let (mut gp, mut cp) = pair(g, &c, &rng.vec(np, 1.0), &[np], DType::F32);
    let (gm_g, cm_g) = pair(g, &c, &rng.vec(np, 0.1), &[np], DType::F32);
    let (mut gm, mut cm) = pair(g, &c, &rng.vec(np, 0.01), &[np], DType::F32);
    let vv: Vec<f32> = rng.vec(np, 0.01).iter().map(|x| x.abs()).collect();
    let (mut gv, mut cv) = pair(g, &c, &vv, &[np], DType::F32);
    for step in 1..=3 {
        let hp = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 0.5,
        };
        g.adamw(&mut gp, &gm_g, &mut gm, &mut gv, 0..np, hp)
            .unwrap();
        c.adamw(&mut cp, &cm_g, &mut cm, &mut cv, 0..np, hp)
            .unwrap();
        // a sub-range (an FSDP shard's segment) leaves the rest untouched
        g.adamw(&mut gp, &gm_g, &mut gm, &mut gv, 100..5_003, hp)
            .unwrap();
        c.adamw(&mut cp, &cm_g, &mut cm, &mut cv, 100..5_003, hp)
            .unwrap();
    }
    check("adamw param", g, &gp, &c, &cp);
    check("adamw m", g, &gm, &c, &cm);
    check("adamw v", g, &gv, &c, &cv);
}

/// The multi-tensor AdamW against the per-piece kernel followed by the copy
/// that rounds the F32 master to the BF16 parameters (as the optimizer did
/// before): the same bits in masters, moments and parameters over 5 steps
/// of one call over three slots, with pieces of odd lengths and their own
/// weight decay, the first past element 0, gaps between them, 46 pieces
/// (two launches, a slot across both), flat and 2-D parameters (the copy's
/// element-wise and 8-wide casts), F32 parameters updated in place (no
/// write-back) beside BF16 ones, F32 and BF16 gradients, and pieces whose
/// start is and is not aligned for the kernel's 4-element loads.
#[test]
fn adamw_multi_is_bit_identical_to_adamw_per_piece_and_copy() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new("adamw_multi");
    let many: Vec<std::ops::Range<usize>> = (0..40).map(|k| k * 70 + 1..k * 70 + 18 + k).collect();
    let slots: [(Vec<usize>, Vec<std::ops::Range<usize>>); 3] = [
        (vec![10_007], vec![5..4_000, 4_000..4_001, 4_100..10_007]),
        (vec![2_800], many),
        (vec![64, 96], vec![0..96, 96..1_000, 1_003..6_144]),
    ];
    let wd = [0.1, 0.0, 0.05];
    for narrow in [[true, false, true], [false, true, false]] {
        let what = format!("adamw_multi narrow={narrow:?}");
        // [param, master, m, v] of each slot, for each way of updating
        let (mut one, mut multi, mut init) = (Vec::new(), Vec::new(), Vec::new());
        for ((shape, _), narrow) in slots.iter().zip(narrow) {
            let n: usize = shape.iter().product();
            let w = round(&rng.vec(n, 1.0), DType::BF16);
            let pdt = if narrow { DType::BF16 } else { DType::F32 };
            let t = |d: &[f32], dt| g.from_host(d, shape, dt, Category::Weights).unwrap();
            let zeros = vec![0.0; n];
            let fresh = || {
                [
                    t(&w, pdt),
                    t(&w, DType::F32),
                    t(&zeros, DType::F32),
                    t(&zeros, DType::F32),
                ]
            };
            one.push(fresh());
            multi.push(fresh());
            init.push(w);
        }
        for step in 1..=5 {
            // F32 gradients, and BF16 ones every other step
            let gdt = if step % 2 == 0 {
                DType::BF16
            } else {
                DType::F32
            };
            let grads: Vec<Tensor<CudaBackend>> = slots
                .iter()
                .map(|(shape, _)| {
                    let n = shape.iter().product();
                    g.from_host(&rng.vec(n, 0.1), shape, gdt, Category::Workspace)
                        .unwrap()
                })
                .collect();
            let pieces: Vec<Vec<(std::ops::Range<usize>, AdamWStep)>> = slots
                .iter()
                .map(|(_, ranges)| {
                    let hp = |k: usize| AdamWStep {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.95,
                        eps: 1e-8,
                        weight_decay: wd[k % 3],
                        step,
                        grad_scale: 0.5,
                    };
                    ranges
                        .iter()
                        .enumerate()
                        .map(|(k, r)| (r.clone(), hp(k)))
                        .collect()
                })
                .collect();
            for (s, [p, w, m, v]) in one.iter_mut().enumerate() {
                let target = if narrow[s] { &mut *w } else { &mut *p };
                for (r, hp) in &pieces[s] {
                    g.adamw(target, &grads[s], m, v, r.clone(), *hp).unwrap();
                }
                if narrow[s] {
                    g.copy(p.mat_mut(), w.mat()).unwrap();
                }
            }
            let mut update: Vec<AdamWSlot<'_, CudaBackend>> = multi
                .iter_mut()
                .enumerate()
                .map(|(s, [p, w, m, v])| {
                    let (target, narrow) = if narrow[s] { (w, Some(p)) } else { (p, None) };
                    AdamWSlot {
                        target,
                        grad: &grads[s],
                        m,
                        v,
                        narrow,
                        pieces: &pieces[s],
                        scales: None,
                        rounding_key: 0,
                    }
                })
                .collect();
            g.adamw_multi(&mut update).unwrap();
        }
        for (s, (a, b)) in one.iter().zip(multi.iter()).enumerate() {
            for (k, part) in ["param", "master", "m", "v"].iter().enumerate() {
                let (x, y) = (g.to_host(&a[k]).unwrap(), g.to_host(&b[k]).unwrap());
                let differ = x
                    .iter()
                    .zip(&y)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(
                    differ, None,
                    "{what}: slot {s} {part} differs at that element"
                );
            }
            let p = g.to_host(&b[0]).unwrap();
            let first = slots[s].1[0].start;
            assert_ne!(p[first], init[s][first], "{what}: slot {s} updated");
        }
    }
}

/// The backend's routed attention (bf16 inputs, `grad_dt` gradients) against
/// the CPU reference, forward and backward, on views starting past row 0.
#[allow(clippy::too_many_arguments)]
fn attention_case(
    g: &CudaBackend,
    c: &CpuBackend,
    rng: &mut Rng,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    grad_dt: DType,
) {
    let p = AttnProblem::new(rng, sq, sk, hq, hkv, d, causal);
    let tag = format!("attn {} grads={grad_dt:?}", p.tag());
    let (go, gl) = attn_fwd_on(g, DType::BF16, &p);
    let (co, cl) = attn_fwd_on(c, DType::F32, &p);
    close(&format!("{tag} o"), &go, &co);
    close(&format!("{tag} lse"), &gl, &cl);
    // backward from the CPU's o / lse (bf16-rounded o on both sides)
    let co = round(&co, DType::BF16);
    #[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
    let kblocks = [0..sk];
    for w in BWD_WRITES {
        let gg = attn_bwd_on(g, DType::BF16, grad_dt, &p, &co, &cl, &kblocks, w);
        let cg = attn_bwd_on(c, DType::F32, DType::F32, &p, &co, &cl, &kblocks, w);
        close(&format!("{tag} {w:?} dq"), &gg.0, &cg.0);
        close(&format!("{tag} {w:?} dk"), &gg.1, &cg.1);
        close(&format!("{tag} {w:?} dv"), &gg.2, &cg.2);
    }
}

#[test]
fn attention_fwd_bwd_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("attention");
    attention_case(g, &c, &mut rng, 150, 150, 4, 4, 64, true, DType::F32);
    attention_case(g, &c, &mut rng, 150, 150, 8, 2, 128, true, DType::BF16);
    attention_case(g, &c, &mut rng, 70, 200, 6, 3, 32, false, DType::F32);
    attention_case(g, &c, &mut rng, 129, 131, 2, 1, 256, false, DType::BF16);
}

#[test]
fn lse_merge_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("lse_merge");
    let (s, h, d) = (41, 5, 64);
    let (mut goa, mut coa) = pair(g, &c, &rng.vec(s * h * d, 1.0), &[s, h, d], DType::BF16);
    let (mut gla, mut cla) = pair(g, &c, &rng.vec(s * h, 3.0), &[s, h], DType::F32);
    let (gob, cob) = pair(g, &c, &rng.vec(s * h * d, 1.0), &[s, h, d], DType::BF16);
    let mut lb = rng.vec(s * h, 3.0);
    lb[7] = f32::NEG_INFINITY; // an empty block contributes nothing
    let (glb, clb) = pair(g, &c, &lb, &[s, h], DType::F32);
    let r = 2..s;
    g.lse_merge(LseMerge {
        o_acc: goa.rows_view_mut(r.clone()),
        lse_acc: gla.rows_view_mut(r.clone()),
        o_blk: gob.rows_view(r.clone()),
        lse_blk: glb.rows_view(r.clone()),
    })
    .unwrap();
    c.lse_merge(LseMerge {
        o_acc: coa.rows_view_mut(r.clone()),
        lse_acc: cla.rows_view_mut(r.clone()),
        o_blk: cob.rows_view(r.clone()),
        lse_blk: clb.rows_view(r.clone()),
    })
    .unwrap();
    check("lse_merge o", g, &goa, &c, &coa);
    check("lse_merge lse", g, &gla, &c, &cla);
}

#[test]
fn pool_and_ledger_agree_and_oom_is_an_error() {
    if gpu().is_none() {
        return;
    }
    // Its own backend so no other test's tensors are counted.
    let g = CudaBackend::new(0).unwrap();
    assert!(
        g.kernels_from_cache(),
        "the second backend reads the kernel cache"
    );
    g.reset_pool_peak().unwrap();
    g.ledger().reset_peak();
    let base = g.pool_stats().unwrap().used_current;
    {
        let a = g
            .zeros(&[64 << 20], DType::BF16, Category::Activations)
            .unwrap(); // 128 MiB
        let b = g.zeros(&[32 << 20], DType::F32, Category::Weights).unwrap(); // 128 MiB
        drop(a);
        let _c = g
            .zeros(&[16 << 20], DType::F32, Category::Workspace)
            .unwrap(); // 64 MiB
        let st = g.pool_stats().unwrap();
        assert_eq!(g.ledger().current(), (128 + 64) << 20);
        assert_eq!(g.ledger().peak(), 256 << 20);
        eprintln!("pool {st:?}, ledger peak {}", g.ledger().peak());
        let high = (st.used_high - base) as f64;
        let peak = g.ledger().peak() as f64;
        assert!(
            high >= peak && high <= peak * 1.01,
            "pool high-water {high} vs ledger peak {peak}"
        );
        drop(b);
    }
    assert_eq!(g.ledger().current(), 0);
    assert_eq!(
        g.pool_stats().unwrap().used_current,
        base,
        "drop returns device memory to the pool"
    );
    match g.zeros(&[1 << 36], DType::F32, Category::Activations) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 4usize << 36),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(
        g.ledger().current(),
        0,
        "a failed allocation records nothing"
    );
}

/// Backends of their own for the flash tests (exact call counters): one with
/// the flash kernels, one forced onto the naive kernels (the GPU oracle).
/// Held by each test that uses [`flash_pair`]: the tests count the calls
/// their cases make on the shared backends, which a test running beside
/// them would add to.
fn flash_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // a failed test poisons the lock; the next one still runs
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn flash_pair() -> Option<&'static (CudaBackend, CudaBackend)> {
    static B: OnceLock<Option<(CudaBackend, CudaBackend)>> = OnceLock::new();
    gpu()?;
    B.get_or_init(|| {
        let mut f = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
        f.set_attn_kernel(upipe::backend::cuda::cudnn::AttnKernel::Native);
        let n = CudaBackend::with_attention(0, AttentionKernels::Naive).unwrap();
        Some((f, n))
    })
    .as_ref()
}

/// The flash backend and its loaded kernels; `None` (a skip) without a GPU
/// or on a device the flash kernels do not run on.
fn flash_kernels() -> Option<(
    &'static CudaBackend,
    &'static upipe::backend::cuda::flash::FlashFunctions,
)> {
    let (f, _) = flash_pair()?;
    let funcs = f.flash_functions().unwrap();
    if funcs.is_none() {
        eprintln!("SKIP: no flash kernels on {}", f.arch());
    }
    Some((f, funcs?))
}

/// One attention problem on host data (bf16-representable values).
struct AttnProblem {
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    /// A documents mask in place of `causal` (`AttnMask::Bounded`).
    bounded: Option<AttnMask>,
    /// Rows of padding before each view (exercises row offsets).
    off: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
    /// Initial gradients (the backward accumulates into them).
    dq0: Vec<f32>,
    dk0: Vec<f32>,
    dv0: Vec<f32>,
}

impl AttnProblem {
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut Rng,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        causal: bool,
    ) -> AttnProblem {
        let off = 5;
        let r = |v: Vec<f32>| round(&v, DType::BF16);
        let (nq, nk) = ((sq + off) * hq * d, (sk + off) * hkv * d);
        AttnProblem {
            sq,
            sk,
            hq,
            hkv,
            d,
            causal,
            bounded: None,
            off,
            q: r(rng.vec(nq, 2.0)),
            k: r(rng.vec(nk, 2.0)),
            v: r(rng.vec(nk, 1.0)),
            d_o: r(rng.vec(nq, 1.0)),
            dq0: r(rng.vec(nq, 0.1)),
            dk0: r(rng.vec(nk, 0.1)),
            dv0: r(rng.vec(nk, 0.1)),
        }
    }
    fn mask(&self) -> AttnMask {
        if let Some(m) = &self.bounded {
            m.clone()
        } else if self.causal {
            AttnMask::Causal
        } else {
            AttnMask::Full
        }
    }
    fn tag(&self) -> String {
        format!(
            "sq={} sk={} hq={} hkv={} d={} mask={}",
            self.sq,
            self.sk,
            self.hq,
            self.hkv,
            self.d,
            self.mask()
        )
    }
}

/// Forward on `b` with inputs of dtype `dt`: (o, lse) of the whole padded tensors.
fn attn_fwd_on<B: Backend>(b: &B, dt: DType, p: &AttnProblem) -> (Vec<f32>, Vec<f32>) {
    let (off, hq, hkv, d) = (p.off, p.hq, p.hkv, p.d);
    let up = |x: &[f32], s: usize, h: usize| {
        b.from_host(x, &[s + off, h, d], dt, Category::Workspace)
            .unwrap()
    };
    let (q, k, v) = (up(&p.q, p.sq, hq), up(&p.k, p.sk, hkv), up(&p.v, p.sk, hkv));
    let mut o = b
        .zeros(&[p.sq + off, hq, d], dt, Category::Workspace)
        .unwrap();
    let mut lse = b
        .zeros(&[p.sq + off, hq], DType::F32, Category::Workspace)
        .unwrap();
    let (qr, kr) = (off..off + p.sq, off..off + p.sk);
    b.attention_fwd(AttentionFwd {
        q: q.rows_view(qr.clone()),
        k: k.rows_view(kr.clone()),
        v: v.rows_view(kr),
        mask: &p.mask(),
        scale: 1.0 / (d as f32).sqrt(),
        o: o.rows_view_mut(qr.clone()),
        lse: lse.rows_view_mut(qr),
    })
    .unwrap();
    (b.to_host(&o).unwrap(), b.to_host(&lse).unwrap())
}

/// The gradient writes every backward check runs: adding into the initial
/// gradients, and overwriting them with the first key block's call (later
/// blocks add, as ring attention's steps do).
const BWD_WRITES: [AttnGradWrites; 2] = [
    AttnGradWrites::ADD,
    AttnGradWrites {
        dq: GradWrite::Overwrite,
        dkv: GradWrite::Overwrite,
    },
];

/// Backward on `b` (inputs `dt`, gradients `grad_dt`) from the given o / lse of
/// the full rows, one call per key block of `kblocks` (ranges of keys), the
/// first with `writes`, the others adding: the (dq, dk, dv) of the whole
/// padded tensors.
#[allow(clippy::too_many_arguments)]
fn attn_bwd_on<B: Backend>(
    b: &B,
    dt: DType,
    grad_dt: DType,
    p: &AttnProblem,
    o: &[f32],
    lse: &[f32],
    kblocks: &[std::ops::Range<usize>],
    writes: AttnGradWrites,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (off, hq, hkv, d) = (p.off, p.hq, p.hkv, p.d);
    let up = |x: &[f32], s: usize, h: usize, dt: DType| {
        b.from_host(x, &[s + off, h, d], dt, Category::Workspace)
            .unwrap()
    };
    let (q, k, v) = (
        up(&p.q, p.sq, hq, dt),
        up(&p.k, p.sk, hkv, dt),
        up(&p.v, p.sk, hkv, dt),
    );
    let (o, d_o) = (up(o, p.sq, hq, dt), up(&p.d_o, p.sq, hq, dt));
    let lse = b
        .from_host(lse, &[p.sq + off, hq], DType::F32, Category::Workspace)
        .unwrap();
    let mut dq = up(&p.dq0, p.sq, hq, grad_dt);
    let mut dk = up(&p.dk0, p.sk, hkv, grad_dt);
    let mut dv = up(&p.dv0, p.sk, hkv, grad_dt);
    let qr = off..off + p.sq;
    for (i, kb) in kblocks.iter().enumerate() {
        let kr = off + kb.start..off + kb.end;
        b.attention_bwd(AttentionBwd {
            q: q.rows_view(qr.clone()),
            k: k.rows_view(kr.clone()),
            v: v.rows_view(kr.clone()),
            o: o.rows_view(qr.clone()),
            d_o: d_o.rows_view(qr.clone()),
            lse: lse.rows_view(qr.clone()),
            mask: &p.mask(),
            scale: 1.0 / (d as f32).sqrt(),
            dq: dq.rows_view_mut(qr.clone()),
            dk: dk.rows_view_mut(kr.clone()),
            dv: dv.rows_view_mut(kr),
            writes: if i == 0 { writes } else { AttnGradWrites::ADD },
        })
        .unwrap();
    }
    (
        b.to_host(&dq).unwrap(),
        b.to_host(&dk).unwrap(),
        b.to_host(&dv).unwrap(),
    )
}

/// LSEs equal: -inf (a row that sees no key) at the same rows, the rest close.
fn close_lse(name: &str, got: &[f32], want: &[f32]) {
    let finite = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| if x == f32::NEG_INFINITY { 0.0 } else { x })
            .collect()
    };
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let (ai, bi) = (a == f32::NEG_INFINITY, b == f32::NEG_INFINITY);
        assert_eq!(ai, bi, "{name}: lse[{i}] {a} where the reference has {b}");
    }
    close(name, &finite(got), &finite(want));
}

fn close(name: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want);
    eprintln!("{name}: rel err {e:.2e}");
    assert!(e <= TOL, "{name}: rel err {e:.3e} > {TOL}");
}

/// Forward and backward on `subject` against the CPU reference and against
/// `oracle` (a GPU backend on other kernels), all in bf16 except the CPU; the
/// backward starts from the CPU's o / lse (bf16-rounded o) on every side.
fn compare_kernels(
    tag: &str,
    (subject, oracle, oracle_name): (&CudaBackend, &CudaBackend, &str),
    p: &AttnProblem,
    grad_dt: DType,
    kblocks: &[std::ops::Range<usize>],
) {
    let c = CpuBackend::new();
    let (so, sl) = attn_fwd_on(subject, DType::BF16, p);
    let (oo, ol) = attn_fwd_on(oracle, DType::BF16, p);
    let (co, cl) = attn_fwd_on(&c, DType::F32, p);
    close(&format!("{tag} o vs cpu"), &so, &co);
    close_lse(&format!("{tag} lse vs cpu"), &sl, &cl);
    close(&format!("{tag} o vs {oracle_name}"), &so, &oo);
    close_lse(&format!("{tag} lse vs {oracle_name}"), &sl, &ol);
    let co = round(&co, DType::BF16);
    for w in BWD_WRITES {
        let sg = attn_bwd_on(subject, DType::BF16, grad_dt, p, &co, &cl, kblocks, w);
        let og = attn_bwd_on(oracle, DType::BF16, grad_dt, p, &co, &cl, kblocks, w);
        let cg = attn_bwd_on(&c, DType::F32, DType::F32, p, &co, &cl, kblocks, w);
        for (name, sx, ox, cx) in [
            ("dq", &sg.0, &og.0, &cg.0),
            ("dk", &sg.1, &og.1, &cg.1),
            ("dv", &sg.2, &og.2, &cg.2),
        ] {
            close(&format!("{tag} {w:?} {name} vs cpu"), sx, cx);
            close(&format!("{tag} {w:?} {name} vs {oracle_name}"), sx, ox);
        }
    }
}

/// Flash forward and backward through the backend against the CPU reference
/// and against the naive kernels (GPU oracle); `kblocks` splits the backward
/// into key blocks that all use the full rows' o / lse.
fn flash_case(
    rng: &mut Rng,
    dims: (usize, usize, usize, usize, usize),
    causal: bool,
    grad_dt: DType,
    kblocks: &[std::ops::Range<usize>],
) {
    let (f, n) = flash_pair().expect("checked by the caller");
    let (sq, sk, hq, hkv, d) = dims;
    let p = AttnProblem::new(rng, sq, sk, hq, hkv, d, causal);
    let tag = format!("flash {} grads={grad_dt:?} blocks={kblocks:?}", p.tag());
    let before = f.attention_calls();
    compare_kernels(&tag, (f, n, "naive"), &p, grad_dt, kblocks);
    let after = f.attention_calls();
    assert_eq!(
        after.flash_fwd - before.flash_fwd,
        1,
        "{tag}: forward ran on the flash kernels"
    );
    assert_eq!(
        after.flash_bwd - before.flash_bwd,
        (BWD_WRITES.len() * kblocks.len()) as u64,
        "{tag}: backward ran on the flash kernels"
    );
    assert_eq!(
        after.naive_fwd + after.naive_bwd,
        before.naive_fwd + before.naive_bwd
    );
}

#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn flash_attention_through_the_backend_matches_cpu_and_naive() {
    let _serial = flash_serial();
    let Some((f, n)) = flash_pair() else { return };
    let cc9 = f
        .arch()
        .trim_start_matches("sm_")
        .parse::<u32>()
        .unwrap_or(0)
        >= 90;
    if !cc9 {
        eprintln!("SKIP flash attention: {} is below sm_90", f.arch());
        return;
    }
    assert!(f.flash_functions().unwrap().is_some());
    assert!(n.flash_functions().unwrap().is_none());
    let mut rng = Rng::new("flash attention");
    // (sq, sk, hq, hkv, d): odd lengths, GQA, every head dim, causal and full.
    flash_case(&mut rng, (300, 300, 4, 4, 64), true, DType::F32, &[0..300]);
    // Head dim 256 (Gemma 3): its own tiles (8 forward warps of 16 rows,
    // 64-key backward blocks): two key blocks and a tail, GQA, both masks.
    flash_case(
        &mut rng,
        (333, 333, 8, 4, 256),
        true,
        DType::BF16,
        &[0..333],
    );
    flash_case(
        &mut rng,
        (129, 200, 4, 1, 256),
        false,
        DType::F32,
        &[0..200],
    );
    flash_case(
        &mut rng,
        (150, 390, 4, 2, 256),
        false,
        DType::BF16,
        &[0..64, 64..65, 65..390],
    );
    flash_case(
        &mut rng,
        (257, 257, 8, 2, 128),
        true,
        DType::BF16,
        &[0..257],
    );
    flash_case(&mut rng, (77, 333, 6, 3, 64), false, DType::BF16, &[0..333]);
    flash_case(&mut rng, (1, 129, 2, 1, 128), false, DType::F32, &[0..129]);
    flash_case(&mut rng, (640, 640, 4, 1, 128), true, DType::F32, &[0..640]);
    // Key-block backward (as ring attention does): the lse / o of the full rows,
    // three key blocks of odd sizes accumulating into one dq.
    flash_case(
        &mut rng,
        (200, 517, 4, 2, 128),
        false,
        DType::F32,
        &[0..130, 130..131, 131..517],
    );
    flash_case(
        &mut rng,
        (150, 390, 8, 8, 64),
        false,
        DType::BF16,
        &[0..256, 256..390],
    );
}

/// Documents masks on the flash kernels (every head dim: mma.sync for 64 and 256,
/// wgmma on sm_90 for 128) against the CPU reference and the naive kernels:
/// whole windows of documents that start mid-tile, of one token, longer than
/// a tile; ring blocks whose rows are two runs of positions, with rows that
/// see no key (O = 0, LSE = -inf) and tiles with none.
#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn flash_documents_masks_match_cpu_and_naive() {
    use upipe::backend::mask::{BoundedMask, RowPositions};
    let _serial = flash_serial();
    let Some((f, n)) = flash_pair() else { return };
    if f.flash_functions().unwrap().is_none() {
        eprintln!("SKIP flash documents: no flash kernels on {}", f.arch());
        return;
    }
    let mut rng = Rng::new("flash documents");
    let starts: &[u32] = &[0, 1, 64, 200, 201, 450, 599];
    let window = BoundedMask::documents(starts, 600).unwrap();
    let ring_rows = RowPositions::two_runs(0..150, 450..600);
    let cases: Vec<(BoundedMask, (usize, usize, usize))> = vec![
        (window.clone(), (4, 2, 64)),
        (window.clone(), (8, 2, 128)),
        (window.clone(), (4, 2, 256)),
        (window.with_rows(ring_rows, ring_rows), (2, 1, 256)),
        (window.with_rows(ring_rows, ring_rows), (4, 4, 128)),
        (
            window.with_rows(
                RowPositions::contiguous(300, 300),
                RowPositions::contiguous(0, 300),
            ),
            (4, 1, 64),
        ),
        (
            window.with_rows(
                RowPositions::contiguous(300, 300),
                RowPositions::contiguous(0, 300),
            ),
            (4, 2, 128),
        ),
        (BoundedMask::documents(&[0], 333).unwrap(), (2, 1, 128)),
    ];
    for (mask, (hq, hkv, d)) in cases {
        let (q, k) = mask.rows();
        let mut p = AttnProblem::new(&mut rng, q.len(), k.len(), hq, hkv, d, false);
        p.bounded = Some(AttnMask::Bounded(mask));
        for grad_dt in [DType::F32, DType::BF16] {
            let tag = format!("flash {} grads={grad_dt:?}", p.tag());
            let before = f.attention_calls();
            compare_kernels(&tag, (f, n, "naive"), &p, grad_dt, &[0..p.sk]);
            let after = f.attention_calls();
            assert_eq!(
                after.flash_fwd - before.flash_fwd,
                1,
                "{tag}: flash forward"
            );
            assert_eq!(after.naive_fwd, before.naive_fwd, "{tag}: no naive forward");
        }
    }
}

/// Sliding windows (Mistral's `sliding_window`) on the flash kernels (every
/// head dim) against the CPU reference and the naive kernels: a window
/// alone (lower bounds that move every row, within a tile and across
/// tiles), a window composed with documents, and ring blocks of two runs of
/// positions where whole tiles lie outside every row's window.
#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn flash_sliding_windows_match_cpu_and_naive() {
    use upipe::backend::mask::{BoundedMask, RowPositions};
    let _serial = flash_serial();
    let Some((f, n)) = flash_pair() else { return };
    if f.flash_functions().unwrap().is_none() {
        eprintln!("SKIP flash windows: no flash kernels on {}", f.arch());
        return;
    }
    let mut rng = Rng::new("flash sliding windows");
    let alone = BoundedMask::documents(&[0], 600)
        .unwrap()
        .with_window(100)
        .unwrap();
    let with_docs = BoundedMask::documents(&[0, 1, 64, 200, 201, 450, 599], 600)
        .unwrap()
        .with_window(37)
        .unwrap();
    let ring_rows = RowPositions::two_runs(0..150, 450..600);
    let cases: Vec<(BoundedMask, (usize, usize, usize))> = vec![
        (alone.clone(), (4, 2, 64)),
        (alone.clone(), (8, 2, 128)),
        (alone.clone(), (4, 2, 256)),
        (with_docs.clone(), (2, 1, 256)),
        (with_docs.clone(), (4, 1, 128)),
        (with_docs.with_rows(ring_rows, ring_rows), (4, 4, 64)),
        (alone.with_rows(ring_rows, ring_rows), (4, 2, 128)),
        (
            alone.with_rows(
                RowPositions::contiguous(300, 300),
                RowPositions::contiguous(0, 300),
            ),
            (4, 2, 128),
        ),
    ];
    for (mask, (hq, hkv, d)) in cases {
        let (q, k) = mask.rows();
        let mut p = AttnProblem::new(&mut rng, q.len(), k.len(), hq, hkv, d, false);
        p.bounded = Some(AttnMask::Bounded(mask));
        for grad_dt in [DType::F32, DType::BF16] {
            let tag = format!("flash window {} grads={grad_dt:?}", p.tag());
            let before = f.attention_calls();
            compare_kernels(&tag, (f, n, "naive"), &p, grad_dt, &[0..p.sk]);
            let after = f.attention_calls();
            assert_eq!(
                after.flash_fwd - before.flash_fwd,
                1,
                "{tag}: flash forward"
            );
        }
    }
}

/// On compute capability 9.0 the backend loads the wgmma forward and runs it
/// for head dim 128 (unless `UPIPE_FLASH_FWD=mma`); the mma.sync forward stays
/// for head dims 64 and 256.
#[test]
fn flash_forward_kernel_choice() {
    use upipe::backend::cuda::flash::{FlashKernel, fwd_kernel_from_env};
    let _serial = flash_serial();
    let Some((f, funcs)) = flash_kernels() else {
        return;
    };
    let choice = fwd_kernel_from_env().unwrap();
    eprintln!(
        "{}: UPIPE_FLASH_FWD={choice:?}, wgmma forward loaded: {}",
        f.arch(),
        funcs.has_wgmma()
    );
    assert_eq!(funcs.fwd_kernel_for(64).unwrap(), FlashKernel::Mma);
    assert_eq!(funcs.fwd_kernel_for(256).unwrap(), FlashKernel::Mma);
    let want = if f.arch() == "sm_90" && choice != FlashKernel::Mma {
        FlashKernel::Wgmma
    } else {
        FlashKernel::Mma
    };
    assert_eq!(funcs.fwd_kernel_for(128).unwrap(), want);
}

/// The wgmma backward is loaded on compute capability 9.0 unless
/// `UPIPE_FLASH_BWD=mma`, and then runs for head dim 128 (`auto`, the
/// default, and `wgmma`).
#[test]
fn flash_backward_kernel_choice() {
    use upipe::backend::cuda::flash::{FlashKernel, bwd_kernel_from_env};
    let _serial = flash_serial();
    let Some((f, funcs)) = flash_kernels() else {
        return;
    };
    let choice = bwd_kernel_from_env().unwrap();
    eprintln!(
        "{}: UPIPE_FLASH_BWD={choice:?}, wgmma backward loaded: {}",
        f.arch(),
        funcs.has_wgmma_bwd()
    );
    assert_eq!(funcs.bwd_kernel_for(64).unwrap(), FlashKernel::Mma);
    assert_eq!(funcs.bwd_kernel_for(256).unwrap(), FlashKernel::Mma);
    if choice != FlashKernel::Mma && f.arch() == "sm_90" {
        assert!(
            funcs.has_wgmma_bwd(),
            "UPIPE_FLASH_BWD={choice:?} must load the kernel on sm_90"
        );
    }
    if choice == FlashKernel::Mma {
        assert!(
            !funcs.has_wgmma_bwd(),
            "UPIPE_FLASH_BWD=mma must not load the wgmma backward"
        );
    }
    if choice == FlashKernel::Wgmma && !funcs.has_wgmma_bwd() {
        // Not an sm_90 device: asking for the wgmma backward is an error.
        assert!(funcs.bwd_kernel_for(128).is_err());
        return;
    }
    let want = if choice != FlashKernel::Mma && funcs.has_wgmma_bwd() {
        FlashKernel::Wgmma
    } else {
        FlashKernel::Mma
    };
    assert_eq!(funcs.bwd_kernel_for(128).unwrap(), want);
}

#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn attention_outside_the_flash_kernels_runs_naive() {
    if gpu().is_none() {
        return;
    }
    // Its own backend: exact call counts while other tests run.
    let mut f = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    f.set_attn_kernel(upipe::backend::cuda::cudnn::AttnKernel::Native);
    let f = &f;
    let c = CpuBackend::new();
    let mut rng = Rng::new("attention routing");
    let before = f.attention_calls();
    // f32 inputs and a head dim the flash kernels do not take.
    for (dt, d) in [(DType::F32, 64), (DType::BF16, 96)] {
        let p = AttnProblem::new(&mut rng, 70, 70, 4, 2, d, true);
        let (fo, fl) = attn_fwd_on(f, dt, &p);
        let (co, cl) = attn_fwd_on(&c, DType::F32, &p);
        close(&format!("routing {dt:?} d={d} o"), &fo, &co);
        close(&format!("routing {dt:?} d={d} lse"), &fl, &cl);
        let add = AttnGradWrites::ADD;
        let g = attn_bwd_on(f, dt, DType::F32, &p, &co, &cl, &[0..70], add);
        let cg = attn_bwd_on(&c, DType::F32, DType::F32, &p, &co, &cl, &[0..70], add);
        close(&format!("routing {dt:?} d={d} dq"), &g.0, &cg.0);
        close(&format!("routing {dt:?} d={d} dk"), &g.1, &cg.1);
        close(&format!("routing {dt:?} d={d} dv"), &g.2, &cg.2);
    }
    let after = f.attention_calls();
    assert_eq!(after.naive_fwd - before.naive_fwd, 2);
    assert_eq!(after.naive_bwd - before.naive_bwd, 2);
}

/// (sq, sk, hq, hkv, d), causal, gradient dtype, key blocks of the backward.
type CudnnCase = (
    (usize, usize, usize, usize, usize),
    bool,
    DType,
    &'static [std::ops::Range<usize>],
);

/// cuDNN SDPA through the backend (`--attn-kernel auto`) against the CPU
/// reference and against our flash kernels, on the shapes the flash test
/// uses; every call must run (cuDNN where it supports the shape, our kernels
/// otherwise: never an error).
#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn cudnn_attention_through_the_backend_matches_cpu_and_native() {
    // its own native backend: the flash test asserts on the shared one's call
    // counters, and the two tests run at the same time
    let Some((native, auto, version)) = native_and_cudnn("cuDNN attention") else {
        return;
    };
    eprintln!("cuDNN {version:?}");
    let (native, auto) = (&native, &auto);
    let mut rng = Rng::new("cudnn attention");
    let cases: [CudnnCase; 9] = [
        ((300, 300, 4, 4, 64), true, DType::F32, &[0..300]),
        // Gemma 3's head dim (1B-12B)
        ((300, 300, 4, 2, 256), true, DType::BF16, &[0..300]),
        ((129, 384, 2, 1, 256), false, DType::F32, &[0..384]),
        ((257, 257, 8, 2, 128), true, DType::BF16, &[0..257]),
        ((77, 333, 6, 3, 64), false, DType::BF16, &[0..333]),
        ((1, 129, 2, 1, 128), false, DType::F32, &[0..129]),
        ((640, 640, 4, 1, 128), true, DType::F32, &[0..640]),
        ((512, 512, 8, 2, 64), false, DType::BF16, &[0..512]),
        // ring attention's key blocks accumulating into one dq
        (
            (200, 517, 4, 2, 128),
            false,
            DType::F32,
            &[0..130, 130..131, 131..517],
        ),
    ];
    let mut on_cudnn = 0;
    for ((sq, sk, hq, hkv, d), causal, grad_dt, kblocks) in cases {
        let p = AttnProblem::new(&mut rng, sq, sk, hq, hkv, d, causal);
        let tag = format!("cudnn {} grads={grad_dt:?} blocks={kblocks:?}", p.tag());
        let before = auto.attention_calls();
        compare_kernels(&tag, (auto, native, "native"), &p, grad_dt, kblocks);
        let after = auto.attention_calls();
        let (cf, cb) = (
            after.cudnn_fwd - before.cudnn_fwd,
            after.cudnn_bwd - before.cudnn_bwd,
        );
        let ours = (after.flash_fwd + after.naive_fwd) - (before.flash_fwd + before.naive_fwd);
        let ours_b = (after.flash_bwd + after.naive_bwd) - (before.flash_bwd + before.naive_bwd);
        eprintln!(
            "{tag}: forward on cuDNN {cf}, ours {ours}; backward on cuDNN {cb}, ours {ours_b}"
        );
        assert_eq!(cf + ours, 1, "{tag}: one forward call");
        assert_eq!(
            cb + ours_b,
            (BWD_WRITES.len() * kblocks.len()) as u64,
            "{tag}: one call per key block and gradient write"
        );
        on_cudnn += cf + cb;
    }
    assert!(on_cudnn > 0, "cuDNN served none of the shapes");
}

/// A backend on our kernels (`--attn-kernel native`) and one on `auto`
/// with cuDNN loaded, and cuDNN's version; `None` (the test skips, saying
/// why) without a GPU or a usable cuDNN.
fn native_and_cudnn(what: &str) -> Option<(CudaBackend, CudaBackend, usize)> {
    gpu()?;
    let mut native = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    native.set_attn_kernel(AttnKernel::Native);
    let mut auto = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    auto.set_attn_kernel(AttnKernel::Auto);
    let version = match auto.cudnn_sdpa() {
        Ok(c) => c.version(),
        Err(e) => {
            eprintln!("SKIP {what}: {e}");
            return None;
        }
    };
    Some((native, auto, version))
}

/// A call under a bounded mask, its heads `(hq, hkv, d)`, and whether
/// cuDNN takes it (forward and every backward write).
type BoundedCase = (
    upipe::backend::mask::BoundedMask,
    (usize, usize, usize),
    bool,
);

/// Each case against the CPU reference and the flash kernels (`native`) on
/// `subject(i)` (the i-th case's backend), with F32 gradients over the
/// whole key range: its forward and each backward write on cuDNN when the
/// case says so, none there otherwise.
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn compare_bounded_cases<'a>(
    what: &str,
    rng: &mut Rng,
    cases: Vec<BoundedCase>,
    subject: impl Fn(usize) -> &'a CudaBackend,
    native: &CudaBackend,
) {
    for (i, (mask, (hq, hkv, d), on_cudnn)) in cases.into_iter().enumerate() {
        let (q, k) = mask.rows();
        let mut p = AttnProblem::new(rng, q.len(), k.len(), hq, hkv, d, false);
        p.bounded = Some(AttnMask::Bounded(mask));
        let tag = format!("{what} {}", p.tag());
        let b = subject(i);
        let before = b.attention_calls();
        compare_kernels(&tag, (b, native, "flash"), &p, DType::F32, &[0..p.sk]);
        let after = b.attention_calls();
        let (cf, cb) = (
            after.cudnn_fwd - before.cudnn_fwd,
            after.cudnn_bwd - before.cudnn_bwd,
        );
        eprintln!("{tag}: cuDNN forward {cf}, backward {cb}");
        let want = if on_cudnn { 1 } else { 0 };
        assert_eq!(cf, want, "{tag}: forward on cuDNN");
        assert_eq!(
            cb,
            want * BWD_WRITES.len() as u64,
            "{tag}: backward on cuDNN"
        );
    }
}

/// A sliding window over one document is a causal band, which cuDNN's
/// SDPA graphs take (its left bound): forward and backward equal the CPU
/// reference and the flash kernels, windows shorter than a tile and over
/// several tiles, with GQA; a window composed with documents, and a ring
/// block of two runs, stay on the flash kernels.
#[test]
fn cudnn_sliding_windows_match_cpu_and_flash() {
    use upipe::backend::mask::{BoundedMask, RowPositions};
    let Some((native, auto, _)) = native_and_cudnn("cuDNN windows") else {
        return;
    };
    let mut rng = Rng::new("cudnn sliding windows");
    let s = 640;
    let window = |w: usize| {
        BoundedMask::documents(&[0], s)
            .unwrap()
            .with_window(w)
            .unwrap()
    };
    let ring = RowPositions::two_runs(0..160, 480..640);
    let cases: Vec<BoundedCase> = vec![
        (window(100), (4, 2, 64), true),
        (window(37), (8, 2, 128), true),
        (window(300), (4, 4, 128), true),
        (window(1000), (4, 1, 64), true),
        (
            BoundedMask::documents(&[0, 200, 201], s)
                .unwrap()
                .with_window(50)
                .unwrap(),
            (4, 2, 64),
            false,
        ),
        (window(100).with_rows(ring, ring), (4, 2, 128), false),
    ];
    compare_bounded_cases("cudnn window", &mut rng, cases, |_| &auto, &native);
}

/// Several documents in one call run on cuDNN's ragged path (cuDNN 9.10
/// and newer): forward O and LSE and dQ, dK, dV equal the CPU reference
/// and the flash kernels for documents of 1, 37, 300 and 1000 rows, a call
/// whose rows begin inside a document, one document over the whole call,
/// with GQA and without, head dims 64 and 128; a ring block of two runs
/// stays on the flash kernels. A run with documents decides cuDNN and
/// serves them there. Prints each ragged plan's workspace against the
/// planner's figures (forward 0, backward `estimated_bwd_plan_workspace`).
#[test]
fn cudnn_documents_match_cpu_and_flash() {
    use upipe::backend::cuda::cudnn::{self, AttentionKernel, decide_run_kernel};
    use upipe::backend::mask::{BoundedMask, RowPositions};
    let Some((native, auto, version)) = native_and_cudnn("cuDNN documents") else {
        return;
    };
    if version < cudnn::ragged::FIRST_RAGGED_VERSION {
        eprintln!("SKIP cuDNN documents: cuDNN {version} is older than 9.10");
        return;
    }
    // the run-level decision: documents on cuDNN, served there call by call
    let facts = CudaBackend::kernel_facts(0, 128, true).unwrap();
    let decided = decide_run_kernel(AttnKernel::Auto, &facts).unwrap();
    assert_eq!(decided.kernel, AttentionKernel::Cudnn { version });
    let mut run = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    run.set_attention_kernel(decided.kernel);

    let mut rng = Rng::new("cudnn documents");
    let docs = BoundedMask::documents(&[0, 1, 38, 338], 1338).unwrap();
    let mid = RowPositions::contiguous(150, 700);
    let ring = RowPositions::two_runs(0..400, 938..1338);
    // (mask, (hq, hkv, d), forward and backward on cuDNN)
    let cases: Vec<BoundedCase> = vec![
        (docs.clone(), (8, 2, 128), true),
        (docs.clone(), (4, 2, 64), true),
        (docs.clone(), (4, 4, 128), true),
        (docs.with_rows(mid, mid), (4, 1, 64), true),
        (
            BoundedMask::documents(&[0, 300, 337], 1338).unwrap(),
            (8, 2, 64),
            true,
        ),
        (
            BoundedMask::documents(&[0], 1024).unwrap(),
            (8, 2, 128),
            true,
        ),
        (docs.with_rows(ring, ring), (4, 2, 128), false),
    ];
    // the first case on the run's decided kernel, the others on `auto`
    let subject = |i: usize| if i == 0 { &run } else { &auto };
    compare_bounded_cases("cudnn documents", &mut rng, cases, subject, &native);
    for b in [&run, &auto] {
        let builds = b.cudnn_sdpa().unwrap().plan_builds();
        for pb in builds.iter().filter(|pb| pb.shape.ragged.is_some()) {
            let planned = match pb.bwd {
                false => 0,
                true => cudnn::estimated_bwd_plan_workspace(&pb.shape),
            };
            eprintln!(
                "ragged plan bwd={} {:?} hq {} hkv {} d {}: workspace {} (planned {planned}), \
                 built in {:.1} ms, {}",
                pb.bwd,
                pb.shape.ragged,
                pb.shape.hq,
                pb.shape.hkv,
                pb.shape.d,
                pb.workspace,
                pb.build_ms,
                pb.engine
            );
        }
    }
}

/// Documents of a mean of `mean` tokens filling `total` (lengths drawn
/// from an exponential distribution, at least 64; the last one fills up),
/// from a fixed seed: the same mix on every run.
fn document_mix(total: usize, mean: f64) -> Vec<u32> {
    let mut rng = upipe::rng::Rng::new(8192);
    let mut starts = vec![0u32];
    let mut at = 0usize;
    loop {
        let len = (-(1.0 - rng.uniform()).ln() * mean).max(64.0) as usize;
        if at + len >= total {
            return starts;
        }
        at += len;
        starts.push(at as u32);
    }
}

/// Median milliseconds of `runs` calls of `f` after one warm-up, each
/// synchronized.
fn time_ms(b: &CudaBackend, runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    b.synchronize().unwrap();
    let mut ms: Vec<f64> = (0..runs)
        .map(|_| {
            let t0 = std::time::Instant::now();
            f();
            b.synchronize().unwrap();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[runs / 2]
}

/// Documents on cuDNN against the flash kernels, timed: 128K tokens of
/// documents with a mean of 8K (`UPIPE_DOC_TOKENS`, `UPIPE_DOC_MEAN`),
/// Llama 3.2 1B's heads (32 over 8, d 64) and Llama 3.1 8B's (32 over 8,
/// d 128), one call over the whole window, gradients as the engine asks
/// for them (cuDNN: bf16 overwritten in place; flash: f32 added into);
/// prints a table of the median forward and backward of 5 calls each.
#[test]
fn cudnn_documents_timing_against_flash() {
    use upipe::backend::mask::BoundedMask;
    if gpu().is_none() {
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let total = env("UPIPE_DOC_TOKENS", 131_072);
    let mean = env("UPIPE_DOC_MEAN", 8192) as f64;
    let mut native = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    native.set_attn_kernel(AttnKernel::Native);
    let mut cudnn = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    cudnn.set_attn_kernel(AttnKernel::Cudnn);
    match cudnn.cudnn_sdpa().map(|c| c.version()) {
        Ok(v) if v >= upipe::backend::cuda::cudnn::ragged::FIRST_RAGGED_VERSION => {}
        Ok(v) => {
            eprintln!("SKIP documents timing: cuDNN {v} takes no documents");
            return;
        }
        Err(e) => {
            eprintln!("SKIP documents timing: {e}");
            return;
        }
    }
    let starts = document_mix(total, mean);
    let mask = AttnMask::Bounded(BoundedMask::documents(&starts, total).unwrap());
    eprintln!(
        "documents timing: {} documents over {total} tokens (mean {:.0})",
        starts.len(),
        total as f64 / starts.len() as f64
    );
    eprintln!("| heads (q/kv) | d | kernel | forward ms | backward ms | fwd+bwd ms |");
    eprintln!("|---|---|---|---|---|---|");
    for (hq, hkv, d) in [(32, 8, 64), (32, 8, 128)] {
        let mut both = Vec::new();
        let overwrite = BWD_WRITES[1];
        let runs = [
            ("flash", &native, DType::F32, AttnGradWrites::ADD),
            ("cudnn", &cudnn, DType::BF16, overwrite),
        ];
        for (name, b, grad_dt, writes) in runs {
            let mut rng = Rng::new("documents timing");
            // random rows of each width, shared by Q and dO, K and V
            let (rq, rkv) = (rng.vec(total * hq * d, 1.0), rng.vec(total * hkv * d, 1.0));
            let up = |x: &[f32], h: usize| {
                b.from_host(x, &[total, h, d], DType::BF16, Category::Workspace)
                    .unwrap()
            };
            let (q, k, v, d_o) = (up(&rq, hq), up(&rkv, hkv), up(&rkv, hkv), up(&rq, hq));
            let zeros = |h: usize, dt| b.zeros(&[total, h, d], dt, Category::Workspace).unwrap();
            let mut o = zeros(hq, DType::BF16);
            let (mut dq, mut dk, mut dv) =
                (zeros(hq, grad_dt), zeros(hkv, grad_dt), zeros(hkv, grad_dt));
            let mut lse = b
                .zeros(&[total, hq], DType::F32, Category::Workspace)
                .unwrap();
            let fwd = time_ms(b, 5, || {
                b.attention_fwd(AttentionFwd {
                    q: q.all_rows(),
                    k: k.all_rows(),
                    v: v.all_rows(),
                    mask: &mask,
                    scale: 1.0 / (d as f32).sqrt(),
                    o: o.all_rows_mut(),
                    lse: lse.all_rows_mut(),
                })
                .unwrap()
            });
            let bwd = time_ms(b, 5, || {
                b.attention_bwd(AttentionBwd {
                    q: q.all_rows(),
                    k: k.all_rows(),
                    v: v.all_rows(),
                    o: o.all_rows(),
                    d_o: d_o.all_rows(),
                    lse: lse.all_rows(),
                    mask: &mask,
                    scale: 1.0 / (d as f32).sqrt(),
                    dq: dq.all_rows_mut(),
                    dk: dk.all_rows_mut(),
                    dv: dv.all_rows_mut(),
                    writes,
                })
                .unwrap()
            });
            eprintln!(
                "| {hq}/{hkv} | {d} | {name} | {fwd:.2} | {bwd:.2} | {:.2} |",
                fwd + bwd
            );
            both.push(fwd + bwd);
        }
        eprintln!(
            "| {hq}/{hkv} | {d} | flash / cudnn | | | {:.2}x |",
            both[0] / both[1]
        );
    }
    let calls = cudnn.attention_calls();
    assert!(calls.cudnn_fwd > 0 && calls.cudnn_bwd > 0, "{calls:?}");
}

/// Shapes cuDNN cannot take fall back to our kernels under `auto` without
/// an error; forcing `cudnn` on them is an error that names the flag.
#[test]
fn cudnn_unsupported_shapes_fall_back_or_name_the_flag() {
    if gpu().is_none() {
        return;
    }
    let mut auto = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    auto.set_attn_kernel(AttnKernel::Auto);
    if let Err(e) = auto.cudnn_sdpa() {
        eprintln!("SKIP cuDNN fallback: {e}");
        return;
    }
    let c = CpuBackend::new();
    let mut rng = Rng::new("cudnn fallback");
    // head dim 96 (neither cuDNN's fused path here nor flash) and f32 inputs
    for (dt, d) in [(DType::BF16, 96), (DType::F32, 64)] {
        let p = AttnProblem::new(&mut rng, 70, 70, 4, 2, d, true);
        let before = auto.attention_calls();
        let (go, gl) = attn_fwd_on(&auto, dt, &p);
        let (co, cl) = attn_fwd_on(&c, DType::F32, &p);
        close(&format!("fallback {dt:?} d={d} o"), &go, &co);
        close(&format!("fallback {dt:?} d={d} lse"), &gl, &cl);
        let after = auto.attention_calls();
        assert_eq!(
            after.cudnn_fwd, before.cudnn_fwd,
            "{dt:?} d={d} is not cuDNN's"
        );
    }
    let mut forced = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    forced.set_attn_kernel(AttnKernel::Cudnn);
    let p = AttnProblem::new(&mut rng, 70, 70, 4, 2, 96, true);
    let q = forced
        .from_host(&p.q, &[75, 4, 96], DType::BF16, Category::Workspace)
        .unwrap();
    let k = forced
        .from_host(&p.k, &[75, 2, 96], DType::BF16, Category::Workspace)
        .unwrap();
    let mut o = forced
        .zeros(&[75, 4, 96], DType::BF16, Category::Workspace)
        .unwrap();
    let mut lse = forced
        .zeros(&[75, 4], DType::F32, Category::Workspace)
        .unwrap();
    let e = forced
        .attention_fwd(AttentionFwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: k.all_rows(),
            mask: &AttnMask::Causal,
            scale: 1.0 / 96f32.sqrt(),
            o: o.all_rows_mut(),
            lse: lse.all_rows_mut(),
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("--attn-kernel cudnn"), "{e}");
}

/// Offloaded tensors live in pinned host memory: a device tensor copied
/// there and back on the copy stream is unchanged, and the host sees what
/// the copy wrote. Prints how fast a large region is pinned.
#[test]
fn pinned_host_memory_round_trips() {
    if gpu().is_none() {
        return;
    }
    let g = CudaBackend::new(0).unwrap();
    let n = 1usize << 30; // 4 GiB of f32: an own-size region
    let t0 = std::time::Instant::now();
    let mut host = g.alloc(&[n], DType::F32, Category::Offload).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "pinned {} bytes in {secs:.2} s ({:.1} GB/s)",
        n * 4,
        (n * 4) as f64 / secs / 1e9
    );
    let vals: Vec<f32> = (0..n).map(|i| (i % 65_521) as f32 - 7.5).collect();
    let dev = g
        .from_host(&vals, &[n], DType::F32, Category::Workspace)
        .unwrap();
    let done = g.copy_start(&mut host, &dev).unwrap();
    g.copy_finish(done).unwrap();
    assert_eq!(g.host_f32(&host).unwrap(), &vals[..]);
    g.host_f32_mut(&mut host).unwrap()[12_345] = 0.25;
    let mut back = g.zeros(&[n], DType::F32, Category::Workspace).unwrap();
    let done = g.copy_start(&mut back, &host).unwrap();
    g.copy_finish(done).unwrap();
    let got = g.to_host(&back).unwrap();
    assert_eq!(got[12_345], 0.25);
    assert_eq!(got[..12_345], vals[..12_345]);
    assert_eq!(got[12_346..], vals[12_346..]);
}

/// The deferred optimizer's upload: f32 values rounded to bf16 on the host
/// into pinned memory and copied into a device tensor after a compute
/// point equal the device's own cast of the same values (both round to
/// nearest even), ties and extremes included.
#[test]
fn host_rounded_bf16_uploads_equal_the_device_cast() {
    let Some(g) = gpu() else {
        return;
    };
    let mut rng = Rng::new("bf16-upload");
    let mut vals = rng.vec(1 << 20, 3.0);
    // halfway between two bf16 values (both directions of the tie), the
    // largest finite f32, a subnormal, signed zeros, infinities
    let special = [
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0xbf80_8000),
        f32::MAX,
        1e-40,
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    vals[..special.len()].copy_from_slice(&special);
    let n = vals.len();
    let wide = g
        .from_host(&vals, &[n], DType::F32, Category::Workspace)
        .unwrap();
    let device_cast = upipe::backend::cast(g, &wide, DType::BF16, Category::Workspace).unwrap();
    let point = g.compute_point().unwrap();
    let mut host = g.empty(&[n], DType::BF16, Category::Offload).unwrap();
    for (d, &x) in g.host_bf16_mut(&mut host).unwrap().iter_mut().zip(&vals) {
        *d = half::bf16::from_f32(x).to_bits();
    }
    let mut dst = g.zeros(&[n], DType::BF16, Category::Workspace).unwrap();
    let done = g.copy_start_from(&mut dst, &host, &point).unwrap();
    g.copy_order(&done).unwrap();
    g.copy_finish(done).unwrap();
    let (got, want) = (g.to_host(&dst).unwrap(), g.to_host(&device_cast).unwrap());
    let same = got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "host and device rounding differ");
}

/// A documents mask's per-row key bounds stay on the device (in the ledger,
/// `Workspace`) from one call to the next: calls that repeat a mask reuse
/// them and a new mask replaces them, so masks that change, repeat and
/// change back still give the CPU's results; releasing the attention
/// workspace frees them. A run decided on cuDNN runs a causal call there
/// and a documents call on the flash kernels (the planner's rule,
/// `AttentionKernel::takes_on_cudnn`).
#[test]
#[allow(clippy::single_range_in_vec_init)] // one key block = the whole key range
fn documents_mask_bounds_are_kept_until_the_mask_changes() {
    use upipe::backend::cuda::cudnn::AttentionKernel;
    use upipe::backend::mask::BoundedMask;
    let _serial = flash_serial();
    let Some((_, n)) = flash_pair() else { return };
    let mut f = CudaBackend::with_attention(0, AttentionKernels::Auto).unwrap();
    f.set_attention_kernel(AttentionKernel::Flash);
    if f.flash_functions().unwrap().is_none() {
        eprintln!("SKIP kept mask bounds: no flash kernels on {}", f.arch());
        return;
    }
    let s = 256;
    let a = BoundedMask::documents(&[0, 100, 130], s).unwrap();
    let other = BoundedMask::documents(&[0, 7, 200], s).unwrap();
    let mut rng = Rng::new("kept mask bounds");
    let mut p = AttnProblem::new(&mut rng, s, s, 4, 2, 64, false);
    for (i, mask) in [a.clone(), a.clone(), other, a].into_iter().enumerate() {
        p.bounded = Some(AttnMask::Bounded(mask));
        let tag = format!("kept bounds call {i} {}", p.tag());
        compare_kernels(&tag, (&f, n, "naive"), &p, DType::F32, &[0..s]);
        assert_eq!(
            f.ledger().current_of(Category::Workspace),
            2 * s * 4,
            "{tag}: the bounds of the last mask are kept"
        );
    }
    f.release_attention_workspace().unwrap();
    assert_eq!(
        f.ledger().current(),
        0,
        "released with the attention workspace"
    );
    // a run decided on cuDNN: causal on cuDNN, documents too (ragged, from 9.10)
    let Ok((version, _)) = upipe::backend::cuda::cudnn::probe() else {
        eprintln!("SKIP decided cuDNN: cuDNN not usable here");
        return;
    };
    f.set_attention_kernel(AttentionKernel::Cudnn { version });
    let mut causal = AttnProblem::new(&mut rng, s, s, 4, 2, 64, true);
    let before = f.attention_calls();
    let _ = attn_fwd_on(&f, DType::BF16, &causal);
    causal.bounded = Some(AttnMask::Bounded(
        BoundedMask::documents(&[0, 100], s).unwrap(),
    ));
    let _ = attn_fwd_on(&f, DType::BF16, &causal);
    let after = f.attention_calls();
    // documents take cuDNN's ragged path from 9.10 on, flash before
    let ragged = version >= upipe::backend::cuda::cudnn::ragged::FIRST_RAGGED_VERSION;
    let on_cudnn = if ragged { 2 } else { 1 };
    assert_eq!(
        after.cudnn_fwd - before.cudnn_fwd,
        on_cudnn,
        "causal (and documents) on cuDNN"
    );
    assert_eq!(
        after.flash_fwd - before.flash_fwd,
        2 - on_cudnn,
        "documents before 9.10 on flash"
    );
}

/// Compact AdamW state (`optim::adamw::compact_adamw`) on the GPU against the
/// CPU reference, bit for bit over 4 steps: F32, BF16 and 8-bit moments,
/// F32 masters with a BF16 copy and BF16 weights with no master
/// (stochastic rounding), two slots of pieces of odd lengths (shorter and
/// longer than an 8-bit block, gaps between them; 30 pieces, two launches).
#[test]
fn compact_adamw_is_bit_identical_to_the_cpu_reference() {
    let Some(g) = gpu() else { return };
    let c = CpuBackend::new();
    let mut rng = Rng::new("compact_adamw");
    let many: Vec<std::ops::Range<usize>> =
        (0..28).map(|k| k * 90 + 3..k * 90 + 40 + 2 * k).collect();
    let slots: [(usize, Vec<std::ops::Range<usize>>); 2] =
        [(2_600, many), (1_500, vec![0..700, 700..701, 705..1_500])];
    let combos = [
        (DType::F32, DType::BF16, false),
        (DType::BF16, DType::F32, true),
        (DType::U8, DType::F32, true),
        (DType::U8, DType::BF16, false),
        (DType::BF16, DType::BF16, false),
    ];
    for (mdt, pdt, narrow) in combos {
        let what = format!("moments {mdt:?}, weights {pdt:?}, narrow copy {narrow}");
        let init: Vec<Vec<f32>> = slots
            .iter()
            .map(|(n, _)| round(&rng.vec(*n, 1.0), DType::BF16))
            .collect();
        let grads: Vec<Vec<Vec<f32>>> = (0..4)
            .map(|_| slots.iter().map(|(n, _)| rng.vec(*n, 0.1)).collect())
            .collect();
        let gpu_state = run_compact(g, &slots, &init, &grads, (mdt, pdt, narrow));
        let cpu_state = run_compact(&c, &slots, &init, &grads, (mdt, pdt, narrow));
        for (s, (a, b)) in gpu_state.iter().zip(&cpu_state).enumerate() {
            for (k, (x, y)) in a.iter().zip(b).enumerate() {
                let differ = x
                    .iter()
                    .zip(y)
                    .position(|(p, q)| p.to_bits() != q.to_bits());
                assert_eq!(
                    differ, None,
                    "{what}: slot {s} tensor {k} (target, m, v, narrow, scales)"
                );
            }
            assert_ne!(a[0], init[s], "{what}: slot {s} updated");
        }
    }
}

/// Four steps of compact AdamW on `b`; every state tensor of each slot
/// afterwards, on the host.
fn run_compact<B: Backend>(
    b: &B,
    slots: &[(usize, Vec<std::ops::Range<usize>>)],
    init: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
    (mdt, pdt, narrow): (DType, DType, bool),
) -> Vec<Vec<Vec<f32>>> {
    use upipe::optim::adamw::compact_adamw::{q8_blocks, rounding_key};
    let t = |d: &[f32], dt| {
        b.from_host(d, &[d.len()], dt, Category::OptimState)
            .unwrap()
    };
    let mut state: Vec<Vec<Tensor<B>>> = slots
        .iter()
        .zip(init)
        .map(|((n, ranges), w)| {
            let blocks: usize = ranges.iter().map(|r| q8_blocks(r.len())).sum();
            let zeros = vec![0.0; *n];
            let mut ts = vec![t(w, pdt), t(&zeros, mdt), t(&zeros, mdt), t(w, DType::BF16)];
            if mdt == DType::U8 {
                ts.push(t(&vec![0.0; blocks], DType::F32));
                ts.push(t(&vec![0.0; blocks], DType::F32));
            }
            ts
        })
        .collect();
    for (step, step_grads) in grads.iter().enumerate() {
        let step = step as u32 + 1;
        let gs: Vec<Tensor<B>> = step_grads.iter().map(|d| t(d, DType::F32)).collect();
        let pieces: Vec<Vec<(std::ops::Range<usize>, AdamWStep)>> = slots
            .iter()
            .map(|(_, ranges)| {
                let hp = |k: usize| AdamWStep {
                    lr: 1e-2,
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: [0.1, 0.0][k % 2],
                    step,
                    grad_scale: 0.5,
                };
                ranges
                    .iter()
                    .enumerate()
                    .map(|(k, r)| (r.clone(), hp(k)))
                    .collect()
            })
            .collect();
        let mut update: Vec<AdamWSlot<'_, B>> = state
            .iter_mut()
            .enumerate()
            .map(|(s, ts)| {
                let (head, scales) = ts.split_at_mut(4);
                let [p, m, v, q] = head else { unreachable!() };
                let scales = match scales {
                    [ms, vs] => Some((ms, vs)),
                    _ => None,
                };
                AdamWSlot {
                    target: p,
                    grad: &gs[s],
                    m,
                    v,
                    narrow: narrow.then_some(q),
                    pieces: &pieces[s],
                    scales,
                    rounding_key: rounding_key(11, step, s as u32),
                }
            })
            .collect();
        b.adamw_multi(&mut update).unwrap();
    }
    state
        .iter()
        .map(|ts| ts.iter().map(|x| b.to_host(x).unwrap()).collect())
        .collect()
}
