//! `upipe eval` on GPUs (bf16) against the CPU f32 evaluation: the loss
//! and every position bucket within 1e-2 relative, on thread ranks sharing
//! one GPU (local and UPipe) and as two NCCL process ranks (UPipe over 2
//! Ulysses ranks, the path of `upipe eval` under a launch or started by
//! itself). Skipped with a message where no GPU (or fewer than two, for the
//! process test) exists.

use crate::common;
use std::collections::BTreeMap;
use std::time::Duration;
use upipe::attention::Strategy;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::checkpoint::HostTensor;
use upipe::comm::env::DistEnv;
use upipe::data::Tokens;
use upipe::model::ModelConfig;
use upipe::rng::Rng;
use upipe::train::eval::{EvalConfig, EvalReport, eval_cpu, eval_threads};
use upipe::train::trainer::eval_process_rank;

/// Set in the children of the process test: they run the ranks.
const ROLE: &str = "UPIPE_GPU_EVAL_ROLE";

/// A small model with head dim 64 (the flash and cuDNN kernels' shapes).
fn model() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    (c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab) = (256, 4, 2, 64, 512, 1000);
    c.validate().unwrap();
    c
}

fn host_weights(cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(11);
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = match name.ends_with("norm.weight") {
                true => vec![1.0; n],
                false => rng.normal_vec(n, 0.1),
            };
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect()
}

fn tokens(cfg: &ModelConfig) -> Tokens {
    let mut rng = Rng::new(12);
    let ids: Vec<u32> = (0..2 * 512 + 1)
        .map(|_| rng.below(cfg.vocab as u64) as u32)
        .collect();
    Tokens::from(ids)
}

fn eval_config(strategy: Strategy, ulysses: usize) -> EvalConfig {
    EvalConfig {
        strategy,
        ulysses,
        seq: Some(512),
        buckets: 4,
        ..EvalConfig::new(model())
    }
}

/// Every loss of `gpu` within 1e-2 relative of `cpu`.
fn assert_close(what: &str, gpu: &EvalReport, cpu: &EvalReport) {
    println!(
        "{what}: gpu {:.5} cpu {:.5} ({:.0} tok/s)",
        gpu.loss, cpu.loss, gpu.tokens_per_s
    );
    assert_eq!((gpu.tokens, gpu.windows), (cpu.tokens, cpu.windows));
    let pairs = std::iter::once((gpu.loss, cpu.loss)).chain(
        gpu.by_position
            .iter()
            .zip(&cpu.by_position)
            .map(|(g, c)| (g.loss, c.loss)),
    );
    for (g, c) in pairs {
        assert!(
            ((g - c) / c).abs() <= 1e-2,
            "{what}: gpu {g} vs cpu {c} (bf16 vs f32)"
        );
    }
}

#[test]
fn eval_on_one_gpu_matches_cpu() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_eval: no usable CUDA GPU ({e})");
        return;
    }
    let (host, data) = (host_weights(&model()), tokens(&model()));
    for (strategy, pu) in [(Strategy::Local, 1), (Strategy::Upipe, 2)] {
        let c = eval_config(strategy, pu);
        let cpu = eval_cpu(&c, &data, &host).unwrap();
        for kernel in [AttnKernel::Native, AttnKernel::Auto] {
            let make = || {
                let mut b = CudaBackend::new(0).expect("GPU was available a moment ago");
                b.set_attn_kernel(kernel);
                b
            };
            let gpu = eval_threads(&c, &data, &host, make).unwrap();
            assert_close(&format!("{strategy} Pu {pu} {kernel:?}"), &gpu, &cpu);
        }
    }
}

#[test]
fn nccl_eval_matches_cpu() {
    const TEST: &str = "nccl_eval_matches_cpu";
    let c = eval_config(Strategy::Upipe, 2);
    let (host, data) = (host_weights(&c.model), tokens(&c.model));
    if std::env::var(ROLE).as_deref() == Ok(TEST) {
        let env = DistEnv::from_env().unwrap().expect("RANK/WORLD_SIZE set");
        let r = eval_process_rank(&c, &data, &host, &env, AttnKernel::Auto).unwrap();
        println!("EVAL {}", serde_json::to_string(&r).unwrap());
        return;
    }
    if let Some(why) = common::two_gpus_missing() {
        eprintln!("SKIP gpu_eval::{TEST}: {why}");
        return;
    }
    let ranks = common::run_two_ranks(module_path!(), TEST, ROLE, &[], Duration::from_secs(300));
    assert!(
        ranks.iter().all(|r| r.success),
        "a rank failed (see its output above)"
    );
    let cpu = eval_cpu(&c, &data, &host).unwrap();
    for (rank, r) in ranks.iter().enumerate() {
        let line = r
            .stdout
            .lines()
            .find_map(|l| l.split_once("EVAL ").map(|(_, j)| j))
            .expect("every rank prints its report");
        let gpu: EvalReport = serde_json::from_str(line).unwrap();
        assert_close(&format!("NCCL rank {rank}"), &gpu, &cpu);
    }
}
