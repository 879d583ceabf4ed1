//! What a training run leaves to watch it by, through the real binary:
//! `--tensorboard` event files read back by a reader of its own here (the
//! record format parsed, both CRC32Cs checked by a bitwise CRC, the
//! protobuf decoded field by field), every scalar at every step equal to
//! the `--metrics` line; the lines' times; and plain text (no escape codes)
//! on a pipe and under `NO_COLOR`.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const STEPS: u64 = 6;
const GIB: f64 = (1u64 << 30) as f64;

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-obs-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `upipe train` on the CPU for [`STEPS`] steps with `args`, stdout and
/// stderr piped.
fn train(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_upipe"));
    c.args(["train", "--device", "cpu", "--steps", &STEPS.to_string()])
        .args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe train {args:?} failed: {log}");
    out
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn masked(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of an event file, each CRC checked.
fn records(bytes: &[u8]) -> Vec<&[u8]> {
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap());
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let len_bytes = &bytes[i..i + 8];
        assert_eq!(u32_at(i + 8), masked(crc32c(len_bytes)), "length CRC");
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let data = &bytes[i + 12..i + 12 + len];
        assert_eq!(u32_at(i + 12 + len), masked(crc32c(data)), "data CRC");
        out.push(data);
        i += 16 + len;
    }
    assert_eq!(i, bytes.len(), "the file ends with a whole record");
    out
}

/// One protobuf field's value by wire type.
#[derive(Debug, Clone)]
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn read_varint(b: &[u8], i: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let byte = b[*i];
        *i += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// A message's fields in order, as (number, value).
fn fields(b: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let key = read_varint(b, &mut i);
        let value = match key & 7 {
            0 => Field::Varint(read_varint(b, &mut i)),
            1 => {
                i += 8;
                Field::Fixed64(b[i - 8..i].try_into().unwrap())
            }
            2 => {
                let n = read_varint(b, &mut i) as usize;
                i += n;
                Field::Bytes(&b[i - n..i])
            }
            5 => {
                i += 4;
                Field::Fixed32(b[i - 4..i].try_into().unwrap())
            }
            t => panic!("wire type {t}"),
        };
        out.push((key >> 3, value));
    }
    out
}

/// One decoded `Event`.
#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: u64,
    file_version: Option<String>,
    scalars: BTreeMap<String, f32>,
}

fn event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(data) {
        match (n, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v,
            (3, Field::Bytes(s)) => e.file_version = Some(String::from_utf8(s.to_vec()).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (n, f) in fields(summary) {
                    let (1, Field::Bytes(value)) = (n, f) else {
                        panic!("Summary field {n}")
                    };
                    let (mut tag, mut v) = (None, None);
                    for (n, f) in fields(value) {
                        match (n, f) {
                            (1, Field::Bytes(t)) => {
                                tag = Some(String::from_utf8(t.to_vec()).unwrap())
                            }
                            (2, Field::Fixed32(b)) => v = Some(f32::from_le_bytes(b)),
                            other => panic!("Summary.Value field {other:?}"),
                        }
                    }
                    e.scalars.insert(tag.unwrap(), v.unwrap());
                }
            }
            other => panic!("Event field {other:?}"),
        }
    }
    e
}

fn metrics_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// What the metrics line `m` says the scalar `tag` is.
fn expected(m: &Value, tag: &str) -> Option<f64> {
    if let Some((group, name)) = tag.split_once('/') {
        return match group.strip_suffix("_gib") {
            Some(key) => m[key][name].as_f64().map(|b| b / GIB),
            None => m[group][name].as_f64(),
        };
    }
    match tag.strip_suffix("_gib") {
        Some(stem) => m[format!("{stem}_bytes")].as_f64().map(|b| b / GIB),
        None => m[tag].as_f64(),
    }
}

