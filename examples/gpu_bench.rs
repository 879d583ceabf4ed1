//! GPU micro-benchmarks of the CUDA backend: cuBLASLt bf16 GEMM (8192³ by
//! default) and, for reference, the interim attention kernel. Prints a table
//! and one JSON line. Exits 0 with a message when no GPU is present.
//!
//! `cargo run --release --example gpu_bench [-- N]`

use std::time::Instant;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::{Backend, Category, DType};

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

fn main() -> upipe::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(8192);
    let b = match CudaBackend::new(0) {
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

    // Interim attention kernel (correctness path; the flash kernels replace it).
    let (s_len, h, d) = (4096, 16, 128);
    let mut q = b.zeros(&[s_len, h, d], DType::BF16, Category::Activations)?;
    b.fill(&mut q, 0.1)?;
    let mut o = b.zeros(&[s_len, h, d], DType::BF16, Category::Activations)?;
    let mut lse = b.zeros(&[s_len, h], DType::F32, Category::Activations)?;
    let st = time(&b, 3, || {
        b.attention_fwd(
            q.all_rows(),
            q.all_rows(),
            q.all_rows(),
            true,
            o.all_rows_mut(),
            lse.all_rows_mut(),
        )
    })?;
    let aflops = 2.0 * (s_len as f64).powi(2) * h as f64 * d as f64;
    rows.push((
        format!("interim attention fwd causal s={s_len} h={h} d={d}"),
        st,
        aflops / st / 1e12,
    ));

    let ps = b.pool_stats()?;
    println!("{:<52} {:>10} {:>10}", "op", "ms", "TFLOP/s");
    for (name, s, tf) in &rows {
        println!("{name:<52} {:>10.3} {:>10.1}", s * 1e3, tf);
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
