//! The planner predicts a LoRA run to the byte: the adapters beside the
//! frozen base weights, their F32 gradients and AdamW state (on the device
//! or, with `--offload-optimizer`, in host memory), and each adapter
//! application's transient buffers. On the CPU backend the planned step,
//! the engine's step with every iteration run and the ledger of a real run
//! agree exactly, and the ledger holds no gradient or optimizer state of
//! the frozen base; on the CUDA allocation rules (bf16 weights, F32
//! masters) the planned and the whole step agree.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::{Category, MemoryStats};
use upipe::cli::plan::{PlanArgs, plan_request};
use upipe::model::lora::{LoraConfig, parse_targets};
use upipe::model::{Freeze, MemoryPolicy, ModelConfig, Unit};
use upipe::optim::AdamWConfig;
use upipe::optim::settling::state_on_host;
use upipe::plan::engine::{engine_step_rank, engine_step_rank_uncollapsed};
use upipe::plan::{Depth, DeviceKind, StepSpec, predict_step, predict_step_rank, resolve_run};
use upipe::rng::Rng;
use upipe::train::lora_run::LoraRun;
use upipe::train::trainer::{TrainConfig, train_cpu};

use crate::common;
use common::tiny;

/// (strategy, Pu, Pr)
type Mesh = (Strategy, usize, usize);

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..1024).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn lora(targets: &str) -> LoraConfig {
    lora_of_rank(4, targets)
}

fn lora_of_rank(rank: usize, targets: &str) -> LoraConfig {
    LoraConfig::new(rank, 8.0, false, parse_targets(targets).unwrap()).unwrap()
}

/// [`tiny`] with an MLP narrower than the hidden size: the gate and up
/// adapters' backward buffers (`[s, r]`, beside dm) then set the step's
/// peak at rank 16, so a plan without them would be short.
fn narrow_mlp() -> ModelConfig {
    let mut c = tiny(false);
    (c.hidden, c.ffn) = (64, 16);
    c.validate().unwrap();
    c
}

