//! `train --tensorboard DIR`: every step's metrics as TensorBoard scalars,
//! written by rank 0 into one event file of `DIR`
//! (`events.out.tfevents.<unix seconds>.<host>.<pid>`).
//!
//! An event file is a sequence of records, each `u64` length (little
//! endian), masked CRC32C of those 8 bytes, the data, masked CRC32C of the
//! data; each record's data is one `tensorflow.Event` protobuf. The first
//! event carries `file_version: "brain.Event:2"`, every later one a step's
//! `Summary { value { tag, simple_value } }`. The three messages use six
//! fields, encoded here by hand (a varint, a fixed64 and fixed32, and
//! length-delimited bytes): a protobuf crate would need generated code or
//! derive macros for as many lines as the encoding itself.

use crate::cli::metrics::{StepMetrics, unix_now};
use crate::error::{Error, Result};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The first record of every event file.
pub const FILE_VERSION: &str = "brain.Event:2";

const GIB: f64 = (1u64 << 30) as f64;

/// An event file being written: one record per call, flushed, so a run
/// that stops leaves every finished step behind. Write errors are kept and
/// returned by [`EventWriter::finish`].
pub struct EventWriter {
    path: PathBuf,
    out: Mutex<(std::fs::File, Option<std::io::Error>)>,
}

