//! cuDNN's FP8 attention (`backend::cuda::cudnn::sdpa_fp8`) against its
//! BF16 attention on the same inputs: the error of O, Stats, dQ, dK and dV,
//! each amax cuDNN reports against the bound its scale was set from, and
//! the time of each forward and backward.
//!
//! `cudnn_fp8_check` on GPU 0. `FP8_S=4096,32768` sets the lengths,
//! `FP8_HEADS=32:8,28:4` the query:kv heads (head dim 128, causal).

use cudarc::driver::sys::CUevent_flags;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::sdpa_fp8::{SLOTS, Slot, cells as cells_of};
use upipe::backend::cuda::cudnn::{CudnnSdpa, SdpaBwd, SdpaFp8, SdpaFwd, SdpaShape, dense_shape};
use upipe::backend::fp8::attention::{AttnAmax, scales};
use upipe::backend::{AttnMask, Backend, Category, DType, Tensor};

mod support;
use support::{Res, Rng, rel_err};

fn list(var: &str, default: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect()
}

fn amax(x: &[f32]) -> f32 {
    upipe::backend::fp8::amax(x.iter().copied())
}

fn main() -> Res<()> {
    let mut be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("cudnn_fp8_check: skipped, no usable CUDA GPU ({e})");
            return Ok(());
        }
    };
    be.set_attn_kernel(upipe::backend::cuda::cudnn::AttnKernel::Cudnn);
    let sdpa = CudnnSdpa::new(&be)?;
    println!("{} cuDNN {}", be.name(), sdpa.version());
    println!(
        "| S | Hq:Hkv | fwd bf16 ms | fwd fp8 ms | bwd bf16 ms | bwd fp8 ms | err O | err lse | err dQ | err dK | err dV |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for s in list("FP8_S", "4096,32768") {
        for heads in list("FP8_HEADS", "32:8,28:4") {
            let s: usize = s.parse()?;
            let (hq, hkv) = heads.split_once(':').ok_or("FP8_HEADS: hq:hkv")?;
            run(&mut be, &sdpa, s, hq.parse()?, hkv.parse()?)?;
        }
    }
    for b in sdpa.plan_builds() {
        println!(
            "plan: bwd {} fp8 {} s {} hq {} hkv {}: workspace {} B, candidate {:?}, {} ({:.0} ms)",
            b.bwd,
            b.shape.fp8,
            b.shape.sq,
            b.shape.hq,
            b.shape.hkv,
            b.workspace,
            b.candidate,
            b.engine,
            b.build_ms
        );
    }
    Ok(())
}

struct Host {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
}

