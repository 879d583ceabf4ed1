//! FSDP on one GPU shared by thread ranks (the route `upipe train` takes
//! when the mesh has more ranks than GPUs): bf16 losses and gradient norms
//! track the CPU f32 run of the same sharded configuration, and sharding
//! changes nothing against the unsharded GPU run beyond bf16 rounding.
//! Skipped where no GPU exists.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::model::ModelConfig;
use upipe::optim::AdamWConfig;
use upipe::train::trainer::{TrainConfig, train_threads};

fn cuda() -> CudaBackend {
    let mut b = CudaBackend::new(0).expect("GPU was available a moment ago");
    b.set_attn_kernel(AttnKernel::Auto);
    b
}

fn qwen_style() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.family = upipe::model::Family::Qwen3;
    c.tie_embeddings = true;
    c.validate().unwrap();
    c
}

#[test]
fn fsdp_on_thread_ranks_of_one_gpu_tracks_the_cpu() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_fsdp: no usable CUDA GPU ({e})");
        return;
    }
    let tokens: Arc<[u32]> = upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into();
    let steps = 6;
    // (name, model, data, strategy, Pu, Pr)
    for (name, model, data, strategy, pu, pr) in [
        (
            "tiny upipe 2x2",
            ModelConfig::resolve("tiny").unwrap(),
            1,
            Strategy::Upipe,
            2,
            2,
        ),
        (
            "qwen-style ulysses 2",
            qwen_style(),
            1,
            Strategy::Ulysses,
            2,
            1,
        ),
        (
            "tiny ring 2, data 2",
            ModelConfig::resolve("tiny").unwrap(),
            2,
            Strategy::Ring,
            1,
            2,
        ),
    ] {
        let cfg = |fsdp: bool| TrainConfig {
            data_parallel: data,
            strategy,
            ulysses: pu,
            ring: pr,
            seed: 2,
            fsdp,
            ..TrainConfig::new(
                model.clone(),
                256,
                steps,
                AdamWConfig::schedule(3e-3, 3e-4, 2, steps),
            )
        };
        let cpu = train_threads(&cfg(true), tokens.clone(), CpuBackend::new, &|_| {}).unwrap();
        let gpu = train_threads(&cfg(true), tokens.clone(), cuda, &|_| {}).unwrap();
        let plain = train_threads(&cfg(false), tokens.clone(), cuda, &|_| {}).unwrap();
        for ((c, g), p) in cpu.reports.iter().zip(&gpu.reports).zip(&plain.reports) {
            println!(
                "{name} step {}: cpu f32 {:.5}, gpu fsdp {:.5}, gpu unsharded {:.5}; grad norm {:.4} / {:.4}",
                c.step, c.loss, g.loss, p.loss, c.grad_norm, g.grad_norm
            );
            let rel = |a: f64, b: f64| ((a - b) / b).abs();
            assert!(
                rel(g.loss, c.loss) <= 1e-2,
                "{name} step {}: {} vs {}",
                c.step,
                g.loss,
                c.loss
            );
            assert!(
                rel(g.grad_norm, c.grad_norm) <= 5e-2,
                "{name} step {}: grad norm",
                c.step
            );
            assert!(
                rel(g.loss, p.loss) <= 1e-2,
                "{name} step {}: fsdp vs unsharded",
                c.step
            );
        }
        let (c0, c1) = (cpu.reports[0].loss, cpu.reports.last().unwrap().loss);
        let (g0, g1) = (gpu.reports[0].loss, gpu.reports.last().unwrap().loss);
        assert!(
            g1 < g0 && c1 < c0,
            "{name}: it learns (cpu {c0}->{c1}, gpu {g0}->{g1})"
        );
        println!(
            "{name}: GPU peak {} sharded, {} unsharded (rank 0)",
            gpu.memory.peak, plain.memory.peak
        );
    }
}
