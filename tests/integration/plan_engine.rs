//! The planner's prediction is the engine's own step on a counting backend
//! and counting process groups (`plan::engine`), with the loops whose
//! iterations allocate alike (MLP tiles, loss chunks) collapsed to the
//! iterations that can allocate differently (`model::chunk_loop`). Here it
//! is held, to the byte, to the same step with every iteration run, for
//! every ring role, on the CPU's and CUDA's allocation rules, across the
//! strategies, meshes and memory policies of `tests/integration/plan.rs`
//! and `tests/integration/rehearse.rs` (checkpointing, offload,
//! save-attention, tiled MLP, FSDP and HSDP, grad accumulation, the
//! optimizer on the host), and on long runs whose loops collapse to a few
//! iterations of thousands. The CPU's prediction against its measured
//! ledger is `tests/integration/plan.rs`.

use upipe::attention::Strategy;
use upipe::backend::Category;
use upipe::model::{HostUpdate, MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::engine::{engine_step_rank, engine_step_rank_uncollapsed};
use upipe::plan::{DeviceKind, Prediction, StepSpec};
use upipe::train::trainer::TrainConfig;

use crate::common;
use common::tiny;

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
            checkpoint_every: 1,
            ..MemoryPolicy::default()
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
        // the host's state paged through the device for its update
        MemoryPolicy {
            host_update: HostUpdate::Gpu,
            ..p(true, 1, all, false, 256, 1)
        },
        MemoryPolicy {
            host_update: HostUpdate::Gpu,
            ..p(false, 0, 2, true, 256, 0)
        },
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

fn same(whole: &Prediction, engine: &Prediction, what: &str) {
    assert_eq!(whole.peak, engine.peak, "{what}: device peak");
    assert_eq!(whole.host_peak, engine.host_peak, "{what}: host peak");
    assert_eq!(whole.peak_at, engine.peak_at, "{what}: where");
    for cat in Category::ALL.into_iter().filter(|c| c.on_device()) {
        assert_eq!(
            whole.at(cat),
            engine.at(cat),
            "{what}: {} at the peak",
            cat.name()
        );
    }
}

/// Every ring role's prediction, collapsed and with every iteration run.
fn check(spec: &StepSpec, what: &str) {
    let pr = spec.plan.layout.pr;
    let mut ranks = vec![0, 1, pr.saturating_sub(2), pr.saturating_sub(1)];
    ranks.retain(|&r| r < pr);
    ranks.dedup();
    for r in ranks {
        let whole = engine_step_rank_uncollapsed(spec, r).unwrap();
        let engine = engine_step_rank(spec, r).unwrap();
        same(&whole, &engine, &format!("{what} ring rank {r}"));
    }
}

#[test]
fn the_collapsed_and_the_whole_engine_predict_the_same_step_on_every_device() {
    for device in [DeviceKind::Cpu, DeviceKind::CUDA, DeviceKind::CudaNative] {
        for m in MESHES {
            for policy in policies(tiny(false).layers) {
                for fsdp in [false, true] {
                    let mut model = tiny(m.0);
                    model.tie_embeddings = m.0 && fsdp;
                    // 240 tokens: a multiple of every mesh's zigzag chunks
                    let mut s = spec(&model, m, 240, policy);
                    s.device = device;
                    s.fsdp = fsdp;
                    check(&s, &format!("{device:?} {m:?} fsdp={fsdp} {policy:?}"));
                }
            }
        }
    }
}

/// At 24,000 tokens the MLP runs in hundreds of tiles and the loss in
/// thousands of chunks per rank, of which the planned step runs a few: the
/// same ledger as running them all, with a shorter last tile and chunk.
#[test]
fn long_loops_collapse_to_the_same_prediction() {
    let model = tiny(true);
    let meshes = [MESHES[0], MESHES[4], MESHES[5]];
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
        for m in &meshes {
            for policy in [policies(model.layers)[1], policies(model.layers)[9]] {
                let mut s = spec(&model, m, 24_000, policy);
                s.device = device;
                check(&s, &format!("24K {device:?} {m:?} {policy:?}"));
            }
        }
    }
}

