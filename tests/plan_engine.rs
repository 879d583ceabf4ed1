//! The planner's step prediction is the engine's own step run on a
//! counting backend and counting process groups (`plan::engine`). Before it
//! replaced the hand-written walk of the step, the two agreed to the byte
//! (device peak, host peak, every category at the peak, where the peak
//! falls) for every ring role, on the CPU's and CUDA's allocation rules,
//! across the strategies, meshes and memory policies of `tests/plan.rs` and
//! `tests/rehearse.rs` (checkpointing, offload, save-attention, tiled MLP,
//! FSDP and HSDP, grad accumulation, the optimizer on the host). The CPU
//! side is held to the measured ledger by `tests/plan.rs` and
//! `tests/rehearse.rs`; here the CUDA side is pinned: the walk's totals over
//! the configurations below, and the engine's choice of the highest rank
//! over every rank's.

use upipe::attention::Strategy;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::engine::engine_step_rank;
use upipe::plan::{DeviceKind, Prediction, StepSpec, predict_step};
use upipe::train::trainer::TrainConfig;

/// The tiny model of `tests/plan.rs` (head dim 8: our naive kernels on CUDA).
fn tiny(qk_norm: bool) -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.qk_norm = qk_norm;
    c.heads = 8;
    c.kv_heads = 2;
    c.head_dim = 8;
    c.hidden = 32;
    c.ffn = 48;
    c.validate().unwrap();
    c
}

/// A small model with head dim 64, which cuDNN and the flash kernels take.
fn d64() -> ModelConfig {
    let mut c = tiny(false);
    c.head_dim = 64;
    c.hidden = 128;
    c.ffn = 192;
    c.validate().unwrap();
    c
}

fn policies(layers: usize) -> Vec<MemoryPolicy> {
    let all = MemoryPolicy::optimizer_units(layers);
    let p = |checkpoint, offload, offload_optimizer, tiled_mlp, loss_chunk, save_attention| {
        MemoryPolicy {
            checkpoint,
            offload,
            offload_optimizer,
            tiled_mlp,
            loss_chunk,
            save_attention,
        }
    };
    vec![
        p(false, 0, 0, false, 256, 0),
        p(false, 0, 0, true, 7, 0),
        p(true, 0, 0, false, 256, 0),
        p(true, 0, 0, true, 256, 1),
        p(true, layers, 0, false, 256, layers),
        p(true, 1, all, false, 256, 1),
        p(false, 0, all, false, 256, 0),
        p(true, 0, 1, false, 256, 0),
        p(false, 0, layers + 1, false, 256, 0),
        p(true, layers, 0, true, 7, 0),
    ]
}

/// (QK-norm, strategy, Pu, Pr, U, forward U, data replicas)
type Mesh = (
    bool,
    Strategy,
    usize,
    usize,
    Option<usize>,
    Option<usize>,
    usize,
);

const MESHES: &[Mesh] = &[
    (false, Strategy::Upipe, 2, 2, None, None, 1),
    (true, Strategy::Upipe, 4, 1, Some(4), None, 1),
    (true, Strategy::Upipe, 2, 2, Some(2), Some(8), 1),
    (false, Strategy::Ulysses, 4, 1, None, None, 1),
    (true, Strategy::Ring, 1, 4, None, None, 1),
    (false, Strategy::Usp, 2, 3, None, None, 1),
    (false, Strategy::Local, 1, 1, None, None, 1),
    (false, Strategy::Upipe, 2, 1, None, None, 2),
];

fn spec(model: &ModelConfig, m: &Mesh, seq: usize, policy: MemoryPolicy) -> StepSpec {
    let &(_, s, pu, pr, u, uf, data) = m;
    let cfg = TrainConfig {
        strategy: s,
        ulysses: pu,
        ring: pr,
        chunk_heads: u,
        fwd_chunk_heads: uf,
        data_parallel: data,
        policy,
        ..TrainConfig::new(
            model.clone(),
            seq,
            2,
            AdamWConfig::schedule(1e-3, 1e-4, 0, 2),
        )
    };
    StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cpu)
}

/// Every ring rank's prediction; the highest is `predict_step`'s.
fn check(spec: &StepSpec, what: &str) -> Prediction {
    let all: Vec<Prediction> = (0..spec.plan.layout.pr)
        .map(|r| engine_step_rank(spec, r).unwrap())
        .collect();
    let got = predict_step(spec).unwrap();
    let top = all.iter().map(|p| p.peak).max().unwrap();
    assert_eq!(got.peak, top, "{what}");
    assert!(!got.peak_at.is_empty(), "{what}: the peak's part is named");
    got
}

/// The walk's totals (device peaks, host peaks) over the tiny model at 240
/// tokens and the head-dim-64 model at 1536 (cuDNN's and the flash
/// kernels' calls), every mesh, policy and FSDP choice, on CUDA with cuDNN
/// and with our kernels only: computed by `plan::predict_step` when it
/// walked by hand (2026-12-03), equal to the engine's then and now.
const WALK_TOTALS: [(DeviceKind, usize, usize); 2] = [
    (DeviceKind::Cuda, 13_031_121_576, 289_799_656),
    (DeviceKind::CudaNative, 12_758_737_576, 289_799_656),
];

#[test]
fn cuda_predictions_equal_the_hand_walks_totals() {
    for (device, peaks, hosts) in WALK_TOTALS {
        let (mut got_peaks, mut got_hosts) = (0, 0);
        for (model, seq) in [(tiny(false), 240), (d64(), 1536)] {
            for m in MESHES {
                for policy in policies(model.layers) {
                    for fsdp in [false, true] {
                        let mut s = spec(&model, m, seq, policy);
                        s.device = device;
                        s.fsdp = fsdp;
                        let p = check(&s, &format!("{device:?} {m:?} fsdp={fsdp} {policy:?}"));
                        got_peaks += p.peak;
                        got_hosts += p.host_peak;
                    }
                }
            }
        }
        assert_eq!((got_peaks, got_hosts), (peaks, hosts), "{device:?}");
    }
}

#[test]
fn every_device_predicts_with_qk_norm_and_tied_embeddings() {
    for device in [DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::CudaNative] {
        for m in MESHES.iter().filter(|m| m.0) {
            for policy in policies(tiny(true).layers) {
                let mut model = tiny(true);
                model.tie_embeddings = true;
                let mut s = spec(&model, m, 240, policy);
                s.device = device;
                s.fsdp = true;
                check(&s, &format!("{device:?} {m:?} {policy:?}"));
            }
        }
    }
}

#[test]
fn grad_accumulation_and_hsdp_predict() {
    let model = tiny(false);
    let m = &(false, Strategy::Upipe, 2, 1, None, None, 2);
    for device in [DeviceKind::Cpu, DeviceKind::Cuda] {
        for policy in policies(model.layers).into_iter().take(6) {
            for (fsdp, replicas, accum) in [(false, 1, 3), (true, 1, 2), (true, 2, 1), (true, 2, 2)]
            {
                let mut s = spec(&model, m, 256, policy);
                s.device = device;
                s.fsdp = fsdp;
                s.fsdp_replicas = replicas;
                s.grad_accum = accum;
                let what =
                    format!("{device:?} fsdp={fsdp} replicas={replicas} accum={accum} {policy:?}");
                check(&s, &what);
            }
        }
    }
}
