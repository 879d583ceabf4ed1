//! A save directory through the real binary: upipe replaces only what it
//! wrote, one run at a time, checks the whole save path before the first
//! step, survives a kill at any moment, and never saves over a good
//! checkpoint once a run diverges.

use crate::common::Tmp;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A small, fast run: 64 tokens, no warm-up.
const RUN: &[&str] = &[
    "train", "--device", "cpu", "--seq", "64", "--json", "--warmup", "0",
];

fn run(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .current_dir(cwd)
        .args(RUN)
        .args(args)
        .output()
        .unwrap()
}

fn ok(cwd: &Path, args: &[&str]) -> String {
    let out = run(cwd, args);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe {args:?} failed: {log}");
    String::from_utf8(out.stdout).unwrap()
}

fn fails(cwd: &Path, args: &[&str]) -> (String, String) {
    let out = run(cwd, args);
    assert!(!out.status.success(), "upipe {args:?} succeeded");
    let stdout = String::from_utf8(out.stdout).unwrap();
    (stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| v["loss"].as_f64().unwrap_or(f64::NAN))
        .collect()
}

fn step_of(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("state.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["step"]
        .as_u64()
        .unwrap()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn files_the_user_keeps_in_the_save_dir_survive_saves_and_resumes() {
    let t = Tmp::new("keep");
    let dir = t.path("run");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "my notes").unwrap();
    std::fs::write(dir.join("main.rs"), "fn main() {}").unwrap();
    let d = dir.to_str().unwrap();
    // a directory of someone else's files is refused before the first step
    let (stdout, err) = fails(&t.0, &["--steps", "2", "--save-dir", d]);
    assert!(stdout.is_empty(), "no step ran: {stdout}");
    assert!(
        err.contains("did not write") && err.contains("--overwrite"),
        "{err}"
    );
    assert!(!dir.join("state.json").exists());
    ok(&t.0, &["--steps", "2", "--save-dir", d, "--overwrite"]);
    // the README's flow: a tokenizer copied in after the first save
    std::fs::write(dir.join("tokenizer.json"), "{\"mine\": true}").unwrap();
    ok(
        &t.0,
        &[
            "--steps",
            "4",
            "--save-every",
            "1",
            "--save-dir",
            d,
            "--resume",
        ],
    );
    ok(&t.0, &["--steps", "5", "--save-dir", d, "--resume"]);
    assert_eq!(step_of(&dir), 5);
    assert_eq!(read(&dir.join("notes.txt")), b"my notes");
    assert_eq!(read(&dir.join("main.rs")), b"fn main() {}");
    assert_eq!(read(&dir.join("tokenizer.json")), b"{\"mine\": true}");
    // a metrics file inside the save dir is the user's too
    let metrics = dir.join("metrics.jsonl");
    let m = metrics.to_str().unwrap();
    ok(
        &t.0,
        &["--steps", "6", "--save-dir", d, "--resume", "--metrics", m],
    );
    assert_eq!(
        read(&metrics)
            .split(|&c| c == b'\n')
            .filter(|l| !l.is_empty())
            .count(),
        1
    );
}

#[test]
fn a_dead_runs_staged_files_are_never_published() {
    let t = Tmp::new("stale");
    let dir = t.path("run");
    let d = dir.to_str().unwrap();
    ok(&t.0, &["--steps", "2", "--save-dir", d]);
    let good = read(&dir.join("model.safetensors"));
    // a run died while writing a sharded checkpoint: an index, a shard, a temp file
    let staged = dir.join(".upipe/staging");
    std::fs::create_dir_all(&staged).unwrap();
    let index =
        r#"{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#;
    std::fs::write(staged.join("model.safetensors.index.json"), index).unwrap();
    std::fs::write(staged.join("model-00001-of-00002.safetensors"), "stale").unwrap();
    std::fs::write(staged.join("model.safetensors.tmp-1"), "partial").unwrap();
    // so did an older build's `<dir>.partial` beside it
    std::fs::create_dir_all(t.path("run.partial")).unwrap();
    std::fs::write(t.path("run.partial/state.json"), "{}").unwrap();
    ok(&t.0, &["--steps", "3", "--save-dir", d, "--resume"]);
    assert_eq!(step_of(&dir), 3);
    assert!(!dir.join("model.safetensors.index.json").exists());
    assert!(!dir.join("model-00001-of-00002.safetensors").exists());
    assert!(!staged.exists());
    assert_ne!(
        read(&dir.join("model.safetensors")),
        good,
        "step 3's weights"
    );
}

#[test]
fn a_second_run_on_the_same_save_dir_is_refused_at_start() {
    let t = Tmp::new("lock");
    let dir = t.path("run");
    let d = dir.to_str().unwrap();
    let mut first = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .current_dir(&t.0)
        .args(RUN)
        .args(["--steps", "100000", "--save-dir", d])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // the first run holds the lock once it has trained a step
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    assert!(lines.next().is_some(), "the first run trains");
    let (stdout, err) = fails(&t.0, &["--steps", "2", "--save-dir", d]);
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(stdout.is_empty(), "no step ran: {stdout}");
    let pid = first.id().to_string();
    assert!(
        err.contains("in use by another upipe run") && err.contains(&pid),
        "{err}"
    );
    // the kernel released the dead run's lock
    ok(&t.0, &["--steps", "1", "--save-dir", d]);
}

#[test]
fn the_whole_save_path_is_checked_before_the_first_step() {
    let t = Tmp::new("path");
    std::fs::write(t.path("a-file"), "").unwrap();
    for (dir, why) in [
        ("a-file", "is not a directory"),
        ("a-file/below", "cannot create it"),
        ("/proc/upipe-cannot-be-here", "cannot create it"),
    ] {
        let (stdout, err) = fails(&t.0, &["--steps", "2", "--save-dir", dir]);
        assert!(stdout.is_empty(), "{dir}: no step ran: {stdout}");
        assert!(err.contains(why), "{dir}: {err}");
    }
    // `.` holds a checkpoint like any directory, with nothing left beside it
    let cwd = t.path("here");
    std::fs::create_dir_all(&cwd).unwrap();
    ok(&cwd, &["--steps", "2", "--save-dir", "."]);
    assert_eq!(step_of(&cwd), 2);
    let beside: Vec<_> = std::fs::read_dir(&t.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(beside.len(), 2, "only a-file and here/: {beside:?}");
}

#[test]
fn a_diverging_run_stops_without_saving_over_the_good_checkpoint() {
    let t = Tmp::new("diverge");
    let dir = t.path("run");
    let d = dir.to_str().unwrap();
    ok(&t.0, &["--steps", "3", "--save-dir", d]);
    let good = read(&dir.join("model.safetensors"));
    let tokens = t.path("heldout.u32");
    let ids: Vec<u8> = b"held-out text, byte by byte, for the evaluation of the model"
        .iter()
        .flat_map(|&c| u32::from(c).to_le_bytes())
        .collect();
    std::fs::write(&tokens, ids).unwrap();
    let eval = |dir: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
            .args([
                "eval",
                "--json",
                "--model-dir",
                dir,
                "--seq",
                "32",
                "--device",
                "cpu",
            ])
            .args(["--tokens", tokens.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let before = eval(d);
    let diverge = ["--steps", "12", "--save-dir", d, "--resume", "--lr", "1e30"];
    let (stdout, err) = fails(&t.0, &diverge);
    assert!(losses(&stdout).len() < 9, "stopped early: {stdout}");
    assert!(
        err.contains("training diverged") && err.contains("of step 3"),
        "{err}"
    );
    assert!(err.contains("--skip-nonfinite"), "{err}");
    assert_eq!(step_of(&dir), 3);
    assert_eq!(read(&dir.join("model.safetensors")), good);
    assert_eq!(eval(d), before);
    // skipping steps is counted, and a step not applied leaves the model as it was
    let out = ok(
        &t.0,
        &["--steps", "3", "--lr", "1e30", "--skip-nonfinite", "100"],
    );
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let skipped = lines.last().unwrap()["skipped_steps"].as_u64().unwrap();
    assert!(skipped >= 1, "{out}");
}

/// Kills a run at several moments of its saves (`kill -9`) and resumes it:
/// the resumed run ends bit-identical to one that was never interrupted.
#[test]
fn a_run_killed_at_any_moment_resumes_bit_exactly() {
    let t = Tmp::new("kill");
    let whole = t.path("whole");
    let args = |dir: &Path| {
        let d = dir.to_str().unwrap().to_string();
        vec![
            "--steps".into(),
            "8".into(),
            "--save-every".into(),
            "1".into(),
            "--save-dir".into(),
            d,
        ]
    };
    let want = losses(&ok(&t.0, &strs(&args(&whole))));
    let want_model = read(&whole.join("model.safetensors"));
    for (k, delay_us) in [(1, 0), (2, 700), (3, 1500), (4, 3000), (6, 6000)] {
        let dir = t.path(&format!("killed-{k}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_upipe"))
            .current_dir(&t.0)
            .args(RUN)
            .args(args(&dir))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        for _ in 0..k {
            lines.next();
        }
        std::thread::sleep(Duration::from_micros(delay_us));
        child.kill().unwrap();
        child.wait().unwrap();
        let start = Instant::now();
        let mut resume = args(&dir);
        resume.push("--resume".into());
        let got = losses(&ok(&t.0, &strs(&resume)));
        assert!(start.elapsed() < Duration::from_secs(60));
        let resumed_at = want.len() - got.len();
        assert_eq!(
            got,
            want[resumed_at..],
            "killed after step {k} (+{delay_us} us)"
        );
        assert_eq!(
            read(&dir.join("model.safetensors")),
            want_model,
            "killed after step {k}"
        );
    }
}
