//! Checkpoints of a sharded run.
//!
//! - Weights: an HF directory (`model.safetensors`, or files of at most
//!   [`FILE_BYTES`] with `model.safetensors.index.json`), in the run's
//!   `--save-dtype`, written by the lead rank one tensor at a time as the
//!   units are gathered, so no rank holds more than one unit and one tensor.
//! - Optimizer: one file per rank, `optimizer.rank{r}-of-{W}.safetensors`,
//!   holding that rank's `[shard]` of every unit (`exp_avg.<unit>`; a LoRA
//!   run's adapter units `<unit>.lora`,
//!   `exp_avg_sq.<unit>`, and `master.<unit>`, F32, where the optimizer
//!   keeps masters or the weight files are narrower than the shards).
//! - `state.json` last, with the world size: a directory whose state.json is
//!   present has all its files. Resuming on another world size re-shards by
//!   reading, for each new shard, the ranges of the old files it overlaps
//!   ([`crate::model::flat_layout::pieces`]); a checkpoint written without FSDP
//!   (`optimizer.safetensors`, whole tensors) resumes sharded too.

use crate::checkpoint::ranged::RangedFile;
use crate::error::{Error, Result};
use crate::model::flat_layout::{UnitLayout, pieces};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

pub use super::model_files::{FILE_BYTES, file_groups, weight_file_name, write_index};

const STATE_FILE: &str = "state.json";
const STATE_VERSION: u64 = 1;

/// Whether `dir` holds a checkpoint written under FSDP.
pub fn is_sharded(dir: &Path) -> bool {
    read_state(dir).is_ok_and(|v| v.get("fsdp").is_some())
}

/// The optimizer file of `rank` of `world`.
pub fn optimizer_file(dir: &Path, rank: usize, world: usize) -> PathBuf {
    dir.join(format!("optimizer.rank{rank:05}-of-{world:05}.safetensors"))
}

/// Writes `state.json` (last: it marks the checkpoint complete).
pub fn write_state(dir: &Path, step: u64, world: usize, extra: &Value) -> Result<()> {
    let v = json!({ "version": STATE_VERSION, "step": step, "extra": extra, "fsdp": { "world": world } });
    write(&dir.join(STATE_FILE), &v)
}

fn write(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("a JSON value always serialises");
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| Error::io(tmp.display().to_string(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path.display().to_string(), e))
}

/// Removes `state.json` before files are rewritten (a crash then leaves no
/// state.json beside a half-written checkpoint).
pub fn begin_write(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
    match std::fs::remove_file(dir.join(STATE_FILE)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(dir.display().to_string(), e)),
    }
}

/// Reads `state.json`.
pub fn read_state(dir: &Path) -> Result<Value> {
    let path = dir.join(STATE_FILE);
    crate::input_path::check_file(&path, "checkpoint state")?;
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::io(
            format!(
                "reading {} (is this a complete training checkpoint?)",
                path.display()
            ),
            e,
        )
    })?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Checkpoint(format!("{} is malformed: {e}", path.display())))?;
    match v.get("version").and_then(Value::as_u64) {
        Some(STATE_VERSION) => Ok(v),
        _ => Err(Error::Checkpoint(format!(
            "{} has no version {STATE_VERSION} (written by another upipe?)",
            path.display()
        ))),
    }
}

/// The optimizer state of a checkpoint, read by ranges for any new shard.
pub enum SavedOptimizer {
    /// Written under FSDP on `world` ranks: one file per old rank.
    Sharded {
        files: Vec<RangedFile>,
        world: usize,
    },
    /// Written without FSDP: whole tensors by HF name.
    Whole(RangedFile),
}

impl SavedOptimizer {
    /// Opens the optimizer files of `dir` (headers only).
    pub fn open(dir: &Path) -> Result<Self> {
        let state = read_state(dir)?;
        match state.pointer("/fsdp/world").and_then(Value::as_u64) {
            Some(world) => {
                let world = world as usize;
                let files = (0..world)
                    .map(|r| RangedFile::open(&optimizer_file(dir, r, world)))
                    .collect::<Result<Vec<_>>>()?;
                Ok(SavedOptimizer::Sharded { files, world })
            }
            None => Ok(SavedOptimizer::Whole(RangedFile::open(
                &dir.join("optimizer.safetensors"),
            )?)),
        }
    }

    /// Whether the checkpoint kept F32 master weights of `unit`.
    pub fn has_master(&self, unit: &UnitLayout) -> bool {
        match self {
            SavedOptimizer::Sharded { files, .. } => {
                files[0].contains(&format!("master.{}", unit.key()))
            }
            SavedOptimizer::Whole(f) => unit
                .params
                .first()
                .is_some_and(|p| f.contains(&format!("master.{}", p.name))),
        }
    }

    /// `kind` (`exp_avg`, `exp_avg_sq`, `master`) of rank `rank`'s new shard of `unit`.
    pub fn shard(&self, kind: &str, unit: &UnitLayout, rank: usize) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; unit.shard];
        let own = unit.owned(rank);
        let real = own.start.min(unit.numel)..own.end.min(unit.numel);
        match self {
            SavedOptimizer::Sharded { files, world } => {
                let old_shard = unit.numel.div_ceil(*world);
                let key = format!("{kind}.{}", unit.key());
                for (r, piece) in pieces(&real, old_shard) {
                    let f = files.get(r).ok_or_else(|| {
                        Error::Checkpoint(format!("{key}: old rank {r} has no file"))
                    })?;
                    let local = piece.start - r * old_shard..piece.end - r * old_shard;
                    let v = f.read(&key, local)?;
                    out[piece.start - own.start..piece.end - own.start].copy_from_slice(&v);
                }
            }
            SavedOptimizer::Whole(f) => {
                for s in unit.segments(rank) {
                    let p = &unit.params[s.param];
                    let v = f.read(&format!("{kind}.{}", p.name), s.elems.clone())?;
                    out[s.at..s.at + v.len()].copy_from_slice(&v);
                }
            }
        }
        Ok(out)
    }
}
