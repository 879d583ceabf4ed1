//! Correctness and speed of cuDNN fused attention (`backend::cuda::cudnn`)
//! against the CPU f32 oracle, plus TFLOP/s at long sequences.
//!
//! `cudnn_check [check] [bench]` (default both) runs on GPU 0 with the cuDNN
//! that `libs.rs` finds; `UPIPE_CUDNN_LIB=/path/libcudnn.so.9` picks another
//! (put its folder on `LD_LIBRARY_PATH` too, so its sub-libraries match).
//! `CUDNN_BENCH_S=16384,65536` sets the benchmark lengths, `CUDNN_BENCH_H=16,1`
//! the head counts, `CUDNN_BENCH_GROUP=4` query heads per kv head,
//! `CUDNN_BENCH_LAYOUT=tokens,heads` the storage (token rows `[s, h, d]`, ours,
//! or head by head `[h, s, d]`). `CUDNN_BENCH_PAIR=1` also times two forwards of the same
//! shape back to back on one stream against side by side on two streams
//! (the cost of each call's last partial wave, when few heads leave SMs idle).
//! `CUDNN_BENCH_PARTS=1` splits the accumulate backward into its parts.
//! `CUDNN_BENCH_CONTEXT=1` times one forward after other work (`context`).
//! `UPIPE_CUDNN_PLAN=fastest` times every engine configuration on each
//! shape's first call (listed under "plan builds" at the end).

use cudarc::driver::sys::CUevent_flags;
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::{CudnnSdpa, SdpaBwd, SdpaFwd, SdpaShape};
use upipe::backend::{AttentionBwd, AttentionFwd, AttnMask, Backend, Category, DType, Tensor};

mod support;
use support::{Res, Rng, rel_err};

#[derive(Clone, Copy, Debug)]
struct Case {
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    /// Rows of padding before the views (tests row offsets).
    off: usize,
    /// Gradients accumulated into bf16 (else f32) buffers.
    bf16_grads: bool,
}

/// The mask of a case's `causal` column.
fn mask(causal: bool) -> AttnMask {
    if causal {
        AttnMask::Causal
    } else {
        AttnMask::Full
    }
}

fn shape(c: &Case) -> SdpaShape {
    upipe::backend::cuda::cudnn::dense_shape(c.sq, c.sk, c.hq, c.hkv, c.d, mask(c.causal))
}

/// Device address of row `row` of a `[rows, ...]` tensor.
fn at(be: &CudaBackend, t: &Tensor<CudaBackend>, row: usize) -> u64 {
    be.device_ptr(t) + (row * t.row_len() * t.dtype().size()) as u64
}

