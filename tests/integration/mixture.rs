//! `train --data a.u32:0.7,b.u32:0.3`: a weighted mixture of corpora
//! through the real binary: realised proportions in the metrics, a resumed
//! run continuing the mixture exactly, bad specs refused naming the flag.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn upipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn json_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = upipe(args);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe {args:?} failed: {log}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn error(args: &[&str]) -> String {
    let out = upipe(args);
    assert!(!out.status.success(), "upipe {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Byte ids of `text` repeated to `n` ids, as a `.u32` file in `dir`.
fn corpus(dir: &Path, name: &str, text: &str, n: usize) -> PathBuf {
    let path = dir.join(name);
    let bytes: Vec<u8> = text
        .bytes()
        .cycle()
        .take(n)
        .flat_map(|b| u32::from(b).to_le_bytes())
        .collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("upipe-mixture-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_mixture_trains_logs_its_proportions_and_resumes_exactly() {
    let dir = temp_dir("resume");
    let a = corpus(
        &dir,
        "a.u32",
        "Alice was beginning to get very tired. ",
        3000,
    );
    let b = corpus(&dir, "b.u32", "0123456789+-*/=()[]{}<>", 2000);
    let spec = format!("{}:0.75,{}:0.25", a.display(), b.display());
    let run = |steps: &str, save: &Path, resume: bool| {
        let mut args = vec![
            "train",
            "--device",
            "cpu",
            "--seq",
            "32",
            "--grad-accum",
            "2",
            "--json",
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-3",
            "--warmup",
            "0",
            "--data",
            &spec,
            "--steps",
            steps,
            "--save-dir",
        ];
        args.push(save.to_str().unwrap());
        if resume {
            args.push("--resume");
        }
        json_lines(&args)
    };
    let full = run("4", &dir.join("full"), false);
    assert_eq!(full.len(), 4);
    // 8 windows of rank 0's replica: 6 from a, 2 from b
    let last = &full[3]["mixture"];
    assert_eq!(last[0]["windows"], 6, "{last}");
    assert_eq!(last[1]["windows"], 2, "{last}");
    assert!((last[0]["share"].as_f64().unwrap() - 0.75).abs() < 1e-12);
    assert!((last[1]["weight"].as_f64().unwrap() - 0.25).abs() < 1e-12);
    run("2", &dir.join("half"), false);
    let resumed = run("4", &dir.join("half"), true);
    assert_eq!(resumed.len(), 2, "steps 3 and 4");
    for (r, f) in resumed.iter().zip(&full[2..]) {
        assert_eq!(r["loss"], f["loss"], "resumed {r} vs uninterrupted {f}");
        assert_eq!(r["mixture"], f["mixture"]);
    }
    // a checkpoint of this mixture does not resume under other weights
    let other = format!("{}:0.5,{}:0.5", a.display(), b.display());
    let half = dir.join("half");
    let e = error(&[
        "train",
        "--device",
        "cpu",
        "--seq",
        "32",
        "--grad-accum",
        "2",
        "--data",
        &other,
        "--steps",
        "6",
        "--save-dir",
        half.to_str().unwrap(),
        "--resume",
    ]);
    assert!(e.contains("weights") && e.contains("--data"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_mixtures_name_the_flag_and_the_fix() {
    let dir = temp_dir("bad");
    let a = corpus(&dir, "a.u32", "some text to train on. ", 500);
    let a = a.to_str().unwrap();
    let train = |spec: &str| {
        error(&[
            "train", "--device", "cpu", "--steps", "1", "--seq", "32", "--data", spec,
        ])
    };
    let e = train(&format!("{a}:0.5,{a}:-0.5"));
    assert!(e.contains("--data") && e.contains("non-negative"), "{e}");
    let e = train(&format!("{a}:0,{a}:0"));
    assert!(
        e.contains("--data") && e.contains("weight 0") && e.contains("above 0"),
        "{e}"
    );
    let e = train(&format!("{a}:0.5,{}/missing.u32:0.5", dir.display()));
    assert!(
        e.contains("--data") && e.contains("missing.u32") && e.contains("does not exist"),
        "{e}"
    );
    let e = train(&format!("{a}:0.5,{a}:half"));
    assert!(
        e.contains("--data") && e.contains("'half'") && e.contains("not a number"),
        "{e}"
    );
    let e = train(&format!("{a}:0.5,{a}"));
    assert!(e.contains("--data") && e.contains("has no weight"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
