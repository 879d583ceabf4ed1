//! Compact optimizer state (`--optim-state`, `--master-weights`) through
//! the real binary on the CPU: each format resumes bit for bit (replicated
//! and FSDP), trains as F32 AdamW does within a small margin, is planned to
//! the byte, is said in the header, metrics and run file, and trains on
//! the host (`--offload-optimizer`) as on the device.

use crate::common;
use std::path::Path;

/// Runs `upipe args` and returns its stdout; it must succeed.
fn ok(args: &[&str]) -> String {
    let (stdout, log, success) = common::upipe(args);
    assert!(success, "upipe {args:?} failed: {log}");
    stdout
}

/// Every JSON step line of `stdout`.
fn steps(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["step"].as_u64().is_some())
        .collect()
}

fn losses(stdout: &str) -> Vec<f64> {
    steps(stdout)
        .iter()
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("upipe-optim-state-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const FORMATS: [[&str; 4]; 4] = [
    ["--optim-state", "bf16", "--master-weights", "f32"],
    ["--optim-state", "8bit", "--master-weights", "f32"],
    ["--optim-state", "8bit", "--master-weights", "none"],
    ["--optim-state", "f32", "--master-weights", "none"],
];

/// The state format of `moments` and `master` with BF16 gradients.
fn with_bf16_grads(
    moments: upipe::optim::MomentFormat,
    master: upipe::optim::MasterWeights,
) -> upipe::optim::StateFormat {
    upipe::optim::StateFormat {
        moments,
        master,
        grads: upipe::optim::GradDtype::Bf16,
    }
}

/// The bytes of every file a checkpoint holds that a resume reads
/// (weights and optimizer state), by name.
fn checkpoint_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    assert!(
        out.len() >= 2,
        "{}: weights and optimizer state",
        dir.display()
    );
    out
}

/// 4 steps straight against 2, a save, and 2 resumed: the same losses and
/// the same checkpoint bytes, for every format, replicated and sharded.
#[test]
fn every_state_format_resumes_bit_exactly() {
    let base = scratch("resume");
    for (f, format) in FORMATS.iter().enumerate() {
        for sharding in ["off", "on"] {
            let what = format!("{format:?} --fsdp {sharding}");
            let run = |dir: &Path, steps: &str, resume: bool| {
                let mut args = vec![
                    "train", "--steps", "4", "--json", "--seq", "64", "--warmup", "0", "--lr",
                    "1e-3", "--min-lr", "1e-3",
                ];
                args.extend_from_slice(format);
                args.extend(["--fsdp", sharding, "--save-dir", dir.to_str().unwrap()]);
                args[2] = steps;
                if resume {
                    args.push("--resume");
                }
                losses(&ok(&args))
            };
            let (a, b) = (
                base.join(format!("{f}-{sharding}-a")),
                base.join(format!("{f}-{sharding}-b")),
            );
            let full = run(&a, "4", false);
            run(&b, "2", false);
            let resumed = run(&b, "4", true);
            assert_eq!(resumed.len(), 2, "{what}: steps 3 and 4 only");
            assert_eq!(
                resumed,
                full[2..].to_vec(),
                "{what}: resumed losses (full {full:?})"
            );
            assert!(
                checkpoint_files(&a) == checkpoint_files(&b),
                "{what}: the checkpoints after step 4 differ"
            );
        }
    }
    std::fs::remove_dir_all(&base).ok();
}