/// `[o, lse, dq, dk, dv]` errors, or `None` for the backward when it falls back.
fn run_case(
    be: &CudaBackend,
    sdpa: &CudnnSdpa,
    c: Case,
    seed: u64,
) -> Res<(Vec<f32>, Option<String>)> {
    let cpu = CpuBackend::new();
    let mut rng = Rng(seed);
    let (sq, sk, hq, hkv, d, off) = (c.sq, c.sk, c.hq, c.hkv, c.d, c.off);
    let q = rng.vec_bf16((off + sq) * hq * d, 1.5);
    let k = rng.vec_bf16((off + sk) * hkv * d, 1.5);
    let v = rng.vec_bf16((off + sk) * hkv * d, 1.0);
    let d_o = rng.vec_bf16(sq * hq * d, 1.0);
    let dq0 = rng.vec_bf16(sq * hq * d, 0.1);
    let dk0 = rng.vec_bf16(sk * hkv * d, 0.1);
    let dv0 = rng.vec_bf16(sk * hkv * d, 0.1);

    // CPU oracle on the viewed rows.
    let ct = |x: &[f32], s: usize, h: usize| {
        cpu.from_host(x, &[s, h, d], DType::F32, Category::Activations)
    };
    let (cq, ck, cv, cdo) = (
        ct(&q[off * hq * d..], sq, hq)?,
        ct(&k[off * hkv * d..], sk, hkv)?,
        ct(&v[off * hkv * d..], sk, hkv)?,
        ct(&d_o, sq, hq)?,
    );
    let mut co = cpu.zeros(&[sq, hq, d], DType::F32, Category::Activations)?;
    let mut clse = cpu.zeros(&[sq, hq], DType::F32, Category::Activations)?;
    cpu.attention_fwd(AttentionFwd {
        q: cq.all_rows(),
        k: ck.all_rows(),
        v: cv.all_rows(),
        mask: &mask(c.causal),
        scale: 1.0 / (d as f32).sqrt(),
        o: co.all_rows_mut(),
        lse: clse.all_rows_mut(),
    })?;
    let (mut cdq, mut cdk, mut cdv) = (ct(&dq0, sq, hq)?, ct(&dk0, sk, hkv)?, ct(&dv0, sk, hkv)?);
    cpu.attention_bwd(AttentionBwd {
        q: cq.all_rows(),
        k: ck.all_rows(),
        v: cv.all_rows(),
        o: co.all_rows(),
        d_o: cdo.all_rows(),
        lse: clse.all_rows(),
        mask: &mask(c.causal),
        scale: 1.0 / (d as f32).sqrt(),
        dq: cdq.all_rows_mut(),
        dk: cdk.all_rows_mut(),
        dv: cdv.all_rows_mut(),
        writes: upipe::backend::AttnGradWrites::ADD,
    })?;

    // GPU.
    let gt = |x: &[f32], s: usize, h: usize, dt: DType| {
        be.from_host(x, &[s, h, d], dt, Category::Activations)
    };
    let gq = gt(&q, off + sq, hq, DType::BF16)?;
    let gk = gt(&k, off + sk, hkv, DType::BF16)?;
    let gv = gt(&v, off + sk, hkv, DType::BF16)?;
    let gdo = gt(&d_o, sq, hq, DType::BF16)?;
    let go = be.zeros(&[off + sq, hq, d], DType::BF16, Category::Activations)?;
    let glse = be.zeros(&[sq, hq], DType::F32, Category::Activations)?;
    let s = shape(&c);
    let fa = SdpaFwd {
        q: at(be, &gq, off),
        k: at(be, &gk, off),
        v: at(be, &gv, off),
        o: at(be, &go, off),
        lse: be.device_ptr(&glse),
        shape: s.clone(),
        docs: Vec::new(),
        scale: 1.0 / (s.d as f32).sqrt(),
    };
    sdpa.fwd(be, &fa)?;
    let o_all = be.to_host(&go)?;
    let mut errs = vec![
        rel_err(&o_all[off * hq * d..], &cpu.to_host(&co)?),
        rel_err(&be.to_host(&glse)?, &cpu.to_host(&clse)?),
    ];
    let gdt = if c.bf16_grads {
        DType::BF16
    } else {
        DType::F32
    };
    let (gdq, gdk, gdv) = (
        gt(&dq0, sq, hq, gdt)?,
        gt(&dk0, sk, hkv, gdt)?,
        gt(&dv0, sk, hkv, gdt)?,
    );
    let ba = SdpaBwd {
        q: fa.q,
        k: fa.k,
        v: fa.v,
        o: fa.o,
        d_o: be.device_ptr(&gdo),
        lse: fa.lse,
        dq: be.device_ptr(&gdq),
        dk: be.device_ptr(&gdk),
        dv: be.device_ptr(&gdv),
        dq_dt: gdt,
        dkv_dt: gdt,
        shape: s.clone(),
        docs: Vec::new(),
        scale: 1.0 / (s.d as f32).sqrt(),
    };
    if let Err(reason) = sdpa.supports(&s, true) {
        return Ok((errs, Some(reason)));
    }
    sdpa.bwd(be, &ba, upipe::backend::AttnGradWrites::ADD)?;
    errs.push(rel_err(&be.to_host(&gdq)?, &cpu.to_host(&cdq)?));
    errs.push(rel_err(&be.to_host(&gdk)?, &cpu.to_host(&cdk)?));
    errs.push(rel_err(&be.to_host(&gdv)?, &cpu.to_host(&cdv)?));
    Ok((errs, None))
}

