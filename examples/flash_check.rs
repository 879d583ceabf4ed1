//! Correctness and speed check of the native flash attention kernels against
//! the CPU f32 oracle, plus TFLOP/s at long sequences.
//!
//! `flash_check ptx <out.ptx>` only compiles the kernels with NVRTC (no GPU needed;
//! the wgmma modules go to `<out.ptx>.wgmma.ptx` and `<out.ptx>.wgmma_bwd.ptx`);
//! `flash_check [check] [bench]` (default both) runs on GPU 0. Every check case
//! and bench row runs with both forward kernels, the mma.sync one and (on
//! sm_90a devices) the wgmma one, and each forward's O and LSE feed both
//! backward kernels, the mma.sync one and (on sm_90a devices, unless
//! `UPIPE_FLASH_BWD=mma`) the wgmma one; `UPIPE_FLASH_BWD=wgmma` makes a
//! failure to build the wgmma backward an error instead of a note.
//! NVRTC and the driver are opened at run time: put the directory of
//! `libnvrtc.so.13` on `LD_LIBRARY_PATH`. `FLASH_DEFINES="BWD_HEADS_FASTEST=0"`
//! (`;`-separated) overrides the kernels' compile-time tuning knobs.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use half::bf16;
use std::sync::Arc;
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::attention::{AttnBwd, AttnFwd};
use upipe::backend::cuda::flash::{
    FLASH_SOURCE, FLASH_WGMMA_BWD_SOURCE, FLASH_WGMMA_SOURCE, FlashFunctions, FlashKernel,
    NVRTC_ARCH, NVRTC_OPTIONS, WGMMA_NVRTC_ARCH, bwd_kernel_from_env, flash_bwd,
    flash_bwd_workspace_bytes, flash_fwd,
};
use upipe::backend::{AttentionBwd, AttentionFwd, AttnMask, Backend, Category, DType};

mod support;
use support::{Res, Rng, rel_err};

fn compile(source: &str, arch: &'static str) -> Res<cudarc::nvrtc::Ptx> {
    let t = std::time::Instant::now();
    let opts = CompileOptions {
        arch: Some(arch),
        options: NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    // FLASH_DEFINES="A=1;B=0" overrides the kernels' compile-time tuning knobs.
    let mut src = String::new();
    if let Ok(defs) = std::env::var("FLASH_DEFINES") {
        for d in defs.split(';').filter(|d| !d.is_empty()) {
            let (k, v) = d.split_once('=').unwrap_or((d, "1"));
            src.push_str(&format!("#define {k} {v}\n"));
        }
        eprintln!("variant: {defs}");
    }
    src.push_str(source);
    let ptx = compile_ptx_with_opts(&src, opts)?;
    eprintln!("nvrtc compile ({arch}): {:.2} s", t.elapsed().as_secs_f64());
    Ok(ptx)
}

fn to_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect()
}

struct Gpu {
    stream: Arc<CudaStream>,
    f: FlashFunctions,
    /// The forward kernels to run (mma, and wgmma where loaded).
    kernels: Vec<FlashKernel>,
    /// The backward kernels to run (mma, and wgmma where loaded).
    bwd_kernels: Vec<FlashKernel>,
}

impl Gpu {
    fn up16(&self, x: &[f32]) -> Res<CudaSlice<u16>> {
        Ok(self.stream.clone_htod(&to_bits(x))?)
    }
    fn up32(&self, x: &[f32]) -> Res<CudaSlice<f32>> {
        Ok(self.stream.clone_htod(x)?)
    }
    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
    /// Backward over keys `[key_from, sk)` only, with the lse of the full rows.
    key_from: usize,
}

/// The mask of a case's `causal` column.
fn mask(causal: bool) -> AttnMask {
    if causal {
        AttnMask::Causal
    } else {
        AttnMask::Full
    }
}

type CaseResult = ((FlashKernel, FlashKernel), [f32; 5]);

