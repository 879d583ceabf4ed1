//! `upipe train --rehearse`: a rehearsed step allocates exactly what a real
//! step allocates (the ledger's device and host peaks, by category, equal
//! the real step's and the planner's to the byte) while computing nothing;
//! a model far larger than the host's memory rehearses without using it.

use std::process::Command;
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::Category;
use upipe::backend::MemoryStats;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::{DeviceKind, StepSpec, predict_step_rank};
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, TrainSummary, train_cpu};

use crate::common;

/// The shared tiny model (Llama).
fn tiny() -> ModelConfig {
    common::tiny(false)
}

fn config(model: &ModelConfig, policy: MemoryPolicy, fsdp: bool) -> TrainConfig {
    TrainConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        ring: 2,
        policy,
        fsdp,
        ..TrainConfig::new(
            model.clone(),
            256,
            1,
            AdamWConfig::schedule(1e-3, 1e-4, 0, 1),
        )
    }
}

/// `offload`: blocks whose input goes to the host (`--offload N`).
fn policy(
    checkpoint: bool,
    tiled_mlp: bool,
    offload: usize,
    save_attention: usize,
) -> MemoryPolicy {
    MemoryPolicy {
        checkpoint,
        tiled_mlp,
        offload,
        save_attention,
        ..MemoryPolicy::default()
    }
}

/// The device and host peaks and the bytes of every category at the peak.
fn peaks(m: &MemoryStats) -> (usize, usize, Vec<(Category, usize)>) {
    (m.peak, m.host_peak, m.at_peak_by_category.clone())
}

fn rehearse(cfg: &TrainConfig, tokens: Arc<[u32]>) -> TrainSummary {
    let cfg = TrainConfig {
        rehearse: true,
        ..cfg.clone()
    };
    train_cpu(&cfg, tokens, &|_| {}).unwrap()
}

#[test]
fn a_rehearsed_step_allocates_what_a_real_step_and_the_planner_do() {
    let layers = tiny().layers;
    let mut rng = Rng::new(7);
    let tokens: Arc<[u32]> = (0..2048).map(|_| rng.below(256) as u32).collect();
    let policies = [
        policy(false, false, 0, 0),
        policy(true, false, 0, 0),
        policy(true, true, 0, 0),
        policy(true, false, layers, 0),
        policy(true, false, 1, 0),
        policy(true, false, 0, 1),
        policy(true, false, 0, layers),
        policy(true, true, layers, layers),
        MemoryPolicy {
            offload_optimizer: MemoryPolicy::optimizer_units(layers),
            ..policy(true, false, 1, 1)
        },
        MemoryPolicy {
            offload_optimizer: 1,
            ..policy(true, false, 0, 1)
        },
    ];
    for p in policies {
        for fsdp in [false, true] {
            let cfg = config(&tiny(), p, fsdp);
            let what = format!("fsdp={fsdp} {p:?}");
            // two steps, as a rehearsal runs: the second starts with what the
            // first left (its deferred host updates, kept workspaces)
            let two = TrainConfig {
                steps: 2,
                ..cfg.clone()
            };
            let real = train_cpu(&two, tokens.clone(), &|_| {}).unwrap();
            let rehearsed = rehearse(&cfg, tokens.clone());
            let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cpu);
            let pred = predict_step_rank(&spec, 0).unwrap();
            assert_eq!(
                peaks(&rehearsed.memory),
                peaks(&real.memory),
                "{what}: rehearsed vs real"
            );
            assert_eq!(rehearsed.memory.peak, pred.peak, "{what}: device peak");
            assert_eq!(rehearsed.memory.host_peak, pred.host_peak, "{what}: host");
            for cat in Category::ALL.into_iter().filter(|c| c.on_device()) {
                assert_eq!(
                    rehearsed.memory.at_peak(cat),
                    pred.at(cat),
                    "{what}: {cat:?}"
                );
            }
            // nothing was computed: no loss, no gradient norm
            let (r, t) = (&rehearsed.reports, &real.reports);
            assert_eq!(r.len(), 2);
            assert!(r[0].loss.is_nan() && r[1].grad_norm.is_nan(), "{what}");
            assert!(
                t[0].loss.is_finite() && t[0].grad_norm.is_finite(),
                "{what}"
            );
        }
    }
}