fn check(be: &CudaBackend, sdpa: &CudnnSdpa) -> bool {
    let c = |sq, sk, hq, hkv, d, causal, off| Case {
        sq,
        sk,
        hq,
        hkv,
        d,
        causal,
        off,
        bf16_grads: false,
    };
    let cases = [
        c(256, 256, 4, 4, 64, false, 0),
        c(256, 256, 4, 4, 64, true, 0),
        c(384, 384, 8, 2, 128, true, 3),
        c(384, 384, 8, 2, 128, false, 0),
        c(128, 384, 4, 1, 64, false, 1),
        c(1000, 1000, 4, 2, 64, true, 0),
        c(333, 517, 2, 2, 128, false, 5),
        c(1024, 1024, 4, 2, 128, true, 7),
        Case {
            bf16_grads: true,
            ..c(512, 512, 4, 2, 64, true, 2)
        },
    ];
    let tol = 1e-2;
    let mut ok = true;
    println!("| sq | sk | hq | hkv | d | causal | off | grads | o | lse | dq | dk | dv | |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (i, cs) in cases.iter().enumerate() {
        let head = format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            cs.sq,
            cs.sk,
            cs.hq,
            cs.hkv,
            cs.d,
            cs.causal,
            cs.off,
            if cs.bf16_grads { "bf16" } else { "f32" }
        );
        match run_case(be, sdpa, *cs, 1234 + i as u64) {
            Ok((errs, fallback)) => {
                let pass = errs.iter().all(|e| *e <= tol);
                ok &= pass;
                let mut cols: Vec<String> = errs.iter().map(|e| format!("{e:.1e}")).collect();
                let note = match &fallback {
                    Some(r) => {
                        cols.extend(["-".into(), "-".into(), "-".into()]);
                        format!("bwd fallback: {r}")
                    }
                    None => String::new(),
                };
                println!(
                    "{head} {} | {} {note} |",
                    cols.join(" | "),
                    if pass { "ok" } else { "FAIL" }
                );
            }
            Err(e) => {
                ok = false;
                println!("{head} ERROR: {e} |");
            }
        }
    }
    // Unsupported shapes must give a reason, not crash.
    for (name, s) in [
        (
            "d=96",
            SdpaShape {
                d: 96,
                q_rs: 4 * 96,
                k_rs: 2 * 96,
                v_rs: 2 * 96,
                o_rs: 4 * 96,
                ..shape(&cases[0])
            },
        ),
        (
            "hq%hkv",
            SdpaShape {
                hq: 4,
                hkv: 3,
                k_rs: 3 * 64,
                v_rs: 3 * 64,
                ..shape(&cases[0])
            },
        ),
        (
            "causal sq!=sk",
            SdpaShape {
                mask: AttnMask::Causal,
                ..shape(&cases[4])
            },
        ),
    ] {
        match sdpa.supports(&s, false) {
            Err(r) => println!("unsupported {name}: fallback reason: {r}"),
            Ok(()) => {
                ok = false;
                println!("unsupported {name}: WRONGLY accepted");
            }
        }
    }
    ok
}

/// One benchmark shape: `h` query heads sharing kv heads in groups of
/// `group`, stored as token rows or (`head_major`) head by head.
#[derive(Clone, Copy)]
struct BenchShape {
    s: usize,
    h: usize,
    group: usize,
    d: usize,
    head_major: bool,
}

