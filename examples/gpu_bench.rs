//! GPU micro-benchmarks of the CUDA backend: cuBLASLt bf16 GEMM (8192³ by
//! default), attention through `CudaBackend::attention_fwd` / `attention_bwd`
//! (the flash kernels; causal, H=16, d=128, S=16K and 64K; causal fwd flops =
//! 2·S²·H·d, fwd+bwd = 3.5x that) and, for reference, the naive attention
//! kernel. Prints a table and one JSON line. Exits 0 with a message when no
//! GPU is present.
//!
//! `cargo run --release --example gpu_bench [-- N [S,S,...]]`

use std::time::Instant;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::backend::cuda::{AttentionKernels, CudaBackend};
use upipe::backend::{AttentionBwd, AttentionFwd, AttnMask, Backend, Category, DType, Tensor};

fn time<F: FnMut() -> upipe::Result<()>>(
    b: &CudaBackend,
    iters: usize,
    mut f: F,
) -> upipe::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    b.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    b.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

/// Uniform(-scale, scale) values from a xorshift generator.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Seconds per attention forward and per forward+backward through the backend
/// (causal, MHA, bf16 q/k/v/o/dO, gradients of `grad_dt`).
fn attention_times(
    b: &CudaBackend,
    s: usize,
    h: usize,
    d: usize,
    grad_dt: DType,
    iters: usize,
) -> upipe::Result<(f64, f64)> {
    let n = s * h * d;
    let up = |seed: u64, scale: f32| -> upipe::Result<Tensor<CudaBackend>> {
        b.from_host(
            &random(n, seed, scale),
            &[s, h, d],
            DType::BF16,
            Category::Activations,
        )
    };
    let (q, k, v, d_o) = (up(1, 2.0)?, up(2, 2.0)?, up(3, 1.0)?, up(4, 1.0)?);
    let mut o = b.zeros(&[s, h, d], DType::BF16, Category::Activations)?;
    let mut lse = b.zeros(&[s, h], DType::F32, Category::Activations)?;
    let mut dq = b.zeros(&[s, h, d], grad_dt, Category::Grads)?;
    let mut dk = b.zeros(&[s, h, d], grad_dt, Category::Grads)?;
    let mut dv = b.zeros(&[s, h, d], grad_dt, Category::Grads)?;
    let fwd = |o: &mut Tensor<CudaBackend>, lse: &mut Tensor<CudaBackend>| {
        b.attention_fwd(AttentionFwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: v.all_rows(),
            mask: &AttnMask::Causal,
            scale: 1.0 / (d as f32).sqrt(),
            o: o.all_rows_mut(),
            lse: lse.all_rows_mut(),
        })
    };
    let t_fwd = time(b, iters, || fwd(&mut o, &mut lse))?;
    let t_both = time(b, iters, || {
        fwd(&mut o, &mut lse)?;
        b.attention_bwd(AttentionBwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: v.all_rows(),
            o: o.all_rows(),
            d_o: d_o.all_rows(),
            lse: lse.all_rows(),
            mask: &AttnMask::Causal,
            scale: 1.0 / (d as f32).sqrt(),
            dq: dq.all_rows_mut(),
            dk: dk.all_rows_mut(),
            dv: dv.all_rows_mut(),
            writes: upipe::backend::AttnGradWrites::ADD,
        })
    })?;
    let l = b.to_host(&lse)?;
    if l.iter().any(|x| !x.is_finite()) {
        return Err(upipe::Error::Backend(
            "attention benchmark: non-finite lse".into(),
        ));
    }
    Ok((t_fwd, t_both))
}

