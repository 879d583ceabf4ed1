//! FP8 linear layers (`--precision fp8`) on the CPU oracle: the linear
//! GEMM of each role equals an independent f64 reference of the same
//! arithmetic (quantize with the tensor's own scale, multiply, scale back);
//! a model step differs from the f32 one by FP8's rounding and no more;
//! policies that run the same GEMMs on the same tensors equal the plain
//! run, every strategy stays near it; a run through the binary trains, is
//! planned to the byte and says its precision; bad values are refused.

use std::collections::BTreeMap;
use upipe::attention::trial::rel_err;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::fp8::{
    Fp8Format, Fp8Operand, LinearGemm, LinearRole, Precision, Quantized, linear_gemm,
    linear_gemm_quantized,
};
use upipe::backend::{Backend, Category, DType, MatLayout};
use upipe::data::PackedWindow;
use upipe::model::decoder::attn_dims;
use upipe::model::{MemoryPolicy, ModelConfig, ModelWeights};
use upipe::rng::Rng;
use upipe::train::trainer::loss_and_grads_cpu_precision;

use crate::common;

// ---- an independent reference of the FP8 formats and the GEMM ----

/// Every finite non-negative value of a format with its code.
type Table = [(u32, f64)];

/// Every finite non-negative value of a format (exponent bits, mantissa
/// bits, bias, whether the all-ones exponent is reserved), with its code,
/// from the OCP bit fields in f64.
fn values(eb: u32, mb: u32, bias: i32, ieee: bool) -> Vec<(u32, f64)> {
    let mut out = Vec::new();
    for code in 0u32..128 {
        let (e, m) = (code >> mb, code & ((1 << mb) - 1));
        let top = (1 << eb) - 1;
        let reserved = e == top && (ieee || m == (1 << mb) - 1);
        if reserved {
            continue;
        }
        let frac = m as f64 / (1u32 << mb) as f64;
        let v = match e {
            0 => frac * 2f64.powi(1 - bias),
            _ => (1.0 + frac) * 2f64.powi(e as i32 - bias),
        };
        out.push((code, v));
    }
    out
}

/// `x` to the nearest value of `table` (ties to the even code),
/// saturated at the largest.
fn nearest(table: &[(u32, f64)], x: f64) -> f64 {
    let a = x.abs();
    let max = table.last().unwrap().1;
    if a >= max {
        return max.copysign(x);
    }
    let mut best = table[0];
    for &(c, v) in table {
        let (d, bd) = ((v - a).abs(), (best.1 - a).abs());
        if d < bd || (d == bd && c % 2 == 0) {
            best = (c, v);
        }
    }
    best.1.copysign(x)
}

/// `a [m, k] @ b [k, n]` as the FP8 GEMM computes it: each operand
/// quantized with its own scale (`max / amax` in f32, as the engine
/// computes it), multiplied in f64 and scaled back.
fn reference(a: &[Vec<f64>], b: &[Vec<f64>], formats: (&Table, &Table)) -> Vec<f64> {
    let quantize = |x: &[Vec<f64>], table: &[(u32, f64)]| {
        let amax = x.iter().flatten().fold(0f64, |m, v| m.max(v.abs())) as f32;
        let scale = (table.last().unwrap().1 as f32) / amax;
        let q: Vec<Vec<f64>> = (x.iter())
            .map(|r| {
                r.iter()
                    .map(|&v| nearest(table, (v as f32 * scale) as f64))
                    .collect()
            })
            .collect();
        (q, (1.0 / scale) as f64)
    };
    let (qa, sa) = quantize(a, formats.0);
    let (qb, sb) = quantize(b, formats.1);
    let (m, k, n) = (a.len(), b.len(), b[0].len());
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k).map(|p| qa[i][p] * qb[p][j]).sum();
            c[i * n + j] = dot * sa * sb;
        }
    }
    c
}

/// The `[rows, cols]` logical matrix of `data` seen through layout `l`.
fn logical(data: &[f32], l: MatLayout) -> Vec<Vec<f64>> {
    let (rs, cs) = l.strides();
    (0..l.rows)
        .map(|i| {
            (0..l.cols)
                .map(|j| data[l.offset + i * rs + j * cs] as f64)
                .collect()
        })
        .collect()
}

