//! The planner's bf16 predictions against the CUDA backend's ledger: one
//! attention layer under each strategy and a tiny-model training step under
//! each policy, thread ranks sharing one GPU. Skipped where no GPU exists.

use std::sync::Arc;
use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, run_trial};
use upipe::attention::{AttnDims, CpPlan, Strategy};
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::model::{HostUpdate, MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::{DeviceKind, StepSpec, predict_attention_trial, predict_step_rank};
use upipe::train::trainer::{TrainConfig, train_threads};

fn gpu_available() -> bool {
    match CudaBackend::new(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP gpu_plan: no usable CUDA GPU ({e})");
            false
        }
    }
}

/// Our own attention kernels: the planner models their memory exactly.
fn cuda() -> CudaBackend {
    cuda_with(AttnKernel::Native)
}

fn cuda_with(kernel: AttnKernel) -> CudaBackend {
    let mut b = CudaBackend::new(0).expect("GPU was available a moment ago");
    b.set_attn_kernel(kernel);
    b
}

fn rel(pred: usize, measured: usize) -> f64 {
    (pred as f64 - measured as f64).abs() / measured.max(1) as f64
}

#[test]
fn attention_layer_prediction_matches_the_cuda_ledger() {
    if !gpu_available() {
        return;
    }
    for qk_norm in [false, true] {
        let d = AttnDims {
            hidden: 512,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            qk_norm,
            norm: upipe::backend::RmsNorm::plain(1e-6),
            rope: RopeConfig {
                theta: 10000.0,
                scaling: None,
            },
            softmax_scale: AttnDims::default_softmax_scale(64),
            precision: upipe::backend::fp8::Precision::Bf16,
        };
        let seq = 1536;
        let inputs = TrialInputs::random(&d, seq, 7);
        for (s, pu, pr, u, overlap) in [
            (Strategy::Local, 1, 1, None, false),
            (Strategy::Ulysses, 2, 1, None, false),
            (Strategy::Ring, 1, 2, None, false),
            (Strategy::Upipe, 2, 1, Some(2), false),
            (Strategy::Upipe, 2, 1, Some(2), true),
            (Strategy::Upipe, 2, 2, Some(4), false),
            (Strategy::Upipe, 2, 3, Some(2), true),
        ] {
            let plan = CpPlan::new(s, &d, seq, pu, pr, u)
                .unwrap()
                .with_overlap(overlap);
            let what = format!("{s} {pu}x{pr} U={u:?} qk={qk_norm} overlap={overlap}");
            let got = run_trial(&plan, &d, &inputs, cuda).unwrap();
            let pred = predict_attention_trial(&plan, &d, DeviceKind::CudaNative, 1).unwrap();
            let e = rel(pred.peak, got.peak_bytes);
            println!(
                "gpu attention {what}: predicted {} measured {} ({:+.3}%)",
                pred.peak,
                got.peak_bytes,
                100.0 * e
            );
            assert!(e <= 0.05, "{what}: {:.2}%", 100.0 * e);
            assert_eq!(pred.peak, got.peak_bytes, "{what}");
            // cuDNN: its plan workspace is the H200-measured estimate, so
            // within 1% rather than exact
            let got = run_trial(&plan, &d, &inputs, || cuda_with(AttnKernel::Auto)).unwrap();
            // planned for the cuDNN the backend loads (its routing by version)
            let loaded = upipe::backend::cuda::cudnn::probe()
                .map_or(DeviceKind::CudaNative, |(v, _)| {
                    DeviceKind::CUDA.with_cudnn(v)
                });
            let pred = predict_attention_trial(&plan, &d, loaded, 1).unwrap();
            let e = rel(pred.peak, got.peak_bytes);
            println!(
                "gpu attention (cuDNN) {what}: predicted {} measured {} ({:+.3}%)",
                pred.peak,
                got.peak_bytes,
                100.0 * e
            );
            assert!(e <= 0.01, "cuDNN {what}: {:.2}%", 100.0 * e);
        }
    }
}

