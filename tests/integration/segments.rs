//! `--checkpoint-every k`: segment checkpointing keeps one block input every
//! k blocks and rebuilds the others by recomputing each segment's forward
//! before its backward, with the same arithmetic: every k trains
//! bit-identically to 1 (every strategy, offload, kept attention, tiled
//! MLP, documents and sliding windows, FSDP, LoRA, freezing); the planner
//! predicts the CPU ledger to the byte; `auto` takes the fewest recomputes
//! that fit; bad settings are errors naming the fix.

use std::process::Command;
use std::sync::Arc;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::{Category, IGNORE};
use upipe::data::PackedWindow;
use upipe::model::decoder::attn_dims;
use upipe::model::lora::{LoraConfig, LoraTarget};
use upipe::model::{Family, Freeze, MemoryPolicy, ModelConfig, ModelWeights};
use upipe::optim::AdamWConfig;
use upipe::plan::checkpoint_every::every_candidates;
use upipe::plan::{
    CheckpointEvery, DeviceKind, EveryBudget, OffloadBlocks, StepSpec, checkpoint_every_auto,
    predict_step, predict_step_rank, resolve_checkpoint_every, resolve_plan,
};
use upipe::rng::Rng;
use upipe::train::lora_run::LoraRun;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu_packed, train_cpu};

use crate::common;

/// The tiny model with five blocks: segments of 2, 3 and 4 leave a shorter
/// last segment, 5 and 7 are one segment.
fn five_blocks(qk_norm: bool) -> ModelConfig {
    let mut c = common::tiny(qk_norm);
    c.layers = 5;
    c.validate().unwrap();
    c
}

const EVERY: [usize; 5] = [2, 3, 4, 5, 7];

/// (strategy, Pu, Pr, U) of the meshes compared: every strategy.
const MESHES: [(Strategy, usize, usize, Option<usize>); 5] = [
    (Strategy::Upipe, 2, 2, Some(2)),
    (Strategy::Ulysses, 4, 1, None),
    (Strategy::Ring, 1, 4, None),
    (Strategy::Usp, 2, 2, None),
    (Strategy::Local, 1, 1, None),
];

fn checkpointed(offload: usize, tiled_mlp: bool, save_attention: usize) -> MemoryPolicy {
    MemoryPolicy {
        checkpoint: true,
        offload,
        tiled_mlp,
        save_attention,
        ..Default::default()
    }
}

fn every(policy: MemoryPolicy, k: usize) -> MemoryPolicy {
    MemoryPolicy {
        checkpoint_every: k,
        ..policy
    }
}

fn window(seq: usize, vocab: usize, starts: &[u32]) -> PackedWindow {
    let mut rng = Rng::new(11);
    let t: Vec<u32> = (0..=seq).map(|_| rng.below(vocab as u64) as u32).collect();
    let mut targets = t[1..].to_vec();
    for &s in &starts[1..] {
        targets[s as usize - 1] = IGNORE;
    }
    PackedWindow {
        inputs: t[..seq].to_vec(),
        targets,
        doc_starts: starts.to_vec(),
    }
}

type LossGrads = (f64, std::collections::BTreeMap<String, Vec<f32>>);

fn one_step(
    cfg: &ModelConfig,
    mesh: (Strategy, usize, usize, Option<usize>),
    p: MemoryPolicy,
    w: &PackedWindow,
) -> LossGrads {
    let (s, pu, pr, u) = mesh;
    let plan = CpPlan::new(s, &attn_dims(cfg), w.inputs.len(), pu, pr, u).unwrap();
    let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
    loss_and_grads_cpu_packed(cfg, &plan, p, w, &init).unwrap()
}

fn assert_same_bits(got: &LossGrads, want: &LossGrads, what: &str) {
    assert_eq!(got.0.to_bits(), want.0.to_bits(), "{what}: loss");
    assert_eq!(got.1.len(), want.1.len(), "{what}: gradients");
    for (name, g) in &want.1 {
        let same = got.1[name]
            .iter()
            .zip(g)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: the gradient of {name} differs");
    }
}

#[test]
fn every_segment_length_gives_the_loss_and_gradients_of_one_checkpoint_per_block() {
    let cfg = five_blocks(true);
    // 64 tokens per rank on 4 ranks: 2 MLP tiles of `hidden` rows
    let w = window(256, cfg.vocab, &[0]);
    let layers = cfg.layers;
    for mesh in MESHES {
        for policy in [
            checkpointed(0, false, 0),
            checkpointed(0, true, 2),
            checkpointed(layers, false, 1),
            checkpointed(2, true, layers),
        ] {
            let one = one_step(&cfg, mesh, policy, &w);
            for k in EVERY {
                let got = one_step(&cfg, mesh, every(policy, k), &w);
                assert_same_bits(&got, &one, &format!("{mesh:?} every {k} {policy:?}"));
            }
        }
    }
}