fn main() -> upipe::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(8192);
    let attn_lens: Vec<usize> = std::env::args()
        .nth(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![16384, 65536]);
    let mut b = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("gpu_bench: skipped, no usable CUDA GPU ({e})");
            return Ok(());
        }
    };
    println!(
        "gpu_bench on {} (kernels {} from cache)",
        b.name(),
        if b.kernels_from_cache() {
            "read"
        } else {
            "not"
        }
    );
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    let flops = 2.0 * (n as f64).powi(3);
    let mut a = b.zeros(&[n, n], DType::BF16, Category::Workspace)?;
    let mut w = b.zeros(&[n, n], DType::BF16, Category::Workspace)?;
    b.fill(&mut a, 0.01)?;
    b.fill(&mut w, 0.02)?;
    let mut c16 = b.zeros(&[n, n], DType::BF16, Category::Workspace)?;
    let s = time(&b, 20, || b.gemm(c16.mat_mut(), a.mat(), w.mat(), 1.0, 0.0))?;
    rows.push((
        format!("gemm bf16 {n}x{n}x{n} -> bf16 (NN)"),
        s,
        flops / s / 1e12,
    ));
    let s = time(&b, 20, || {
        b.gemm(c16.mat_mut(), a.mat(), w.mat().t(), 1.0, 0.0)
    })?;
    rows.push((
        format!("gemm bf16 {n}^3 -> bf16 (x @ W^T)"),
        s,
        flops / s / 1e12,
    ));
    drop(c16);
    let mut c32 = b.zeros(&[n, n], DType::F32, Category::Grads)?;
    let s = time(&b, 20, || {
        b.gemm(c32.mat_mut(), a.mat().t(), w.mat(), 1.0, 1.0)
    })?;
    rows.push((
        format!("gemm bf16 {n}^3 -> f32 beta=1 (dW += x^T dy)"),
        s,
        flops / s / 1e12,
    ));
    let got = b.to_host(&c32)?;
    // Every element is 23 accumulations of n * 0.01 * 0.02 (3 warm-up + 20 timed).
    let want = 23.0
        * n as f32
        * f32::from(half::bf16::from_f32(0.01))
        * f32::from(half::bf16::from_f32(0.02));
    let err = ((got[0] - want) / want).abs();
    println!(
        "check: c[0] = {} (expected {want}, rel err {err:.1e})",
        got[0]
    );
    drop((a, w, c32));

    // Attention through the backend (flash kernels where they apply).
    let t = Instant::now();
    let flash = b.flash_functions()?.is_some();
    println!(
        "flash kernels: {} ({:.2} s to load)",
        if flash { "in use" } else { "not in use" },
        t.elapsed().as_secs_f64()
    );
    let (h, d) = (16, 128);
    // our flash kernels, then the automatic choice (cuDNN where it serves)
    for (kernel, label) in [(AttnKernel::Native, "native"), (AttnKernel::Auto, "auto")] {
        b.set_attn_kernel(kernel);
        if kernel == AttnKernel::Auto {
            match b.cudnn_sdpa() {
                Ok(c) => println!("auto: cuDNN {} ({})", c.version(), c.library()),
                Err(e) => println!("auto: cuDNN unavailable ({e})"),
            }
        }
        for &s_len in &attn_lens {
            let fwd_flops = 2.0 * (s_len as f64).powi(2) * h as f64 * d as f64;
            let iters = if s_len >= 65536 { 5 } else { 20 };
            let (tf, tb) = attention_times(&b, s_len, h, d, DType::F32, iters)?;
            rows.push((
                format!("attention[{label}] fwd causal S={s_len} H={h} d={d}"),
                tf,
                fwd_flops / tf / 1e12,
            ));
            rows.push((
                format!("attention[{label}] fwd+bwd causal S={s_len} H={h} d={d} f32 grads"),
                tb,
                3.5 * fwd_flops / tb / 1e12,
            ));
        }
    }
    let calls = b.attention_calls();
    println!("attention calls by kernel: {calls:?}");

    // The naive kernels, for reference (the GPU oracle of the tests).
    let nb = CudaBackend::with_attention(0, AttentionKernels::Naive)?;
    let (s_len, h, d) = (4096, 16, 128);
    let mut q = nb.zeros(&[s_len, h, d], DType::BF16, Category::Activations)?;
    nb.fill(&mut q, 0.1)?;
    let mut o = nb.zeros(&[s_len, h, d], DType::BF16, Category::Activations)?;
    let mut lse = nb.zeros(&[s_len, h], DType::F32, Category::Activations)?;
    let st = time(&nb, 3, || {
        nb.attention_fwd(AttentionFwd {
            q: q.all_rows(),
            k: q.all_rows(),
            v: q.all_rows(),
            mask: &AttnMask::Causal,
            scale: 1.0 / (d as f32).sqrt(),
            o: o.all_rows_mut(),
            lse: lse.all_rows_mut(),
        })
    })?;
    let aflops = 2.0 * (s_len as f64).powi(2) * h as f64 * d as f64;
    rows.push((
        format!("naive attention fwd causal S={s_len} H={h} d={d}"),
        st,
        aflops / st / 1e12,
    ));
    drop((q, o, lse, nb));

    let ps = b.pool_stats()?;
    println!("{:<60} {:>10} {:>10}", "op", "ms", "TFLOP/s");
    for (name, s, tf) in &rows {
        println!("{name:<60} {:>10.3} {:>10.1}", s * 1e3, tf);
    }
    println!(
        "memory: ledger peak {} B, pool used high-water {} B, pool reserved high-water {} B",
        b.ledger().peak(),
        ps.used_high,
        ps.reserved_high
    );
    let json: Vec<String> = rows
        .iter()
        .map(|(name, s, tf)| {
            format!(
                "{{\"op\":\"{name}\",\"ms\":{:.4},\"tflops\":{:.2}}}",
                s * 1e3,
                tf
            )
        })
        .collect();
    println!(
        "JSON {{\"device\":\"{}\",\"results\":[{}]}}",
        b.name(),
        json.join(",")
    );
    Ok(())
}
