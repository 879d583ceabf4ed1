//! A LoRA run from the command line: the run header's trainable-parameter
//! line, the save directory holding the adapter alone, `upipe merge` of it
//! without training, and the adapter directory refused where a model is
//! read.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use upipe::checkpoint::lora_merge::{BaseModel, MergeJob, merge_adapter_dir};
use upipe::checkpoint::{SaveDtype, load_hf_model};
use upipe::model::ModelConfig;
use upipe::model::lora::{LoraConfig, LoraTarget};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-lora-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn text(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// `upipe train --lora-rank 4` prints PEFT's count (adapters of all seven
/// targets of tiny, of tiny's parameters and the adapters') and saves the
/// adapter alone; `upipe merge tiny DIR OUT --seed 3` writes the model the
/// library's merge of the seed's base writes, a second time refused (OUT
/// not empty); `eval --model-dir DIR` is refused naming `--lora-from` and
/// `upipe merge`.
#[test]
fn a_lora_run_counts_saves_the_adapter_alone_and_merges_without_training() {
    let dir = temp("run");
    let d = text(&dir);
    let args = [
        "train",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--seq",
        "64",
        "--lora-rank",
        "4",
        "--seed",
        "3",
        "--save-dir",
        &d,
    ];
    let out = run(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = ModelConfig::resolve("tiny").unwrap();
    let lora = LoraConfig::new(4, 8.0, false, LoraTarget::ALL.to_vec()).unwrap();
    let adapters = lora.param_count(&m);
    let base: usize = m
        .params()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let all = base + adapters;
    let commas = |n: usize| {
        let s = n.to_string();
        let b = s.as_bytes();
        let parts: Vec<String> = (0..b.len())
            .rev()
            .step_by(3)
            .map(|end| s[end.saturating_sub(2)..=end].to_string())
            .collect();
        parts.into_iter().rev().collect::<Vec<_>>().join(",")
    };
    let want = format!(
        "trainable parameters {} of {} ({:.4} %)",
        commas(adapters),
        commas(all),
        100.0 * adapters as f64 / all as f64
    );
    assert!(
        adapters > 0 && stdout.contains(&want),
        "want {want} in:\n{stdout}"
    );
    for f in ["model.safetensors", "config.json"] {
        assert!(!dir.join(f).exists(), "{f} saved beside the adapter");
    }
    assert!(dir.join("adapter_model.safetensors").is_file());

    let (merged, lib) = (temp("merged"), temp("lib"));
    let out = run(&[
        "merge",
        "tiny",
        &d,
        &text(&merged),
        "--seed",
        "3",
        "--save-dtype",
        "f32",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job = MergeJob {
        base: &BaseModel::Random { seed: 3 },
        adapter: &dir,
        out: &lib,
        cfg: &m,
        dtype: SaveDtype::F32,
    };
    merge_adapter_dir(&job).unwrap();
    let (got, want) = (
        load_hf_model(&merged, &m).unwrap(),
        load_hf_model(&lib, &m).unwrap(),
    );
    assert_eq!(got, want);
    let base = BaseModel::Random { seed: 3 }.tensors(&m).unwrap();
    assert_ne!(got, base, "the merge changed nothing");
    let again = run(&["merge", "tiny", &d, &text(&merged), "--seed", "3"]);
    let e = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && e.contains("not empty"), "{e}");

    let eval = run(&["eval", "--model-dir", &d, "--tokens", "/nonexistent.u32"]);
    let e = String::from_utf8_lossy(&eval.stderr);
    assert!(
        !eval.status.success() && e.contains("--lora-from") && e.contains("upipe merge"),
        "{e}"
    );
    for p in [dir, merged, lib] {
        let _ = std::fs::remove_dir_all(p);
    }
}
