//! Host offload on the CPU reference: offloading checkpointed block inputs
//! (all or the first N blocks) and the optimizer state leaves losses,
//! gradient norms and parameters bit-identical to keeping them on the
//! device, with and without FSDP; the ledger holds the optimizer state in
//! host memory; resume continues exactly; bad choices are clear errors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::Category;
use upipe::checkpoint::{HostTensor, load_safetensors};
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, TrainSummary, train_cpu};

fn model(qwen: bool) -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.heads = 8;
    c.kv_heads = 2;
    c.head_dim = 8;
    c.hidden = 32;
    c.ffn = 48;
    c.layers = 3;
    c.family = if qwen {
        upipe::model::Family::Qwen3
    } else {
        upipe::model::Family::Llama
    };
    c.tie_embeddings = qwen;
    c.validate().unwrap();
    c
}

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(3);
    (0..4096)
        .map(|_| rng.below(vocab as u64) as u32)
        .collect::<Vec<_>>()
        .into()
}

fn config(m: &ModelConfig, fsdp: bool, policy: MemoryPolicy, dir: &Path) -> TrainConfig {
    TrainConfig {
        data_parallel: 2,
        strategy: Strategy::Upipe,
        ulysses: 2,
        ring: 1,
        seed: 9,
        fsdp,
        policy,
        save_dir: Some(dir.to_path_buf()),
        ..TrainConfig::new(m.clone(), 32, 5, AdamWConfig::schedule(3e-3, 3e-4, 1, 5))
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-offload-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn weights(dir: &Path) -> BTreeMap<String, HostTensor> {
    load_safetensors(&dir.join("model.safetensors")).unwrap()
}

fn assert_identical(a: &TrainSummary, b: &TrainSummary, what: &str) {
    assert_eq!(a.reports.len(), b.reports.len());
    for (x, y) in a.reports.iter().zip(&b.reports) {
        assert_eq!(
            x.loss.to_bits(),
            y.loss.to_bits(),
            "{what} step {} loss",
            x.step
        );
        assert_eq!(
            x.grad_norm.to_bits(),
            y.grad_norm.to_bits(),
            "{what} step {} grad norm",
            x.step
        );
    }
}

fn assert_identical_weights(a: &Path, b: &Path, what: &str) {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len(), "{what}");
    for (name, x) in &wa {
        let same = x
            .data
            .iter()
            .zip(&wb[name].data)
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{what}: {name} differs");
    }
}

/// `--offload offload --offload-optimizer host_units`.
fn policy(offload: usize, host_units: usize) -> MemoryPolicy {
    MemoryPolicy {
        checkpoint: true,
        offload,
        offload_optimizer: host_units,
        ..MemoryPolicy::default()
    }
}

/// Every offload mode, with and without FSDP and with a tied embedding,
/// gives the bits of the run that offloads nothing, over 5 AdamW steps.
#[test]
fn every_offload_mode_is_bit_identical_to_no_offload() {
    for (qwen, fsdp) in [(false, false), (true, false), (false, true), (true, true)] {
        let m = model(qwen);
        let base_dir = temp("base");
        let base = train_cpu(
            &config(&m, fsdp, policy(0, 0), &base_dir),
            tokens(m.vocab),
            &|_| {},
        )
        .unwrap();
        let all = MemoryPolicy::optimizer_units(m.layers);
        // (blocks offloaded, units whose optimizer state is on the host):
        // all, the last block, every block and the embedding, ...
        let modes = [
            (m.layers, 0),
            (1, 0),
            (0, all),
            (2, all),
            (0, 1),
            (1, m.layers + 1),
        ];
        for (blocks, opt) in modes {
            let what =
                format!("qwen={qwen} fsdp={fsdp} --offload {blocks} --offload-optimizer {opt}");
            let dir = temp("mode");
            let run = train_cpu(
                &config(&m, fsdp, policy(blocks, opt), &dir),
                tokens(m.vocab),
                &|_| {},
            )
            .unwrap();
            assert_identical(&base, &run, &what);
            assert_identical_weights(&base_dir, &dir, &what);
            let mem = &run.memory;
            if opt == all {
                // master + two moments in host memory, none on the device
                assert_eq!(mem.at_peak(Category::OptimState), 0, "{what}");
            }
            if opt > 0 {
                assert!(run.reports[0].host_peak_bytes > 0, "{what}");
            }
            if 0 < opt && opt < all {
                // the head's moments stay on the device
                assert!(mem.at_peak(Category::OptimState) > 0, "{what}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        let _ = std::fs::remove_dir_all(&base_dir);
    }
}

/// A Qwen2's q/k/v biases offload like any parameter: its optimizer state
/// on the host (with and without FSDP) gives the bits of the run that
/// offloads nothing.
#[test]
fn qwen2_biases_offload_like_any_parameter() {
    let mut m = model(true);
    m.family = upipe::model::Family::Qwen2;
    m.validate().unwrap();
    let all = MemoryPolicy::optimizer_units(m.layers);
    for fsdp in [false, true] {
        let base_dir = temp("q2base");
        let base = train_cpu(
            &config(&m, fsdp, policy(0, 0), &base_dir),
            tokens(m.vocab),
            &|_| {},
        )
        .unwrap();
        for (blocks, opt) in [(0, all), (1, 2)] {
            let what = format!("qwen2 fsdp={fsdp} --offload {blocks} --offload-optimizer {opt}");
            let dir = temp("q2mode");
            let cfg = config(&m, fsdp, policy(blocks, opt), &dir);
            let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
            assert_identical(&base, &run, &what);
            assert_identical_weights(&base_dir, &dir, &what);
            let _ = std::fs::remove_dir_all(&dir);
        }
        let _ = std::fs::remove_dir_all(&base_dir);
    }
}

/// With several sequences per step the host updates deferred into the next
/// step's forward (which zero each gradient they read) leave the
/// accumulated gradients exact: bit-identical to the on-device optimizer.
#[test]
fn accumulated_steps_with_the_optimizer_on_the_host_are_bit_identical() {
    let m = model(false);
    for fsdp in [false, true] {
        let run = |opt: usize, dir: &Path| {
            let cfg = TrainConfig {
                grad_accum: 2,
                ..config(&m, fsdp, policy(0, opt), dir)
            };
            train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap()
        };
        let (base_dir, dir) = (temp("accum-base"), temp("accum-host"));
        let base = run(0, &base_dir);
        // every unit's state on the host, and the last two units'
        for opt in [MemoryPolicy::optimizer_units(m.layers), 2] {
            let host = run(opt, &dir);
            let what = format!("fsdp={fsdp} --grad-accum 2 --offload-optimizer {opt}");
            assert_identical(&base, &host, &what);
            assert_identical_weights(&base_dir, &dir, &what);
            let _ = std::fs::remove_dir_all(&dir);
        }
        let _ = std::fs::remove_dir_all(&base_dir);
    }
}

/// A run with the optimizer offloaded resumes from its checkpoint exactly
/// where an uninterrupted run is, on the device or the host.
#[test]
fn offloaded_optimizer_resumes_exactly() {
    let m = model(false);
    let whole_dir = temp("whole");
    let whole = train_cpu(
        &config(&m, false, policy(0, 0), &whole_dir),
        tokens(m.vocab),
        &|_| {},
    )
    .unwrap();
    // every unit's state on the host, and only the last two units'
    for opt in [MemoryPolicy::optimizer_units(m.layers), 2] {
        let dir = temp("resume");
        let mut first = config(&m, false, policy(0, opt), &dir);
        first.steps = 3;
        train_cpu(&first, tokens(m.vocab), &|_| {}).unwrap();
        let mut rest = config(&m, false, policy(0, opt), &dir);
        rest.resume = true;
        let resumed = train_cpu(&rest, tokens(m.vocab), &|_| {}).unwrap();
        let tail = &whole.reports[3..];
        assert_eq!(resumed.reports.len(), tail.len());
        for (x, y) in tail.iter().zip(&resumed.reports) {
            assert_eq!(x.step, y.step);
            assert_eq!(
                x.loss.to_bits(),
                y.loss.to_bits(),
                "step {} opt {opt}",
                x.step
            );
        }
        assert_identical_weights(&whole_dir, &dir, &format!("resumed, opt {opt}"));
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&whole_dir);
}

/// `--offload N` beyond the model's blocks, offload without checkpointing
/// and `--offload-optimizer N` beyond the model's units are errors naming
/// the fix.
#[test]
fn bad_offload_choices_name_the_fix() {
    let m = model(false);
    let dir = temp("bad");
    let too_many = train_cpu(
        &config(&m, false, policy(m.layers + 1, 0), &dir),
        tokens(m.vocab),
        &|_| {},
    );
    let e = refusal(too_many);
    assert!(e.contains("--offload 4") && e.contains("3 blocks"), "{e}");
    let no_ckpt = MemoryPolicy {
        checkpoint: false,
        ..policy(1, 0)
    };
    let e = refusal(train_cpu(
        &config(&m, false, no_ckpt, &dir),
        tokens(m.vocab),
        &|_| {},
    ));
    assert!(e.contains("add --checkpoint"), "{e}");
    let e = refusal(train_cpu(
        &config(&m, false, policy(0, m.layers + 3), &dir),
        tokens(m.vocab),
        &|_| {},
    ));
    assert!(
        e.contains("--offload-optimizer 6") && e.contains("5 units"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn refusal<T>(r: upipe::Result<T>) -> String {
    match r {
        Ok(_) => panic!("the run should have been refused"),
        Err(e) => e.to_string(),
    }
}

/// The multi-tensor AdamW (one op over every device slot, each parameter
/// piece of an FSDP shard with its own weight decay: Qwen2's biases and
/// norms have none) gives the bits of an update per parameter over 5 steps:
/// replicated and FSDP, with the optimizer state on the device, and with
/// part of it on the host (whose device slots zero their gradients).
#[test]
fn multi_tensor_adamw_is_bit_identical_to_an_update_per_parameter() {
    let mut m = model(true);
    m.family = upipe::model::Family::Qwen2;
    m.validate().unwrap();
    for (fsdp, host_units) in [(false, 0), (true, 0), (false, 2), (true, 2)] {
        let what = format!("fsdp={fsdp} --offload-optimizer {host_units}");
        let (ref_dir, dir) = (temp("mt-per-piece"), temp("mt-multi"));
        let mut per_piece = config(&m, fsdp, policy(0, host_units), &ref_dir);
        per_piece.optim.per_piece = true;
        let reference = train_cpu(&per_piece, tokens(m.vocab), &|_| {}).unwrap();
        let cfg = config(&m, fsdp, policy(0, host_units), &dir);
        assert!(
            !cfg.optim.per_piece,
            "the multi-tensor update is the default"
        );
        let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
        assert_identical(&reference, &run, &what);
        assert_identical_weights(&ref_dir, &dir, &what);
        let _ = std::fs::remove_dir_all(&ref_dir);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