fn bench(be: &CudaBackend, sdpa: &CudnnSdpa, b: BenchShape) -> Res<()> {
    let BenchShape { s, h, d, .. } = b;
    let hkv = h / b.group;
    let mut rng = Rng(42);
    let (n, nkv) = (s * h * d, s * hkv * d);
    let up =
        |x: Vec<f32>, heads| be.from_host(&x, &[s, heads, d], DType::BF16, Category::Activations);
    let q = up(rng.vec_bf16(n, 1.0), h)?;
    let k = up(rng.vec_bf16(nkv, 1.0), hkv)?;
    let v = up(rng.vec_bf16(nkv, 1.0), hkv)?;
    let d_o = up(rng.vec_bf16(n, 1.0), h)?;
    let o = be.zeros(&[s, h, d], DType::BF16, Category::Activations)?;
    let lse = be.zeros(&[s, h], DType::F32, Category::Activations)?;
    let g = |dt, heads| be.zeros(&[s, heads, d], dt, Category::Activations);
    let (dq, dk, dv) = (g(DType::F32, h)?, g(DType::F32, hkv)?, g(DType::F32, hkv)?);
    let (bq, bk, bv) = (
        g(DType::BF16, h)?,
        g(DType::BF16, hkv)?,
        g(DType::BF16, hkv)?,
    );
    let c = Case {
        sq: s,
        sk: s,
        hq: h,
        hkv,
        d,
        causal: true,
        off: 0,
        bf16_grads: false,
    };
    let sh = if b.head_major {
        SdpaShape {
            q_rs: d,
            k_rs: d,
            v_rs: d,
            o_rs: d,
            lse_rs: 1,
            lse_hs: s,
            head_major: true,
            ..shape(&c)
        }
    } else {
        shape(&c)
    };
    let p = |t: &Tensor<CudaBackend>| be.device_ptr(t);
    let fa = SdpaFwd {
        q: p(&q),
        k: p(&k),
        v: p(&v),
        o: p(&o),
        lse: p(&lse),
        shape: sh.clone(),
        docs: Vec::new(),
        scale: 1.0 / (d as f32).sqrt(),
    };
    let ba = SdpaBwd {
        q: fa.q,
        k: fa.k,
        v: fa.v,
        o: fa.o,
        d_o: p(&d_o),
        lse: fa.lse,
        dq: p(&dq),
        dk: p(&dk),
        dv: p(&dv),
        dq_dt: DType::F32,
        dkv_dt: DType::F32,
        shape: sh,
        docs: Vec::new(),
        scale: 1.0 / (d as f32).sqrt(),
    };
    let iters = if s >= 32768 { 3 } else { 10 };
    let stream = be.stream().clone();
    let time = |f: &dyn Fn() -> Res<()>| -> Res<f64> {
        f()?;
        stream.synchronize()?;
        let e0 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let e1 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        e1.synchronize()?;
        Ok(e0.elapsed_ms(&e1)? as f64 / iters as f64)
    };
    let t_fwd = time(&|| Ok(sdpa.fwd(be, &fa)?))?;
    let t_bwd = time(&|| Ok(sdpa.bwd_overwrite(be, &ba, p(&bq), p(&bk), p(&bv))?))?;
    let t_bwd_acc = time(&|| Ok(sdpa.bwd(be, &ba, upipe::backend::AttnGradWrites::ADD)?))?;
    if std::env::var("CUDNN_BENCH_PARTS").as_deref() == Ok("1") {
        // where the accumulate path's extra time goes
        let (nq, nk) = (s * h * d, s * hkv * d);
        let scratch = || -> Res<()> {
            let a = be.alloc(&[nq], DType::BF16, Category::Workspace)?;
            let b = be.alloc(&[nk], DType::BF16, Category::Workspace)?;
            let c = be.alloc(&[nk], DType::BF16, Category::Workspace)?;
            drop((a, b, c));
            Ok(())
        };
        let t_scratch = time(&scratch)?;
        let t_axpy = time(&|| {
            be.axpy_raw(p(&dq), DType::F32, p(&bq), DType::BF16, nq, 1.0)?;
            be.axpy_raw(p(&dk), DType::F32, p(&bk), DType::BF16, nk, 1.0)?;
            be.axpy_raw(p(&dv), DType::F32, p(&bv), DType::BF16, nk, 1.0)?;
            Ok(())
        })?;
        let t_bwd2 = time(&|| Ok(sdpa.bwd_overwrite(be, &ba, p(&bq), p(&bk), p(&bv))?))?;
        println!(
            "parts S={s} H={h}: bwd overwrite {t_bwd:.3} ms, accumulate {t_bwd_acc:.3}, scratch alloc+free {t_scratch:.3}, 3 axpy {t_axpy:.3}, overwrite again {t_bwd2:.3}"
        );
    }
    if std::env::var("CUDNN_BENCH_CONTEXT").as_deref() == Ok("1") {
        context(be, sdpa, &fa, s)?;
    }
    let flops = 2.0 * (s as f64).powi(2) * h as f64 * d as f64;
    let layout = if b.head_major { "heads" } else { "tokens" };
    println!(
        "| {s} | {h} | {hkv} | {layout} | {d} | {:.2} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1} |",
        t_fwd,
        flops / t_fwd / 1e9,
        t_bwd,
        2.5 * flops / t_bwd / 1e9,
        3.5 * flops / (t_fwd + t_bwd) / 1e9,
        3.5 * flops / (t_fwd + t_bwd_acc) / 1e9,
    );
    Ok(())
}

