//! A fine-tune a user can trust end to end, through the real binary: the
//! model's own tokenizer by default, a checkpoint never replaced unasked,
//! every save logged, `checkpoint-STEP` folders kept by `--keep-last` and
//! `--keep-best`, weight files that follow the umask, and no output path
//! that writes over an input.

use crate::common::Tmp;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A small, fast training run on the CPU.
const TRAIN: &[&str] = &["train", "--device", "cpu", "--seq", "64", "--warmup", "0"];

fn upipe(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .current_dir(cwd)
        .env("UPIPE_LOG", "info")
        .args(args)
        .output()
        .unwrap()
}

fn train(cwd: &Path, args: &[&str]) -> Output {
    let all: Vec<&str> = TRAIN.iter().chain(args).copied().collect();
    upipe(cwd, &all)
}

/// stdout and stderr of a run that must succeed.
fn ok(out: Output) -> (String, String) {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "upipe failed: {err}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), err)
}

/// stderr of a run that must fail.
fn fails(out: Output) -> String {
    assert!(!out.status.success(), "upipe succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn step_of(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&text).unwrap();
    state["step"].as_u64().unwrap()
}

/// A word-level tokenizer of 3 ids: `hello` 1, `world` 2, anything else 0.
const WORDS: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2},
            "unk_token": "[UNK]"}
}"#;

