//! Host offload on one GPU: the optimizer on the host (`--offload-optimizer`)
//! gives the on-device optimizer's results up to f32 rounding (the GPU's
//! AdamW kernel may fuse multiply-adds the host does not), replicated and
//! under FSDP, and offloading the first N blocks' checkpoints changes no
//! loss beyond cuDNN's run-to-run noise; compact state (BF16 or 8-bit
//! moments, no master) on the host tracks the same state on the device,
//! and state paged through the GPU for its update (`--host-update gpu`) is
//! updated bit for bit as on the device. Skipped where no GPU exists.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::cuda::CudaBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::model::{HostUpdate, MemoryPolicy, ModelConfig};
use upipe::optim::{AdamWConfig, GradDtype, MasterWeights, MomentFormat, StateFormat};
use upipe::train::trainer::{TrainConfig, TrainSummary, train_threads};

use crate::common::three_adamw_steps;

fn cuda() -> CudaBackend {
    let mut b = CudaBackend::new(0).expect("GPU was available a moment ago");
    b.set_attn_kernel(AttnKernel::Auto);
    b
}

/// `--offload offload --offload-optimizer host_units` on tiny (4 units).
fn run(fsdp: bool, offload: usize, host_units: usize) -> TrainSummary {
    run_state(fsdp, offload, host_units, StateFormat::default())
}

/// [`run`] with the training state kept as `state` says.
fn run_state(fsdp: bool, offload: usize, host_units: usize, state: StateFormat) -> TrainSummary {
    run_with(fsdp, offload, host_units, HostUpdate::Cpu, state)
}

/// [`run_state`] with the host's state paged through the GPU.
fn run_paged(fsdp: bool, host_units: usize, state: StateFormat) -> TrainSummary {
    run_with(fsdp, 0, host_units, HostUpdate::Gpu, state)
}

fn run_with(
    fsdp: bool,
    offload: usize,
    host_units: usize,
    host_update: HostUpdate,
    state: StateFormat,
) -> TrainSummary {
    let tokens: Arc<[u32]> = upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into();
    let model = ModelConfig::resolve("tiny").unwrap();
    let cfg = TrainConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        ring: 1,
        data_parallel: 1,
        seed: 4,
        fsdp,
        policy: MemoryPolicy {
            checkpoint: true,
            offload,
            offload_optimizer: host_units,
            host_update,
            ..MemoryPolicy::default()
        },
        ..TrainConfig::new(
            model,
            256,
            5,
            AdamWConfig {
                state,
                ..AdamWConfig::schedule(3e-3, 3e-4, 1, 5)
            },
        )
    };
    train_threads(&cfg, tokens, cuda, &|_| {}).unwrap()
}

/// Each step's loss of `got` within 1e-3 of `base`'s, printed as `what`.
fn tracks(base: &TrainSummary, got: &TrainSummary, what: &str) {
    for (b, g) in base.reports.iter().zip(&got.reports) {
        println!("{what} step {}: {:.6} vs {:.6}", b.step, g.loss, b.loss);
        let rel = ((g.loss - b.loss) / b.loss).abs();
        assert!(rel <= 1e-3, "step {}: {} vs {}", b.step, g.loss, b.loss);
    }
}

#[test]
fn host_optimizer_and_offload_track_the_device_run() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_offload: no usable CUDA GPU ({e})");
        return;
    }
    for fsdp in [false, true] {
        let base = run(fsdp, 0, 0);
        for (offload, opt) in [(0, 4), (1, 0), (2, 4), (1, 2)] {
            let got = run(fsdp, offload, opt);
            tracks(
                &base,
                &got,
                &format!("fsdp {fsdp} --offload {offload} --offload-optimizer {opt}"),
            );
            if opt == 4 {
                assert_eq!(
                    got.memory.at_peak(upipe::backend::Category::OptimState),
                    0,
                    "the optimizer state lives on the host"
                );
            }
            if opt > 0 {
                assert!(got.memory.host_peak > 0);
            }
        }
    }
}

/// BF16 moments with an F32 master, and 8-bit moments with no master (BF16
/// weights rounded stochastically on the host from the downloaded
/// parameter), on the host for every unit or the last two: the losses of
/// the same state on the device, up to cuDNN's run-to-run noise (the
/// update's arithmetic is the same on both: `adamw_compact` uses no fused
/// multiply-add).
#[test]
fn compact_state_on_the_host_tracks_the_device_run() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_offload: no usable CUDA GPU ({e})");
        return;
    }
    let formats = [
        (MomentFormat::Bf16, MasterWeights::F32),
        (MomentFormat::Q8, MasterWeights::None),
    ];
    for (moments, master) in formats {
        let state = StateFormat {
            moments,
            master,
            grads: GradDtype::Bf16,
        };
        for fsdp in [false, true] {
            let base = run_state(fsdp, 0, 0, state);
            for opt in [4, 2] {
                let got = run_state(fsdp, 0, opt, state);
                tracks(
                    &base,
                    &got,
                    &format!("{state} fsdp {fsdp} --offload-optimizer {opt}"),
                );
                let on_device = got.memory.at_peak(upipe::backend::Category::OptimState);
                assert!(opt != 4 || on_device == 0, "{state}: state on the device");
                assert!(got.memory.host_peak > 0);
            }
        }
    }
}

/// State on the host paged through the GPU (`--host-update gpu`) is updated
/// by the device's kernel: parameters and moments bit for bit those of the
/// same state kept on the device, every unit's state on the host or the
/// last two, F32, BF16 and 8-bit moments, masters or stochastic rounding.
#[test]
fn paged_state_updates_as_the_devices_does_bit_for_bit() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_offload: no usable CUDA GPU ({e})");
        return;
    }
    for moments in [MomentFormat::F32, MomentFormat::Bf16, MomentFormat::Q8] {
        for master in [MasterWeights::F32, MasterWeights::None] {
            let state = StateFormat {
                moments,
                master,
                grads: GradDtype::Bf16,
            };
            let device = three_adamw_steps(&cuda(), state, 0, HostUpdate::Gpu).0;
            for host_units in [3, 2] {
                let paged = three_adamw_steps(&cuda(), state, host_units, HostUpdate::Gpu).0;
                assert!(paged == device, "{state}: {host_units} units paged");
            }
        }
    }
}

/// Compact state paged through the GPU for every unit or the last two, in a
/// training run (replicated and FSDP): the losses of the same state on the
/// device up to cuDNN's run-to-run noise (its peaks against the plan:
/// `gpu_plan.rs`).
#[test]
fn paged_state_tracks_the_device_run() {
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP gpu_offload: no usable CUDA GPU ({e})");
        return;
    }
    let state = StateFormat {
        moments: MomentFormat::Q8,
        master: MasterWeights::None,
        grads: GradDtype::Bf16,
    };
    for fsdp in [false, true] {
        let base = run_state(fsdp, 0, 0, state);
        for opt in [4, 2] {
            let got = run_paged(fsdp, opt, state);
            tracks(
                &base,
                &got,
                &format!("{state} fsdp {fsdp} --offload-optimizer {opt} --host-update gpu"),
            );
            assert!(got.memory.host_peak > 0);
        }
    }
}
