//! A save moved into place through its journal (`.upipe/commit.json`):
//! published, rolled forward after a crash, or its files retired.

use super::layout::{
    JOURNAL, Listing, MANIFEST, STATE_FILE, entries, io, read_listing, remove_dir_if_exists,
    staging, sync_dir, sync_file, work, write_listing,
};
use crate::checkpoint::fs::remove_if_exists;
use crate::error::{Error, Result};
use std::path::Path;

/// Finishes a save a killed run left journaled, and removes a dead run's
/// staging (never published: its files may be of any step, or partial).
pub(super) fn recover(dir: &Path) -> Result<()> {
    if let Some(journal) = read_listing(&work(dir).join(JOURNAL))? {
        roll_forward(dir, &journal, &mut Unlimited)?;
    }
    remove_dir_if_exists(&staging(dir))
}

/// The bytes of the files written into `dir`'s [`staging`] (what a save
/// logs).
pub fn staged_bytes(dir: &Path) -> u64 {
    let Ok(read) = std::fs::read_dir(staging(dir)) else {
        return 0;
    };
    read.flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Moves the complete checkpoint written into [`staging`] into `dir`
/// (rank 0, after every rank wrote its files): flushed, journaled, rolled
/// forward. The files of the previous checkpoint that the new one lacks are
/// removed; no other file of `dir` is touched.
pub fn publish(dir: &Path) -> Result<()> {
    publish_steps(dir, &mut Unlimited)
}

/// Removes the checkpoint in `dir` itself (its `state.json` first, then
/// the files its manifest lists; the owner's files stay): what a fresh run
/// that keeps `checkpoint-STEP` folders does under `--overwrite` once its
/// own first checkpoint is published.
pub fn retire_own(dir: &Path) -> Result<()> {
    let manifest = work(dir).join(MANIFEST);
    let Some(listing) = read_listing(&manifest)? else {
        return Ok(());
    };
    if listing.files.is_empty() {
        return Ok(());
    }
    remove_if_exists(&dir.join(STATE_FILE))?;
    for f in &listing.files {
        remove_if_exists(&dir.join(f))?;
    }
    write_listing(&manifest, &Listing::default())
}

/// Counts a save's filesystem changes: tests stop a save after any one of
/// them, as a crash would.
pub(super) trait Steps {
    fn next(&mut self) -> Result<()>;
}

struct Unlimited;

impl Steps for Unlimited {
    fn next(&mut self) -> Result<()> {
        Ok(())
    }
}

pub(super) fn publish_steps(dir: &Path, steps: &mut dyn Steps) -> Result<()> {
    let staged = staging(dir);
    if !staged.join(STATE_FILE).is_file() {
        return Err(Error::Checkpoint(format!(
            "{}: no {STATE_FILE}, so the checkpoint written there is incomplete",
            staged.display()
        )));
    }
    let files = entries(&staged)?;
    for f in &files {
        sync_file(&staged.join(f))?;
    }
    sync_dir(&staged)?;
    let old = read_listing(&work(dir).join(MANIFEST))?.unwrap_or_default();
    let remove = old
        .files
        .into_iter()
        .filter(|f| !files.contains(f))
        .collect();
    let journal = Listing { files, remove };
    steps.next()?;
    write_listing(&work(dir).join(JOURNAL), &journal)?;
    roll_forward(dir, &journal, steps)
}

/// Carries out `journal`; every change is idempotent, so a roll forward
/// cut short by a crash is finished by running it again.
fn roll_forward(dir: &Path, journal: &Listing, steps: &mut dyn Steps) -> Result<()> {
    let staged = staging(dir);
    // the old checkpoint stops being complete before any of its files change
    if staged.join(STATE_FILE).exists() {
        steps.next()?;
        remove_if_exists(&dir.join(STATE_FILE))?;
    }
    let last = journal.files.iter().filter(|f| *f != STATE_FILE);
    for f in last.chain(std::iter::once(&STATE_FILE.to_string())) {
        if f == STATE_FILE {
            for stale in &journal.remove {
                steps.next()?;
                remove_if_exists(&dir.join(stale))?;
            }
        }
        let from = staged.join(f);
        if from.exists() {
            steps.next()?;
            std::fs::rename(&from, dir.join(f)).map_err(io(format!(
                "moving {} into {}",
                from.display(),
                dir.display()
            )))?;
        }
    }
    sync_dir(dir)?;
    steps.next()?;
    write_listing(
        &work(dir).join(MANIFEST),
        &Listing {
            files: journal.files.clone(),
            remove: vec![],
        },
    )?;
    steps.next()?;
    remove_if_exists(&work(dir).join(JOURNAL))?;
    remove_dir_if_exists(&staged)?;
    sync_dir(&work(dir))
}