/// A model directory of a tiny model with a vocabulary of 1,024 ids
/// (config.json only: random weights), and text of 600 words.
fn model_of_1024_ids(t: &Tmp) -> (PathBuf, PathBuf) {
    ok(train(&t.0, &["--steps", "1", "--save-dir", &t.s("base")]));
    let text = std::fs::read_to_string(t.path("base/config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["vocab_size"] = 1024.into();
    let dir = t.path("bpe-model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let data = t.path("words.txt");
    std::fs::write(&data, "hello world ".repeat(300)).unwrap();
    (dir, data)
}

#[test]
fn text_is_tokenized_with_the_models_own_tokenizer_by_default() {
    let t = Tmp::new("tokenizer");
    let (model, data) = model_of_1024_ids(&t);
    let (model, data) = (model.to_string_lossy(), data.to_string_lossy());
    let args = ["--model", &model, "--data", &data, "--steps", "1"];
    // no tokenizer.json beside the model: refused, naming --tokenizer
    let err = fails(train(&t.0, &args));
    assert!(
        err.contains("--tokenizer") && err.contains("1024 ids") && err.contains("words.txt"),
        "{err}"
    );
    std::fs::write(t.path("bpe-model/tokenizer.json"), WORDS).unwrap();
    let (stdout, _) = ok(train(&t.0, &args));
    // 600 words, not 3,600 bytes, and the header names the tokenizer
    assert!(stdout.contains("on 600 tokens"), "{stdout}");
    assert!(
        stdout.contains("bpe-model/tokenizer.json, the model's own"),
        "{stdout}"
    );
    // a byte model keeps bytes, and says so
    let (stdout, _) = ok(train(&t.0, &["--data", &data, "--steps", "1"]));
    assert!(
        stdout.contains("on 3600 tokens (tokenizer: bytes"),
        "{stdout}"
    );
}

#[test]
fn a_checkpoint_is_never_replaced_without_resume_or_overwrite() {
    let t = Tmp::new("replace");
    let d = t.s("run1");
    let (_, log) = ok(train(&t.0, &["--steps", "3", "--save-dir", &d]));
    // every save is logged: step, path, size, seconds
    assert!(
        log.contains("saved the checkpoint of step 3 to") && log.contains("MiB, "),
        "{log}"
    );
    let before = std::fs::read(t.path("run1/model.safetensors")).unwrap();
    let err = fails(train(&t.0, &["--steps", "2", "--save-dir", &d]));
    assert!(
        err.contains("--resume") && err.contains("--overwrite") && err.contains("step 3"),
        "{err}"
    );
    assert_eq!(step_of(&t.path("run1")), 3);
    assert_eq!(
        std::fs::read(t.path("run1/model.safetensors")).unwrap(),
        before
    );
    ok(train(
        &t.0,
        &["--steps", "2", "--save-dir", &d, "--overwrite"],
    ));
    assert_eq!(step_of(&t.path("run1")), 2);
}

/// The `checkpoint-STEP` folders of `dir`, by step.
fn folder_steps(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("checkpoint-")?.parse().ok()
        })
        .collect();
    steps.sort();
    steps
}

#[test]
fn keep_last_keeps_checkpoint_folders_and_resume_finds_the_latest() {
    let t = Tmp::new("keep-last");
    let d = t.s("run");
    let keep = ["--save-every", "1", "--keep-last", "2", "--save-dir", &d];
    let (_, log) = ok(train(&t.0, &[&["--steps", "4"][..], &keep].concat()));
    assert_eq!(folder_steps(&t.path("run")), [3, 4]);
    assert!(log.contains("removed the checkpoint"), "{log}");
    for step in [3, 4] {
        let folder = t.path(&format!("run/checkpoint-{step}"));
        assert_eq!(step_of(&folder), step);
        assert!(folder.join("config.json").is_file());
        assert!(folder.join("model.safetensors").is_file());
    }
    // nothing of the run in the save directory itself
    assert!(!t.path("run/state.json").exists());
    let (_, log) = ok(train(
        &t.0,
        &[&["--steps", "6", "--resume"][..], &keep].concat(),
    ));
    assert!(log.contains("checkpoint-4 at step 4"), "{log}");
    assert_eq!(folder_steps(&t.path("run")), [5, 6]);
    // a run that neither resumes nor overwrites is refused
    let err = fails(train(&t.0, &[&["--steps", "6"][..], &keep].concat()));
    assert!(
        err.contains("checkpoint-6") && err.contains("--resume"),
        "{err}"
    );
}

#[test]
fn keep_best_keeps_the_checkpoint_of_the_lowest_eval_loss() {
    let t = Tmp::new("keep-best");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/corpus.txt"));
    std::fs::write(t.path("eval.txt"), &text.unwrap()[..20000]).unwrap();
    let d = t.s("run");
    let args = [
        "--steps",
        "5",
        "--lr",
        "0.05",
        "--schedule",
        "constant",
        "--json",
        "--eval-data",
        "eval.txt",
        "--eval-every",
        "1",
        "--save-every",
        "1",
        "--keep-best",
        "--save-dir",
        &d,
    ];
    let (stdout, _) = ok(train(&t.0, &args));
    let evals: Vec<(u64, f64)> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v["eval"]["loss"].as_f64()?)))
        .collect();
    assert_eq!(evals.len(), 5, "{stdout}");
    let best = evals.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_ne!(
        best, 5,
        "the test needs a best checkpoint before the last: {evals:?}"
    );
    // the best and the latest; the others removed
    assert_eq!(folder_steps(&t.path("run")), [best, 5]);
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn checkpoint_files_follow_the_umask() {
    let t = Tmp::new("umask");
    let out = Command::new("sh")
        .current_dir(&t.0)
        .arg("-c")
        .arg(format!(
            "umask 027 && exec {} train --device cpu --seq 64 --steps 1 --save-dir run",
            env!("CARGO_BIN_EXE_upipe")
        ))
        .output()
        .unwrap();
    ok(out);
    for file in ["model.safetensors", "optimizer.safetensors", "config.json"] {
        assert_eq!(mode_of(&t.path("run").join(file)), 0o640, "{file}");
    }
}