/// Packed documents (a block-diagonal mask) on a model with a sliding
/// window: the recompute attends under the same mask.
#[test]
fn documents_and_a_sliding_window_give_the_same_bits() {
    let mut cfg = five_blocks(false);
    cfg.family = Family::Mistral;
    cfg.sliding_window = Some(9);
    cfg.validate().unwrap();
    let w = window(240, cfg.vocab, &[0, 50, 131, 200]);
    for mesh in [MESHES[0], MESHES[2], (Strategy::Usp, 2, 3, None), MESHES[4]] {
        let policy = checkpointed(1, true, 1);
        let one = one_step(&cfg, mesh, policy, &w);
        for k in [2, 3] {
            let got = one_step(&cfg, mesh, every(policy, k), &w);
            assert_same_bits(&got, &one, &format!("documents {mesh:?} every {k}"));
        }
    }
}

/// How a training run is set up besides its policy.
#[derive(Debug, Clone, Copy)]
struct Setup {
    mesh: (Strategy, usize, usize, Option<usize>),
    fsdp: bool,
    lora: bool,
    freeze: &'static str,
    grad_accum: usize,
}

fn train_config(model: &ModelConfig, setup: Setup, policy: MemoryPolicy) -> TrainConfig {
    let (strategy, ulysses, ring, chunk_heads) = setup.mesh;
    let lora = setup.lora.then(|| LoraRun {
        config: LoraConfig::new(2, 3.0, false, vec![LoraTarget::Q, LoraTarget::Down]).unwrap(),
        from: None,
    });
    TrainConfig {
        strategy,
        ulysses,
        ring,
        chunk_heads,
        policy,
        fsdp: setup.fsdp,
        grad_accum: setup.grad_accum,
        freeze: match setup.lora {
            true => Freeze::whole_base(),
            false => Freeze::parse(setup.freeze).unwrap(),
        },
        lora,
        ..TrainConfig::new(
            model.clone(),
            256,
            3,
            AdamWConfig::schedule(3e-3, 3e-4, 1, 3),
        )
    }
}

const SETUPS: [Setup; 6] = [
    Setup {
        mesh: MESHES[0],
        fsdp: true,
        lora: false,
        freeze: "none",
        grad_accum: 1,
    },
    Setup {
        mesh: MESHES[2],
        fsdp: true,
        lora: false,
        freeze: "none",
        grad_accum: 2,
    },
    Setup {
        mesh: MESHES[1],
        fsdp: false,
        lora: true,
        freeze: "none",
        grad_accum: 1,
    },
    Setup {
        mesh: MESHES[0],
        fsdp: true,
        lora: true,
        freeze: "none",
        grad_accum: 1,
    },
    Setup {
        mesh: MESHES[3],
        fsdp: false,
        lora: false,
        freeze: "embeddings,blocks:0",
        grad_accum: 1,
    },
    Setup {
        mesh: MESHES[0],
        fsdp: true,
        lora: false,
        freeze: "blocks:0-1",
        grad_accum: 1,
    },
];

/// Three training steps under FSDP (each recomputed block gathered again),
/// LoRA (replicated and sharded), frozen blocks (segments start at the
/// backward's floor), gradient accumulation, offloaded inputs and
/// optimizer state: the same losses, gradient norms and weights.
#[test]
fn training_is_bit_identical_with_fsdp_lora_freezing_and_offload() {
    let mut rng = Rng::new(2);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let model = five_blocks(true);
    let all = MemoryPolicy::optimizer_units(model.layers);
    for setup in SETUPS {
        let policy = MemoryPolicy {
            offload_optimizer: all,
            ..checkpointed(2, true, 1)
        };
        let run = |policy: MemoryPolicy| {
            let cfg = train_config(&model, setup, policy);
            let summary = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap();
            let steps: Vec<(u64, u64)> = summary
                .reports
                .iter()
                .map(|r| (r.loss.to_bits(), r.grad_norm.to_bits()))
                .collect();
            assert_eq!(steps.len(), 3);
            steps
        };
        let one = run(policy);
        for k in [2, 3] {
            let got = run(every(policy, k));
            assert_eq!(got, one, "{setup:?} every {k}: losses and gradient norms");
        }
    }
}