/// One forward's time (events around the call alone) in three settings, 16
/// calls each: back to back; each after a projection GEMM of one UPipe stage
/// (`[s/2, 4096] x [4096, 256]`, random bf16); each after a 64 MiB copy. Tells
/// whether the work around a call in the layer slows the call itself.
fn context(be: &CudaBackend, sdpa: &CudnnSdpa, fa: &SdpaFwd, s: usize) -> Res<()> {
    let stream = be.stream().clone();
    let ev = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let rows = s / 2;
    let up = |n: usize, shape: &[usize], seed: u64| {
        let v = upipe::rng::normal_vec_par(seed, n, 1.0);
        be.from_host(&v, shape, DType::BF16, Category::Workspace)
    };
    let x = up(rows * 4096, &[rows, 4096], 1)?;
    let w = up(256 * 4096, &[256, 4096], 2)?;
    let mut y = be.zeros(&[rows, 256], DType::BF16, Category::Workspace)?;
    let src = up(32 << 20, &[32 << 20], 3)?;
    let mut dst = be.zeros(&[32 << 20], DType::BF16, Category::Workspace)?;
    let run = |before: &mut dyn FnMut() -> Res<()>| -> Res<f64> {
        sdpa.fwd(be, fa)?;
        stream.synchronize()?;
        let mut total = 0.0;
        for _ in 0..16 {
            before()?;
            let (e0, e1) = (ev()?, {
                sdpa.fwd(be, fa)?;
                ev()?
            });
            e1.synchronize()?;
            total += e0.elapsed_ms(&e1)? as f64;
        }
        Ok(total / 16.0)
    };
    let alone = run(&mut || Ok(()))?;
    let after_gemm = run(&mut || Ok(be.gemm(y.mat_mut(), x.mat(), w.mat().t(), 1.0, 0.0)?))?;
    let after_copy = run(&mut || {
        let n = 32 << 20;
        Ok(be.copy(
            dst.view_mut(upipe::backend::MatLayout::row_major(1, n)),
            src.view(upipe::backend::MatLayout::row_major(1, n)),
        )?)
    })?;
    let alone_again = run(&mut || Ok(()))?;
    println!(
        "context S={s} H={}: fwd ms back to back {alone:.3}, after a GEMM {after_gemm:.3}, after a 64 MiB copy {after_copy:.3}, back to back again {alone_again:.3}",
        fa.shape.hq
    );
    Ok(())
}