fn run(bm: &mut CudaBackend, sdpa: &CudnnSdpa, s: usize, hq: usize, hkv: usize) -> Res<()> {
    let t_route = route(bm, s, hq, hkv)?;
    let be: &CudaBackend = bm;
    let d = 128;
    let mut rng = Rng(7);
    let h = Host {
        q: rng.vec_bf16(s * hq * d, 2.0),
        k: rng.vec_bf16(s * hkv * d, 2.0),
        v: rng.vec_bf16(s * hkv * d, 1.0),
        d_o: rng.vec_bf16(s * hq * d, 1e-3),
    };
    let shape = dense_shape(s, s, hq, hkv, d, AttnMask::Causal);
    let scale = 1.0 / (d as f32).sqrt();
    let up =
        |x: &[f32], heads: usize, dt| be.from_host(x, &[s, heads, d], dt, Category::Activations);
    let zeros = |heads: usize, dt| be.zeros(&[s, heads, d], dt, Category::Activations);
    let p = |t: &Tensor<CudaBackend>| be.device_ptr(t);
    let stream = be.stream().clone();
    let iters = if s >= 32768 { 3 } else { 10 };
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

    // BF16 reference
    let (q, k, v, d_o) = (
        up(&h.q, hq, DType::BF16)?,
        up(&h.k, hkv, DType::BF16)?,
        up(&h.v, hkv, DType::BF16)?,
        up(&h.d_o, hq, DType::BF16)?,
    );
    let o = zeros(hq, DType::BF16)?;
    let lse = be.zeros(&[s, hq], DType::F32, Category::Activations)?;
    let (dq, dk, dv) = (
        zeros(hq, DType::BF16)?,
        zeros(hkv, DType::BF16)?,
        zeros(hkv, DType::BF16)?,
    );
    let fa = SdpaFwd {
        q: p(&q),
        k: p(&k),
        v: p(&v),
        o: p(&o),
        lse: p(&lse),
        shape: shape.clone(),
        docs: Vec::new(),
        scale,
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
        dq_dt: DType::BF16,
        dkv_dt: DType::BF16,
        shape: shape.clone(),
        docs: Vec::new(),
        scale,
    };
    let t_fwd = time(&|| Ok(sdpa.fwd(be, &fa)?))?;
    let t_bwd = time(&|| Ok(sdpa.bwd_overwrite(be, &ba, ba.dq, ba.dk, ba.dv)?))?;
    let want = [&o, &lse, &dq, &dk, &dv].map(|t| be.to_host(t));

    // FP8: operands quantized on the host with the scales of the policy
    let a = AttnAmax {
        q: amax(&h.q),
        k: amax(&h.k),
        v: amax(&h.v),
        d_o: amax(&h.d_o),
        o: 0.0,
    };
    let f = scales(&a, s, d, scale);
    let quant = |x: &[f32], sc: f32| -> Vec<f32> { x.iter().map(|v| v * sc).collect() };
    let (q8, k8, v8) = (
        up(&quant(&h.q, f.q), hq, DType::F8E4M3)?,
        up(&quant(&h.k, f.k), hkv, DType::F8E4M3)?,
        up(&quant(&h.v, f.v), hkv, DType::F8E4M3)?,
    );
    let o8 = zeros(hq, DType::F8E4M3)?;
    let lse8 = be.zeros(&[s, hq], DType::F32, Category::Activations)?;
    let mut cells = vec![0f32; SLOTS];
    for (slot, value) in cells_of(&f) {
        cells[slot as usize] = value;
    }
    let sc = be.from_host(&cells, &[SLOTS], DType::F32, Category::Workspace)?;
    let fp8_shape = SdpaShape {
        fp8: true,
        ..shape.clone()
    };
    let fwd8 = SdpaFp8 {
        bwd: false,
        q: p(&q8),
        k: p(&k8),
        v: p(&v8),
        o: p(&o8),
        d_o: 0,
        lse: p(&lse8),
        dq: 0,
        dk: 0,
        dv: 0,
        scales: p(&sc),
        shape: fp8_shape.clone(),
        scale,
    };
    let t_fwd8 = time(&|| Ok(sdpa.run_fp8(be, &fwd8)?))?;
    let o_got: Vec<f32> = be.to_host(&o8)?.iter().map(|x| x / f.o).collect();
    let lse_got = be.to_host(&lse8)?;
    // the backward reads O₈ as written, dO quantized with its scale
    let do8 = up(&quant(&h.d_o, f.d_o), hq, DType::F8E5M2)?;
    let fwd_cells = be.to_host(&sc)?;
    let sc = be.from_host(&fwd_cells, &[SLOTS], DType::F32, Category::Workspace)?;
    let (dq8, dk8, dv8) = (
        zeros(hq, DType::F8E5M2)?,
        zeros(hkv, DType::F8E5M2)?,
        zeros(hkv, DType::F8E5M2)?,
    );
    let bwd8 = SdpaFp8 {
        bwd: true,
        d_o: p(&do8),
        dq: p(&dq8),
        dk: p(&dk8),
        dv: p(&dv8),
        scales: p(&sc),
        ..fwd8.clone()
    };
    let t_bwd8 = time(&|| Ok(sdpa.run_fp8(be, &bwd8)?))?;
    let got = |t: &Tensor<CudaBackend>, sc: f32| -> Res<Vec<f32>> {
        Ok(be.to_host(t)?.iter().map(|x| x / sc).collect())
    };
    let (dq_got, dk_got, dv_got) = (got(&dq8, f.dq)?, got(&dk8, f.dk)?, got(&dv8, f.dv)?);
    let want: Vec<Vec<f32>> = want.into_iter().collect::<Result<_, _>>()?;
    println!(
        "| {s} | {hq}:{hkv} | {t_fwd:.2} | {t_fwd8:.2} | {t_bwd:.2} | {t_bwd8:.2} | {:.1e} | {:.1e} | {:.1e} | {:.1e} | {:.1e} |",
        rel_err(&o_got, &want[0]),
        rel_err(&lse_got, &want[1]),
        rel_err(&dq_got, &want[2]),
        rel_err(&dk_got, &want[3]),
        rel_err(&dv_got, &want[4]),
    );
    let cells = be.to_host(&sc)?;
    println!("  through the backend (quantization included): {t_route}");
    println!(
        "  amax/bound: O {:.2e}/{:.2e} dS {:.2e}/{:.2e} dQ {:.2e}/{:.2e} dK {:.2e}/{:.2e} dV {:.2e}/{:.2e}; want amax dQ {:.2e} dK {:.2e} dV {:.2e}",
        fwd_cells[Slot::AmaxO as usize],
        f.bound_o,
        cells[Slot::AmaxDp as usize],
        f.bound_ds,
        cells[Slot::AmaxDq as usize],
        f.bound_dq,
        cells[Slot::AmaxDk as usize],
        f.bound_dk,
        cells[Slot::AmaxDv as usize],
        f.bound_dv,
        amax(&want[2]),
        amax(&want[3]),
        amax(&want[4]),
    );
    Ok(())
}

