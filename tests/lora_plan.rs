//! The planner walks a LoRA run to the byte: the adapters beside the
//! frozen base weights, their F32 gradients and AdamW state (on the device
//! or, with `--offload-optimizer`, in host memory), and each adapter
//! application's transient buffers. On the CPU backend the walk, the
//! engine's own step and the ledger of a real run agree exactly, and the
//! ledger holds no gradient or optimizer state of the frozen base; on the
//! CUDA allocation rules (bf16 weights, F32 masters) walk and engine agree.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::{Category, MemoryStats};
use upipe::model::lora::{LoraConfig, parse_targets};
use upipe::model::lora_params::lora_base_freeze;
use upipe::model::{MemoryPolicy, ModelConfig, Unit};
use upipe::optim::AdamWConfig;
use upipe::optim::settling::state_on_host;
use upipe::plan::engine::engine_step_rank;
use upipe::plan::{DeviceKind, StepSpec, predict_step_rank, walk_step_rank};
use upipe::rng::Rng;
use upipe::train::lora_run::LoraRun;
use upipe::train::trainer::{TrainConfig, train_cpu};

mod common;
use common::tiny;

/// (strategy, Pu, Pr)
type Mesh = (Strategy, usize, usize);

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..1024).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn lora(targets: &str) -> LoraConfig {
    LoraConfig::new(4, 8.0, false, parse_targets(targets).unwrap()).unwrap()
}

fn config(m: &ModelConfig, mesh: Mesh, lora: &LoraConfig, policy: MemoryPolicy) -> TrainConfig {
    let (strategy, ulysses, ring) = mesh;
    TrainConfig {
        strategy,
        ulysses,
        ring,
        seed: 5,
        policy,
        freeze: lora_base_freeze(),
        lora: Some(LoraRun {
            config: lora.clone(),
            from: None,
        }),
        ..TrainConfig::new(m.clone(), 32, 2, AdamWConfig::schedule(3e-3, 3e-4, 1, 2))
    }
}

fn checkpointed() -> MemoryPolicy {
    MemoryPolicy {
        checkpoint: true,
        offload: 1,
        save_attention: 1,
        ..MemoryPolicy::default()
    }
}

/// The last `n` units' optimizer state in host memory.
fn optimizer_on_host(n: usize) -> MemoryPolicy {
    MemoryPolicy {
        offload_optimizer: n,
        ..MemoryPolicy::default()
    }
}

/// The runs: (what, mesh, targets, policy).
fn cases() -> Vec<(&'static str, Mesh, &'static str, MemoryPolicy)> {
    let layers = tiny(false).layers;
    vec![
        (
            "local all-linear",
            (Strategy::Local, 1, 1),
            "all-linear",
            MemoryPolicy::default(),
        ),
        (
            "upipe 2x2 q,v checkpoint",
            (Strategy::Upipe, 2, 2),
            "q_proj,v_proj",
            checkpointed(),
        ),
        (
            "upipe Pu 2 all-linear optimizer on the host",
            (Strategy::Upipe, 2, 1),
            "all-linear",
            optimizer_on_host(MemoryPolicy::optimizer_units(layers)),
        ),
        (
            "local q,v checkpoint tiled, two blocks' optimizer on the host",
            (Strategy::Local, 1, 1),
            "q_proj,v_proj",
            MemoryPolicy {
                tiled_mlp: true,
                ..optimizer_on_host(2)
            },
        ),
    ]
}

fn at_end(s: &MemoryStats, c: Category) -> usize {
    s.current_by_category
        .iter()
        .find(|(k, _)| *k == c)
        .map_or(0, |(_, b)| *b)
}