/// Each role's GEMM, on views laid out as the engine lays them (a weight
/// seen transposed, a gradient seen transposed, a block of a wider
/// buffer), accumulating into `c` with beta 1, equals the reference within
/// f32 rounding, and differs from the f32 GEMM by FP8's rounding.
#[test]
fn each_linear_gemm_equals_an_independent_f64_reference() {
    let e4m3 = values(4, 3, 7, false);
    let e5m2 = values(5, 2, 15, true);
    let dev = CpuBackend::new();
    let mut rng = Rng::new(11);
    let (m, k, n) = (9, 24, 7);
    for role in [
        LinearRole::Forward,
        LinearRole::InputGrad,
        LinearRole::WeightGrad,
    ] {
        // a: [m, k] stored transposed as [k, m] for the weight gradient
        // (dYᵀ); b: [k, n] seen as the transpose of a row-major [n, k]
        // weight for the forward, a block of a wider [k, n + 3] otherwise
        let a_len = m * k;
        let a_host: Vec<f32> = rng.normal_vec(a_len, 2.0);
        let b_host: Vec<f32> = rng.normal_vec(k * (n + 3), 0.05);
        let a_l = match role {
            LinearRole::WeightGrad => MatLayout::row_major(k, m).t(),
            _ => MatLayout::row_major(m, k),
        };
        let b_l = match role {
            LinearRole::Forward => MatLayout::row_major(n, k).t(),
            _ => MatLayout::block(2, k, n, n + 3),
        };
        let a = dev
            .from_host(&a_host, &[a_len], DType::F32, Category::Workspace)
            .unwrap();
        let b = dev
            .from_host(&b_host, &[b_host.len()], DType::F32, Category::Workspace)
            .unwrap();
        let c0: Vec<f32> = rng.normal_vec(m * n, 1.0);
        let run = |precision| {
            let mut c = dev
                .from_host(&c0, &[m, n], DType::F32, Category::Workspace)
                .unwrap();
            let g = LinearGemm::new(role, c.mat_mut(), a.view(a_l), b.view(b_l)).accumulate();
            linear_gemm(&dev, precision, g).unwrap();
            dev.to_host(&c).unwrap()
        };
        let (fp8, exact) = (run(Precision::Fp8), run(Precision::Bf16));
        let formats = match role {
            LinearRole::Forward => (&e4m3[..], &e4m3[..]),
            _ => (&e5m2[..], &e4m3[..]),
        };
        let want = reference(&logical(&a_host, a_l), &logical(&b_host, b_l), formats);
        let want: Vec<f32> = want
            .iter()
            .zip(&c0)
            .map(|(p, c)| (p + *c as f64) as f32)
            .collect();
        let e = rel_err(&fp8, &want);
        assert!(e < 2e-6, "{role:?}: FP8 GEMM against the reference: {e:e}");
        let moved = rel_err(&fp8, &exact);
        assert!(
            moved > 1e-3 && moved < 0.1,
            "{role:?}: FP8 against f32 {moved:e}"
        );
    }
}

