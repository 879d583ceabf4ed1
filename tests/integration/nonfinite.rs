//! A step whose gradients are not finite changes nothing: with
//! `--skip-nonfinite` the run goes on and its weights and optimizer state
//! stay bit-identical to those of the last applied step, replicated or
//! sharded (FSDP), with the optimizer state on the device or on the host
//! (whose updates are deferred into the next step's forward); without it
//! the run stops with an error before anything is saved.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::error::Error;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::train::trainer::{TrainConfig, train_cpu};

fn model() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.layers = 3;
    c.validate().unwrap();
    c
}

fn tokens() -> Arc<[u32]> {
    (0..4096u32)
        .map(|i| (i * 7 + i / 13) % 256)
        .collect::<Vec<_>>()
        .into()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-nonfinite-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A run whose first step, at a learning rate of 1e30, makes every later
/// step's gradients overflow.
fn config(steps: u32, fsdp: bool, host_units: usize, dir: &Path) -> TrainConfig {
    TrainConfig {
        data_parallel: 2,
        strategy: Strategy::Upipe,
        ulysses: 2,
        ring: 1,
        fsdp,
        policy: MemoryPolicy {
            offload_optimizer: host_units,
            ..MemoryPolicy::default()
        },
        save_dir: Some(dir.to_path_buf()),
        skip_nonfinite: 10,
        ..TrainConfig::new(
            model(),
            32,
            steps,
            AdamWConfig::schedule(1e30, 1e30, 0, steps),
        )
    }
}

/// The bytes of every safetensors file of a checkpoint, by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    files
}

#[test]
fn skipped_steps_leave_weights_and_optimizer_state_bit_identical() {
    for (fsdp, host_units) in [(false, 0), (false, 2), (true, 0), (true, 2)] {
        let what = format!("fsdp {fsdp}, {host_units} units' state on the host");
        let (one, four) = (temp("one"), temp("four"));
        let first = train_cpu(&config(1, fsdp, host_units, &one), tokens(), &|_| {}).unwrap();
        assert_eq!(first.reports[0].skipped, 0, "{what}: step 1 is applied");
        let run = train_cpu(&config(4, fsdp, host_units, &four), tokens(), &|_| {}).unwrap();
        let skipped: Vec<u32> = run.reports.iter().map(|r| r.skipped).collect();
        assert_eq!(skipped, [0, 1, 2, 3], "{what}");
        assert!(!run.reports[3].grad_norm.is_finite(), "{what}");
        assert!(
            tensors(&four) == tensors(&one),
            "{what}: the skipped steps changed the state"
        );
        let _ = std::fs::remove_dir_all(&one);
        let _ = std::fs::remove_dir_all(&four);
    }
}

#[test]
fn without_skips_the_first_non_finite_step_stops_the_run_before_it_saves() {
    let dir = temp("stop");
    let cfg = TrainConfig {
        skip_nonfinite: 0,
        save_every: 1,
        ..config(4, false, 0, &dir)
    };
    let err = train_cpu(&cfg, tokens(), &|_| {}).unwrap_err();
    assert!(matches!(err, Error::Diverged(_)), "{err}");
    let e = err.to_string();
    assert!(e.contains("step 2") && e.contains("of step 1"), "{e}");
    let state = std::fs::read_to_string(dir.join("state.json")).unwrap();
    assert!(
        state.contains("\"step\": 1"),
        "step 1's checkpoint stays: {state}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
