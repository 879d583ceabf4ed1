//! LoRA adapters under FSDP on CPU thread meshes: the same losses, gradient
//! norms and adapters as the replicated LoRA run, the base bit-identical;
//! the save's PEFT adapter directory, `--lora-from`, `--merge-lora`, and a
//! resume that continues bit-identically (and re-shards onto one rank).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::attention::trial::rel_err;
use upipe::checkpoint::lora_merge::{BaseModel, MergeJob, merge_adapter_dir};
use upipe::checkpoint::peft::{read_adapter, write_adapter};
use upipe::checkpoint::{SaveDtype, load_safetensors};
use upipe::model::lora::{LoraConfig, LoraTarget, LoraWeights};
use upipe::model::{Freeze, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::rng::Rng;
use upipe::train::lora_run::LoraRun;
use upipe::train::trainer::{TrainConfig, TrainSummary, train_cpu};

use crate::common;
use common::tiny;

/// (data, strategy, Pu, Pr)
type Mesh = (usize, Strategy, usize, usize);

fn lora_config() -> LoraConfig {
    let targets = vec![
        LoraTarget::Q,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Down,
    ];
    LoraConfig::new(2, 3.0, false, targets).unwrap()
}

fn config(m: &ModelConfig, mesh: Mesh, steps: u32, fsdp: bool, from: Option<&Path>) -> TrainConfig {
    let (data, strategy, ulysses, ring) = mesh;
    TrainConfig {
        data_parallel: data,
        strategy,
        ulysses,
        ring,
        seed: 5,
        fsdp,
        freeze: Freeze::whole_base(),
        lora: Some(LoraRun {
            config: lora_config(),
            from: from.map(Path::to_path_buf),
        }),
        ..TrainConfig::new(
            m.clone(),
            32,
            steps,
            AdamWConfig::schedule(3e-3, 3e-4, 1, steps),
        )
    }
}

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..2048).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-lora-fsdp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

fn train(cfg: &TrainConfig, dir: &Path) -> TrainSummary {
    let mut cfg = cfg.clone();
    cfg.save_dir = Some(dir.to_path_buf());
    train_cpu(&cfg, tokens(cfg.model.vocab), &|_| {}).unwrap()
}

fn assert_same_adapters(a: &Path, b: &Path, m: &ModelConfig, tol: f64, what: &str) {
    let (x, y) = (
        read_adapter(a, m).unwrap().weights,
        read_adapter(b, m).unwrap().weights,
    );
    assert_eq!(x.config, y.config, "{what}");
    for (l, (fx, fy)) in x.layers.iter().zip(&y.layers).enumerate() {
        for (p, q) in fx.iter().zip(fy) {
            for (u, v) in [(&p.a, &q.a), (&p.b, &q.b)] {
                let err = rel_err(u, v);
                assert!(err <= tol, "{what} layer {l}: adapter rel err {err}");
            }
        }
    }
}

/// A save directory copied whole (upipe's manifest too: the copy is a save
/// directory upipe wrote).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        match e.path().is_dir() {
            true => copy_dir(&e.path(), &to.join(e.file_name())),
            false => drop(std::fs::copy(e.path(), to.join(e.file_name())).unwrap()),
        }
    }
}

/// A random adapter directory (B non-zero, so `--lora-from` matters from
/// the first step).
fn random_adapter_dir(m: &ModelConfig) -> PathBuf {
    let mut w = LoraWeights::init(m, &lora_config(), 9).unwrap();
    let mut rng = Rng::new(4);
    for f in w.layers.iter_mut().flatten() {
        f.b.iter_mut()
            .for_each(|v| *v = (rng.normal() * 0.3) as f32);
    }
    let dir = temp("from");
    write_adapter(&dir, &w, "tiny", SaveDtype::F32).unwrap();
    dir
}

