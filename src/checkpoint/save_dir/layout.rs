//! The layout of a save directory: upipe's work area (`.upipe/`) and the
//! names in it, the listings kept there (manifest, journal), the names of
//! checkpoint folders, and the file steps (flush, remove) every part uses.

use crate::checkpoint::fs::is_plain_file_name;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

const WORK: &str = ".upipe";

pub(super) const MANIFEST: &str = "manifest.json";

pub(super) const JOURNAL: &str = "commit.json";

const STAGING: &str = "staging";

pub(super) const LOCK: &str = "lock";

pub(super) const STATE_FILE: &str = "state.json";

/// Whether `name` is a file an upipe checkpoint writes: the HF model files
/// (`config.json`, `model.safetensors`, `model-0000k-of-0000n.safetensors`
/// and their index), the optimizer's files, `state.json` and `run.toml`.
/// Only these are adopted from a directory upipe did not list
/// (`--overwrite`, or a checkpoint copied without its `.upipe`).
pub fn is_checkpoint_file(name: &str) -> bool {
    matches!(
        name,
        "config.json" | "model.safetensors.index.json" | STATE_FILE | "run.toml"
    ) || (name.ends_with(".safetensors")
        && (name.starts_with("model") || name.starts_with("optimizer")))
}

/// Whether a checkpoint may write file `name` of `dir`: there is none, or
/// upipe's manifest lists it (a file of the owner's is never replaced).
pub fn may_write(dir: &Path, name: &str) -> Result<bool> {
    if !dir.join(name).exists() {
        return Ok(true);
    }
    let listed = read_listing(&work(dir).join(MANIFEST))?;
    Ok(listed.is_some_and(|l| l.files.iter().any(|f| f == name)))
}

/// Where the ranks write the next checkpoint of `dir` before [`publish`].
pub fn staging(dir: &Path) -> PathBuf {
    dir.join(WORK).join(STAGING)
}

pub(super) fn work(dir: &Path) -> PathBuf {
    dir.join(WORK)
}

pub(super) fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

/// What `.upipe/manifest.json` and `.upipe/commit.json` hold.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Listing {
    /// The checkpoint's files, by name inside `DIR`.
    pub(super) files: Vec<String>,
    /// (journal only) the old checkpoint's files that the new one lacks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) remove: Vec<String>,
}

/// The names in `dir` other than upipe's work area, sorted.
pub(super) fn entries(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    let read = std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?;
    for e in read {
        let e = e.map_err(io(format!("reading {}", dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != WORK && !is_folder(dir, &name) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

pub(super) fn read_listing(path: &Path) -> Result<Option<Listing>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    let listing: Listing = serde_json::from_str(&text).map_err(|e| {
        Error::Checkpoint(format!(
            "{} is malformed ({e}); it lists upipe's files in that directory: \
             remove the `.upipe` folder and pass --overwrite to start over",
            path.display()
        ))
    })?;
    match listing
        .files
        .iter()
        .chain(&listing.remove)
        .find(|f| !plain(f))
    {
        Some(f) => Err(Error::Checkpoint(format!(
            "{} names '{f}', which is not a file of that directory",
            path.display()
        ))),
        None => Ok(Some(listing)),
    }
}

/// Whether `f` names a file directly inside a directory, other than upipe's work area.
pub(super) fn plain(f: &str) -> bool {
    is_plain_file_name(f) && f != WORK
}

/// Writes `listing` to `path` durably: a flushed temporary file renamed
/// into place, and the directory flushed.
pub(super) fn write_listing(path: &Path, listing: &Listing) -> Result<()> {
    use std::io::Write;
    let text = serde_json::to_string_pretty(listing).expect("a listing always serialises");
    let tmp = path.with_extension("json.tmp");
    let mut f = File::create(&tmp).map_err(io(format!("writing {}", tmp.display())))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("renaming {}", tmp.display())))?;
    sync_dir(path.parent().expect("a listing lives in a directory"))
}

/// Flushes a written file's data to disk.
pub(super) fn sync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("flushing {}", path.display())))
}

/// Flushes a directory's entries (renames, new files) to disk.
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("flushing {}", dir.display())))
}

pub(super) fn remove_dir_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", path.display()), e))
        }
        _ => Ok(()),
    }
}

pub(super) const PREFIX: &str = "checkpoint-";

/// The step of an upipe checkpoint folder's name (`checkpoint-40`: 40).
pub(super) fn step_of_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?;
    let plain = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    plain.then(|| digits.parse().ok()).flatten()
}

/// Whether `name` in `dir` is one of upipe's checkpoint folders.
pub(super) fn is_folder(dir: &Path, name: &str) -> bool {
    let path = dir.join(name);
    let real_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    step_of_name(name).is_some() && real_dir(&path) && real_dir(&path.join(WORK))
}