/// A Qwen2 (q/k/v biases, tied embeddings): its biases are planned with
/// their block's parameters, gradients, shards and optimizer state.
#[test]
fn the_collapsed_and_the_whole_engine_agree_on_a_qwen2() {
    let model = common::tiny_qwen2();
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
        for m in &MESHES[..4] {
            for policy in policies(model.layers) {
                for fsdp in [false, true] {
                    let mut s = spec(&model, m, 240, policy);
                    s.device = device;
                    s.fsdp = fsdp;
                    check(
                        &s,
                        &format!("qwen2 {device:?} {m:?} fsdp={fsdp} {policy:?}"),
                    );
                }
            }
        }
    }
}

#[test]
fn the_collapsed_and_the_whole_engine_agree_where_cudnn_and_flash_take_the_calls() {
    let model = d64();
    // 1024 tokens: every stage's keys a multiple of 128 (cuDNN's backward)
    // on 2 ranks, not on 3 (the native kernels then)
    for device in [DeviceKind::CUDA, DeviceKind::CudaNative] {
        for m in MESHES {
            for policy in policies(model.layers).into_iter().take(6) {
                for fsdp in [false, true] {
                    let mut s = spec(&model, m, 1536, policy);
                    s.device = device;
                    s.fsdp = fsdp;
                    check(&s, &format!("d64 {device:?} {m:?} fsdp={fsdp} {policy:?}"));
                }
            }
        }
    }
}

/// A sliding window on cuDNN: the whole-sequence calls of Ulysses and UPipe
/// are causal bands cuDNN takes, the ring's blocks go to the flash kernels
/// with their kept key bounds; the plan follows both, on every mesh.
#[test]
fn the_collapsed_and_the_whole_engine_agree_with_a_sliding_window_on_cudnn() {
    let mut model = d64();
    model.family = upipe::model::Family::Mistral;
    model.sliding_window = Some(300);
    model.validate().unwrap();
    for m in MESHES {
        for policy in policies(model.layers).into_iter().take(3) {
            let mut s = spec(&model, m, 1536, policy);
            s.device = DeviceKind::CUDA;
            check(&s, &format!("window 300 {m:?} {policy:?}"));
        }
    }
}

/// A packed documents run on our kernels (`--attn-kernel native`, or a
/// cuDNN before 9.10): the engine's rehearsal attends under a documents mask, whose
/// per-row key bounds the backend keeps on the device, and the plan keeps
/// the same, on every mesh and ring role; the bounds are in the peak.
#[test]
fn the_collapsed_and_the_whole_engine_agree_on_packed_documents_runs() {
    let model = d64();
    for m in MESHES {
        for policy in policies(model.layers).into_iter().take(6) {
            for fsdp in [false, true] {
                let mut s = spec(&model, m, 1536, policy);
                s.device = DeviceKind::CudaDocuments;
                s.fsdp = fsdp;
                check(&s, &format!("documents {m:?} fsdp={fsdp} {policy:?}"));
            }
        }
    }
    // one rank of 1536 rows: the kept bounds are 2·1536 4-byte elements
    let ulysses = &(false, Strategy::Ulysses, 4, 1, None, None, 1);
    let mut s = spec(&model, ulysses, 1536, policies(model.layers)[0]);
    s.device = DeviceKind::CudaNative;
    let native = engine_step_rank(&s, 0).unwrap();
    s.device = DeviceKind::CudaDocuments;
    let documents = engine_step_rank(&s, 0).unwrap();
    assert_eq!(documents.peak, native.peak + 2 * 1536 * 4);
}