/// Three steps of LoRA under FSDP (data parallel over 3 ranks, a padded
/// shard; UPipe over 2 with `--lora-from`) equal the replicated run: losses,
/// gradient norms, the saved PEFT adapters (the adapter alone, no base
/// weights) and their merged models.
#[test]
fn fsdp_lora_equals_the_replicated_run() {
    let m = tiny(false);
    let from = random_adapter_dir(&m);
    let meshes: [(Mesh, Option<&Path>); 2] = [
        ((3, Strategy::Local, 1, 1), None),
        ((1, Strategy::Upipe, 2, 1), Some(&from)),
    ];
    for (mesh, from) in meshes {
        let what = format!("{mesh:?}");
        let (dr, ds) = (temp("replicated"), temp("sharded"));
        let want = train(&config(&m, mesh, 3, false, from), &dr);
        let got = train(&config(&m, mesh, 3, true, from), &ds);
        for (x, y) in got.reports.iter().zip(&want.reports) {
            assert!(
                rel(x.loss, y.loss) <= 1e-5,
                "{what}: loss {} vs {}",
                x.loss,
                y.loss
            );
            let (gx, gy) = (x.grad_norm, y.grad_norm);
            assert!(rel(gx, gy) <= 1e-5, "{what}: grad norm {gx} vs {gy}");
        }
        assert!(upipe::checkpoint::sharded::is_sharded(&ds), "{what}");
        assert_same_adapters(&ds, &dr, &m, 1e-5, &what);
        // the adapter alone: the base is the seed's, read again on resume
        for d in [&dr, &ds] {
            assert!(!d.join("model.safetensors").exists(), "{what}: base saved");
            assert!(d.join("adapter_model.safetensors").is_file(), "{what}");
        }
        let (mr, ms) = (temp("merged-r"), temp("merged-s"));
        let base = BaseModel::Random { seed: 5 };
        for (adapter, out) in [(&dr, &mr), (&ds, &ms)] {
            let (cfg, dtype) = (&m, SaveDtype::F32);
            let job = MergeJob {
                base: &base,
                adapter,
                out,
                cfg,
                dtype,
            };
            merge_adapter_dir(&job).unwrap();
        }
        let (x, y) = (
            load_safetensors(&ms.join("model.safetensors")).unwrap(),
            load_safetensors(&mr.join("model.safetensors")).unwrap(),
        );
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
        for (name, t) in &x {
            assert!(
                rel_err(&t.data, &y[name].data) <= 1e-5,
                "{what}: merged {name}"
            );
        }
        for d in [dr, ds, mr, ms] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    let _ = std::fs::remove_dir_all(from);
}

/// Saved under FSDP on 2 ranks after 3 of 4 steps, resumed on 2 (adapter
/// shards and their AdamW moments: bit-identical to the uninterrupted run)
/// and on 1 (re-sharded: within float rounding).
#[test]
fn fsdp_lora_resumes_bit_identically() {
    let m = tiny(false);
    let two = (1, Strategy::Upipe, 2, 1);
    let one = (1, Strategy::Local, 1, 1);
    let whole = temp("whole");
    let full = train(&config(&m, two, 4, true, None), &whole);
    let dir = temp("resume");
    let mut first = config(&m, two, 3, true, None);
    first.optim = config(&m, two, 4, true, None).optim;
    train(&first, &dir);
    for (mesh, tol) in [(two, 0.0), (one, 1e-5)] {
        let again_dir = temp("again");
        copy_dir(&dir, &again_dir);
        let mut again = config(&m, mesh, 4, true, None);
        again.resume = true;
        let rest = train(&again, &again_dir);
        assert_eq!(rest.reports.len(), 1, "{mesh:?}: one more step");
        let (x, y) = (rest.reports[0].loss, full.reports[3].loss);
        assert!(rel(x, y) <= tol, "{mesh:?}: loss {x} vs {y}");
        assert_same_adapters(&again_dir, &whole, &m, tol, &format!("{mesh:?}"));
        let _ = std::fs::remove_dir_all(again_dir);
    }
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(whole);
}