#[test]
fn training_step_prediction_matches_the_cuda_ledger() {
    if !gpu_available() {
        return;
    }
    let tokens: Arc<[u32]> = upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into();
    let model = ModelConfig::resolve("tiny").unwrap();
    // (checkpoint, blocks offloaded, units whose optimizer state is on the
    // host (tiny: 4 is all), tiled MLP, FSDP, blocks keeping their attention output)
    for (checkpoint, offload, offload_optimizer, tiled_mlp, fsdp, save_attention) in [
        (false, 0, 0, false, false, 0),
        (true, 0, 0, false, false, 0),
        (true, 0, 0, false, false, 1),
        (true, 2, 0, true, false, 0),
        (true, 1, 4, false, false, 0),
        (true, 0, 0, true, false, 2),
        (false, 0, 0, true, false, 0),
        (false, 0, 4, false, false, 0),
        (false, 0, 0, false, true, 0),
        (true, 0, 0, false, true, 0),
        (true, 2, 0, true, true, 0),
        (true, 2, 0, true, true, 1),
        (true, 1, 4, true, true, 0),
        (true, 0, 2, false, false, 0),
        (true, 1, 3, true, true, 1),
        (true, 1, 3, false, false, 0),
    ] {
        // an odd number of host units, or FSDP's: paged through the GPU
        let host_update = match offload_optimizer % 2 == 1 || fsdp {
            true => HostUpdate::Gpu,
            false => HostUpdate::Cpu,
        };
        let policy = MemoryPolicy {
            checkpoint,
            offload,
            offload_optimizer,
            host_update,
            tiled_mlp,
            loss_chunk: 256,
            save_attention,
            checkpoint_every: 1,
        };
        let cfg = TrainConfig {
            strategy: Strategy::Upipe,
            ulysses: 2,
            ring: 2,
            seed: 1,
            policy,
            fsdp,
            // two steps: the planner's peak covers the second, which runs
            // the first's deferred host updates and starts with kept workspaces
            ..TrainConfig::new(
                model.clone(),
                1024,
                2,
                AdamWConfig::schedule(3e-3, 3e-3, 0, 2),
            )
        };
        let plan = cfg.plan().unwrap();
        let got = train_threads(&cfg, tokens.clone(), cuda, &|_| {}).unwrap();
        // the trainer reports ring rank 0's ledger
        let pred = predict_step_rank(
            &StepSpec {
                model: model.clone(),
                plan,
                data: 1,
                policy,
                fsdp,
                fsdp_replicas: 1,
                grad_accum: 1,
                device: DeviceKind::CudaNative,
                optimizer: true,
                state: Default::default(),
                precision: Default::default(),
                freeze: Default::default(),
                lora: None,
            },
            0,
        )
        .unwrap();
        let e = rel(pred.peak, got.memory.peak);
        println!(
            "gpu step {policy:?} fsdp {fsdp}: predicted {} measured {} ({:+.3}%), host {} vs {}",
            pred.peak,
            got.memory.peak,
            100.0 * e,
            pred.host_peak,
            got.memory.host_peak
        );
        assert!(e <= 0.05, "{policy:?} fsdp {fsdp}: {:.2}%", 100.0 * e);
        assert_eq!(pred.peak, got.memory.peak, "{policy:?} fsdp {fsdp}");
        assert_eq!(
            pred.host_peak, got.memory.host_peak,
            "{policy:?} fsdp {fsdp}"
        );
    }
}

/// `Rehearsal<CudaBackend>` (`train --rehearse` on a GPU) allocates what a
/// real step on the GPU allocates: the device and host peaks, by category,
/// equal to the byte, on our kernels and on cuDNN.
#[test]
fn a_cuda_rehearsal_allocates_what_a_real_cuda_step_does() {
    if !gpu_available() {
        return;
    }
    let tokens: Arc<[u32]> = upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into();
    let model = ModelConfig::resolve("tiny").unwrap();
    for kernel in [AttnKernel::Native, AttnKernel::Auto] {
        for (offload, offload_optimizer, fsdp, save_attention) in
            [(0, 0, false, 0), (2, 0, true, 1), (1, 4, false, 0)]
        {
            let policy = MemoryPolicy {
                checkpoint: true,
                offload,
                offload_optimizer,
                tiled_mlp: true,
                loss_chunk: 256,
                save_attention,
                checkpoint_every: 1,
                ..MemoryPolicy::default()
            };
            let cfg = TrainConfig {
                strategy: Strategy::Upipe,
                ulysses: 2,
                ring: 2,
                seed: 1,
                policy,
                fsdp,
                ..TrainConfig::new(
                    model.clone(),
                    1024,
                    2,
                    AdamWConfig::schedule(3e-3, 3e-3, 0, 2),
                )
            };
            let make = || cuda_with(kernel);
            let real = train_threads(&cfg, tokens.clone(), make, &|_| {}).unwrap();
            let rehearsed = TrainConfig {
                rehearse: true,
                ..cfg.clone()
            };
            let got = train_threads(&rehearsed, tokens.clone(), make, &|_| {}).unwrap();
            let what = format!("{kernel:?} {policy:?} fsdp {fsdp}");
            println!(
                "gpu rehearsal {what}: rehearsed {} real {}, host {} vs {}",
                got.memory.peak, real.memory.peak, got.memory.host_peak, real.memory.host_peak
            );
            assert_eq!(got.memory.peak, real.memory.peak, "{what}");
            assert_eq!(got.memory.host_peak, real.memory.host_peak, "{what}");
            assert_eq!(
                got.memory.at_peak_by_category, real.memory.at_peak_by_category,
                "{what}"
            );
        }
    }
}