#[test]
fn tensorboard_events_hold_every_scalar_of_every_step() {
    let dir = scratch("tb");
    let (m, tb) = (dir.join("m.jsonl"), dir.join("tb"));
    let (ms, tbs) = (m.to_str().unwrap(), tb.to_str().unwrap());
    train(&["--profile", "--metrics", ms, "--tensorboard", tbs], &[]);
    let files: Vec<_> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let events: Vec<Event> = records(&bytes).into_iter().map(event).collect();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].scalars.is_empty());
    let steps = &events[1..];
    let lines = metrics_lines(&m);
    assert_eq!(steps.len() as u64, STEPS);
    let tags: Vec<&String> = steps[0].scalars.keys().collect();
    for want in [
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_s",
        "tflops",
        "tflops_per_rank",
        "peak_gib",
        "predicted_peak_gib",
        "peak_by_category_gib/weights",
        "peak_by_category_gib/activations",
        "peak_by_category_gib/offload_host",
        "predicted_by_category_gib/optim_state",
        "profile/gemm_ms",
        "profile/wall_ms",
    ] {
        assert!(
            tags.iter().any(|t| *t == want),
            "no scalar {want} in {tags:?}"
        );
    }
    for (i, (e, line)) in steps.iter().zip(&lines).enumerate() {
        assert_eq!(e.step, i as u64 + 1);
        // serde_json reads a float back to within an ulp or two
        let when = line["time_unix_s"].as_f64().unwrap();
        assert!(
            (e.wall_time - when).abs() < 1e-6,
            "{} against {when}",
            e.wall_time
        );
        assert_eq!(
            e.scalars.keys().collect::<Vec<_>>(),
            tags,
            "step {}",
            e.step
        );
        for (tag, &v) in &e.scalars {
            let want = expected(line, tag).unwrap_or_else(|| panic!("{tag} not in {line}"));
            assert_eq!(v, want as f32, "step {} {tag}", e.step);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn metrics_lines_carry_monotone_times() {
    let dir = scratch("times");
    let m = dir.join("m.jsonl");
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    train(&["--metrics", m.to_str().unwrap()], &[]);
    let lines = metrics_lines(&m);
    assert_eq!(lines.len() as u64, STEPS);
    let time = |l: &Value| l["time_unix_s"].as_f64().unwrap();
    let elapsed = |l: &Value| l["elapsed_s"].as_f64().unwrap();
    assert!(time(&lines[0]) >= before - 1.0, "unix seconds of this run");
    assert!(elapsed(&lines[0]) >= 0.0);
    for w in lines.windows(2) {
        assert!(time(&w[1]) >= time(&w[0]), "{} then {}", w[0], w[1]);
        assert!(elapsed(&w[1]) >= elapsed(&w[0]));
        // both clocks advance together: the wall time is start + elapsed
        let drift = (time(&w[1]) - time(&w[0])) - (elapsed(&w[1]) - elapsed(&w[0]));
        assert!(drift.abs() < 1e-3, "{drift}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn has_escape(bytes: &[u8]) -> bool {
    bytes.contains(&0x1b)
}

#[test]
fn progress_on_a_pipe_is_plain_text_with_elapsed_and_eta() {
    for env in [&[][..], &[("NO_COLOR", "1")][..]] {
        let out = train(&[], env);
        let (stdout, stderr) = (&out.stdout, &out.stderr);
        assert!(
            !has_escape(stdout),
            "{env:?}: {}",
            String::from_utf8_lossy(stdout)
        );
        assert!(
            !has_escape(stderr),
            "{env:?}: {}",
            String::from_utf8_lossy(stderr)
        );
        let text = String::from_utf8_lossy(stdout);
        let last = text
            .lines()
            .find(|l| l.starts_with(&format!("step {STEPS}/{STEPS}")))
            .unwrap_or_else(|| panic!("no line of the last step in {text}"));
        assert!(
            last.contains("ETA 0s") && last.contains("elapsed "),
            "{last}"
        );
        assert!(
            String::from_utf8_lossy(stderr).contains("INFO"),
            "the log is there"
        );
    }
}

/// On a terminal (`script` gives the run one) the log is coloured, and
/// under `NO_COLOR` it is not: no SGR sequence (`ESC [ ... m`) at all.
#[test]
fn no_color_turns_colours_off_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to give the run a terminal");
        return;
    }
    let sgr = |bytes: &[u8]| {
        let s = String::from_utf8_lossy(bytes);
        s.split('\x1b').skip(1).any(|rest| {
            let rest = rest.strip_prefix('[').unwrap_or("");
            let end = rest.find(|c: char| !(c.is_ascii_digit() || c == ';'));
            end.is_some_and(|e| rest[e..].starts_with('m'))
        })
    };
    let cmd = format!(
        "{} train --device cpu --steps 2",
        env!("CARGO_BIN_EXE_upipe")
    );
    let on_tty = |no_color: bool| {
        let mut c = Command::new("script");
        c.args(["-qefc", &cmd, "/dev/null"]).env("TERM", "xterm");
        if no_color {
            c.env("NO_COLOR", "1");
        } else {
            c.env_remove("NO_COLOR");
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    assert!(sgr(&on_tty(false)), "a terminal gets a coloured log");
    assert!(!sgr(&on_tty(true)), "NO_COLOR: no colour");
}

#[test]
fn a_tensorboard_path_that_is_a_file_is_refused_naming_the_flag() {
    let dir = scratch("tbfile");
    let file = dir.join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(["train", "--device", "cpu", "--steps", "1", "--tensorboard"])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--tensorboard") && err.contains("give a directory"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"x",
        "the file is left as it was"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
