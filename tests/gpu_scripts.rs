//! The multi-GPU script (`scripts/gpu-multi.sh`) parses, and its dry mode
//! (CPU thread ranks, tiny model) runs one configuration of its `correct`
//! part end to end: the CPU reference, the run, the rehearsal and the
//! resume chain, one log file with parseable result lines.

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
