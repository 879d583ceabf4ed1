//! `upipe info`: devices and GPU libraries.

use crate::backend::Bytes;
use crate::backend::cuda::{device, libs};
use crate::error::Result;

#[derive(clap::Args, Debug)]
pub struct InfoArgs {}

pub fn run(_args: InfoArgs) -> Result<i32> {
    println!("upipe {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu backend: f32 reference, {} threads",
        rayon::current_num_threads()
    );
    let driver = device::driver_version();
    match &driver {
        Err(e) => println!("CUDA: not available ({e})"),
        Ok((maj, min)) => println!("CUDA driver: supports CUDA {maj}.{min}"),
    }
    match if driver.is_ok() {
        device::gpus()
    } else {
        Ok(Vec::new())
    } {
        Ok(g) if g.is_empty() && driver.is_err() => {}
        Ok(g) if g.is_empty() => println!("GPUs: none visible"),
        Ok(g) => {
            for d in g {
                println!(
                    "GPU {}: {}  {}  compute capability {}.{}  {} SMs",
                    d.ordinal,
                    d.name,
                    Bytes(d.total_mem),
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.multiprocessors
                );
            }
        }
        Err(e) => println!("GPUs: could not be listed ({e})"),
    }
    println!("libraries:");
    for (lib, r) in libs::report() {
        match r {
            Ok(l) => println!("  {:<9} {}", lib.name(), l.describe()),
            Err(e) => println!("  {:<9} not available: {e}", lib.name()),
        }
    }
    if driver.is_ok() {
        attention_kernel_report();
    }
    Ok(0)
}

/// Which attention kernel `auto` picks on GPU 0, and why.
fn attention_kernel_report() {
    match crate::backend::cuda::CudaBackend::new(0) {
        Err(e) => println!("attention kernel: no CUDA backend on GPU 0 ({e})"),
        Ok(b) => {
            println!(
                "cuBLASLt algorithms (UPIPE_GEMM_ALGO=first|fastest): {:?}",
                b.gemm_pick()
            );
            cudnn_report(&b)
        }
    }
}

/// The cuDNN `auto` routes attention to, and how its plans are picked.
fn cudnn_report(b: &crate::backend::cuda::CudaBackend) {
    match b.cudnn_sdpa() {
        Ok(c) => {
            println!(
                "attention kernel (UPIPE_ATTN_KERNEL=auto): cuDNN {} SDPA ({}) for bf16 with head_dim 64/128 where it supports the shape; native flash kernels otherwise",
                c.version(),
                c.library()
            );
            println!(
                "cuDNN plans (UPIPE_CUDNN_PLAN=first|fastest|N): {:?}",
                c.plan_pick()
            );
        }
        Err(e) => println!(
            "attention kernel (UPIPE_ATTN_KERNEL=auto): native flash kernels (cuDNN unavailable: {e})"
        ),
    }
}
