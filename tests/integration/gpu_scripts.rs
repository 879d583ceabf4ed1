//! The multi-GPU script (`scripts/gpu-multi.sh`) parses, and its dry mode
//! (CPU thread ranks, tiny model) runs one configuration of its `correct`
//! part end to end: the CPU reference, the run, the rehearsal and the
//! resume chain, one log file with parseable result lines. The peer
//! benchmark (`scripts/gpu-peer-bench.sh`) in its dry mode runs upipe's side
//! on the CPU and prints one parseable JSON row per length.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `scripts/<script> <args>` in its dry mode (`DRY=1`, the test's `upipe`,
/// `OUT` a fresh temporary directory) with `env` set, which must succeed:
/// its stdout and its `OUT`.
fn dry_run(script: &str, args: &[&str], env: &[(&str, &str)]) -> (String, PathBuf) {
    let name = script.trim_end_matches(".sh");
    let out_dir = std::env::temp_dir().join(format!("upipe-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&out_dir).ok();
    let out = Command::new("bash")
        .arg(root().join("scripts").join(script))
        .args(args)
        .current_dir(root())
        .env("DRY", "1")
        .envs(env.iter().copied())
        .env("OUT", &out_dir)
        .env("UPIPE", env!("CARGO_BIN_EXE_upipe"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script}: status {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (stdout, out_dir)
}

/// The lines of `text` that start with `prefix`, each parsed as JSON.
fn json_lines(text: &str, prefix: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn gpu_scripts_parse() {
    for script in [
        "gpu-multi.sh",
        "gpu-1x.sh",
        "gpu-2x-bench.sh",
        "gpu-eval-mix.sh",
        "gpu-freeze.sh",
        "gpu-lora-plan.sh",
        "gpu-lora.sh",
        "gpu-peer-bench.sh",
        "gpu-cudnn-plan.sh",
    ] {
        let path = root().join("scripts").join(script);
        let out = Command::new("bash").arg("-n").arg(&path).output().unwrap();
        assert!(
            out.status.success(),
            "bash -n {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn gpu_multi_dry_correct_runs_on_the_cpu() {
    let env = [
        ("GPUS", "2"),
        ("BUDGET", "120"),
        ("TESTS", ""),
        ("CORRECT", "tiny upipe 2 1"),
    ];
    let (stdout, out_dir) = dry_run("gpu-multi.sh", &["correct"], &env);
    assert!(stdout.contains("ok   tiny-upipe-2x1"), "{stdout}");
    assert!(stdout.contains("ok   resume 2 ranks"), "{stdout}");
    let files: Vec<_> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files, ["2x-correct.log"], "one file per part");
    let log = std::fs::read_to_string(out_dir.join("2x-correct.log")).unwrap();
    let results = json_lines(&log, "{\"result\"");
    assert_eq!(
        results.len(),
        2,
        "the run and the resume chain: {results:?}"
    );
    assert!(results.iter().all(|r| r["ok"] == "ok"), "{results:?}");
    std::fs::remove_dir_all(&out_dir).ok();
}

#[test]
fn gpu_peer_bench_dry_runs_upipe_on_the_cpu() {
    let env = [("SEQS", "128 256"), ("LONG", "256"), ("STEPS", "3")];
    let (stdout, out_dir) = dry_run("gpu-peer-bench.sh", &[], &env);
    // below LONG upipe's default, from LONG on `--checkpoint`
    let command = |row: &str| {
        let head = format!("## {row} upipe: ");
        let line = stdout.lines().find(|l| l.starts_with(&head));
        line.unwrap_or_else(|| panic!("no {head}in {stdout}"))
            .to_string()
    };
    assert!(!command("1b-128").contains("--checkpoint"), "{stdout}");
    assert!(
        command("1b-256").contains("--seq 256 --steps 3"),
        "{stdout}"
    );
    assert!(command("1b-256").contains(" --checkpoint "), "{stdout}");
    let rows = json_lines(&stdout, "{\"row\"");
    assert_eq!(rows.len(), 2, "{stdout}");
    for (row, seq) in rows.iter().zip(["1b-128", "1b-256"]) {
        assert_eq!(row["row"], seq, "{row}");
        assert!(row["upipe_tokens_per_s"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["upipe_peak_equals_planned"], true, "{row}");
        assert_eq!(
            row["upipe_peak_bytes"], row["upipe_predicted_peak_bytes"],
            "{row}"
        );
        // the Python peers do not run in the dry mode
        assert!(
            row["liger_tokens_per_s"].is_null() && row["hf_tokens_per_s"].is_null(),
            "{row}"
        );
    }
    std::fs::remove_dir_all(&out_dir).ok();
}

/// The retrieval script (`scripts/gpu-retrieval.sh`) run small on the CPU
/// (`DEVICE=cpu`, the tiny model for the long part): its every command
/// runs, CPU against CPU scores agree exactly, and the long part's table
/// gives each length's peaks, predicted equal to measured.
#[test]
fn the_retrieval_script_runs_small_on_the_cpu() {
    let work = std::env::temp_dir().join(format!("upipe-gpu-retrieval-{}", std::process::id()));
    let out = Command::new("bash")
        .arg(root().join("scripts/gpu-retrieval.sh"))
        .env("DEVICE", "cpu")
        .env("BIG", "tiny")
        .env("BIG_LENGTHS", "1K,2K")
        .env("U", env!("CARGO_BIN_EXE_upipe"))
        .env("WORK", &work)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !stdout.contains("FAILED"),
        "{stdout}"
    );
    let verdict = stdout.lines().find(|l| l.trim_start().starts_with("12 "));
    assert!(verdict.is_some_and(|l| l.ends_with(" ok")), "{stdout}");
    for length in ["1024", "2048"] {
        let row = stdout.lines().find(|l| l.trim_start().starts_with(length));
        let cols: Vec<&str> = row.unwrap_or_default().split_whitespace().collect();
        assert!(cols.len() == 5 && cols[1] == cols[2], "{stdout}");
    }
    std::fs::remove_dir_all(&work).ok();
}
