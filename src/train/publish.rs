//! Checkpoints replaced whole: every rank writes step N's files into
//! `<save-dir>.partial`; once all are written (the checkpoint's own
//! `state.json` last), rank 0 moves the old `<save-dir>` aside to
//! `<save-dir>.previous`, renames the new one into place and removes the
//! old. A rank that dies at any point leaves a loadable checkpoint: the old
//! one in place, or, between the two renames, in `.previous`, which
//! [`recover`] puts back before a `--resume`.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

const STATE_FILE: &str = "state.json";

/// `<dir>` with `suffix` appended to its last component.
fn beside(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Where a checkpoint of `dir` is written before it replaces `dir`.
pub fn partial(dir: &Path) -> PathBuf {
    beside(dir, ".partial")
}

/// Where the replaced checkpoint of `dir` waits until the new one is in place.
pub fn previous(dir: &Path) -> PathBuf {
    beside(dir, ".previous")
}

fn complete(dir: &Path) -> bool {
    dir.join(STATE_FILE).is_file()
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

/// Puts the complete checkpoint written into [`partial`] in place of `dir`.
pub fn publish(dir: &Path) -> Result<()> {
    let (new, old) = (partial(dir), previous(dir));
    if !complete(&new) {
        return Err(Error::Checkpoint(format!(
            "{}: no {STATE_FILE}, so the checkpoint written there is incomplete",
            new.display()
        )));
    }
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io(format!("removing {}", old.display())))?;
    }
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(io(format!("moving {} aside", dir.display())))?;
    }
    std::fs::rename(&new, dir).map_err(io(format!("renaming {} into place", new.display())))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(io(format!("removing {}", old.display())))?;
    }
    Ok(())
}

/// Before resuming from `dir`: when a run died between [`publish`]'s two
/// renames, puts the previous checkpoint back. Several processes may call
/// it at once; only one rename wins and the others find `dir` complete.
pub fn recover(dir: &Path) -> Result<()> {
    let old = previous(dir);
    if complete(dir) || !complete(&old) {
        return Ok(());
    }
    if dir.exists() && !complete(dir) {
        // an incomplete directory in place: a crash before anything was renamed there
        let _ = std::fs::remove_dir_all(dir);
    }
    match std::fs::rename(&old, dir) {
        Ok(()) => Ok(()),
        Err(_) if complete(dir) => Ok(()),
        Err(e) => Err(Error::io(format!("restoring {}", old.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(dir: &Path, step: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("weights"), step).unwrap();
        std::fs::write(dir.join(STATE_FILE), step).unwrap();
    }

    fn step_of(dir: &Path) -> String {
        std::fs::read_to_string(dir.join(STATE_FILE)).unwrap()
    }

    #[test]
    fn a_crash_at_any_point_leaves_a_checkpoint() {
        let root = std::env::temp_dir().join(format!("upipe-publish-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("ckpt");
        // first checkpoint
        checkpoint(&partial(&dir), "1");
        publish(&dir).unwrap();
        assert_eq!(step_of(&dir), "1");
        // a crash while writing step 2: the old one stays in place
        std::fs::create_dir_all(partial(&dir)).unwrap();
        std::fs::write(partial(&dir).join("weights"), "2").unwrap();
        assert!(
            publish(&dir).is_err(),
            "an incomplete checkpoint is not published"
        );
        recover(&dir).unwrap();
        assert_eq!(step_of(&dir), "1");
        // a crash between the renames: recover puts step 1 back
        checkpoint(&partial(&dir), "2");
        std::fs::rename(&dir, previous(&dir)).unwrap();
        recover(&dir).unwrap();
        assert_eq!(step_of(&dir), "1");
        // and a full publish replaces it
        publish(&dir).unwrap();
        assert_eq!(step_of(&dir), "2");
        assert!(!previous(&dir).exists() && !partial(&dir).exists());
        let _ = std::fs::remove_dir_all(&root);
    }
}