fn config(m: &ModelConfig, mesh: Mesh, lora: &LoraConfig, policy: MemoryPolicy) -> TrainConfig {
    let (strategy, ulysses, ring) = mesh;
    TrainConfig {
        strategy,
        ulysses,
        ring,
        seed: 5,
        policy,
        freeze: Freeze::whole_base(),
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

/// The runs: (what, model, mesh, adapters, policy).
fn cases() -> Vec<(&'static str, ModelConfig, Mesh, LoraConfig, MemoryPolicy)> {
    let layers = tiny(false).layers;
    let tiled = MemoryPolicy {
        tiled_mlp: true,
        ..optimizer_on_host(2)
    };
    let all_on_host = optimizer_on_host(MemoryPolicy::optimizer_units(layers));
    let (local, pu2, upipe22) = (
        (Strategy::Local, 1, 1),
        (Strategy::Upipe, 2, 1),
        (Strategy::Upipe, 2, 2),
    );
    let plain = MemoryPolicy::default();
    vec![
        (
            "local all-linear",
            tiny(false),
            local,
            lora("all-linear"),
            plain,
        ),
        (
            "upipe 2x2 q,v checkpoint",
            tiny(false),
            upipe22,
            lora("q_proj,v_proj"),
            checkpointed(),
        ),
        (
            "upipe Pu 2 optimizer on the host",
            tiny(false),
            pu2,
            lora("all-linear"),
            all_on_host,
        ),
        (
            "local q,v tiled, 2 units on the host",
            tiny(false),
            local,
            lora("q_proj,v_proj"),
            tiled,
        ),
        (
            "narrow MLP local r16 checkpoint",
            narrow_mlp(),
            local,
            lora_of_rank(16, "all-linear"),
            checkpointed(),
        ),
        (
            "narrow MLP upipe Pu 2 r16",
            narrow_mlp(),
            pu2,
            lora_of_rank(16, "all-linear"),
            plain,
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
    for (what, m, mesh, lora, policy) in cases() {
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
        let whole = engine_step_rank_uncollapsed(&spec, 0).unwrap();
        assert_eq!(whole, engine, "{what}: every iteration vs collapsed");
        assert_eq!(engine.peak, mem.peak, "{what}: device peak");
        assert_eq!(engine.host_peak, mem.host_peak, "{what}: host peak");
        assert_eq!(engine.peak_at, mem.peak_at, "{what}: where");
    }
}

/// On the CUDA allocation rules (bf16 activations and weights, F32
/// masters, cast copies), with every target and with one, replicated and
/// under FSDP, the collapsed and the whole step agree to the byte on every
/// ring role.
#[test]
fn the_collapsed_and_the_whole_engine_agree_on_lora_runs_on_cuda() {
    let runs = [
        (tiny(true), (Strategy::Local, 1, 1), lora("all-linear")),
        (tiny(true), (Strategy::Upipe, 2, 2), lora("o_proj")),
        (tiny(true), (Strategy::Ulysses, 2, 1), lora("k_proj")),
        (
            narrow_mlp(),
            (Strategy::Upipe, 2, 1),
            lora_of_rank(16, "gate_proj,up_proj"),
        ),
    ];
    let policies = [
        MemoryPolicy::default(),
        checkpointed(),
        optimizer_on_host(2),
    ];
    for (device, fsdp) in [
        (DeviceKind::CUDA, false),
        (DeviceKind::CudaNative, false),
        (DeviceKind::CUDA, true),
    ] {
        for ((m, mesh, lora), policy) in runs.iter().flat_map(|r| policies.map(|p| (r, p))) {
            let cfg = config(m, *mesh, lora, policy);
            let mut spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), device);
            // under FSDP the later sequence adds its reduce-scatters into the shards
            (spec.grad_accum, spec.fsdp) = (2, fsdp);
            for r in 0..mesh.2 {
                let what =
                    format!("{device:?} FSDP {fsdp} {mesh:?} {lora} {policy:?} ring rank {r}");
                let whole = engine_step_rank_uncollapsed(&spec, r).unwrap();
                assert_eq!(whole, engine_step_rank(&spec, r).unwrap(), "{what}");
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
        let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::CUDA);
        engine_step_rank_uncollapsed(&spec, 0).unwrap().peak
    };
    let (full, q, all) = (peak(None), peak(Some("q_proj")), peak(Some("all-linear")));
    assert!(
        q < all && all < full,
        "q {q}, all-linear {all}, full {full}"
    );
    // under FSDP the frozen base is sharded too: less than replicated
    let cfg = config(&m, mesh, &lora("q_proj"), MemoryPolicy::default());
    let mut spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::CUDA);
    spec.fsdp = true;
    let sharded = engine_step_rank_uncollapsed(&spec, 0).unwrap();
    assert_eq!(sharded, engine_step_rank(&spec, 0).unwrap());
    assert!(sharded.peak < q, "FSDP {} vs replicated {q}", sharded.peak);
}

/// A LoRA run under FSDP (the frozen base sharded, each block's adapters an
/// adapter unit with F32 gradient shards and AdamW state over its shard):
/// the ledger holds the adapter shards' gradients and state and nothing of
/// the base's, and the collapsed step, the whole one and a real run agree to the byte, with
/// checkpointing, offload, tiled MLP, saved attention and the host optimizer.
#[test]
fn the_planner_predicts_a_sharded_lora_run_to_the_byte() {
    let layers = tiny(false).layers;
    let tiled = MemoryPolicy {
        tiled_mlp: true,
        ..optimizer_on_host(2)
    };
    let all_on_host = optimizer_on_host(MemoryPolicy::optimizer_units(layers));
    let cases = [
        (
            (Strategy::Upipe, 2, 1),
            lora("all-linear"),
            MemoryPolicy::default(),
            1,
        ),
        (
            (Strategy::Upipe, 2, 2),
            lora("q_proj,v_proj"),
            checkpointed(),
            1,
        ),
        ((Strategy::Upipe, 2, 1), lora("all-linear"), all_on_host, 1),
        (
            (Strategy::Local, 1, 1),
            lora_of_rank(3, "o_proj,down_proj"),
            tiled,
            3,
        ),
    ];
    for (mesh, lora, policy, data) in cases {
        let what = format!("{mesh:?} data {data} {lora} {policy:?}");
        let m = tiny(false);
        let mut cfg = config(&m, mesh, &lora, policy);
        (cfg.fsdp, cfg.data_parallel) = (true, data);
        let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
        let world = data * mesh.1 * mesh.2;
        let shard: usize = (0..m.layers)
            .map(|l| upipe::train::fsdp::UnitLayout::adapters(&m, &lora, l, world).shard)
            .sum();
        assert_eq!(
            at_end(&run.memory, Category::Grads),
            shard * 4,
            "{what}: grads"
        );
        let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cpu);
        assert!(spec.fsdp && spec.lora.as_ref() == Some(&lora), "{what}");
        let engine = predict_step_rank(&spec, 0).unwrap();
        let whole = engine_step_rank_uncollapsed(&spec, 0).unwrap();
        assert_eq!(whole, engine, "{what}: every iteration vs collapsed");
        assert_eq!(engine.peak, run.memory.peak, "{what}: device peak");
        assert_eq!(engine.host_peak, run.memory.host_peak, "{what}: host peak");
        assert_eq!(engine.peak_at, run.memory.peak_at, "{what}: where");
    }
}

/// `A` parsed from `argv` (the flags after the subcommand).
fn parse<A: clap::Args + clap::FromArgMatches>(argv: &[&str]) -> A {
    let cmd = A::augment_args(clap::Command::new("x").no_binary_name(true));
    A::from_arg_matches(&cmd.try_get_matches_from(argv).unwrap()).unwrap()
}

/// `upipe plan --lora-rank ...` predicts the LoRA run: its request carries
/// the adapters and the frozen base, never shards, and needs less than
/// full fine-tuning; `--fsdp on` shards it; `--freeze` with it is refused.
#[test]
fn upipe_plan_takes_the_lora_flags() {
    let base = ["--model", "tiny", "--gpus", "2", "--device", "cpu"];
    let with = |extra: &[&str]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        plan_request(parse::<PlanArgs>(&v), Strategy::Upipe, 256)
    };
    let lora_flags = ["--lora-rank", "4", "--lora-targets", "v_proj,q_proj"];
    let req = with(&lora_flags).unwrap();
    assert_eq!(
        req.lora,
        Some(lora("q_proj,v_proj")),
        "alpha: twice the rank"
    );
    assert_eq!(req.freeze, Freeze::whole_base());
    let run = resolve_run(&req, Depth::Run).unwrap();
    assert!(!run.spec.fsdp);
    assert_eq!(run.spec.lora, req.lora);
    assert_eq!(run.prediction, predict_step(&run.spec).unwrap());
    let full = resolve_run(&with(&[]).unwrap(), Depth::Run).unwrap();
    assert!(run.prediction.peak < full.prediction.peak);
    // `--fsdp on` shards the frozen base and the adapters
    let sharded = with(&[&lora_flags[..], &["--fsdp", "on"]].concat()).unwrap();
    let sharded = resolve_run(&sharded, Depth::Run).unwrap();
    assert!(sharded.spec.fsdp);
    assert_eq!(sharded.spec.lora, req.lora);
    assert_eq!(sharded.prediction, predict_step(&sharded.spec).unwrap());
    let e = with(&[&lora_flags[..], &["--freeze", "attn"]].concat()).unwrap_err();
    assert!(e.to_string().contains("leave --freeze out"), "{e}");
}
