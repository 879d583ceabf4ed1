//! GPU (bf16) against the CPU f32 reference: a whole attention layer under
//! `local` and under UPipe on thread ranks sharing one GPU, and a few training
//! steps of the tiny model. Skipped with a message where no GPU exists.

use std::sync::Arc;
use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, run_trial};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::model::ModelConfig;
use upipe::optim::AdamWConfig;
use upipe::train::trainer::{TrainConfig, train_threads};

fn gpu_available() -> bool {
    match CudaBackend::new(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP gpu_layer: no usable CUDA GPU ({e})");
            false
        }
    }
}

/// A backend on one attention kernel selection.
fn cuda_with(kernel: AttnKernel) -> CudaBackend {
    let mut b = CudaBackend::new(0).expect("GPU was available a moment ago");
    b.set_attn_kernel(kernel);
    b
}

/// Our own attention kernels (flash where they apply).
fn cuda() -> CudaBackend {
    cuda_with(AttnKernel::Native)
}

#[test]
fn attention_layer_on_gpu_matches_cpu() {
    if !gpu_available() {
        return;
    }
    let d = AttnDims {
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        qk_norm: true,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(64),
        precision: upipe::backend::fp8::Precision::Bf16,
    };
    let inputs = TrialInputs::random(&d, 256, 7);
    let cpu_plan = CpPlan::new(Strategy::Local, &d, 256, 1, 1, None).unwrap();
    let reference = run_trial(&cpu_plan, &d, &inputs, CpuBackend::new).unwrap();
    // every error is printed before any assertion, so one GPU run shows them all
    let mut failures = Vec::new();
    for kernel in [AttnKernel::Native, AttnKernel::Auto] {
        for (s, pu, pr, u) in [
            (Strategy::Local, 1, 1, None),
            (Strategy::Upipe, 2, 1, None),
            (Strategy::Upipe, 2, 2, Some(2)),
        ] {
            let plan = CpPlan::new(s, &d, 256, pu, pr, u).unwrap();
            let got = run_trial(&plan, &d, &inputs, || cuda_with(kernel)).unwrap();
            let errs = got.errors_against(&reference);
            println!("gpu {kernel:?} {s} {pu}x{pr}: {errs:?}");
            for (name, e) in errs {
                let tol = upipe::attention::trial::bf16_tolerance(&name);
                if e > tol {
                    failures.push(format!(
                        "{kernel:?} {s} {pu}x{pr}: {name} rel err {e:e} > {tol:e} (bf16 vs f32)"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn tiny_model_training_on_gpu_tracks_cpu() {
    if !gpu_available() {
        return;
    }
    let cfg = TrainConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        seed: 1,
        ..TrainConfig::new(
            ModelConfig::resolve("tiny").unwrap(),
            128,
            5,
            AdamWConfig::schedule(3e-3, 3e-3, 0, 5),
        )
    };
    let tokens: Arc<[u32]> = upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into();
    let cpu = train_threads(&cfg, tokens.clone(), CpuBackend::new, &|_| {}).unwrap();
    let gpu = train_threads(&cfg, tokens, cuda, &|_| {}).unwrap();
    for (c, g) in cpu.reports.iter().zip(&gpu.reports) {
        println!("step {}: cpu {:.5} gpu {:.5}", c.step, c.loss, g.loss);
        assert!(
            ((g.loss - c.loss) / c.loss).abs() <= 1e-2,
            "step {}: gpu {} vs cpu {}",
            c.step,
            g.loss,
            c.loss
        );
    }
}
