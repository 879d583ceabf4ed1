//! `--freeze`: frozen parameters keep their values through training and
//! checkpoints, take no gradient and no optimizer state (the ledger holds
//! exactly their bytes less), leave every trainable parameter's gradient
//! bit-identical, and the planner predicts the step to the byte; replicated,
//! FSDP and with the optimizer on the host.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::Category;
use upipe::checkpoint::load_safetensors;
use upipe::data::PackedWindow;
use upipe::model::{Freeze, MemoryPolicy, ModelConfig, ModelWeights, RandomInit};
use upipe::optim::AdamWConfig;
use upipe::plan::engine::engine_step_rank_uncollapsed;
use upipe::plan::{DeviceKind, StepSpec, predict_step_rank};
use upipe::rng::Rng;
use upipe::train::fsdp::model_layouts;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu_frozen, train_cpu};

use crate::common;
use common::{tiny, tiny_qwen2};

/// (data, strategy, Pu, Pr)
type Mesh = (usize, Strategy, usize, usize);

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..2048).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn config(
    m: &ModelConfig,
    mesh: Mesh,
    freeze: &str,
    fsdp: bool,
    policy: MemoryPolicy,
) -> TrainConfig {
    let (data, strategy, ulysses, ring) = mesh;
    TrainConfig {
        data_parallel: data,
        strategy,
        ulysses,
        ring,
        seed: 5,
        fsdp,
        policy,
        freeze: Freeze::parse(freeze).unwrap(),
        ..TrainConfig::new(m.clone(), 32, 3, AdamWConfig::schedule(3e-3, 3e-4, 1, 3))
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-freeze-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn offload_optimizer(layers: usize) -> MemoryPolicy {
    MemoryPolicy {
        offload_optimizer: MemoryPolicy::optimizer_units(layers),
        ..MemoryPolicy::default()
    }
}

fn checkpointed() -> MemoryPolicy {
    MemoryPolicy {
        checkpoint: true,
        offload: 1,
        offload_optimizer: 2,
        ..MemoryPolicy::default()
    }
}

/// The runs every test here trains: (what, model, mesh, freeze, fsdp, policy).
fn cases() -> Vec<(
    &'static str,
    ModelConfig,
    Mesh,
    &'static str,
    bool,
    MemoryPolicy,
)> {
    let mut qwen3_tied = tiny(true);
    qwen3_tied.tie_embeddings = true;
    let layers = tiny(false).layers;
    vec![
        (
            "replicated",
            tiny(false),
            (1, Strategy::Upipe, 2, 1),
            "embeddings,norms,blocks:0",
            false,
            MemoryPolicy::default(),
        ),
        (
            "fsdp tied",
            qwen3_tied,
            (2, Strategy::Local, 1, 1),
            "embeddings,blocks:0",
            true,
            MemoryPolicy::default(),
        ),
        (
            "offload-optimizer qwen2",
            tiny_qwen2(),
            (1, Strategy::Ulysses, 2, 1),
            "attn,norms",
            false,
            offload_optimizer(layers),
        ),
        (
            "fsdp checkpoint offload",
            tiny(false),
            (1, Strategy::Usp, 2, 2),
            "blocks:1",
            true,
            checkpointed(),
        ),
    ]
}

/// Three steps: every frozen parameter saved exactly as it started (the
/// CPU's F32 weights are the seeded initial values), every other one moved.
#[test]
fn frozen_parameters_keep_their_values_and_the_others_train() {
    for (what, m, mesh, freeze, fsdp, policy) in cases() {
        let dir = temp(what.split(' ').next().unwrap());
        let mut cfg = config(&m, mesh, freeze, fsdp, policy);
        cfg.save_dir = Some(dir.clone());
        let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
        assert!(run.reports.iter().all(|r| r.loss.is_finite()), "{what}");
        let saved = load_safetensors(&dir.join("model.safetensors")).unwrap();
        let init = RandomInit::new(&m, cfg.seed);
        let mut frozen_seen = 0;
        for (p, shape) in m.params() {
            let name = m.hf_name(p);
            let n = shape.iter().product();
            let start = init.values(&name, 0..n);
            let now = &saved[&name].data;
            if cfg.freeze.is_frozen(&m, p) {
                frozen_seen += 1;
                assert!(now == &start, "{what}: frozen {name} changed");
            } else {
                assert!(now != &start, "{what}: trainable {name} did not train");
            }
        }
        assert!(frozen_seen > 0, "{what}");
        // a resume under another --freeze is refused, naming both sets
        let mut other = config(&m, mesh, "none", fsdp, policy);
        (other.save_dir, other.resume, other.steps) = (Some(dir.clone()), true, 4);
        let e = train_cpu(&other, tokens(m.vocab), &|_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("--freeze {freeze}")) && e.contains("--freeze none"),
            "{what}: {e}"
        );
        // the same set resumes, its frozen parameters still as they started
        let mut same = config(&m, mesh, freeze, fsdp, policy);
        (same.save_dir, same.resume, same.steps) = (Some(dir.clone()), true, 4);
        train_cpu(&same, tokens(m.vocab), &|_| {}).unwrap();
        let saved = load_safetensors(&dir.join("model.safetensors")).unwrap();
        for (p, shape) in m
            .params()
            .into_iter()
            .filter(|(p, _)| cfg.freeze.is_frozen(&m, *p))
        {
            let name = m.hf_name(p);
            let start = init.values(&name, 0..shape.iter().product());
            assert!(
                saved[&name].data == start,
                "{what}: resumed, frozen {name} changed"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The ledger at the end of a run holds exactly the frozen parameters'
/// F32 gradients and AdamW state less (two moments on the device; a
/// master and two moments in host memory with the optimizer there), and
/// the planner predicts the frozen run's step to the byte, by both paths.
#[test]
fn the_ledger_holds_no_gradient_or_state_of_frozen_parameters() {
    for (what, m, mesh, freeze, fsdp, policy) in cases() {
        let frozen_cfg = config(&m, mesh, freeze, fsdp, policy);
        let plain_cfg = config(&m, mesh, "none", fsdp, policy);
        let frozen = train_cpu(&frozen_cfg, tokens(m.vocab), &|_| {})
            .unwrap()
            .memory;
        let plain = train_cpu(&plain_cfg, tokens(m.vocab), &|_| {})
            .unwrap()
            .memory;
        let cat = |s: &upipe::backend::MemoryStats, c: Category| {
            s.current_by_category
                .iter()
                .find(|(k, _)| *k == c)
                .map_or(0, |(_, b)| *b)
        };
        let f = &frozen_cfg.freeze;
        // the frozen elements this rank held gradients and state for
        let elems = if fsdp {
            let world = mesh.0 * mesh.2 * mesh.3;
            let layouts = model_layouts(&m, world);
            layouts
                .iter()
                .filter(|u| f.unit_frozen(&m, u.unit))
                .map(|u| u.shard)
                .sum()
        } else {
            f.frozen_elements(&m).0
        };
        let less = |c| cat(&plain, c) - cat(&frozen, c);
        assert_eq!(less(Category::Grads), elems * 4, "{what}: gradients");
        assert_eq!(
            cat(&plain, Category::Weights),
            cat(&frozen, Category::Weights),
            "{what}"
        );
        // units on the host keep master, m and v there; the others m and v here
        let host_units = policy.offload_optimizer;
        let on_host =
            |u: upipe::model::Unit| upipe::optim::settling::state_on_host(u, m.layers, host_units);
        let (mut device, mut host) = (0, 0);
        for (p, shape) in m.params().into_iter().filter(|(p, _)| f.is_frozen(&m, *p)) {
            let n: usize = shape.iter().product();
            if fsdp {
                continue;
            }
            match on_host(p.unit()) {
                true => host += 3 * n * 4,
                false => device += 2 * n * 4,
            }
        }
        if fsdp {
            let world = mesh.0 * mesh.2 * mesh.3;
            for u in model_layouts(&m, world)
                .iter()
                .filter(|u| f.unit_frozen(&m, u.unit))
            {
                match on_host(u.unit) {
                    true => host += 3 * u.shard * 4,
                    false => device += 2 * u.shard * 4,
                }
            }
        }
        assert_eq!(
            less(Category::OptimState),
            device,
            "{what}: device optimizer state"
        );
        assert_eq!(
            less(Category::Offload),
            host,
            "{what}: host optimizer state"
        );
        // the planner: collapsed and whole engine step equal to the ledger
        let spec = StepSpec::of_run(&frozen_cfg, &frozen_cfg.plan().unwrap(), DeviceKind::Cpu);
        let pred = predict_step_rank(&spec, 0).unwrap();
        assert_eq!(
            pred,
            engine_step_rank_uncollapsed(&spec, 0).unwrap(),
            "{what}: every iteration vs collapsed"
        );
        assert_eq!(pred.peak, frozen.peak, "{what}: device peak");
        assert_eq!(pred.host_peak, frozen.host_peak, "{what}: host peak");
        let plain_spec = StepSpec::of_run(&plain_cfg, &plain_cfg.plan().unwrap(), DeviceKind::Cpu);
        let plain_pred = predict_step_rank(&plain_spec, 0).unwrap();
        assert!(
            pred.peak < plain_pred.peak,
            "{what}: freezing lowers the peak"
        );
    }
}

/// One step's gradients with parameters frozen: the trainable parameters'
/// bit-identical to the unfrozen step's (the input gradients run through
/// every frozen weight as before), the frozen ones' absent, the loss equal.
#[test]
fn trainable_gradients_are_bit_identical_with_parameters_frozen() {
    let meshes: [Mesh; 3] = [
        (1, Strategy::Local, 1, 1),
        (1, Strategy::Upipe, 2, 2),
        (1, Strategy::Ulysses, 4, 1),
    ];
    let models = [
        ("qwen3", tiny(true)),
        ("qwen2", tiny_qwen2()),
        ("llama", tiny(false)),
    ];
    for ((name, m), freeze) in
        models
            .into_iter()
            .zip(["norms,blocks:0", "attn,embeddings", "mlp,head"])
    {
        for mesh in meshes {
            let what = format!("{name} {mesh:?} --freeze {freeze}");
            let cfg = config(&m, mesh, freeze, false, MemoryPolicy::default());
            let plan = cfg.plan().unwrap();
            let mut rng = Rng::new(3);
            let ids: Vec<u32> = (0..33).map(|_| rng.below(m.vocab as u64) as u32).collect();
            let window = PackedWindow::stream(ids[..32].to_vec(), ids[1..].to_vec());
            let weights = |b: &_| ModelWeights::random(b, &m, 7);
            let policy = MemoryPolicy::default();
            let none = Freeze::none();
            let (l0, all) =
                loss_and_grads_cpu_frozen(&m, &plan, policy, &window, &weights, &none).unwrap();
            let (l1, some) =
                loss_and_grads_cpu_frozen(&m, &plan, policy, &window, &weights, &cfg.freeze)
                    .unwrap();
            assert_eq!(l0.to_bits(), l1.to_bits(), "{what}: loss");
            let trained: BTreeMap<_, _> = all
                .iter()
                .filter(|(n, _)| {
                    m.params()
                        .iter()
                        .any(|(p, _)| m.hf_name(*p) == **n && !cfg.freeze.is_frozen(&m, *p))
                })
                .collect();
            assert_eq!(
                some.len(),
                trained.len(),
                "{what}: one gradient per trainable parameter"
            );
            assert!(some.len() < all.len(), "{what}");
            for (n, g) in &some {
                assert!(g == trained[n], "{what}: {n} differs");
            }
        }
    }
}

/// What FSDP cannot shard, and specs that name nothing sensible, are
/// refused before anything is allocated, naming the fix.
#[test]
fn bad_freeze_sets_are_refused_with_the_fix() {
    let m = tiny(false);
    let split = config(
        &m,
        (2, Strategy::Local, 1, 1),
        "norms",
        true,
        MemoryPolicy::default(),
    );
    let e = split.plan().unwrap_err().to_string();
    assert!(
        e.contains("freezes part of layers.0") && e.contains("--fsdp off"),
        "{e}"
    );
    let all = config(
        &m,
        (1, Strategy::Local, 1, 1),
        "embeddings,head,norms,blocks:0-1",
        false,
        MemoryPolicy::default(),
    );
    assert!(
        all.plan()
            .unwrap_err()
            .to_string()
            .contains("nothing to train")
    );
    let far = config(
        &m,
        (1, Strategy::Local, 1, 1),
        "blocks:1-2",
        false,
        MemoryPolicy::default(),
    );
    assert!(
        far.plan()
            .unwrap_err()
            .to_string()
            .contains("the model has 2 blocks")
    );
}

/// One step without clipping (AdamW then updates each element from its own
/// gradient alone): every trainable parameter ends bit-identical to the
/// same step of the run that trains everything, so each optimizer slot got
/// its own parameter's gradient (replicated, FSDP, state on the host).
#[test]
fn one_step_moves_the_trained_parameters_exactly_as_an_unfrozen_step() {
    for (what, m, mesh, freeze, fsdp, policy) in cases() {
        let run = |spec: &str, name: &str| {
            let dir = temp(&format!("{}-{name}", what.split(' ').next().unwrap()));
            let mut cfg = config(&m, mesh, spec, fsdp, policy);
            cfg.steps = 1;
            cfg.optim.clip = 0.0;
            cfg.save_dir = Some(dir.clone());
            train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
            let w = load_safetensors(&dir.join("model.safetensors")).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            w
        };
        let (frozen, all) = (run(freeze, "frozen"), run("none", "all"));
        let f = Freeze::parse(freeze).unwrap();
        for (p, _) in m.params().into_iter().filter(|(p, _)| !f.is_frozen(&m, *p)) {
            let name = m.hf_name(p);
            assert!(
                frozen[&name].data == all[&name].data,
                "{what}: {name} differs"
            );
        }
    }
}

/// [`tiny`] with 4 blocks: room for frozen blocks below trained ones.
fn tiny4() -> ModelConfig {
    let mut m = tiny(false);
    m.layers = 4;
    m.validate().unwrap();
    m
}

/// Runs with the embedding and the lower blocks frozen, whose backward
/// stops after the lowest trained block: (what, mesh, fsdp, policy).
fn early_stop_cases() -> Vec<(&'static str, Mesh, bool, MemoryPolicy)> {
    let checkpoint = MemoryPolicy {
        checkpoint: true,
        ..MemoryPolicy::default()
    };
    vec![
        (
            "local checkpoint",
            (1, Strategy::Local, 1, 1),
            false,
            checkpoint,
        ),
        (
            "upipe",
            (1, Strategy::Upipe, 2, 1),
            false,
            MemoryPolicy::default(),
        ),
        (
            "upipe checkpoint offload",
            (1, Strategy::Upipe, 2, 2),
            false,
            MemoryPolicy {
                offload: 3,
                save_attention: 1,
                ..checkpoint
            },
        ),
        (
            "fsdp checkpoint offload",
            (2, Strategy::Local, 1, 1),
            true,
            MemoryPolicy {
                offload: 2,
                ..checkpoint
            },
        ),
    ]
}

/// `--freeze embeddings,blocks:0-1` on 4 blocks: the backward stops after
/// block 2. Three steps give bit-identical losses, gradient norms and
/// weights to the same run through every block's backward
/// (`Freeze::full_backward`), with a lower ledger peak, which the planner
/// predicts to the byte by both paths (replicated and FSDP, checkpointed
/// and offloaded, local and UPipe).
#[test]
fn the_backward_stops_below_the_lowest_trained_block() {
    let m = tiny4();
    let freeze = "embeddings,blocks:0-1";
    assert_eq!(Freeze::parse(freeze).unwrap().backward_floor(&m, false), 2);
    for (what, mesh, fsdp, policy) in early_stop_cases() {
        let run = |full_backward: bool| {
            let dir = temp(&format!("early-{}-{full_backward}", what.replace(' ', "-")));
            let mut cfg = config(&m, mesh, freeze, fsdp, policy);
            cfg.freeze.full_backward = full_backward;
            cfg.save_dir = Some(dir.clone());
            let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
            let w = load_safetensors(&dir.join("model.safetensors")).unwrap();
            let _ = std::fs::remove_dir_all(&dir);
            (cfg, run, w)
        };
        let (cfg, early, early_w) = run(false);
        let (full_cfg, full, full_w) = run(true);
        assert_eq!(early.reports.len(), 3, "{what}");
        for (e, f) in early.reports.iter().zip(&full.reports) {
            assert_eq!(e.loss.to_bits(), f.loss.to_bits(), "{what}: loss");
            let norms = (e.grad_norm.to_bits(), f.grad_norm.to_bits());
            assert_eq!(norms.0, norms.1, "{what}: gradient norm");
        }
        assert_eq!(early_w.len(), full_w.len(), "{what}");
        for (name, t) in &early_w {
            assert!(t.data == full_w[name].data, "{what}: {name} differs");
        }
        assert!(
            early.memory.peak < full.memory.peak,
            "{what}: the early stop lowers the peak ({} vs {})",
            early.memory.peak,
            full.memory.peak
        );
        // the planner: collapsed and whole engine step equal to the ledger, either way
        for (c, ledger) in [(&cfg, &early.memory), (&full_cfg, &full.memory)] {
            let spec = StepSpec::of_run(c, &c.plan().unwrap(), DeviceKind::Cpu);
            let pred = predict_step_rank(&spec, 0).unwrap();
            assert_eq!(
                pred,
                engine_step_rank_uncollapsed(&spec, 0).unwrap(),
                "{what}: whole"
            );
            assert_eq!(pred.peak, ledger.peak, "{what}: device peak");
            assert_eq!(pred.host_peak, ledger.host_peak, "{what}: host peak");
        }
    }
}