/// 40 steps of the default run with each format end within 2 % of F32
/// AdamW's loss (and compact moments not at the same loss: the format is in
/// effect; the CPU's weights are F32, so no master is no change there), and
/// the plan of each is the measured peak to the byte.
#[test]
fn compact_formats_train_as_f32_adamw_does_and_are_planned_exactly() {
    let run = |format: &[&str]| {
        let mut args = vec!["train", "--steps", "40", "--json", "--seq", "128"];
        args.extend_from_slice(format);
        steps(&ok(&args))
    };
    let reference = run(&[]);
    let last = |s: &[serde_json::Value]| s.last().unwrap()["loss"].as_f64().unwrap();
    let f32_loss = last(&reference);
    let f32_state = reference[0]["peak_by_category"]["optim_state"]
        .as_u64()
        .unwrap();
    for format in FORMATS {
        let got = run(&format);
        let loss = last(&got);
        assert!(
            ((loss - f32_loss) / f32_loss).abs() < 0.02
                && (loss != f32_loss) == (format[1] != "f32"),
            "{format:?}: final loss {loss} against F32's {f32_loss}"
        );
        let line = &got[0];
        assert_eq!(
            line["peak_bytes"], line["predicted_peak_bytes"],
            "{format:?}: measured peak against the plan"
        );
        let state = line["peak_by_category"]["optim_state"].as_u64().unwrap();
        if format[1] != "f32" {
            assert!(
                state < f32_state,
                "{format:?}: {state} bytes of state, F32 {f32_state}"
            );
        }
        let said = line["optim_state"].as_str().unwrap();
        assert_eq!(said, format!("moments {}, master {}", format[1], format[3]));
    }
    assert!(
        reference[0].get("optim_state").is_none(),
        "F32 AdamW says nothing"
    );
}