/// Two forwards of `[s, h, d]` (causal): back to back on `be`'s stream, then
/// side by side on `be`'s and `other`'s streams; prints both times.
fn bench_pair(
    be: &CudaBackend,
    sdpa: &CudnnSdpa,
    other: &CudaBackend,
    other_sdpa: &CudnnSdpa,
    s: usize,
    h: usize,
    d: usize,
) -> Res<()> {
    let mut rng = Rng(7);
    let n = s * h * d;
    let c = Case {
        sq: s,
        sk: s,
        hq: h,
        hkv: h,
        d,
        causal: true,
        off: 0,
        bf16_grads: false,
    };
    let mut sets = Vec::new();
    for _ in 0..2 {
        let up = |x: Vec<f32>| be.from_host(&x, &[s, h, d], DType::BF16, Category::Activations);
        let (q, k, v) = (
            up(rng.vec_bf16(n, 1.0))?,
            up(rng.vec_bf16(n, 1.0))?,
            up(rng.vec_bf16(n, 1.0))?,
        );
        let o = be.zeros(&[s, h, d], DType::BF16, Category::Activations)?;
        let lse = be.zeros(&[s, h], DType::F32, Category::Activations)?;
        let p = |t: &Tensor<CudaBackend>| be.device_ptr(t);
        let args = SdpaFwd {
            q: p(&q),
            k: p(&k),
            v: p(&v),
            o: p(&o),
            lse: p(&lse),
            shape: shape(&c),
            docs: Vec::new(),
            scale: 1.0 / (d as f32).sqrt(),
        };
        sets.push((args, [q, k, v, o, lse]));
    }
    let (a, b) = (sets[0].0.clone(), sets[1].0.clone());
    let (s1, s2) = (be.stream().clone(), other.stream().clone());
    let ev = |st: &std::sync::Arc<cudarc::driver::CudaStream>| {
        st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
    };
    // warm both plans (one per handle)
    sdpa.fwd(be, &a)?;
    other_sdpa.fwd(other, &b)?;
    s1.synchronize()?;
    s2.synchronize()?;
    let iters = 3;
    let e0 = ev(&s1)?;
    for _ in 0..iters {
        sdpa.fwd(be, &a)?;
        sdpa.fwd(be, &b)?;
    }
    let e1 = ev(&s1)?;
    e1.synchronize()?;
    let serial = e0.elapsed_ms(&e1)? as f64 / iters as f64;
    let e0 = ev(&s1)?;
    for _ in 0..iters {
        let start = ev(&s1)?;
        s2.wait(&start)?;
        sdpa.fwd(be, &a)?;
        other_sdpa.fwd(other, &b)?;
        let done = ev(&s2)?;
        s1.wait(&done)?;
    }
    let e1 = ev(&s1)?;
    e1.synchronize()?;
    let paired = e0.elapsed_ms(&e1)? as f64 / iters as f64;
    let flops = 2.0 * 2.0 * (s as f64).powi(2) * h as f64 * d as f64;
    println!(
        "| {s} | {h} | {d} | {serial:.2} | {:.1} | {paired:.2} | {:.1} | {:.3} |",
        flops / serial / 1e9,
        flops / paired / 1e9,
        serial / paired
    );
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |w: &str| args.is_empty() || args.iter().any(|a| a == w);
    let be = CudaBackend::new(0)?;
    let sdpa = match CudnnSdpa::new(&be) {
        Ok(s) => s,
        Err(e) => {
            println!("cuDNN unavailable (fallback to native): {e}");
            return Err(e.into());
        }
    };
    println!("cuDNN {} from {}", sdpa.version(), sdpa.library());
    let mut ok = true;
    if want("check") {
        ok &= check(&be, &sdpa);
    }
    if want("bench") {
        let lens: Vec<usize> = std::env::var("CUDNN_BENCH_S")
            .unwrap_or_else(|_| "16384,65536".into())
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        let group: usize = std::env::var("CUDNN_BENCH_GROUP")
            .ok()
            .and_then(|g| g.parse().ok())
            .unwrap_or(1);
        let layouts: Vec<bool> = std::env::var("CUDNN_BENCH_LAYOUT")
            .unwrap_or_else(|_| "tokens".into())
            .split(',')
            .map(|l| l.trim() == "heads")
            .collect();
        println!(
            "| S | H | Hkv | layout | d | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s | fwd+bwd (accumulate) TFLOP/s |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        let heads: Vec<usize> = std::env::var("CUDNN_BENCH_H")
            .unwrap_or_else(|_| "16".into())
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        for &s in &lens {
            for &h in &heads {
                for &head_major in &layouts {
                    let b = BenchShape {
                        s,
                        h,
                        group: group.min(h),
                        d: 128,
                        head_major,
                    };
                    if let Err(e) = bench(&be, &sdpa, b) {
                        ok = false;
                        println!("| {s} | {h} | 128 | ERROR: {e} |");
                    }
                }
            }
        }
        if std::env::var("CUDNN_BENCH_PAIR").as_deref() == Ok("1") {
            let other = CudaBackend::new(0)?;
            let other_sdpa = CudnnSdpa::new(&other)?;
            println!("\ntwo causal forwards: back to back on one stream vs side by side on two");
            println!(
                "| S | H | d | serial ms | serial TFLOP/s | paired ms | paired TFLOP/s | speedup |"
            );
            println!("|---|---|---|---|---|---|---|---|");
            for &s in &lens {
                for &h in &heads {
                    if let Err(e) = bench_pair(&be, &sdpa, &other, &other_sdpa, s, h, 128) {
                        ok = false;
                        println!("| {s} | {h} | 128 | ERROR: {e} |");
                    }
                }
            }
        }
    }
    println!("plan builds (first call per shape):");
    for b in sdpa.plan_builds() {
        println!(
            "  {} sq {} sk {} hq {} hkv {} d {} mask {}: {:.1} ms, workspace {} B, engine cfg #{} of {} ({})",
            if b.bwd { "bwd" } else { "fwd" },
            b.shape.sq,
            b.shape.sk,
            b.shape.hq,
            b.shape.hkv,
            b.shape.d,
            b.shape.mask,
            b.build_ms,
            b.workspace,
            b.candidate.0,
            b.candidate.1,
            b.engine
        );
        for (k, engine, ms) in &b.timings {
            println!("    candidate #{k} ({engine}): {ms:.3} ms");
        }
    }
    if !ok {
        return Err("some checks failed".into());
    }
    println!("all checks passed");
    Ok(())
}