/// The planner's prediction is the engine's own step: equal to the CPU
/// ledger of a real training step, to the byte, under segments.
#[test]
fn the_planned_peak_equals_the_ledger_under_segments() {
    let mut rng = Rng::new(4);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let model = five_blocks(true);
    let layers = model.layers;
    for setup in SETUPS.into_iter().chain([Setup {
        mesh: MESHES[4],
        fsdp: false,
        lora: false,
        freeze: "none",
        grad_accum: 1,
    }]) {
        for policy in [
            checkpointed(0, false, 0),
            checkpointed(layers, true, 2),
            MemoryPolicy {
                offload_optimizer: 1,
                ..checkpointed(1, false, layers)
            },
        ] {
            for k in [1, 2, 3, 7] {
                let cfg = train_config(&model, setup, every(policy, k));
                let plan = cfg.plan().unwrap();
                let measured = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap().memory;
                let spec = StepSpec::of_run(&cfg, &plan, DeviceKind::Cpu);
                let pred = predict_step_rank(&spec, 0).unwrap();
                assert_eq!(pred, predict_step(&spec).unwrap());
                let what = format!("{setup:?} every {k} {policy:?}");
                assert_eq!(pred.peak, measured.peak, "{what}: device peak");
                assert_eq!(pred.host_peak, measured.host_peak, "{what}: host peak");
                for cat in Category::ALL.into_iter().filter(|c| c.on_device()) {
                    let name = cat.name();
                    assert_eq!(pred.at(cat), measured.at_peak(cat), "{what}: {name}");
                }
            }
        }
    }
}

/// Llama3-8B on one GPU at `seq` tokens, checkpointed, tiled, every unit's
/// optimizer state on the host.
fn llama_spec(seq: usize) -> StepSpec {
    let model = ModelConfig::resolve("llama3-8b").unwrap();
    let (plan, data) = resolve_plan(
        Strategy::Upipe,
        &attn_dims(&model),
        seq,
        1,
        None,
        None,
        None,
    )
    .unwrap();
    let policy = MemoryPolicy {
        checkpoint: true,
        tiled_mlp: true,
        offload_optimizer: MemoryPolicy::optimizer_units(model.layers),
        ..Default::default()
    };
    StepSpec {
        model,
        plan,
        data,
        policy,
        fsdp: false,
        fsdp_replicas: 1,
        grad_accum: 1,
        device: DeviceKind::CUDA,
        optimizer: true,
        state: Default::default(),
        precision: Default::default(),
        freeze: Default::default(),
        lora: None,
    }
}

/// Segments keep fewer inputs, so a longer context fits; `auto` takes the
/// candidate with the fewest recomputed blocks that fits, 1 where that does.
#[test]
fn auto_takes_the_fewest_recomputes_that_fit() {
    let ledger = 79usize << 30;
    let at = |spec: &StepSpec, k: usize| {
        let mut s = spec.clone();
        s.policy.checkpoint_every = k;
        predict_step(&s).unwrap().peak
    };
    let short = llama_spec(64 << 10);
    let auto = |s: &StepSpec| checkpoint_every_auto(s, ledger, None, OffloadBlocks::Blocks(0));
    assert_eq!(auto(&short).unwrap(), 1);
    let long = llama_spec(192 << 10);
    assert!(
        at(&long, 1) > ledger,
        "the test needs a step that does not fit"
    );
    let k = auto(&long).unwrap();
    assert!(k > 1 && at(&long, k) <= ledger, "every {k}");
    // every candidate before it in order does not fit
    let (layers, floor) = (long.model.layers, long.backward_floor());
    let candidates = every_candidates(long.policy, layers, floor);
    assert_eq!(candidates[0], 1);
    let before = candidates.iter().take_while(|&&c| c != k);
    for &c in before {
        assert!(at(&long, c) > ledger, "every {c} fits before every {k}");
    }
    // segments of every block or more are one segment: as 1, left out
    assert!(!candidates.contains(&layers));
    // with the host's room, `auto` offloads first: no recompute
    let offload = EveryBudget {
        ledger: Some(ledger),
        host: None,
        offload: OffloadBlocks::Auto,
    };
    let resolve = |budget| resolve_checkpoint_every(CheckpointEvery::Auto, &long, budget);
    assert_eq!(resolve(offload).unwrap(), 1);
    // unknown memory: one checkpoint per block
    let unknown = EveryBudget {
        ledger: None,
        ..offload
    };
    assert_eq!(resolve(unknown).unwrap(), 1);
}