/// An operand quantized once for several GEMMs (a block's input, read by
/// q, k and v and by their weight gradients; an output's gradient, read by
/// its input- and weight-gradient GEMMs in both layouts) gives each GEMM the
/// bits of quantizing it there; a row block of the transpose's codes gives
/// the rows of the whole weight gradient; codes of another shape or format
/// are refused, and under bf16 nothing is quantized.
#[test]
fn an_operand_quantized_once_gives_every_gemm_the_same_bits() {
    let dev = CpuBackend::new();
    let mut rng = Rng::new(12);
    let (m, k, n) = (9, 24, 7);
    let mut tensor = |shape: &[usize], std: f32| {
        let host = rng.normal_vec(shape.iter().product(), std);
        dev.from_host(&host, shape, DType::F32, Category::Workspace)
            .unwrap()
    };
    let (x, w, dy) = (
        tensor(&[m, k], 2.0),
        tensor(&[n, k], 0.05),
        tensor(&[m, n], 1.0),
    );
    let fp8 = Precision::Fp8;
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let x8 = Fp8Operand::of(&dev, fp8, x.mat(), e4).unwrap().unwrap();
    let xt8 = Fp8Operand::of(&dev, fp8, x.mat().t(), e4).unwrap().unwrap();
    let x_both = Fp8Operand::both(&dev, fp8, x.mat(), e4, true)
        .unwrap()
        .unwrap();
    let dy_both = Fp8Operand::both(&dev, fp8, dy.mat(), e5, true)
        .unwrap()
        .unwrap();
    let x5 = Fp8Operand::of(&dev, fp8, x.mat(), e5).unwrap().unwrap();
    let forward = |pre: Quantized<'_, CpuBackend>| {
        let mut c = dev.zeros(&[m, n], DType::F32, Category::Workspace).unwrap();
        let g = LinearGemm::new(LinearRole::Forward, c.mat_mut(), x.mat(), w.mat().t());
        linear_gemm_quantized(&dev, fp8, g, pre).map(|_| dev.to_host(&c).unwrap())
    };
    // dW [n, k] = dyᵀ·x, or rows `cols` of it from dy's columns `cols`
    let wgrad = |pre: Quantized<'_, CpuBackend>, cols: std::ops::Range<usize>| {
        let rows = cols.len();
        let mut c = dev
            .zeros(&[rows, k], DType::F32, Category::Workspace)
            .unwrap();
        let a = dy.view(MatLayout::block(cols.start, m, rows, n)).t();
        let g = LinearGemm::new(LinearRole::WeightGrad, c.mat_mut(), a, x.mat());
        linear_gemm_quantized(&dev, fp8, g, pre).map(|_| dev.to_host(&c).unwrap())
    };
    // dX [m, k] = dy·W
    let dgrad = |pre: Quantized<'_, CpuBackend>| {
        let mut c = dev.zeros(&[m, k], DType::F32, Category::Workspace).unwrap();
        let g = LinearGemm::new(LinearRole::InputGrad, c.mat_mut(), dy.mat(), w.mat());
        linear_gemm_quantized(&dev, fp8, g, pre).map(|_| dev.to_host(&c).unwrap())
    };
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let pre = |a, b| Quantized { a, b };
    let own = bits(forward(pre(None, None)).unwrap());
    for (codes, what) in [(x8.codes(), "of"), (x_both.codes(), "both")] {
        let shared = bits(forward(pre(Some(codes), None)).unwrap());
        assert_eq!(own, shared, "the forward with x quantized once ({what})");
    }
    let own = bits(wgrad(pre(None, None), 0..n).unwrap());
    for (codes, what) in [(xt8.codes(), "of xᵀ"), (x_both.codes_t().unwrap(), "both")] {
        let shared = bits(wgrad(pre(None, Some(codes)), 0..n).unwrap());
        assert_eq!(
            own, shared,
            "the weight gradient with xᵀ quantized once ({what})"
        );
    }
    let both_t = Some(dy_both.codes_t().unwrap());
    let shared = bits(wgrad(pre(both_t, x_both.codes_t()), 0..n).unwrap());
    assert_eq!(
        own, shared,
        "the weight gradient with dyᵀ and xᵀ quantized once"
    );
    let own = bits(dgrad(pre(None, None)).unwrap());
    let shared = bits(dgrad(pre(Some(dy_both.codes()), None)).unwrap());
    assert_eq!(own, shared, "the input gradient with dy quantized once");
    // columns 2..5 of dy under the whole dy's scale: rows 2..5 of dW
    let rows = bits(wgrad(pre(dy_both.codes_t_rows(2..5), None), 2..5).unwrap());
    let whole = bits(wgrad(pre(both_t, None), 0..n).unwrap());
    assert_eq!(rows, whole[2 * k..5 * k], "a row block of dyᵀ's codes");
    let refused = [
        (
            wgrad(pre(None, Some(x8.codes())), 0..n),
            "x's codes read as xᵀ",
        ),
        (
            forward(pre(Some(x5.codes()), None)),
            "E5M2 codes read as E4M3",
        ),
        (
            wgrad(pre(dy_both.codes_t_rows(0..3), None), 0..n),
            "3 rows read as 7",
        ),
    ];
    for (r, what) in refused {
        assert!(r.is_err(), "{what}");
    }
    let none = Fp8Operand::both(&dev, fp8, dy.mat(), e5, false)
        .unwrap()
        .unwrap();
    assert!(none.codes_t().is_none(), "no transpose unless asked");
    let bf16 = Fp8Operand::of(&dev, Precision::Bf16, x.mat(), e4).unwrap();
    assert!(bf16.is_none(), "nothing is quantized under bf16");
}