/// A packed documents run on cuDNN (9.10 and newer take documents): calls
/// of several documents over their own rows run on cuDNN's ragged path,
/// with their tables in its kept workspace and, with GQA, dK and dV per
/// query head beside them; ring blocks stay on our kernels with their key
/// bounds. The plan keeps the same on every mesh, and a
/// ragged call keeps more than the one-document call of the same rows.
#[test]
fn the_collapsed_and_the_whole_engine_agree_on_packed_documents_on_cudnn() {
    let model = d64();
    for m in MESHES {
        for policy in policies(model.layers).into_iter().take(3) {
            let mut s = spec(&model, m, 1536, policy);
            s.device = DeviceKind::CUDNN_DOCUMENTS;
            check(&s, &format!("documents on cuDNN {m:?} {policy:?}"));
        }
    }
    let ulysses = &(false, Strategy::Ulysses, 4, 1, None, None, 1);
    let mut s = spec(&model, ulysses, 1536, policies(model.layers)[0]);
    s.device = DeviceKind::CUDA;
    let one_document = engine_step_rank(&s, 0).unwrap();
    s.device = DeviceKind::CUDNN_DOCUMENTS;
    let documents = engine_step_rank(&s, 0).unwrap();
    assert!(
        documents.peak > one_document.peak,
        "{} <= {}",
        documents.peak,
        one_document.peak
    );
}

#[test]
fn the_collapsed_and_the_whole_engine_agree_under_grad_accumulation_and_hsdp() {
    let model = tiny(false);
    let m = &(false, Strategy::Upipe, 2, 1, None, None, 2);
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
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

/// `--freeze`: frozen parameters have no gradients (nor buckets,
/// reduce-scatters, gradient shards) and no optimizer state, and a frozen
/// embedding's backward (its ids upload on CUDA) is skipped: both paths
/// plan it alike, replicated (any parameters) and under FSDP (whole units).
#[test]
fn the_collapsed_and_the_whole_engine_agree_with_frozen_parameters() {
    use upipe::model::Freeze;
    let layers = tiny(false).layers;
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
        for m in &MESHES[..3] {
            for policy in [
                policies(layers)[0],
                policies(layers)[5],
                policies(layers)[7],
            ] {
                for (fsdp, freeze) in [
                    (false, "embeddings,norms,blocks:0"),
                    (false, "head,attn"),
                    (true, "embeddings,blocks:1"),
                    (true, "head,norms,blocks:0-1"),
                ] {
                    let mut model = tiny(m.0);
                    model.tie_embeddings = m.0;
                    let mut s = spec(&model, m, 240, policy);
                    s.device = device;
                    s.fsdp = fsdp;
                    s.freeze = Freeze::parse(freeze).unwrap();
                    let split = fsdp && s.freeze.split_unit(&model).is_some();
                    if split || s.freeze.check(&model).is_err() {
                        continue;
                    }
                    check(
                        &s,
                        &format!("{device:?} {m:?} fsdp={fsdp} --freeze {freeze} {policy:?}"),
                    );
                }
            }
        }
    }
}

/// A run plans the cuDNN it loads: the decided kernel's version reaches
/// the device kind. Below 9.10 a documents run is on the flash kernels
/// (cuDNN takes no documents masks), from 9.10 on cuDNN's ragged path;
/// both plans equal the engine's rehearsal to the byte, and they differ.
#[test]
fn a_documents_run_plans_the_cudnn_it_loads() {
    use upipe::backend::cuda::cudnn::{AttnKernel, KernelFacts, decide_run_kernel};
    let model = d64();
    let device_of = |version: usize| {
        let facts = KernelFacts {
            cudnn: Ok(version),
            flash: true,
            head_dim: model.head_dim,
            documents: true,
        };
        let decided = decide_run_kernel(AttnKernel::Auto, &facts).unwrap();
        DeviceKind::of_kernel(Some(decided.kernel), true)
    };
    assert_eq!(device_of(90800), DeviceKind::CudaDocuments);
    assert_eq!(
        device_of(91400),
        DeviceKind::CudnnDocuments { cudnn: 91400 }
    );
    // a plan for another version (`upipe plan --cudnn-version`) alike
    assert_eq!(
        DeviceKind::CUDNN_DOCUMENTS.with_cudnn(90800),
        DeviceKind::CudaDocuments
    );
    let ulysses = &(false, Strategy::Ulysses, 4, 1, None, None, 1);
    let mut peaks = Vec::new();
    for version in [90800, 91400] {
        for m in [ulysses, &MESHES[0]] {
            let mut s = spec(&model, m, 1536, policies(model.layers)[0]);
            s.device = device_of(version);
            check(&s, &format!("documents on cuDNN {version} {m:?}"));
            if m == ulysses {
                peaks.push(engine_step_rank(&s, 0).unwrap().peak);
            }
        }
    }
    assert_ne!(peaks[0], peaks[1], "cuDNN 9.8 and 9.14 plan alike");
}