/// The ledger of a LoRA run holds the adapters' F32 gradients and AdamW
/// state and nothing of the frozen base's, and the planner predicts its
/// step to the byte by both paths.
#[test]
fn the_planner_predicts_a_lora_run_to_the_byte() {
    let m = tiny(false);
    for (what, mesh, targets, policy) in cases() {
        let lora = lora(targets);
        let cfg = config(&m, mesh, &lora, policy);
        let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
        assert!(run.reports.iter().all(|r| r.loss.is_finite()), "{what}");
        let mem = run.memory;
        let per_block = lora.params_per_block(&m);
        let adapters = lora.param_count(&m);
        assert_eq!(at_end(&mem, Category::Grads), adapters * 4, "{what}: grads");
        assert_eq!(
            at_end(&mem, Category::Weights),
            (m.param_count() + adapters) * 4,
            "{what}: weights"
        );
        // host units keep master, m and v there; device units m and v here
        let host_blocks = (0..m.layers)
            .filter(|&l| state_on_host(Unit::Block(l), m.layers, policy.offload_optimizer))
            .count();
        let device_blocks = m.layers - host_blocks;
        assert_eq!(
            at_end(&mem, Category::OptimState),
            device_blocks * per_block * 2 * 4,
            "{what}: device optimizer state"
        );
        assert_eq!(
            at_end(&mem, Category::Offload),
            host_blocks * per_block * 3 * 4,
            "{what}: host optimizer state"
        );
        let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cpu);
        assert_eq!(spec.lora.as_ref(), Some(&lora), "{what}");
        let engine = predict_step_rank(&spec, 0).unwrap();
        let walk = walk_step_rank(&spec, 0).unwrap();
        assert_eq!(walk, engine, "{what}: walk vs engine");
        assert_eq!(engine.peak, mem.peak, "{what}: device peak");
        assert_eq!(engine.host_peak, mem.host_peak, "{what}: host peak");
        assert_eq!(engine.peak_at, mem.peak_at, "{what}: where");
    }
}

/// On the CUDA allocation rules (bf16 activations and weights, F32
/// masters, cast copies), with every target and with one, walk and engine
/// agree to the byte on every ring role.
#[test]
fn walk_and_engine_agree_on_lora_runs_on_cuda() {
    let m = tiny(true);
    let meshes = [
        (Strategy::Local, 1, 1),
        (Strategy::Upipe, 2, 2),
        (Strategy::Ulysses, 2, 1),
    ];
    for device in [DeviceKind::Cuda, DeviceKind::CudaNative] {
        for (mesh, targets) in meshes.into_iter().zip(["all-linear", "o_proj", "k_proj"]) {
            for policy in [
                MemoryPolicy::default(),
                checkpointed(),
                optimizer_on_host(2),
            ] {
                let cfg = config(&m, mesh, &lora(targets), policy);
                let mut spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), device);
                spec.grad_accum = 2;
                for r in 0..mesh.2 {
                    let what = format!("{device:?} {mesh:?} {targets} {policy:?} ring rank {r}");
                    let walk = walk_step_rank(&spec, r).unwrap();
                    assert_eq!(walk, engine_step_rank(&spec, r).unwrap(), "{what}");
                }
            }
        }
    }
}

/// The adapters cost what their parameters say and the frozen base saves
/// its gradients and optimizer state: a LoRA step's peak is below the
/// full fine-tuning step's, and an extra target raises it.
#[test]
fn a_lora_step_needs_less_than_full_fine_tuning() {
    let m = tiny(false);
    let mesh = (Strategy::Upipe, 2, 1);
    let peak = |targets: Option<&str>| {
        let mut cfg = config(&m, mesh, &lora("q_proj"), MemoryPolicy::default());
        match targets {
            Some(t) => cfg.lora.as_mut().unwrap().config = lora(t),
            None => (cfg.lora, cfg.freeze) = (None, Default::default()),
        }
        let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cuda);
        walk_step_rank(&spec, 0).unwrap().peak
    };
    let (full, q, all) = (peak(None), peak(Some("q_proj")), peak(Some("all-linear")));
    assert!(
        q < all && all < full,
        "q {q}, all-linear {all}, full {full}"
    );
    // FSDP is refused for a LoRA step, naming the flag
    let cfg = config(&m, mesh, &lora("q_proj"), MemoryPolicy::default());
    let mut spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cuda);
    spec.fsdp = true;
    let e = walk_step_rank(&spec, 0).unwrap_err().to_string();
    assert!(e.contains("--fsdp off"), "{e}");
}