#[test]
fn a_rehearsal_runs_two_steps_whatever_steps_says() {
    let mut cfg = config(&tiny(), MemoryPolicy::default(), false);
    cfg.steps = 50;
    let tokens: Arc<[u32]> = vec![0; 257].into();
    assert_eq!(rehearse(&cfg, tokens).reports.len(), 2);
}

/// Bytes this process has held in memory at most (Linux), if known.
fn max_rss() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

#[test]
fn a_model_far_larger_than_memory_rehearses_without_using_it() {
    let model = ModelConfig::resolve("llama3-8b").unwrap();
    let cfg = TrainConfig {
        strategy: Strategy::Local,
        rehearse: true,
        policy: policy(true, false, 0, 0),
        ..TrainConfig::new(model, 2048, 1, AdamWConfig::schedule(1e-3, 1e-4, 0, 1))
    };
    let tokens: Arc<[u32]> = vec![0; 2049].into();
    let got = train_cpu(&cfg, tokens, &|_| {}).unwrap();
    let spec = StepSpec::of_run(&cfg, &cfg.plan().unwrap(), DeviceKind::Cpu);
    let pred = predict_step_rank(&spec, 0).unwrap();
    assert_eq!(got.memory.peak, pred.peak);
    assert!(
        pred.peak > 100 << 30,
        "8B parameters with AdamW: over 100 GiB"
    );
    if let Some(rss) = max_rss() {
        assert!(
            rss < pred.peak / 8,
            "a rehearsal uses almost none of what it allocates ({rss} bytes of {})",
            pred.peak
        );
    }
}

fn upipe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_cli_reports_measured_beside_planned_and_says_nothing_is_computed() {
    let out = upipe(&["train", "--rehearse", "--device", "cpu", "--steps", "5"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("rehearsal: allocations only, nothing computed"),
        "{stdout}"
    );
    for want in [
        "preflight:",
        "measured",
        "planned",
        "weights",
        "device peak",
        "fits",
    ] {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
    assert!(!stdout.lines().any(|l| l.starts_with("loss")), "{stdout}");
    assert!(stderr.contains("--steps 5 is ignored"), "{stderr}");

    let out = upipe(&[
        "train",
        "--rehearse",
        "--device",
        "cpu",
        "--fsdp",
        "on",
        "--checkpoint",
        "--offload",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["rehearsal"].as_bool(), v["computed"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(v["fits"].as_bool(), Some(true));
    for key in ["device_peak", "host_peak"] {
        assert_eq!(v[key]["measured"], v[key]["planned"], "{key}: {v}");
    }
    assert!(v["host_peak"]["measured"].as_u64().unwrap() > 0, "{v}");
    for (cat, m) in v["by_category"].as_object().unwrap() {
        assert_eq!(m["measured"], m["planned"], "{cat}: {v}");
    }
}

#[test]
fn the_cli_rehearses_what_the_preflight_refuses_and_exits_by_the_verdict() {
    let args = [
        "train",
        "--rehearse",
        "--device",
        "cpu",
        "--model",
        "llama3-8b",
    ];
    let args = [
        &args[..],
        &[
            "--seq",
            "512",
            "--attn",
            "local",
            "--ulysses",
            "1",
            "--ring",
            "1",
            "--json",
        ],
    ]
    .concat();
    let out = upipe(&args);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(
        v["device_peak"]["measured"], v["device_peak"]["planned"],
        "{v}"
    );
    let fits = v["fits"].as_bool().unwrap();
    assert_eq!(out.status.code(), Some(if fits { 0 } else { 1 }), "{v}");
    if !fits {
        let why = v["failure"].as_str().unwrap();
        assert!(why.contains("usable"), "{why}");
        assert!(
            v["preflight_refusal"]
                .as_str()
                .unwrap()
                .contains("cannot fit"),
            "{v}"
        );
    }
}

#[test]
fn rehearse_refuses_save_dir_and_resume_naming_the_flag() {
    let dir = std::env::temp_dir().join(format!("upipe-rehearse-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    for (args, flag) in [
        (vec!["--save-dir", d], "--save-dir"),
        (vec!["--save-dir", d, "--resume"], "--resume"),
    ] {
        let all = [&["train", "--rehearse", "--device", "cpu"][..], &args].concat();
        let out = upipe(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{all:?} succeeded");
        assert!(
            stderr.contains(flag) && stderr.contains("--rehearse") && stderr.contains("nothing"),
            "{stderr}"
        );
    }
    assert!(!dir.exists(), "a refused rehearsal creates nothing");
}