/// A quantization's codes and inverse scale, its transposed copy, and an
/// all-zero tensor (scale 1) and a NaN (poisons the scale).
#[test]
fn quantize_writes_codes_the_transpose_and_the_inverse_scale() {
    use upipe::backend::fp8::Fp8Quantize;
    let dev = CpuBackend::new();
    let x = [1.0f32, -3.5, 0.25, 7.0, 0.0, -0.01];
    let src = dev
        .from_host(&x, &[2, 3], DType::F32, Category::Workspace)
        .unwrap();
    let mut q = dev
        .empty(&[2, 3], DType::F8E4M3, Category::Workspace)
        .unwrap();
    let mut qt = dev
        .empty(&[3, 2], DType::F8E4M3, Category::Workspace)
        .unwrap();
    let mut s = dev.empty(&[1], DType::F32, Category::Workspace).unwrap();
    let args = Fp8Quantize {
        src: src.mat(),
        dst: &mut q,
        dst_t: Some(&mut qt),
        scale_inv: &mut s,
    };
    dev.fp8_quantize(args).unwrap();
    let scale = 448.0f32 / 7.0;
    let table = values(4, 3, 7, false);
    let want: Vec<f32> = x
        .iter()
        .map(|&v| nearest(&table, (v * scale) as f64) as f32)
        .collect();
    assert_eq!(dev.to_host(&q).unwrap(), want);
    let t = dev.to_host(&qt).unwrap();
    for i in 0..2 {
        for j in 0..3 {
            assert_eq!(t[j * 2 + i], want[i * 3 + j]);
        }
    }
    assert_eq!(dev.to_host(&s).unwrap(), vec![1.0 / scale]);
    assert_eq!(Fp8Format::E4M3.round(want[3]), 448.0);
    // all zeros: scale 1; a NaN: a NaN inverse scale
    for (v, ok) in [(0.0f32, true), (f32::NAN, false)] {
        let src = dev
            .from_host(&[v, 0.0], &[1, 2], DType::F32, Category::Workspace)
            .unwrap();
        let mut q = dev
            .empty(&[1, 2], DType::F8E5M2, Category::Workspace)
            .unwrap();
        let mut s = dev.empty(&[1], DType::F32, Category::Workspace).unwrap();
        let args = Fp8Quantize {
            src: src.mat(),
            dst: &mut q,
            dst_t: None,
            scale_inv: &mut s,
        };
        dev.fp8_quantize(args).unwrap();
        let inv = dev.to_host(&s).unwrap()[0];
        assert_eq!(inv == 1.0, ok, "{v}: inverse scale {inv}");
        assert_eq!(inv.is_nan(), !ok);
    }
    // a quantization into a wrong dtype or shape is refused
    let mut bad = dev
        .empty(&[3, 2], DType::F8E4M3, Category::Workspace)
        .unwrap();
    let mut s = dev.empty(&[1], DType::F32, Category::Workspace).unwrap();
    let args = Fp8Quantize {
        src: src.mat(),
        dst: &mut bad,
        dst_t: None,
        scale_inv: &mut s,
    };
    assert!(dev.fp8_quantize(args).is_err());
}

// ---- the model under FP8 ----

type LossGrads = (f64, BTreeMap<String, Vec<f32>>);

/// The model's own random initialisation (larger weights make attention
/// near one-hot, where FP8's rounding moves which key wins).
fn weights(b: &CpuBackend, cfg: &ModelConfig) -> upipe::Result<ModelWeights<CpuBackend>> {
    ModelWeights::random(b, cfg, 5)
}