#[test]
fn bad_settings_are_errors_naming_the_fix() {
    let parse = |s: &str| s.parse::<CheckpointEvery>();
    assert_eq!(parse("auto").unwrap(), CheckpointEvery::Auto);
    assert_eq!(parse("4").unwrap(), CheckpointEvery::Blocks(4));
    let e = parse("sqrt").unwrap_err().to_string();
    assert!(
        e.contains("a number of blocks") && e.contains("auto"),
        "{e}"
    );
    let plain = MemoryPolicy::default();
    for (given, policy, want) in [
        ("0", checkpointed(0, false, 0), "use 1"),
        ("3", plain, "add --checkpoint"),
        ("auto", plain, "add --checkpoint"),
    ] {
        let e = parse(given).unwrap().check(policy).unwrap_err().to_string();
        assert!(
            e.contains(&format!("--checkpoint-every {given}")) && e.contains(want),
            "{e}"
        );
    }
    // the engine refuses what the flags refuse
    let cfg = TrainConfig {
        policy: every(plain, 2),
        ..TrainConfig::new(
            five_blocks(false),
            64,
            1,
            AdamWConfig::schedule(3e-3, 3e-4, 1, 1),
        )
    };
    let e = cfg.plan().unwrap_err().to_string();
    assert!(e.contains("add --checkpoint"), "{e}");
    let e = upipe_err(&["train", "--steps", "1", "--checkpoint-every", "2"]);
    assert!(
        e.contains("--checkpoint-every 2") && e.contains("add --checkpoint"),
        "{e}"
    );
    let e = upipe_err(&[
        "train",
        "--steps",
        "1",
        "--checkpoint",
        "--checkpoint-every",
        "0",
    ]);
    assert!(e.contains("--checkpoint-every 0"), "{e}");
}

fn upipe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn upipe_err(args: &[&str]) -> String {
    let (ok, out, err) = upipe(args);
    assert!(!ok, "{args:?} succeeded: {out}");
    err
}

/// `--checkpoint-every` in a run file, `upipe plan`'s rows and the command
/// each row prints, and `train`'s decided flags.
#[test]
fn the_flag_goes_through_run_files_plan_and_train() {
    let (ok, out, err) = upipe(&[
        "train",
        "--print-config",
        "--checkpoint",
        "--checkpoint-every",
        "3",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("[segments]\ncheckpoint-every = 3\n"), "{out}");
    // the file reads back as the same run
    let file = std::env::temp_dir().join(format!("upipe-segments-{}.toml", std::process::id()));
    std::fs::write(&file, &out).unwrap();
    let (ok, again, err) = upipe(&[
        "train",
        "--config",
        file.to_str().unwrap(),
        "--print-config",
    ]);
    std::fs::remove_file(&file).ok();
    assert!(ok, "{err}");
    assert_eq!(again, out);
    let (ok, out, _) = upipe(&["train", "--print-config", "--checkpoint"]);
    assert!(
        ok && out.contains("[segments]\n# checkpoint-every = (unset)"),
        "{out}"
    );
    let plan = |every: &str| {
        let (ok, out, err) = upipe(&[
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            "1",
            "--host-mem",
            "108",
            "--attn",
            "upipe",
            "--checkpoint",
            "--tiled-mlp",
            "--offload",
            "auto",
            "--offload-optimizer",
            "auto",
            "--checkpoint-every",
            every,
            "--json",
        ]);
        assert!(ok, "{err}");
        let line = out
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap()
            .to_string();
        serde_json::from_str::<serde_json::Value>(&line).unwrap()
    };
    let (one, auto) = (plan("1"), plan("auto"));
    assert_eq!(one["checkpoint_every"], 1);
    let k = auto["checkpoint_every"].as_u64().unwrap();
    assert!(k > 1, "{auto}");
    assert!(auto["longest_seq"].as_u64() > one["longest_seq"].as_u64());
    let command = auto["train_command"].as_str().unwrap();
    assert!(
        command.contains(&format!("--checkpoint-every {k}")),
        "{command}"
    );
    // train decides it and says so
    let (ok, _, log) = upipe(&[
        "train",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--seq",
        "128",
        "--checkpoint",
        "--checkpoint-every",
        "auto",
    ]);
    assert!(ok, "{log}");
    assert!(log.contains("--checkpoint-every 1"), "{log}");
}
