//! Training over NCCL on two GPUs, one process per GPU (the path `upipe
//! train` takes under `upipe launch`, torchrun or srun, and by itself on a
//! machine with 2+ GPUs): the tiny model's losses track the CPU thread-rank
//! run of the same configuration, step by step, within the bf16 tolerance of
//! `tests/integration/gpu_layer.rs`; rank 0 writes the checkpoint.
//!
//! The test re-runs its own binary as the two ranks (as `tests/integration/gpu_nccl.rs`
//! does), so it works wherever the test binary is copied. Skipped with a
//! message where fewer than two GPUs (or no NCCL) exist.

use crate::common;
use std::sync::Arc;
use std::time::Duration;

use upipe::attention::Strategy;
use upipe::backend::cpu::CpuBackend;
use upipe::backend::cuda::cudnn::AttnKernel;
use upipe::comm::env::DistEnv;
use upipe::model::ModelConfig;
use upipe::optim::AdamWConfig;
use upipe::train::trainer::{TrainConfig, train_process_rank, train_threads};

/// Set in the children: they run the ranks.
const ROLE: &str = "UPIPE_GPU_TRAIN_ROLE";
/// One rendezvous port per configuration (comma-separated).
const PORTS: &str = "UPIPE_GPU_TRAIN_PORTS";
/// Where rank 0 saves the first configuration's checkpoint.
const SAVE: &str = "UPIPE_GPU_TRAIN_SAVE";

const STEPS: u32 = 6;

/// The configurations, all of two ranks: UPipe on 2 Ulysses ranks (the
/// default mesh on two GPUs), UPipe on a ring of 2, two data replicas, and
/// FSDP under UPipe, a ring, and Ulysses with a Qwen3-style model.
fn configs() -> Vec<(&'static str, TrainConfig)> {
    let base = TrainConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        seed: 1,
        ..TrainConfig::new(
            ModelConfig::resolve("tiny").unwrap(),
            128,
            STEPS,
            AdamWConfig::schedule(3e-3, 3e-4, 2, STEPS),
        )
    };
    vec![
        ("upipe-pu2", base.clone()),
        (
            "upipe-pr2",
            TrainConfig {
                ulysses: 1,
                ring: 2,
                ..base.clone()
            },
        ),
        (
            "local-data2",
            TrainConfig {
                strategy: Strategy::Local,
                ulysses: 1,
                ring: 1,
                data_parallel: 2,
                ..base.clone()
            },
        ),
        // FSDP over NCCL: gathers and reduce-scatters on the communication stream
        (
            "fsdp-upipe-pu2",
            TrainConfig {
                fsdp: true,
                ..base.clone()
            },
        ),
        (
            "fsdp-ring2",
            TrainConfig {
                fsdp: true,
                ulysses: 1,
                ring: 2,
                ..base.clone()
            },
        ),
        (
            "fsdp-qwen-ulysses2",
            TrainConfig {
                fsdp: true,
                strategy: Strategy::Ulysses,
                model: qwen_style(),
                ..base
            },
        ),
    ]
}

/// QK-norm and tied embeddings, as Qwen3's small models.
fn qwen_style() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.family = upipe::model::Family::Qwen3;
    c.tie_embeddings = true;
    c
}

fn tokens() -> Arc<[u32]> {
    upipe::data::ByteTokenizer
        .encode(upipe::data::CORPUS)
        .into()
}

/// Parent: starts two ranks of this test; returns rank 0's stdout, or
/// `None` when the machine cannot run it.
fn launch_two(test: &str, save: &std::path::Path) -> Option<String> {
    if let Some(why) = common::two_gpus_missing() {
        eprintln!("SKIP gpu_train::{test}: {why}");
        return None;
    }
    let ports: Vec<String> = configs()
        .iter()
        .map(|_| common::free_port().to_string())
        .collect();
    let env = [(PORTS, ports.join(",")), (SAVE, save.display().to_string())];
    let ranks = common::run_two_ranks(module_path!(), test, ROLE, &env, Duration::from_secs(300));
    assert!(
        ranks.iter().all(|r| r.success),
        "a rank failed (see its output above)"
    );
    ranks.into_iter().next().map(|r| r.stdout)
}

/// Child: trains every configuration as one rank, rank 0 printing
/// `STEP <name> <step> <loss> <tokens/s>` lines.
fn run_ranks() {
    let env = DistEnv::from_env().unwrap().expect("RANK/WORLD_SIZE set");
    let ports: Vec<u16> = std::env::var(PORTS)
        .unwrap()
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    let save = std::path::PathBuf::from(std::env::var(SAVE).unwrap());
    for ((name, mut cfg), port) in configs().into_iter().zip(ports) {
        if name == "upipe-pu2" {
            cfg.save_dir = Some(save.clone());
        }
        // a rendezvous of its own per configuration
        let env = DistEnv {
            master_port: port,
            ..env.clone()
        };
        let on_step = |r: &upipe::train::trainer::StepReport| {
            println!("STEP {name} {} {} {}", r.step, r.loss, r.tokens_per_s);
        };
        let s = train_process_rank(&cfg, tokens(), &env, AttnKernel::Auto, &on_step).unwrap();
        assert_eq!(s.reports.len(), STEPS as usize);
        assert_eq!(s.ranks, 2);
    }
}

#[test]
fn nccl_training_tracks_cpu_thread_ranks() {
    const TEST: &str = "nccl_training_tracks_cpu_thread_ranks";
    if std::env::var(ROLE).as_deref() == Ok(TEST) {
        run_ranks();
        return;
    }
    let save = std::env::temp_dir().join(format!("upipe-gpu-train-{}", std::process::id()));
    let Some(lead) = launch_two(TEST, &save) else {
        return;
    };
    for (name, cfg) in configs() {
        let cpu = train_threads(&cfg, tokens(), CpuBackend::new, &|_| {}).unwrap();
        let gpu: Vec<(u32, f64, f64)> = lead
            .lines()
            // the test harness may print its `test ... ` on the same line
            .filter_map(|l| l.split_once("STEP ").map(|(_, r)| r))
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[0] == name).then(|| {
                    (
                        f[1].parse().unwrap(),
                        f[2].parse().unwrap(),
                        f[3].parse().unwrap(),
                    )
                })
            })
            .collect();
        assert_eq!(
            gpu.len(),
            STEPS as usize,
            "{name}: rank 0 reports every step"
        );
        for (c, (step, loss, tps)) in cpu.reports.iter().zip(&gpu) {
            println!(
                "{name} step {step}: cpu {:.5} gpu {loss:.5} ({tps:.0} tok/s on GPUs)",
                c.loss
            );
            assert_eq!(c.step, *step);
            assert!(
                ((loss - c.loss) / c.loss).abs() <= 1e-2,
                "{name} step {step}: gpu {loss} vs cpu {} (bf16 vs f32)",
                c.loss
            );
        }
        // it learns: the loss moves the same way as on the CPU
        let (c0, c1) = (cpu.reports[0].loss, cpu.reports.last().unwrap().loss);
        let (g0, g1) = (gpu[0].1, gpu.last().unwrap().1);
        assert!(g1 < g0 && c1 < c0, "{name}: cpu {c0}->{c1}, gpu {g0}->{g1}");
    }
    for f in ["model.safetensors", "config.json", "state.json"] {
        assert!(
            save.join(f).exists(),
            "rank 0 saved {f} in {}",
            save.display()
        );
    }
    std::fs::remove_dir_all(&save).ok();
}