fn run(
    cfg: &ModelConfig,
    (s, mesh): (Strategy, (usize, usize, Option<usize>)),
    policy: MemoryPolicy,
    precision: Precision,
) -> LossGrads {
    let seq = 64;
    let (pu, pr, u) = mesh;
    let plan = CpPlan::new(s, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let (ids, tg) = common::random_window(seq, cfg.vocab);
    let window = PackedWindow::stream(ids, tg);
    let init = |b: &CpuBackend| weights(b, cfg);
    loss_and_grads_cpu_precision(cfg, &plan, policy, &window, &init, precision).unwrap()
}

/// The largest relative error of any gradient of `a` against `r`.
fn worst(a: &LossGrads, r: &LossGrads) -> f64 {
    assert_eq!(a.1.len(), r.1.len());
    a.1.iter()
        .map(|(n, g)| rel_err(g, &r.1[n]) as f64)
        .fold(0.0, f64::max)
}

const LOCAL: (Strategy, (usize, usize, Option<usize>)) = (Strategy::Local, (1, 1, None));

/// How far FP8 may move a step from the f32 one: the loss by 2 %, each
/// gradient by 25 % of its largest element (E5M2 gradients keep 2 mantissa
/// bits: one rounding is up to 12.5 %).
const LOSS_TOL: f64 = 0.02;
const GRAD_TOL: f64 = 0.25;

/// FP8 moves the loss and every gradient by its rounding and no more, is
/// deterministic, and the policies that run the same GEMMs on the same
/// tensors (checkpointing and its recompute, kept attention, segments,
/// offload) equal the plain FP8 run bit for bit.
#[test]
fn fp8_step_is_fp8_rounding_of_the_f32_step_and_policies_are_exact() {
    let cfg = common::tiny(true);
    let base = MemoryPolicy::default();
    let exact = run(&cfg, LOCAL, base, Precision::Bf16);
    let fp8 = run(&cfg, LOCAL, base, Precision::Fp8);
    let dl = ((fp8.0 - exact.0) / exact.0).abs();
    assert!(
        dl > 0.0 && dl < LOSS_TOL,
        "loss {} against f32 {}",
        fp8.0,
        exact.0
    );
    let e = worst(&fp8, &exact);
    assert!(e > 1e-3 && e < GRAD_TOL, "FP8 gradients against f32: {e:e}");
    let again = run(&cfg, LOCAL, base, Precision::Fp8);
    assert_eq!(again.0.to_bits(), fp8.0.to_bits());
    for policy in [
        MemoryPolicy {
            checkpoint: true,
            ..base
        },
        MemoryPolicy {
            checkpoint: true,
            save_attention: 1,
            ..base
        },
        MemoryPolicy {
            checkpoint: true,
            checkpoint_every: 2,
            offload: 1,
            ..base
        },
    ] {
        let got = run(&cfg, LOCAL, policy, Precision::Fp8);
        assert_eq!(got.0.to_bits(), fp8.0.to_bits(), "{policy:?}");
        assert_eq!(worst(&got, &fp8), 0.0, "{policy:?}");
    }
}

/// Every strategy and the tiled MLP quantize each rank's (each tile's)
/// tensors with their own scales: each stays within FP8's rounding of the
/// exact (f32, one rank) step, as the single rank's FP8 step does, and is
/// an FP8 run (not its own f32 one).
#[test]
fn fp8_under_every_strategy_stays_within_fp8_rounding() {
    let cfg = common::tiny(true);
    let base = MemoryPolicy::default();
    let exact = run(&cfg, LOCAL, base, Precision::Bf16);
    let tiled = MemoryPolicy {
        tiled_mlp: true,
        ..base
    };
    for (layout, policy) in [
        ((Strategy::Ulysses, (2, 1, None)), base),
        ((Strategy::Ring, (1, 4, None)), base),
        ((Strategy::Usp, (2, 2, None)), base),
        ((Strategy::Upipe, (2, 2, None)), base),
        ((Strategy::Upipe, (2, 1, Some(4))), tiled),
        (LOCAL, tiled),
    ] {
        let got = run(&cfg, layout, policy, Precision::Fp8);
        let f32_run = run(&cfg, layout, policy, Precision::Bf16);
        let dl = ((got.0 - exact.0) / exact.0).abs();
        assert!(
            dl < LOSS_TOL,
            "{layout:?}: loss {} against {}",
            got.0,
            exact.0
        );
        let e = worst(&got, &exact);
        assert!(e < GRAD_TOL, "{layout:?} {policy:?}: gradients {e:e}");
        assert_ne!(got.0.to_bits(), f32_run.0.to_bits(), "{layout:?} ran FP8");
    }
}

// ---- through the binary ----

/// 30 steps of the default run (UPipe over 4 thread ranks) in FP8 lower
/// the loss, end within 3 % of the f32 run (and not at it), peak at the
/// planner's prediction to the byte, and name the precision in the
/// metrics; FSDP trains with it too.
#[test]
fn fp8_trains_near_f32_and_is_planned_to_the_byte() {
    let base = ["--steps", "30", "--seq", "128"];
    let fp8 = [&base[..], &["--precision", "fp8"]].concat();
    let reference = common::train_steps(&base);
    let got = common::train_steps(&fp8);
    let (first, last) = (
        common::step_loss(&got[0]),
        common::step_loss(got.last().unwrap()),
    );
    assert!(last < first * 0.9, "FP8 loss {first} -> {last}");
    let want = common::step_loss(reference.last().unwrap());
    assert!(
        ((last - want) / want).abs() < 0.03 && last != want,
        "final loss {last} against f32's {want}"
    );
    assert_eq!(got[0]["peak_bytes"], got[0]["predicted_peak_bytes"]);
    assert_eq!(got[0]["precision"], "fp8");
    assert!(reference[0].get("precision").is_none());
    let fsdp = common::train_steps(&[&fp8[..], &["--fsdp", "on"]].concat());
    assert_eq!(fsdp[0]["peak_bytes"], fsdp[0]["predicted_peak_bytes"]);
    let f = common::step_loss(fsdp.last().unwrap());
    assert!(((f - last) / last).abs() < 0.01, "FSDP {f} against {last}");
}

/// A bad precision is refused naming the choices; `upipe plan
/// --precision fp8` predicts the peak that `train --precision fp8`
/// measures, to the byte, above bf16's (the operand copies counted).
#[test]
fn a_bad_precision_is_refused_and_plan_predicts_fp8() {
    let (_, log, success) = common::upipe(&["train", "--steps", "1", "--precision", "fp4"]);
    assert!(
        !success
            && log.contains("--precision fp4")
            && log.contains("bf16, fp8, fp8-attention or fp8-attention-bwd"),
        "{log}"
    );
    let trained = common::train_steps(&[
        "--seq",
        "256",
        "--steps",
        "1",
        "--precision",
        "fp8",
        "--checkpoint",
        "--offload",
        "--tiled-mlp",
    ]);
    let measured = trained.last().unwrap()["peak_bytes"].as_u64().unwrap();
    let plan = |precision: &str| {
        let mut args = vec!["plan", "--model", "tiny", "--gpus", "4", "--device", "cpu"];
        args.extend(["--attn", "upipe", "--ulysses", "2", "--ring", "2"]);
        args.extend([
            "--policies",
            "checkpoint,offload,tiled-mlp",
            "--seq",
            "256",
            "--json",
        ]);
        args.extend(["--precision", precision]);
        let (stdout, log, success) = common::upipe(&args);
        assert!(success, "{log}");
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap();
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        v["peak_bytes"].as_u64().unwrap()
    };
    assert_eq!(plan("fp8"), measured);
    assert!(plan("fp8") >= plan("bf16"));
}

/// LoRA on an FP8 base (the frozen projections in FP8, the adapters'
/// GEMMs in the compute dtype) trains and is planned to the byte.
#[test]
fn lora_on_an_fp8_base_trains_and_is_planned() {
    let got = common::train_steps(&[
        "--steps",
        "8",
        "--seq",
        "128",
        "--lr",
        "3e-3",
        "--precision",
        "fp8",
        "--lora-rank",
        "4",
    ]);
    assert_eq!(got[0]["peak_bytes"], got[0]["predicted_peak_bytes"]);
    let (first, last) = (
        common::step_loss(&got[0]),
        common::step_loss(got.last().unwrap()),
    );
    assert!(
        last.is_finite() && last < first,
        "LoRA on FP8: {first} -> {last}"
    );
}

/// `--precision fp8-attention` is refused where it cannot run, before
/// anything is allocated, naming the fix: on the CPU, and in a plan for a
/// model whose head dim cuDNN's FP8 backward does not take; planned for
/// a head-dim-128 model, each call's FP8 operands and scales are counted
/// instead of the BF16 calls' buffers (a peak of its own; with
/// `fp8-attention-bwd` the backward's alone, a peak no higher), and the
/// plan's train command carries the precision.
#[test]
fn fp8_attention_is_refused_where_it_cannot_run_and_planned_where_it_can() {
    for precision in ["fp8-attention", "fp8-attention-bwd"] {
        let (_, log, success) = common::upipe(&["train", "--steps", "1", "--precision", precision]);
        assert!(
            !success
                && log.contains(&format!("--precision {precision} runs"))
                && log.contains("on a GPU only")
                && log.contains("--precision fp8 "),
            "{log}"
        );
    }
    let plan = |model: &str, precision: &str| {
        let flags = format!("plan --model {model} --gpus 1 --device cuda --attn upipe --seq 8192");
        let (plan, log, success) = plan_json(&flags, precision);
        let peak = plan.and_then(|v| v["peak_bytes"].as_u64());
        (success, peak, log)
    };
    let (ok, _, log) = plan("llama3.2-1b", "fp8-attention");
    assert!(
        !ok && log.contains("head dim") && log.contains("64"),
        "{log}"
    );
    let (ok8, fp8, log8) = plan("qwen3-0.6b", "fp8");
    let (ok_a, attn, log_a) = plan("qwen3-0.6b", "fp8-attention");
    let (ok_b, bwd, log_b) = plan("qwen3-0.6b", "fp8-attention-bwd");
    assert!(ok8 && ok_a && ok_b, "{log8}\n{log_a}\n{log_b}");
    assert_ne!(attn.unwrap(), fp8.unwrap());
    assert_ne!(bwd.unwrap(), fp8.unwrap());
    assert!(bwd.unwrap() <= attn.unwrap(), "{bwd:?} above {attn:?}");
    let (stdout, _, _) = common::upipe(&[
        "plan",
        "--model",
        "qwen3-0.6b",
        "--gpus",
        "1",
        "--device",
        "cuda",
        "--seq",
        "8192",
        "--precision",
        "fp8-attention",
    ]);
    assert!(stdout.contains("--precision fp8-attention"), "{stdout}");
}

/// Under an FP8 attention backward, `--chunk-heads auto` keeps each call of
/// a grouped-query model (Llama3-8B, 32:8) at or below the query heads
/// cuDNN's FP8 backward runs fast (28): stages of 16 where `fp8` (BF16
/// attention) takes all 32 heads in one stage, the forward's stages left
/// as wide.
#[test]
fn fp8_attention_backward_stages_stay_at_the_heads_cudnn_runs_fast() {
    let chunks = |precision: &str| {
        let flags = "plan --model llama3-8b --gpus 1 --device cuda --attn upipe --seq 65536 \
                     --gpu-mem 79.18 --host-mem 108 --checkpoint --tiled-mlp \
                     --offload-optimizer all --host-update gpu --optim-state 8bit \
                     --master-weights none --grad-dtype bf16";
        let (plan, log, success) = plan_json(flags, precision);
        assert!(success, "{log}");
        let plan = plan.unwrap_or_else(|| panic!("no JSON plan: {log}"));
        let mesh = &plan["mesh"];
        (
            mesh["chunk_heads"].as_u64(),
            mesh["fwd_chunk_heads"].as_u64(),
        )
    };
    assert_eq!(chunks("fp8"), (Some(32), Some(32)));
    assert_eq!(chunks("fp8-attention-bwd"), (Some(16), Some(32)));
    let (bwd, _) = chunks("fp8-attention");
    assert!(bwd.is_some_and(|u| u <= 28), "{bwd:?}");
}

/// `upipe plan` of the whitespace-separated `flags` with `--json
/// --precision precision`: its JSON plan (if it printed one), its log and
/// whether it succeeded.
fn plan_json(flags: &str, precision: &str) -> (Option<serde_json::Value>, String, bool) {
    let mut args: Vec<&str> = flags.split_whitespace().collect();
    args.extend(["--json", "--precision", precision]);
    let (stdout, log, success) = common::upipe(&args);
    let plan = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok());
    (plan, log, success)
}