/// The backend's FP8 route (`set_attention_fp8`) against its BF16 one on
/// the same inputs: errors of O, dQ, dK, dV and the times of both.
fn route(be: &mut CudaBackend, s: usize, hq: usize, hkv: usize) -> Res<String> {
    use upipe::backend::{AttentionBwd, AttentionFwd, AttnGradWrites};
    let d = 128;
    let mut rng = Rng(11);
    let up = |be: &CudaBackend, x: Vec<f32>, heads: usize| {
        be.from_host(&x, &[s, heads, d], DType::BF16, Category::Activations)
    };
    let (q, k, v, d_o) = (
        up(be, rng.vec_bf16(s * hq * d, 2.0), hq)?,
        up(be, rng.vec_bf16(s * hkv * d, 2.0), hkv)?,
        up(be, rng.vec_bf16(s * hkv * d, 1.0), hkv)?,
        up(be, rng.vec_bf16(s * hq * d, 1e-3), hq)?,
    );
    let mut out = Vec::new();
    let mut times = Vec::new();
    for fp8 in [false, true] {
        be.set_attention_fp8(upipe::backend::fp8::Fp8Passes {
            forward: fp8,
            backward: fp8,
        });
        let b: &CudaBackend = be;
        let mut o = b.zeros(&[s, hq, d], DType::BF16, Category::Activations)?;
        let mut lse = b.zeros(&[s, hq], DType::F32, Category::Activations)?;
        let g = |h| b.zeros(&[s, h, d], DType::F32, Category::Activations);
        let (mut dq, mut dk, mut dv) = (g(hq)?, g(hkv)?, g(hkv)?);
        let scale = 1.0 / (d as f32).sqrt();
        let mut pass = |o: &mut Tensor<CudaBackend>, lse: &mut Tensor<CudaBackend>| -> Res<()> {
            b.attention_fwd(AttentionFwd {
                q: q.all_rows(),
                k: k.all_rows(),
                v: v.all_rows(),
                mask: &AttnMask::Causal,
                scale,
                o: o.all_rows_mut(),
                lse: lse.all_rows_mut(),
            })?;
            b.attention_bwd(AttentionBwd {
                q: q.all_rows(),
                k: k.all_rows(),
                v: v.all_rows(),
                o: o.all_rows(),
                d_o: d_o.all_rows(),
                lse: lse.all_rows(),
                mask: &AttnMask::Causal,
                scale,
                dq: dq.all_rows_mut(),
                dk: dk.all_rows_mut(),
                dv: dv.all_rows_mut(),
                writes: AttnGradWrites {
                    dq: upipe::backend::GradWrite::Overwrite,
                    dkv: upipe::backend::GradWrite::Overwrite,
                },
            })?;
            Ok(())
        };
        pass(&mut o, &mut lse)?;
        b.synchronize()?;
        let t0 = std::time::Instant::now();
        pass(&mut o, &mut lse)?;
        b.synchronize()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        out.push([&o, &dq, &dk, &dv].map(|t| b.to_host(t)));
    }
    be.set_attention_fp8(upipe::backend::fp8::Fp8Passes::default());
    let [bf, f8]: [[_; 4]; 2] = out.try_into().map_err(|_| "two passes")?;
    let mut errs = Vec::new();
    for (a, w) in f8.into_iter().zip(bf) {
        errs.push(rel_err(&a?, &w?));
    }
    Ok(format!(
        "fwd+bwd bf16 {:.2} ms, fp8 {:.2} ms; err O {:.1e} dQ {:.1e} dK {:.1e} dV {:.1e}",
        times[0], times[1], errs[0], errs[1], errs[2], errs[3]
    ))
}
