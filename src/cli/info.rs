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
        Err(_) => println!("CUDA: not available (libcuda below)"),
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
    let report = libs::report();
    let errors: Vec<&str> = (report.iter())
        .filter_map(|(_, r)| r.as_ref().err().map(String::as_str))
        .collect();
    let (common, mut short) = compact_searches(&errors);
    if let Some(common) = common {
        println!("  searched for every library: {common}");
    }
    for (lib, r) in &report {
        match r {
            Ok(l) => println!("  {:<9} {}", lib.name(), l.describe()),
            Err(_) => println!("  {:<9} not available: {}", lib.name(), short.remove(0)),
        }
    }
    if driver.is_ok() {
        attention_kernel_report();
    }
    Ok(0)
}

/// The folders every one of `errors` (libraries not found: `...; searched:
/// A, B, ...; ...`) searched, once, and each error with those folders left
/// out (`also searched:` the rest of its own); the errors as they are
/// where fewer than two name their folders.
fn compact_searches(errors: &[&str]) -> (Option<String>, Vec<String>) {
    const MARK: &str = "; searched: ";
    let split = |e: &str| -> Option<(String, Vec<String>, String)> {
        let (head, rest) = e.split_once(MARK)?;
        let (list, tail) = rest.split_once("; ").unwrap_or((rest, ""));
        let dirs = list.split(", ").map(String::from).collect();
        Some((head.to_string(), dirs, tail.to_string()))
    };
    let parts: Vec<_> = errors.iter().map(|e| split(e)).collect();
    let lists: Vec<&Vec<String>> = parts.iter().flatten().map(|(_, d, _)| d).collect();
    let Some(first) = lists.first().filter(|_| lists.len() >= 2) else {
        return (None, errors.iter().map(|e| e.to_string()).collect());
    };
    let common: Vec<&String> = (first.iter())
        .filter(|d| lists.iter().all(|l| l.contains(d)))
        .collect();
    let short = parts.iter().zip(errors).map(|(p, e)| match p {
        None => e.to_string(),
        Some((head, dirs, tail)) => {
            let own: Vec<&str> = (dirs.iter())
                .filter(|d| !common.contains(d))
                .map(String::as_str)
                .collect();
            let also = match own.is_empty() {
                true => String::new(),
                false => format!("; also searched: {}", own.join(", ")),
            };
            let tail = match tail.is_empty() {
                true => String::new(),
                false => format!("; {tail}"),
            };
            format!("{head}{also}{tail}")
        }
    });
    let common = common
        .iter()
        .map(|d| d.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    (Some(common), short.collect())
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
                "attention kernel (UPIPE_ATTN_KERNEL=auto): cuDNN {} SDPA ({}) for bf16 with head_dim 64/128/256 where it supports the shape; native flash kernels otherwise",
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

#[cfg(test)]
mod tests {
    /// Seven libraries not found print their common folders once.
    #[test]
    fn common_search_folders_are_printed_once() {
        let e = |name: &str, own: &str| {
            format!("{name} not found; searched: /usr/lib, /lib{own}; set X=/path to choose")
        };
        let errors = [e("libcuda", ""), e("nccl", ", /opt/nccl/lib")];
        let refs: Vec<&str> = errors.iter().map(String::as_str).collect();
        let (common, short) = super::compact_searches(&refs);
        assert_eq!(common.as_deref(), Some("/usr/lib, /lib"));
        assert_eq!(short[0], "libcuda not found; set X=/path to choose");
        assert_eq!(
            short[1],
            "nccl not found; also searched: /opt/nccl/lib; set X=/path to choose"
        );
        assert!(short.iter().all(|s| !s.contains("/usr/lib")));
        // one error alone is left as it is
        let (none, same) = super::compact_searches(&refs[..1]);
        assert_eq!((none, same[0].as_str()), (None, refs[0]));
    }
}