impl EventWriter {
    /// Creates `dir` (and its parents) and a new event file in it, dated
    /// `unix_time` (seconds), holding the file-version event.
    pub fn create(dir: &Path, unix_time: f64) -> Result<Self> {
        let what = |p: &Path| format!("--tensorboard {}: creating {}", dir.display(), p.display());
        if dir.is_file() {
            return crate::config_err!(
                "--tensorboard {}: is a file; give a directory (TensorBoard reads every \
                 event file in it), e.g. --tensorboard runs/tb",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(what(dir), e))?;
        let name = format!(
            "events.out.tfevents.{}.{}.{}",
            unix_time as u64,
            host_name(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(|e| Error::io(what(&path), e))?;
        let w = EventWriter {
            path,
            out: Mutex::new((file, None)),
        };
        w.append(&event(unix_time, 0, Body::FileVersion(FILE_VERSION)));
        Ok(w)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the scalars of metrics line `m` ([`scalars`]) as the event of
    /// its step, at `m`'s time (`time_unix_s`, or now).
    pub fn write(&self, m: &StepMetrics) {
        let wall_time = m.time_unix_s.unwrap_or_else(unix_now);
        let values = scalars(m);
        self.append(&event(wall_time, m.step.into(), Body::Scalars(&values)));
    }

    fn append(&self, event: &[u8]) {
        let mut out = self.out.lock().expect("event file poisoned");
        if out.1.is_none()
            && let Err(e) = out.0.write_all(&record(event))
        {
            out.1 = Some(e);
        }
    }

    /// The first write error, if any.
    pub fn finish(self) -> Result<()> {
        let (_, err) = self.out.into_inner().expect("event file poisoned");
        match err {
            Some(e) => Err(Error::io(format!("writing {}", self.path.display()), e)),
            None => Ok(()),
        }
    }
}

/// This machine's name (`/proc/sys/kernel/hostname`), or `localhost`.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| {
            h.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
                .collect::<String>()
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The scalars of a metrics line, tagged by its keys: each number (`loss`,
/// `lr`, `grad_norm`, `tokens`, `tokens_per_s`, `tflops`, ...) under its
/// key, each object of numbers as `key/name` (`profile/gemm_ms`). Bytes are
/// given in GiB, `_bytes` in a key becoming `_gib` (`peak_gib`) and a
/// `_by_category` object `key_gib/category` (`peak_by_category_gib/weights`).
/// A mixture of corpora gives each corpus's realised share as
/// `mixture_share/FILE`. Left out: `step` and `ranks` (the event's step, the run's constant), the
/// line's times (the event's own), and values the line writes as `null`
/// (absent, or not finite).
pub fn scalars(m: &StepMetrics) -> Vec<(String, f32)> {
    const SKIP: [&str; 4] = ["step", "ranks", "time_unix_s", "elapsed_s"];
    let Ok(Value::Object(line)) = serde_json::to_value(m) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, value) in line.iter().filter(|(k, _)| !SKIP.contains(&k.as_str())) {
        match value {
            Value::Number(n) => {
                let v = n.as_f64().unwrap_or(f64::NAN);
                match key.strip_suffix("_bytes") {
                    Some(stem) => out.push((format!("{stem}_gib"), (v / GIB) as f32)),
                    None => out.push((key.clone(), v as f32)),
                }
            }
            Value::Object(parts) => {
                let bytes = key.ends_with("_by_category");
                let group = if bytes {
                    format!("{key}_gib")
                } else {
                    key.clone()
                };
                for (name, v) in parts {
                    if let Some(v) = v.as_f64() {
                        let v = if bytes { v / GIB } else { v };
                        out.push((format!("{group}/{name}"), v as f32));
                    }
                }
            }
            // a mixture's realised share of each corpus, by its file name
            Value::Array(corpora) if key == "mixture" => {
                for c in corpora {
                    if let (Some(data), Some(share)) = (c["data"].as_str(), c["share"].as_f64()) {
                        let name = std::path::Path::new(data)
                            .file_name()
                            .map_or(data.into(), |f| f.to_string_lossy());
                        out.push((format!("mixture_share/{name}"), share as f32));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// What an event holds besides its time and step.
enum Body<'a> {
    FileVersion(&'a str),
    Scalars(&'a [(String, f32)]),
}

/// A `tensorflow.Event` protobuf: `wall_time` (1, double), `step` (2,
/// int64), then `file_version` (3, string) or `summary` (5, `Summary`).
fn event(wall_time: f64, step: i64, body: Body) -> Vec<u8> {
    let mut e = Vec::new();
    e.push((1 << 3) | 1); // fixed64
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(2 << 3); // varint
    varint(&mut e, step as u64);
    match body {
        Body::FileVersion(v) => bytes_field(&mut e, 3, v.as_bytes()),
        Body::Scalars(values) => {
            // Summary { repeated Value value = 1 }
            let mut summary = Vec::new();
            for (tag, v) in values {
                // Value { string tag = 1; float simple_value = 2 }
                let mut value = Vec::new();
                bytes_field(&mut value, 1, tag.as_bytes());
                value.push((2 << 3) | 5); // fixed32
                value.extend_from_slice(&v.to_le_bytes());
                bytes_field(&mut summary, 1, &value);
            }
            bytes_field(&mut e, 5, &summary);
        }
    }
    e
}

/// A length-delimited field: its key, the length as a varint, the bytes.
fn bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push((field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A base-128 varint, least significant group first.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// One record of an event file around `data`.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc(data).to_le_bytes());
    r
}

/// TensorFlow's masked CRC32C: rotated right by 15 bits, plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mixtures_shares_are_scalars_by_file_name() {
        let line: StepMetrics = serde_json::from_value(serde_json::json!({
            "step": 3, "loss": 2.0, "tokens": 64, "tokens_per_s": 10.0, "tflops": 0.0,
            "tflops_per_rank": 0.0, "ranks": 1, "peak_bytes": 0, "peak_by_category": {},
            "mixture": [
                {"data": "/d/a.u32", "weight": 0.75, "windows": 3, "share": 0.75},
                {"data": "b.u32", "weight": 0.25, "windows": 1, "share": 0.25}
            ]
        }))
        .unwrap();
        let got = scalars(&line);
        assert!(
            got.contains(&("mixture_share/a.u32".into(), 0.75)),
            "{got:?}"
        );
        assert!(
            got.contains(&("mixture_share/b.u32".into(), 0.25)),
            "{got:?}"
        );
    }

    #[test]
    fn varints_take_seven_bits_a_byte() {
        let enc = |v| {
            let mut out = Vec::new();
            varint(&mut out, v);
            out
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(127), [127]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
    }

    #[test]
    fn the_masked_crc_of_the_crc32c_check_string() {
        // CRC32C("123456789") = 0xe3069283 (RFC 3720)
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let want = 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc(b"123456789"), want);
    }

    #[test]
    fn the_file_version_event_encodes_its_three_fields() {
        let e = event(1.5, 0, Body::FileVersion("brain.Event:2"));
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0x00, 0x1a, 13]);
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(e, want);
    }
}