fn run_case(g: &Gpu, c: Case, seed: u64) -> Res<Vec<CaseResult>> {
    let cpu = CpuBackend::new();
    let mut rng = Rng(seed);
    let (sq, sk, hq, hkv, d) = (c.sq, c.sk, c.hq, c.hkv, c.d);
    let q = rng.vec_bf16(sq * hq * d, 1.5);
    let k = rng.vec_bf16(sk * hkv * d, 1.5);
    let v = rng.vec_bf16(sk * hkv * d, 1.0);
    let d_o = rng.vec_bf16(sq * hq * d, 1.0);
    let dq0 = rng.vec_bf16(sq * hq * d, 0.1);
    let dk0 = rng.vec_bf16(sk * hkv * d, 0.1);
    let dv0 = rng.vec_bf16(sk * hkv * d, 0.1);

    // CPU oracle.
    let t = |x: &[f32], s: usize, h: usize| {
        cpu.from_host(x, &[s, h, d], DType::F32, Category::Activations)
    };
    let (cq, ck, cv, cdo) = (
        t(&q, sq, hq)?,
        t(&k, sk, hkv)?,
        t(&v, sk, hkv)?,
        t(&d_o, sq, hq)?,
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
    let (mut cdq, mut cdk, mut cdv) = (t(&dq0, sq, hq)?, t(&dk0, sk, hkv)?, t(&dv0, sk, hkv)?);
    let kr = c.key_from..sk;
    cpu.attention_bwd(AttentionBwd {
        q: cq.all_rows(),
        k: ck.rows_view(kr.clone()),
        v: cv.rows_view(kr.clone()),
        o: co.all_rows(),
        d_o: cdo.all_rows(),
        lse: clse.all_rows(),
        mask: &mask(c.causal && c.key_from == 0),
        scale: 1.0 / (d as f32).sqrt(),
        dq: cdq.all_rows_mut(),
        dk: cdk.rows_view_mut(kr.clone()),
        dv: cdv.rows_view_mut(kr.clone()),
        writes: upipe::backend::AttnGradWrites::ADD,
    })?;

    let (co, clse, cdq, cdk, cdv) = (
        cpu.to_host(&co)?,
        cpu.to_host(&clse)?,
        cpu.to_host(&cdq)?,
        cpu.to_host(&cdk)?,
        cpu.to_host(&cdv)?,
    );
    let mut out = Vec::new();
    for (&kernel, &bwd) in g
        .kernels
        .iter()
        .flat_map(|k| g.bwd_kernels.iter().map(move |b| (k, b)))
    {
        let mut f = g.f.clone();
        f.set_fwd_kernel(kernel);
        f.set_bwd_kernel(bwd);
        // The kernels that really run (head dims 64 and 256 have no wgmma kernels).
        let kernels = (f.fwd_kernel_for(c.d)?, f.bwd_kernel_for(c.d)?);
        if out.iter().any(|(k, _)| *k == kernels) {
            continue;
        }
        let e = run_gpu(g, &f, c, [&q, &k, &v, &d_o, &dq0, &dk0, &dv0])?;
        out.push((
            kernels,
            [
                rel_err(&e[0], &co),
                rel_err(&e[1], &clse),
                rel_err(&e[2], &cdq),
                rel_err(&e[3], &cdk),
                rel_err(&e[4], &cdv),
            ],
        ));
    }
    Ok(out)
}

/// Forward then backward on the GPU; returns o, lse, dq, dk, dv.
fn run_gpu(g: &Gpu, f: &FlashFunctions, c: Case, x: [&[f32]; 7]) -> Res<[Vec<f32>; 5]> {
    let (sq, sk, hq, hkv, d) = (c.sq, c.sk, c.hq, c.hkv, c.d);
    let [q, k, v, d_o, dq0, dk0, dv0] = x;
    let (gq, gk, gv, gdo) = (g.up16(q)?, g.up16(k)?, g.up16(v)?, g.up16(d_o)?);
    let go = g.stream.alloc_zeros::<u16>(sq * hq * d)?;
    let glse = g.stream.alloc_zeros::<f32>(sq * hq)?;
    flash_fwd(
        &g.stream,
        f,
        &AttnFwd {
            q: g.ptr(&gq),
            k: g.ptr(&gk),
            v: g.ptr(&gv),
            dt: DType::BF16,
            o: g.ptr(&go),
            o_dt: DType::BF16,
            lse: g.ptr(&glse),
            q_rs: hq * d,
            k_rs: hkv * d,
            v_rs: hkv * d,
            o_rs: hq * d,
            lse_rs: hq,
            sq,
            sk,
            hq,
            hkv,
            d,
            mask: mask(c.causal),
            scale: 1.0 / (d as f32).sqrt(),
            bounds: 0,
        },
    )?;
    let (gdq, gdk, gdv) = (g.up32(dq0)?, g.up32(dk0)?, g.up32(dv0)?);
    let ws = g
        .stream
        .alloc_zeros::<u8>(flash_bwd_workspace_bytes(sq, hq))?;
    let koff = (c.key_from * hkv * d) as u64;
    flash_bwd(
        &g.stream,
        f,
        &AttnBwd {
            q: g.ptr(&gq),
            k: g.ptr(&gk) + 2 * koff,
            v: g.ptr(&gv) + 2 * koff,
            dt: DType::BF16,
            o: g.ptr(&go),
            o_dt: DType::BF16,
            d_o: g.ptr(&gdo),
            d_o_dt: DType::BF16,
            lse: g.ptr(&glse),
            dq: g.ptr(&gdq),
            dk: g.ptr(&gdk) + 4 * koff,
            dv: g.ptr(&gdv) + 4 * koff,
            q_rs: hq * d,
            k_rs: hkv * d,
            v_rs: hkv * d,
            o_rs: hq * d,
            d_o_rs: hq * d,
            lse_rs: hq,
            dq_rs: hq * d,
            dk_rs: hkv * d,
            dv_rs: hkv * d,
            sq,
            sk: sk - c.key_from,
            hq,
            hkv,
            d,
            mask: mask(c.causal && c.key_from == 0),
            scale: 1.0 / (d as f32).sqrt(),
            bounds: 0,
        },
        g.ptr(&ws),
    )?;
    g.stream.synchronize()?;
    let o: Vec<f32> = g
        .stream
        .clone_dtoh(&go)?
        .iter()
        .map(|&b| bf16::from_bits(b).to_f32())
        .collect();
    let lse = g.stream.clone_dtoh(&glse)?;
    let dq = g.stream.clone_dtoh(&gdq)?;
    let dk = g.stream.clone_dtoh(&gdk)?;
    let dv = g.stream.clone_dtoh(&gdv)?;
    Ok([o, lse, dq, dk, dv])
}

fn check(g: &Gpu) -> Res<bool> {
    let mut cases = Vec::new();
    for d in [64, 128, 256] {
        for (hq, hkv) in [(4, 4), (8, 2)] {
            for causal in [true, false] {
                for s in [64, 333] {
                    cases.push(Case {
                        sq: s,
                        sk: s,
                        hq,
                        hkv,
                        d,
                        causal,
                        key_from: 0,
                    });
                }
            }
            cases.push(Case {
                sq: 97,
                sk: 300,
                hq,
                hkv,
                d,
                causal: false,
                key_from: 0,
            });
            cases.push(Case {
                sq: 200,
                sk: 300,
                hq,
                hkv,
                d,
                causal: false,
                key_from: 128,
            });
        }
    }
    cases.push(Case {
        sq: 1,
        sk: 1,
        hq: 2,
        hkv: 1,
        d: 64,
        causal: true,
        key_from: 0,
    });
    cases.push(Case {
        sq: 1000,
        sk: 1000,
        hq: 2,
        hkv: 1,
        d: 128,
        causal: true,
        key_from: 0,
    });
    // Several key blocks of the wgmma pipeline, a query tail, more keys than queries.
    cases.push(Case {
        sq: 300,
        sk: 1100,
        hq: 4,
        hkv: 2,
        d: 128,
        causal: false,
        key_from: 0,
    });
    println!("| sq | sk | hq | hkv | d | mask | keys | fwd | bwd | o | lse | dq | dk | dv | ok |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut all_ok = true;
    for (i, c) in cases.iter().enumerate() {
        for ((kernel, bwd), e) in run_case(g, *c, 0x9e3779b97f4a7c15 ^ (i as u64 * 7919 + 1))? {
            let ok = e.iter().all(|&x| x <= 1e-2);
            all_ok &= ok;
            println!(
                "| {} | {} | {} | {} | {} | {} | {}.. | {} | {} | {:.1e} | {:.1e} | {:.1e} | {:.1e} | {:.1e} | {} |",
                c.sq,
                c.sk,
                c.hq,
                c.hkv,
                c.d,
                if c.causal { "causal" } else { "full" },
                c.key_from,
                kernel.name(),
                bwd.name(),
                e[0],
                e[1],
                e[2],
                e[3],
                e[4],
                if ok { "yes" } else { "NO" }
            );
        }
    }
    println!(
        "correctness: {}",
        if all_ok { "ALL PASS" } else { "FAILURES" }
    );
    Ok(all_ok)
}

fn bench(
    g: &Gpu,
    (kernel, bwd): (FlashKernel, FlashKernel),
    s: usize,
    h: usize,
    hkv: usize,
    d: usize,
) -> Res<()> {
    let mut f = g.f.clone();
    f.set_fwd_kernel(kernel);
    f.set_bwd_kernel(bwd);
    let f = &f;
    let mut rng = Rng(42);
    let n = s * h * d;
    let nk = s * hkv * d;
    let q = g.up16(&rng.vec_bf16(n, 1.0))?;
    let k = g.up16(&rng.vec_bf16(nk, 1.0))?;
    let v = g.up16(&rng.vec_bf16(nk, 1.0))?;
    let d_o = g.up16(&rng.vec_bf16(n, 1.0))?;
    let o = g.stream.alloc_zeros::<u16>(n)?;
    let lse = g.stream.alloc_zeros::<f32>(s * h)?;
    let dq = g.stream.alloc_zeros::<f32>(n)?;
    let dk = g.stream.alloc_zeros::<f32>(nk)?;
    let dv = g.stream.alloc_zeros::<f32>(nk)?;
    let ws = g
        .stream
        .alloc_zeros::<u8>(flash_bwd_workspace_bytes(s, h))?;
    let fa = AttnFwd {
        q: g.ptr(&q),
        k: g.ptr(&k),
        v: g.ptr(&v),
        dt: DType::BF16,
        o: g.ptr(&o),
        o_dt: DType::BF16,
        lse: g.ptr(&lse),
        q_rs: h * d,
        k_rs: hkv * d,
        v_rs: hkv * d,
        o_rs: h * d,
        lse_rs: h,
        sq: s,
        sk: s,
        hq: h,
        hkv,
        d,
        mask: AttnMask::Causal,
        scale: 1.0 / (d as f32).sqrt(),
        bounds: 0,
    };
    let ba = AttnBwd {
        q: fa.q,
        k: fa.k,
        v: fa.v,
        dt: DType::BF16,
        o: fa.o,
        o_dt: DType::BF16,
        d_o: g.ptr(&d_o),
        d_o_dt: DType::BF16,
        lse: fa.lse,
        dq: g.ptr(&dq),
        dk: g.ptr(&dk),
        dv: g.ptr(&dv),
        q_rs: h * d,
        k_rs: hkv * d,
        v_rs: hkv * d,
        o_rs: h * d,
        d_o_rs: h * d,
        lse_rs: h,
        dq_rs: h * d,
        dk_rs: hkv * d,
        dv_rs: hkv * d,
        sq: s,
        sk: s,
        hq: h,
        hkv,
        d,
        mask: AttnMask::Causal,
        scale: 1.0 / (d as f32).sqrt(),
        bounds: 0,
    };
    let iters = if s >= 32768 { 3 } else { 10 };
    let time = |f: &dyn Fn() -> Res<()>| -> Res<f64> {
        f()?;
        g.stream.synchronize()?;
        let e0 = g
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            f()?;
        }
        let e1 = g
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        e1.synchronize()?;
        Ok(e0.elapsed_ms(&e1)? as f64 / iters as f64)
    };
    let t_fwd = time(&|| Ok(flash_fwd(&g.stream, f, &fa)?))?;
    let t_bwd = time(&|| Ok(flash_bwd(&g.stream, f, &ba, g.ptr(&ws))?))?;
    let flops = 2.0 * (s as f64).powi(2) * h as f64 * d as f64;
    let t_all = t_fwd + t_bwd;
    println!(
        "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.2} | {:.1} | {:.1} |",
        f.fwd_kernel_for(d)?.name(),
        f.bwd_kernel_for(d)?.name(),
        s,
        h,
        hkv,
        d,
        t_fwd,
        flops / t_fwd / 1e9,
        t_bwd,
        2.5 * flops / t_bwd / 1e9,
        3.5 * flops / t_all / 1e9
    );
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(|s| s.as_str()) == Some("ptx") {
        let ptx = compile(FLASH_SOURCE, NVRTC_ARCH)?;
        let out = args.get(1).cloned().unwrap_or_else(|| "flash.ptx".into());
        std::fs::write(&out, ptx.to_src())?;
        let wg = compile(FLASH_WGMMA_SOURCE, WGMMA_NVRTC_ARCH)?;
        std::fs::write(format!("{out}.wgmma.ptx"), wg.to_src())?;
        let wb = compile(FLASH_WGMMA_BWD_SOURCE, WGMMA_NVRTC_ARCH)?;
        std::fs::write(format!("{out}.wgmma_bwd.ptx"), wb.to_src())?;
        println!("wrote {out}, {out}.wgmma.ptx and {out}.wgmma_bwd.ptx");
        return Ok(());
    }
    let do_check = args.is_empty() || args.iter().any(|a| a == "check");
    let do_bench = args.is_empty() || args.iter().any(|a| a == "bench");
    let ptx = compile(FLASH_SOURCE, NVRTC_ARCH)?;
    let ctx = CudaContext::new(0)?;
    // Raw pointers are used on one stream: no cross-stream tracking needed.
    unsafe { ctx.disable_event_tracking() };
    println!("device: {}", ctx.name()?);
    let module = ctx.load_module(ptx)?;
    let mut f = FlashFunctions::load(&module)?;
    let mut kernels = vec![FlashKernel::Mma];
    let mut bwd_kernels = vec![FlashKernel::Mma];
    let bwd_choice = bwd_kernel_from_env()?;
    if ctx.compute_capability()? == (9, 0) {
        let wg = ctx.load_module(compile(FLASH_WGMMA_SOURCE, WGMMA_NVRTC_ARCH)?)?;
        f = f.with_wgmma(&wg)?;
        kernels.push(FlashKernel::Wgmma);
        if std::env::var("UPIPE_FLASH_BWD").as_deref() != Ok("mma") {
            let wb = compile(FLASH_WGMMA_BWD_SOURCE, WGMMA_NVRTC_ARCH)
                .and_then(|ptx| Ok(ctx.load_module(ptx)?))
                .and_then(|m| Ok(f.clone().with_wgmma_bwd(&m)?));
            match wb {
                Ok(g) => {
                    f = g;
                    bwd_kernels.push(FlashKernel::Wgmma);
                }
                Err(e) if bwd_choice == FlashKernel::Wgmma => return Err(e),
                Err(e) => println!("the wgmma backward is skipped: {e}"),
            }
        }
    } else {
        println!("not an sm_90 device: the wgmma forward and backward are skipped");
    }
    let g = Gpu {
        stream: ctx.default_stream(),
        f,
        kernels,
        bwd_kernels,
    };
    let mut ok = true;
    if do_check {
        ok = check(&g)?;
    }
    if do_bench {
        println!("\ncausal, bf16; TFLOP/s with causal fwd = 2*S^2*H*d, bwd = 2.5x, fwd+bwd = 3.5x");
        println!(
            "| fwd | bwd | S | H | Hkv | d | fwd ms | fwd TF/s | bwd ms | bwd TF/s | fwd+bwd TF/s |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        // Head dim 256 (Gemma 3 1B-12B's, 8 query and 4 kv heads at 4B) has
        // only the mma.sync kernels.
        let rows = [
            (16384, 16, 16, 128),
            (65536, 16, 16, 128),
            (16384, 32, 8, 128),
            (16384, 8, 4, 256),
            (65536, 8, 4, 256),
        ];
        for (s, h, hkv, d) in rows {
            let mut ran = Vec::new();
            for &k in &g.kernels {
                for &b in &g.bwd_kernels {
                    let mut f = g.f.clone();
                    f.set_fwd_kernel(k);
                    f.set_bwd_kernel(b);
                    let runs = (f.fwd_kernel_for(d)?, f.bwd_kernel_for(d)?);
                    if !ran.contains(&runs) {
                        ran.push(runs);
                        bench(&g, (k, b), s, h, hkv, d)?;
                    }
                }
            }
        }
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