/// The header and the run file say the format; the run file repeats it.
#[test]
fn the_format_is_said_and_kept_in_the_run_file() {
    let dir = scratch("header");
    let save = dir.join("ckpt");
    let stdout = ok(&[
        "train",
        "--steps",
        "1",
        "--seq",
        "64",
        "--optim-state",
        "8bit",
        "--master-weights",
        "none",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    assert!(
        stdout.contains("training state: moments 8bit, master none"),
        "{stdout}"
    );
    let run_file = std::fs::read_to_string(save.join("run.toml")).unwrap();
    assert!(
        run_file.contains("optim-state = \"8bit\"")
            && run_file.contains("master-weights = \"none\""),
        "{run_file}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `--optim-state auto` on a run that fits trains in F32 throughout, bit
/// for bit as the default does, says what it chose, and its run file
/// names the state chosen rather than `auto`.
#[test]
fn optim_state_auto_keeps_the_exact_state_where_it_fits() {
    let dir = scratch("auto");
    let save = dir.join("ckpt");
    let args = ["train", "--steps", "2", "--seq", "64", "--json"];
    let (plain, _, success) = common::upipe(&args);
    assert!(success);
    let mut with_auto = args.to_vec();
    with_auto.extend([
        "--optim-state",
        "auto",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    let (auto, log, success) = common::upipe(&with_auto);
    assert!(success, "{log}");
    assert!(
        log.contains("--optim-state auto: moments f32, master f32 (the exact state fits)"),
        "{log}"
    );
    let losses = |out: &str| -> Vec<f64> {
        out.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v.get("loss").and_then(|l| l.as_f64()))
            .collect()
    };
    assert_eq!(losses(&plain).len(), 2, "{plain}");
    assert_eq!(losses(&plain), losses(&auto));
    let run_file = std::fs::read_to_string(save.join("run.toml")).unwrap();
    assert!(
        run_file.contains("optim-state = \"f32\"") && !run_file.contains("optim-state = \"auto\""),
        "{run_file}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad values are refused before anything runs, naming the flags and the
/// fix.
#[test]
fn bad_formats_are_refused_naming_the_fix() {
    let (_, log, success) = common::upipe(&["train", "--steps", "1", "--optim-state", "fp8"]);
    assert!(
        !success && log.contains("--optim-state fp8") && log.contains("8bit"),
        "{log}"
    );
    let (_, log, success) = common::upipe(&["train", "--steps", "1", "--master-weights", "bf16"]);
    assert!(
        !success && log.contains("--master-weights bf16") && log.contains("none"),
        "{log}"
    );
}

/// Each format kept on the host (`--offload-optimizer all`, updated by the
/// host's threads or paged through the device, and the last two units'
/// state there, stopped after 2 steps and resumed) trains as on the
/// device: the same losses and checkpoint bytes after 4 steps, the device
/// holding no optimizer state with `all` on the host's threads (paged, two
/// units' state at most, while they are updated), and the device and host
/// peaks planned to the byte.
#[test]
fn compact_state_on_the_host_trains_as_on_the_device() {
    let base = scratch("host");
    for (f, format) in FORMATS.iter().enumerate() {
        let run = |dir: &Path, host: &str, update: &str, count: &str, resume: bool| {
            let mut args = vec![
                "train",
                "--steps",
                count,
                "--json",
                "--seq",
                "64",
                "--warmup",
                "0",
                "--lr",
                "1e-3",
                "--min-lr",
                "1e-3",
                "--offload-optimizer",
                host,
                "--host-update",
                update,
            ];
            args.extend_from_slice(format);
            args.extend(["--save-dir", dir.to_str().unwrap()]);
            if resume {
                args.push("--resume");
            }
            steps(&ok(&args))
        };
        let dirs = ["device", "cpu", "gpu", "two"].map(|d| base.join(format!("{f}-{d}")));
        let device = run(&dirs[0], "0", "auto", "4", false);
        let all = run(&dirs[1], "all", "cpu", "4", false);
        let paged = run(&dirs[2], "all", "gpu", "4", false);
        run(&dirs[3], "2", "gpu", "2", false);
        let resumed = run(&dirs[3], "2", "cpu", "4", true);
        let loss = |s: &[serde_json::Value]| -> Vec<f64> {
            s.iter().map(|v| v["loss"].as_f64().unwrap()).collect()
        };
        assert_eq!(loss(&all), loss(&device), "{format:?}: host state, losses");
        assert_eq!(loss(&paged), loss(&device), "{format:?}: paged, losses");
        assert_eq!(loss(&resumed), loss(&device)[2..], "{format:?}: resumed");
        for dir in &dirs[1..] {
            assert!(
                checkpoint_files(dir) == checkpoint_files(&dirs[0]),
                "{format:?}: {} against the device's checkpoint",
                dir.display()
            );
        }
        for what in ["peak_by_category", "predicted_by_category"] {
            assert_eq!(
                all.last().unwrap()[what]["optim_state"],
                0,
                "{format:?}: {what}"
            );
        }
        for last in [all.last().unwrap(), paged.last().unwrap()] {
            let state = |what: &str| &last[what]["optim_state"];
            assert_eq!(state("peak_by_category"), state("predicted_by_category"));
            assert_eq!(
                last["peak_bytes"], last["predicted_peak_bytes"],
                "{format:?}"
            );
            let host = &last["peak_by_category"]["offload_host"];
            assert_eq!(
                host, &last["predicted_by_category"]["offload_host"],
                "{format:?}: host memory against the plan"
            );
            assert!(host.as_u64().unwrap() > 0);
        }
    }
    std::fs::remove_dir_all(&base).ok();
}

/// A resume into another format converts the saved (decoded F32) moments
/// into this run's format, says so, and trains on.
#[test]
fn a_resume_into_another_format_converts_and_says_so() {
    let dir = scratch("convert");
    let save = dir.join("ckpt");
    let save = save.to_str().unwrap();
    let common = ["train", "--seq", "64", "--json", "--save-dir", save];
    ok(&[&common[..], &["--steps", "2", "--optim-state", "bf16"]].concat());
    let args = [
        &common[..],
        &["--steps", "4", "--optim-state", "8bit", "--resume"],
    ]
    .concat();
    let (stdout, log, success) = common::upipe(&args);
    assert!(success, "{log}");
    assert!(
        log.contains(
            "kept its optimizer state as moments bf16, master f32, this run as moments 8bit"
        ),
        "{log}"
    );
    let resumed = losses(&stdout);
    assert_eq!(resumed.len(), 2, "steps 3 and 4");
    assert!(resumed.iter().all(|l| l.is_finite()), "{resumed:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Every state format kept on the host (all units, or the last two),
/// updated by the host's threads or paged through the device, updates
/// BF16 parameters and moments exactly as on the device, bit for bit:
/// masters or stochastic rounding, BF16 or 8-bit moments.
#[test]
fn host_state_of_every_format_updates_as_the_devices_does() {
    use upipe::backend::cpu::CpuBackend;
    use upipe::model::HostUpdate;
    use upipe::optim::{MasterWeights, MomentFormat};
    let three_steps = |format, host_units, update| {
        crate::common::three_adamw_steps(&CpuBackend::new(), format, host_units, update).0
    };
    for moments in [MomentFormat::F32, MomentFormat::Bf16, MomentFormat::Q8] {
        for master in [MasterWeights::F32, MasterWeights::None] {
            let format = with_bf16_grads(moments, master);
            let device = three_steps(format, 0, HostUpdate::Cpu);
            for host_units in [3, 2] {
                for update in [HostUpdate::Cpu, HostUpdate::Gpu] {
                    let host = three_steps(format, host_units, update);
                    assert!(
                        host == device,
                        "{format}: --offload-optimizer {host_units} --host-update {update} \
                         against the device"
                    );
                }
            }
            let start = three_steps(format, 0, HostUpdate::Gpu);
            assert_eq!(start, device, "{format}: deterministic");
        }
    }
}

/// Paging holds two units' state on the device at most (the unit updated,
/// or its state on the way back, and the next on its way in): here the
/// embedding's slot and block 0's two; the host's threads hold none there.
#[test]
fn paging_holds_two_units_state_at_most() {
    use crate::common::{ADAMW_SLOT, three_adamw_steps};
    use upipe::backend::cpu::CpuBackend;
    use upipe::model::HostUpdate;
    use upipe::optim::{MasterWeights, MomentFormat};
    for (moments, master) in [
        (MomentFormat::Q8, MasterWeights::None),
        (MomentFormat::Bf16, MasterWeights::F32),
        (MomentFormat::F32, MasterWeights::F32),
    ] {
        let format = with_bf16_grads(moments, master);
        // every slot has 4 blocks of 8-bit codes (its pieces' blocks)
        let scales = if moments == MomentFormat::Q8 {
            2 * 4 * 4
        } else {
            0
        };
        let masters = if master == MasterWeights::F32 { 4 } else { 0 };
        let slot = ADAMW_SLOT * (2 * moments.dtype().size() + masters) + scales;
        let run = |update| three_adamw_steps(&CpuBackend::new(), format, 3, update).1;
        assert_eq!(run(HostUpdate::Gpu), 3 * slot, "{format}: paged");
        assert_eq!(run(HostUpdate::Cpu), 0, "{format}: on the host's threads");
    }
}

/// Paged updates settled unit by unit, as the next forward settles them
/// (each call staging the next unit's state for the call after it), give
/// the state settled at once, bit for bit, holding two units' state at
/// most; so do the host's threads'.
#[test]
fn paged_updates_settled_unit_by_unit_equal_those_settled_at_once() {
    use crate::common::{adamw_steps, three_adamw_steps};
    use upipe::backend::cpu::CpuBackend;
    use upipe::model::HostUpdate;
    use upipe::optim::{MasterWeights, MomentFormat};
    for (moments, master) in [
        (MomentFormat::Q8, MasterWeights::None),
        (MomentFormat::F32, MasterWeights::F32),
    ] {
        let format = with_bf16_grads(moments, master);
        for update in [HostUpdate::Gpu, HostUpdate::Cpu] {
            for host_units in [2, 3] {
                let at_once = three_adamw_steps(&CpuBackend::new(), format, host_units, update);
                let cpu = CpuBackend::new();
                let by_unit = adamw_steps(&cpu, format, (host_units, update), true);
                let what = format!("{format}, {update:?}, {host_units} units");
                assert!(by_unit.0 == at_once.0, "{what}: state");
                assert!(
                    by_unit.1 <= at_once.1,
                    "{what}: held {} > {}",
                    by_unit.1,
                    at_once.1
                );
            }
        }
    }
}

/// A bad `--host-update` is refused before anything runs, naming the
/// values it takes; the run file keeps the decided one.
#[test]
fn host_update_is_checked_and_kept_in_the_run_file() {
    let (_, log, success) = common::upipe(&["train", "--steps", "1", "--host-update", "fast"]);
    assert!(
        !success
            && log.contains("--host-update fast")
            && log.contains("gpu")
            && log.contains("cpu"),
        "{log}"
    );
    let dir = scratch("host-update");
    let save = dir.join("run");
    ok(&[
        "train",
        "--steps",
        "1",
        "--seq",
        "64",
        "--optim-state",
        "8bit",
        "--offload-optimizer",
        "all",
        "--host-update",
        "gpu",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    let run = std::fs::read_to_string(save.join("run.toml")).unwrap();
    assert!(run.contains("host-update = \"gpu\""), "{run}");
    std::fs::remove_dir_all(&dir).ok();
}
