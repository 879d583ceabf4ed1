//! The multi-GPU script (`scripts/gpu-multi.sh`) parses, and its dry mode
//! (CPU thread ranks, tiny model) runs one configuration of its `correct`
//! part end to end: the CPU reference, the run, the rehearsal and the
//! resume chain, one log file with parseable result lines. The peer
//! benchmark (`scripts/gpu-peer-bench.sh`) in its dry mode runs upipe's side
//! on the CPU and prints one parseable JSON row per length.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
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
    let out_dir = std::env::temp_dir().join(format!("upipe-gpu-multi-{}", std::process::id()));
    std::fs::remove_dir_all(&out_dir).ok();
    let out = Command::new("bash")
        .arg(root().join("scripts/gpu-multi.sh"))
        .arg("correct")
        .current_dir(root())
        .env("DRY", "1")
        .env("GPUS", "2")
        .env("BUDGET", "120")
        .env("TESTS", "")
        .env("CORRECT", "tiny upipe 2 1")
        .env("OUT", &out_dir)
        .env("UPIPE", env!("CARGO_BIN_EXE_upipe"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "status {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok   tiny-upipe-2x1"), "{stdout}");
    assert!(stdout.contains("ok   resume 2 ranks"), "{stdout}");
    let files: Vec<_> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(files, ["2x-correct.log"], "one file per part");
    let log = std::fs::read_to_string(out_dir.join("2x-correct.log")).unwrap();
    let results: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.starts_with("{\"result\""))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
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
    let out_dir = std::env::temp_dir().join(format!("upipe-peer-bench-{}", std::process::id()));
    std::fs::remove_dir_all(&out_dir).ok();
    let out = Command::new("bash")
        .arg(root().join("scripts/gpu-peer-bench.sh"))
        .current_dir(root())
        .env("DRY", "1")
        .env("SEQS", "128 256")
        .env("LONG", "256")
        .env("STEPS", "3")
        .env("OUT", &out_dir)
        .env("UPIPE", env!("CARGO_BIN_EXE_upipe"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "status {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
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
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with("{\"row\""))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
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
