//! `upipe train --profile` and `--trace` through the real binary, on the
//! CPU backend (host-timed ops): the per-class profile in every JSON line,
//! the table, the Chrome trace's tracks, and bad trace paths.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

const CLASSES: [&str; 9] = [
    "gemm",
    "attn_fwd",
    "attn_bwd",
    "recompute",
    "elementwise",
    "loss",
    "optimizer",
    "copy",
    "collective",
];

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_upipe"));
    c.args(["train", "--device", "cpu", "--steps", "2"])
        .args(args);
    c.env_remove("UPIPE_PROFILE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// stdout and stderr of a run that must succeed.
fn ok(args: &[&str]) -> (String, String) {
    let out = run(args, &[]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "upipe train {args:?} failed: {err}");
    (String::from_utf8(out.stdout).unwrap(), err)
}

fn lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-profile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `profile` object of a step line, checked for sanity: every class
/// and idle, finite and non-negative, the classes adding up to no more than
/// the wall time (ops of one rank's thread do not overlap on the CPU).
fn profile_of(line: &Value) -> serde_json::Map<String, Value> {
    let p = line["profile"].as_object().expect("a profile").clone();
    let ms = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("{k} in {p:?}"));
    let wall = ms("wall_ms");
    assert!(wall.is_finite() && wall > 0.0, "{p:?}");
    let mut sum = 0.0;
    for c in CLASSES {
        let t = ms(&format!("{c}_ms"));
        assert!(t.is_finite() && t >= 0.0, "{c}: {p:?}");
        sum += t;
    }
    let idle = ms("idle_ms");
    assert!(idle.is_finite() && idle >= 0.0, "{p:?}");
    assert!(
        sum <= 1.05 * wall + 0.5,
        "classes {sum} ms in a {wall} ms step: {p:?}"
    );
    assert!(
        idle <= 1.05 * wall + 0.5,
        "idle {idle} ms in a {wall} ms step: {p:?}"
    );
    p
}

fn ms(p: &serde_json::Map<String, Value>, class: &str) -> f64 {
    p[&format!("{class}_ms")].as_f64().unwrap()
}

#[test]
fn every_json_line_holds_the_step_by_class_and_the_table_goes_to_stderr() {
    let (out, err) = ok(&["--profile", "--json"]);
    let l = lines(&out);
    assert_eq!(l.len(), 2, "one line per step: {out}");
    for line in &l {
        let p = profile_of(line);
        for c in [
            "gemm",
            "attn_fwd",
            "attn_bwd",
            "optimizer",
            "elementwise",
            "loss",
        ] {
            assert!(ms(&p, c) > 0.0, "{c}: {p:?}");
        }
        assert_eq!(
            ms(&p, "recompute"),
            0.0,
            "no --checkpoint, no recompute: {p:?}"
        );
    }
    assert!(
        err.contains("time of step 2 on rank 0 by op class"),
        "{err}"
    );
    for c in CLASSES.iter().chain(&["idle"]) {
        assert!(
            err.lines().any(|r| r.starts_with(c)),
            "table row {c}: {err}"
        );
    }
}

#[test]
fn checkpointing_shows_recompute_and_the_table_ends_a_plain_run() {
    let (out, _) = ok(&["--profile", "--json", "--checkpoint"]);
    for line in lines(&out) {
        let p = profile_of(&line);
        assert!(ms(&p, "recompute") > 0.0, "{p:?}");
        assert!(ms(&p, "gemm") > 0.0 && ms(&p, "attn_bwd") > 0.0, "{p:?}");
    }
    let (out, _) = ok(&["--profile", "--checkpoint", "--save-attention", "0"]);
    let row = out
        .lines()
        .find(|r| r.starts_with("recompute"))
        .unwrap_or_else(|| panic!("a recompute row: {out}"));
    let recompute: f64 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(recompute > 0.0, "{out}");
}

#[test]
fn the_profile_is_off_unless_asked_and_the_environment_asks_too() {
    let (out, _) = ok(&["--json"]);
    for line in lines(&out) {
        assert!(line.get("profile").is_none(), "{line}");
    }
    let out = run(&["--json"], &[("UPIPE_PROFILE", "1")]);
    assert!(out.status.success());
    for line in lines(&String::from_utf8(out.stdout).unwrap()) {
        profile_of(&line);
    }
}

#[test]
fn the_metrics_file_carries_the_profile() {
    let dir = temp("metrics");
    let m = dir.join("m.jsonl");
    ok(&["--profile", "--metrics", m.to_str().unwrap()]);
    let text = std::fs::read_to_string(&m).unwrap();
    let l = lines(&text);
    assert_eq!(l.len(), 2);
    for line in &l {
        assert!(ms(&profile_of(line), "gemm") > 0.0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `ph: X` events of a trace, checked for the fields Perfetto needs.
fn trace_events(path: &std::path::Path) -> Vec<Value> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let all = v["traceEvents"].as_array().unwrap();
    let tracks: Vec<u64> = all
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    let ops: Vec<Value> = all.iter().filter(|e| e["ph"] == "X").cloned().collect();
    for e in &ops {
        assert!(e["name"].is_string() && e["cat"].is_string(), "{e}");
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(
            ts.is_finite() && ts >= 0.0 && dur.is_finite() && dur >= 0.0,
            "{e}"
        );
        assert!(e["pid"].is_u64(), "{e}");
        assert!(
            tracks.contains(&e["tid"].as_u64().unwrap()),
            "named track: {e}"
        );
        assert!(CLASSES.contains(&e["cat"].as_str().unwrap()), "{e}");
    }
    ops
}

#[test]
fn the_trace_has_the_compute_track_and_offload_copies_on_the_copy_track() {
    let dir = temp("trace");
    let plain = dir.join("plain.json");
    ok(&["--trace", plain.to_str().unwrap()]);
    let ops = trace_events(&plain);
    assert!(ops.iter().any(|e| e["tid"] == 1 && e["cat"] == "gemm"));
    assert!(ops.iter().all(|e| e["tid"] == 1), "no copy stream in use");

    let off = dir.join("sub").join("offload.json");
    ok(&[
        "--trace",
        off.to_str().unwrap(),
        "--checkpoint",
        "--offload",
    ]);
    let ops = trace_events(&off);
    assert!(ops.iter().any(|e| e["tid"] == 1 && e["cat"] == "recompute"));
    let copies: Vec<&Value> = ops.iter().filter(|e| e["tid"] == 2).collect();
    assert!(!copies.is_empty(), "offload copies on the copy track");
    assert!(
        copies
            .iter()
            .all(|e| e["name"] == "copy_start" && e["cat"] == "copy")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_trace_paths_are_errors_naming_the_flag() {
    let dir = temp("bad");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    for bad in [dir.clone(), file.join("trace.json")] {
        let out = run(&["--trace", bad.to_str().unwrap()], &[]);
        assert!(!out.status.success(), "--trace {bad:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("--trace {}", bad.display())), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
