//! Checkpoints kept as `DIR/checkpoint-STEP/` folders (`--keep-last N`,
//! `--keep-best`), as HF Trainer lays out its `output_dir`. Each folder is
//! a save directory of its own (its files, `.upipe/manifest.json`, staging,
//! journal: [`publish`](super::publish)), so a save into one is as safe as
//! a save into `DIR`; `DIR/.upipe/lock` covers them all. A folder is
//! upipe's when it is named `checkpoint-<digits>` and holds a `.upipe`
//! directory; folders of other tools (HF Trainer's) are never touched.
//!
//! A folder leaves only through `DIR/.upipe/trash/` (one atomic rename,
//! then removed), so a run killed while removing one leaves no half folder
//! behind: the next [`SaveDir::acquire`](super::SaveDir::acquire) empties
//! the trash and removes folders whose first save never finished.

use super::journal::recover;
use super::layout::{
    MANIFEST, PREFIX, STATE_FILE, is_folder, read_listing, remove_dir_if_exists, step_of_name, work,
};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

const TRASH: &str = "trash";

/// Which checkpoints a run keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// `--keep-last N`: the N latest `checkpoint-STEP` folders (`None`:
    /// every one).
    pub keep_last: Option<u32>,
    /// `--keep-best`: also the folder of the lowest held-out loss.
    pub keep_best: bool,
}

impl Retention {
    /// Whether checkpoints go into `checkpoint-STEP` folders (else one
    /// checkpoint in the save directory itself).
    pub fn folders(&self) -> bool {
        self.keep_last.is_some() || self.keep_best
    }
}

/// The folder the checkpoint of `step` goes into.
pub fn folder_of(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step}"))
}

/// upipe's checkpoint folders of `dir`, by step.
pub fn folders(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return Ok(vec![]);
    };
    let mut found = Vec::new();
    for e in read {
        let e = e.map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let (Some(step), true) = (step_of_name(&name), is_folder(dir, &name)) {
            found.push((step, e.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The step of the complete checkpoint in `dir` (`state.json`'s), if any.
pub(super) fn step_in(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join(STATE_FILE)).ok()?;
    let state: serde_json::Value = serde_json::from_str(&text).ok()?;
    state.get("step")?.as_u64()
}

/// The latest complete checkpoint of save directory `dir`: the one of the
/// highest step among `dir` itself and its `checkpoint-STEP` folders.
pub fn latest(dir: &Path) -> Option<PathBuf> {
    let own = step_in(dir).map(|s| (s, dir.to_path_buf()));
    let kept = folders(dir)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(_, p)| {
            let step = step_in(&p)?;
            Some((step, p))
        });
    own.into_iter()
        .chain(kept)
        .max_by_key(|(s, _)| *s)
        .map(|(_, p)| p)
}

/// Finishes or removes what a killed run left in the folders of `dir`: a
/// journaled save rolled forward, a staging removed, a folder whose first
/// save never finished removed, the trash emptied.
pub(super) fn recover_folders(dir: &Path) -> Result<()> {
    remove_dir_if_exists(&work(dir).join(TRASH))?;
    for (_, folder) in folders(dir)? {
        recover(&folder)?;
        if read_listing(&work(&folder).join(MANIFEST))?.is_none() && step_in(&folder).is_none() {
            trash(dir, &folder)?;
        }
    }
    Ok(())
}

/// Removes `folder` of `dir` through the trash (one rename, then removed).
fn trash(dir: &Path, folder: &Path) -> Result<()> {
    let bin = work(dir).join(TRASH);
    std::fs::create_dir_all(&bin)
        .map_err(|e| Error::io(format!("creating {}", bin.display()), e))?;
    let to = bin.join(folder.file_name().unwrap_or_default());
    remove_dir_if_exists(&to)?;
    std::fs::rename(folder, &to).map_err(|e| {
        Error::io(
            format!("moving {} to {}", folder.display(), to.display()),
            e,
        )
    })?;
    remove_dir_if_exists(&to)?;
    // an empty trash goes too (another run's removal may still be in it)
    let _ = std::fs::remove_dir(&bin);
    Ok(())
}

/// The held-out loss a checkpoint's `state.json` records (`eval_loss`).
fn eval_loss(folder: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(folder.join(STATE_FILE)).ok()?;
    let state: serde_json::Value = serde_json::from_str(&text).ok()?;
    state.get("extra")?.get("eval_loss")?.as_f64()
}

/// What a run's saves so far are: `lineage(step)` tells a folder this run
/// wrote or continues from one it does not (an older run's, replaced under
/// `--overwrite`).
pub struct Kept<'a> {
    pub keep: Retention,
    pub lineage: &'a dyn Fn(u64) -> bool,
}

/// After a save: removes the folders of older runs, keeps the `keep_last`
/// latest (all without it) and the best by eval loss, and removes the
/// rest; returns the folders removed.
pub fn retain(dir: &Path, kept: &Kept) -> Result<Vec<PathBuf>> {
    let all = folders(dir)?;
    let (ours, stale): (Vec<_>, Vec<_>) = all.into_iter().partition(|(s, _)| (kept.lineage)(*s));
    let last = kept.keep.keep_last.map_or(usize::MAX, |n| n as usize);
    let best = match kept.keep.keep_best {
        true => (ours.iter())
            .filter_map(|(s, p)| eval_loss(p).map(|l| (*s, l)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(s, _)| s),
        false => None,
    };
    let cut = ours.len().saturating_sub(last);
    let old = ours
        .iter()
        .enumerate()
        .filter(|(i, (s, _))| *i < cut && Some(*s) != best);
    let gone: Vec<PathBuf> = (stale.iter().chain(old.map(|(_, f)| f)))
        .map(|(_, p)| p.clone())
        .collect();
    for folder in &gone {
        trash(dir, folder)?;
    }
    Ok(gone)
}

/// The step of the best checkpoint folder by held-out loss, with its loss.
pub fn best(dir: &Path) -> Result<Option<(u64, f64)>> {
    Ok(folders(dir)?
        .into_iter()
        .filter_map(|(s, p)| eval_loss(&p).map(|l| (s, l)))
        .min_by(|a, b| a.1.total_cmp(&b.1)))
}