/// The version decides the routing the plan follows: a backward over keys
/// that are not a multiple of 128 runs on the flash kernels with cuDNN
/// 9.14 and on cuDNN with 9.19; the plan follows each.
#[test]
fn the_planned_cudnn_version_routes_the_planned_step() {
    let model = d64();
    let ulysses = &(false, Strategy::Ulysses, 4, 1, None, None, 1);
    let peak = |version: usize| {
        let mut s = spec(&model, ulysses, 1000, policies(model.layers)[0]);
        s.device = DeviceKind::CUDA.with_cudnn(version);
        check(&s, &format!("s_kv 1000 on cuDNN {version}"));
        engine_step_rank(&s, 0).unwrap().peak
    };
    assert_eq!(DeviceKind::CUDA, DeviceKind::Cuda { cudnn: 91400 });
    assert_ne!(peak(91400), peak(91900));
}

/// A backward that stops after the lowest trained block (`--freeze
/// embeddings,blocks:0-1` of 4 blocks: nothing kept below block 2, no
/// gather of a block whose backward does not run): both paths alike,
/// replicated and FSDP, checkpointed and offloaded.
#[test]
fn the_collapsed_and_the_whole_engine_agree_when_the_backward_stops_early() {
    use upipe::model::Freeze;
    let mut model = tiny(false);
    model.layers = 4;
    model.validate().unwrap();
    let all = policies(model.layers);
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
        for m in [&MESHES[0], &MESHES[2], &MESHES[7]] {
            for policy in [all[0], all[3], all[4], all[5], all[9]] {
                for fsdp in [false, true] {
                    let mut s = spec(&model, m, 240, policy);
                    (s.device, s.fsdp) = (device, fsdp);
                    s.freeze = Freeze::parse("embeddings,blocks:0-1").unwrap();
                    assert_eq!(s.freeze.backward_floor(&model, false), 2);
                    let what = format!("{device:?} {m:?} fsdp={fsdp} {policy:?}");
                    check(&s, &what);
                }
            }
        }
    }
}

/// Segment checkpointing (`--checkpoint-every`): segments that divide the
/// blocks and that do not, one segment of every block, with offloaded
/// inputs, kept attention and a backward that stops early; both paths
/// alike on every mesh, replicated and FSDP (each recomputed block gathered
/// again).
#[test]
fn the_collapsed_and_the_whole_engine_agree_under_segment_checkpointing() {
    use upipe::model::Freeze;
    let mut model = tiny(false);
    model.layers = 5;
    model.validate().unwrap();
    let all = policies(model.layers);
    for device in [DeviceKind::Cpu, DeviceKind::CUDA] {
        for m in MESHES {
            for policy in [all[2], all[3], all[4], all[5], all[9]] {
                for (k, fsdp, freeze) in [
                    (2, false, "none"),
                    (3, true, "none"),
                    (6, false, "none"),
                    (2, true, "embeddings,blocks:0"),
                ] {
                    let policy = MemoryPolicy {
                        checkpoint_every: k,
                        ..policy
                    };
                    let mut s = spec(&model, m, 240, policy);
                    (s.device, s.fsdp) = (device, fsdp);
                    s.freeze = Freeze::parse(freeze).unwrap();
                    let what = format!("{device:?} {m:?} fsdp={fsdp} --freeze {freeze} {policy:?}");
                    check(&s, &what);
                }
            }
        }
    }
}