#[test]
fn an_output_naming_an_input_is_refused_before_it_is_opened() {
    let t = Tmp::new("outputs");
    let corpus = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/corpus.txt"));
    let data = &corpus.unwrap()[..8000];
    std::fs::write(t.path("data.txt"), data).unwrap();
    std::os::unix::fs::symlink(t.path("data.txt"), t.path("link.txt")).unwrap();
    for flag in ["--metrics", "--trace"] {
        let args = ["--data", "data.txt", "--steps", "1", flag, "link.txt"];
        let err = fails(train(&t.0, &args));
        assert!(
            err.contains(flag) && err.contains("same file as --data"),
            "{err}"
        );
        assert_eq!(std::fs::read(t.path("data.txt")).unwrap(), data);
    }
    ok(train(
        &t.0,
        &["--data", "data.txt", "--steps", "1", "--save-dir", "m"],
    ));
    let tokenize = [
        "tokenize",
        "data.txt",
        "--tokenizer",
        "byte",
        "--out",
        "data.txt",
    ];
    let err = fails(upipe(&t.0, &tokenize));
    assert!(
        err.contains("--out data.txt is the same file as the input"),
        "{err}"
    );
    let tokenize = [&tokenize[..5], &["ids.u32", "--eos", "10"]].concat();
    ok(upipe(&t.0, &tokenize));
    let ids = std::fs::read(t.path("ids.u32")).unwrap();
    let eval = [
        "eval",
        "--device",
        "cpu",
        "--model-dir",
        "m",
        "--tokens",
        "ids.u32",
    ];
    let err = fails(upipe(
        &t.0,
        &[&eval[..], &["--metrics", "ids.u32"]].concat(),
    ));
    assert!(
        err.contains("--metrics ids.u32 is the same file as --tokens"),
        "{err}"
    );
    assert_eq!(std::fs::read(t.path("ids.u32")).unwrap(), ids);
    // a model directory stands for the files a load reads from it: a new
    // file beside them is fine, its config is not
    let err = fails(upipe(
        &t.0,
        &[&eval[..], &["--metrics", "m/config.json"]].concat(),
    ));
    assert!(err.contains("the same file as --model-dir"), "{err}");
    std::fs::write(t.path("m.jsonl"), "{}\n").unwrap();
    let err = fails(upipe(&t.0, &["report", "m.jsonl", "--out", "m.jsonl"]));
    assert!(err.contains("--out m.jsonl is the same file"), "{err}");
    assert_eq!(std::fs::read(t.path("m.jsonl")).unwrap(), b"{}\n");
}

#[test]
fn a_resumed_run_appends_to_its_metrics_file() {
    let t = Tmp::new("metrics-resume");
    let args = ["--save-dir", "run", "--metrics", "m.jsonl"];
    ok(train(&t.0, &[&["--steps", "2"][..], &args].concat()));
    ok(train(
        &t.0,
        &[&["--steps", "4", "--resume"][..], &args].concat(),
    ));
    let text = std::fs::read_to_string(t.path("m.jsonl")).unwrap();
    let steps: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);
}

#[test]
fn a_symlinked_work_folder_and_a_non_utf8_save_dir_are_refused() {
    let t = Tmp::new("hostile-save-dir");
    std::fs::create_dir_all(t.path("elsewhere/staging")).unwrap();
    std::fs::create_dir_all(t.path("run")).unwrap();
    std::os::unix::fs::symlink(t.path("elsewhere"), t.path("run/.upipe")).unwrap();
    let err = fails(train(&t.0, &["--steps", "1", "--save-dir", "run"]));
    assert!(err.contains(".upipe is a symbolic link"), "{err}");
    // the other directory is untouched: its staging kept, no lock written
    assert!(t.path("elsewhere/staging").is_dir());
    assert!(!t.path("elsewhere/lock").exists());
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::OsStr::from_bytes(b"run-\xff");
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .current_dir(&t.0)
        .args(TRAIN)
        .args(["--steps", "1", "--save-dir"])
        .arg(name)
        .output()
        .unwrap();
    let err = fails(out);
    assert!(
        err.contains("--save-dir run-") && err.contains("not a UTF-8 path"),
        "{err}"
    );
}
