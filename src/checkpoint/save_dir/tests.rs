use super::claim::*;
use super::journal::*;
use super::layout::*;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A run that resumes what the directory holds.
const KEEP: SaveRules = SaveRules {
    overwrite: false,
    resume: true,
};
/// A run under `--overwrite`.
const OVERWRITE: SaveRules = SaveRules {
    overwrite: true,
    resume: false,
};

/// A fresh directory under the system's temporary folder, removed on drop.
struct Tmp(PathBuf);

impl Tmp {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("upipe-save-dir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tmp(dir)
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a checkpoint of `step` into staging: weights in one file, or in
/// two with an index when `sharded`, and `state.json` last.
fn stage(dir: &Path, step: u32, sharded: bool) {
    let s = staging(dir);
    std::fs::create_dir_all(&s).unwrap();
    if sharded {
        for k in 1..=2 {
            let name = format!("model-0000{k}-of-00002.safetensors");
            std::fs::write(s.join(name), format!("{step}")).unwrap();
        }
        std::fs::write(s.join("model.safetensors.index.json"), format!("{step}")).unwrap();
    } else {
        std::fs::write(s.join("model.safetensors"), format!("{step}")).unwrap();
    }
    std::fs::write(s.join("config.json"), format!("{step}")).unwrap();
    std::fs::write(s.join(STATE_FILE), format!("{step}")).unwrap();
}

/// The step of the complete checkpoint in `dir`, checking that every
/// checkpoint file there is of that step.
fn step_of(dir: &Path) -> String {
    let step = std::fs::read_to_string(dir.join(STATE_FILE)).unwrap();
    for name in entries(dir).unwrap() {
        if is_checkpoint_file(&name) {
            let text = std::fs::read_to_string(dir.join(&name)).unwrap();
            assert_eq!(text, step, "{name} is of another step than state.json");
        }
    }
    step
}

fn save(dir: &Path, step: u32, sharded: bool) {
    stage(dir, step, sharded);
    publish(dir).unwrap();
}

#[test]
fn a_save_keeps_the_owners_files_and_removes_only_its_own_stale_ones() {
    let t = Tmp::new("keep");
    let dir = t.0.join("run");
    drop(SaveDir::acquire(&dir, KEEP).unwrap());
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    save(&dir, 1, true);
    assert_eq!(step_of(&dir), "1");
    save(&dir, 2, false);
    assert_eq!(step_of(&dir), "2");
    // the sharded files of step 1 are gone: a loader cannot prefer a stale index
    assert!(!dir.join("model.safetensors.index.json").exists());
    assert!(!dir.join("model-00001-of-00002.safetensors").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("tokenizer.json")).unwrap(),
        "{}"
    );
    assert!(!staging(&dir).exists() && !work(&dir).join(JOURNAL).exists());
}

#[test]
fn a_directory_of_foreign_files_is_refused_unless_overwrite() {
    let t = Tmp::new("foreign");
    let dir = t.0.join("src");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("main.rs"), "fn main() {}").unwrap();
    std::fs::write(dir.join("model.safetensors"), "theirs").unwrap();
    let e = SaveDir::acquire(&dir, KEEP).unwrap_err().to_string();
    assert!(e.contains("main.rs") && e.contains("--overwrite"), "{e}");
    let e = check(&dir, KEEP, 0).unwrap_err().to_string();
    assert!(e.contains("did not write"), "{e}");
    assert!(
        !work(&dir).exists(),
        "nothing is created in a refused directory"
    );
    check(&dir, OVERWRITE, 0).unwrap();
    // --overwrite adopts the checkpoint-named files and keeps the rest
    let held = SaveDir::acquire(&dir, OVERWRITE).unwrap();
    save(&dir, 3, false);
    drop(held);
    assert_eq!(step_of(&dir), "3");
    assert_eq!(
        std::fs::read_to_string(dir.join("main.rs")).unwrap(),
        "fn main() {}"
    );
    // upipe's own directory needs no --overwrite from then on
    SaveDir::acquire(&dir, KEEP).unwrap();
}

#[test]
fn a_checkpoint_without_a_manifest_is_adopted() {
    let t = Tmp::new("legacy");
    let dir = t.0.join("old");
    std::fs::create_dir_all(&dir).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        STATE_FILE,
    ] {
        std::fs::write(dir.join(f), "1").unwrap();
    }
    drop(SaveDir::acquire(&dir, KEEP).unwrap());
    save(&dir, 2, false);
    assert_eq!(step_of(&dir), "2");
    assert!(
        !dir.join("optimizer.safetensors").exists(),
        "stale and upipe's: removed"
    );
}

#[test]
fn a_second_run_is_refused_naming_the_holder() {
    let t = Tmp::new("lock");
    let dir = t.0.join("run");
    let first = SaveDir::acquire(&dir, KEEP).unwrap();
    let e = SaveDir::acquire(&dir, KEEP).unwrap_err().to_string();
    let pid = std::process::id().to_string();
    assert!(
        e.contains("in use by another upipe run") && e.contains(&pid),
        "{e}"
    );
    drop(first);
    SaveDir::acquire(&dir, KEEP).unwrap();
}

#[test]
fn a_dead_runs_staging_is_removed_never_published() {
    let t = Tmp::new("stale");
    let dir = t.0.join("run");
    drop(SaveDir::acquire(&dir, KEEP).unwrap());
    save(&dir, 1, false);
    // a run died while writing step 2: staging holds a complete-looking mix
    stage(&dir, 2, true);
    drop(SaveDir::acquire(&dir, KEEP).unwrap());
    assert!(!staging(&dir).exists());
    assert_eq!(step_of(&dir), "1");
    assert!(!dir.join("model.safetensors.index.json").exists());
}

/// Stops a save after `left` filesystem changes, as a crash would.
struct CrashAfter(usize);

impl Steps for CrashAfter {
    fn next(&mut self) -> Result<()> {
        match self.0 {
            0 => Err(Error::Checkpoint("crashed".into())),
            _ => {
                self.0 -= 1;
                Ok(())
            }
        }
    }
}

/// A crash after every possible change of a save leaves, once the next run
/// takes the directory, one whole checkpoint (the old or the new one) and
/// the owner's file untouched.
#[test]
fn a_crash_at_any_point_of_a_save_leaves_one_whole_checkpoint() {
    for (from_sharded, to_sharded) in [(true, false), (false, true), (false, false)] {
        let mut saw_old_and_new = (false, false);
        for crash in 0.. {
            let t = Tmp::new("crash");
            let dir = t.0.join("run");
            drop(SaveDir::acquire(&dir, KEEP).unwrap());
            std::fs::write(dir.join("notes.txt"), "mine").unwrap();
            save(&dir, 1, from_sharded);
            stage(&dir, 2, to_sharded);
            let finished = publish_steps(&dir, &mut CrashAfter(crash)).is_ok();
            drop(SaveDir::acquire(&dir, KEEP).unwrap());
            let step = step_of(&dir);
            saw_old_and_new.0 |= step == "1";
            saw_old_and_new.1 |= step == "2";
            assert_eq!(
                std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
                "mine"
            );
            let index = dir.join("model.safetensors.index.json").exists();
            assert_eq!(
                index,
                if step == "1" {
                    from_sharded
                } else {
                    to_sharded
                }
            );
            if finished {
                break;
            }
        }
        assert_eq!(saw_old_and_new, (true, true));
    }
}

#[test]
fn check_refuses_what_cannot_hold_a_checkpoint() {
    let t = Tmp::new("check");
    let file = t.0.join("a-file");
    std::fs::write(&file, "").unwrap();
    let e = check(&file, KEEP, 0).unwrap_err().to_string();
    assert!(e.contains("is not a directory"), "{e}");
    let e = check(&file.join("below"), KEEP, 0).unwrap_err().to_string();
    assert!(e.contains("cannot create it"), "{e}");
    let e = check(&t.0.join("big"), KEEP, u64::MAX)
        .unwrap_err()
        .to_string();
    assert!(e.contains("free, and a checkpoint"), "{e}");
    check(&t.0.join("fine"), KEEP, 1 << 20).unwrap();
    // `.` works: nothing renames the directory itself
    assert!(is_checkpoint_file("model-00001-of-00003.safetensors"));
    assert!(!is_checkpoint_file("tokenizer.json") && !is_checkpoint_file("notes.txt"));
}

#[test]
fn a_reader_finishes_a_killed_save_but_never_one_in_progress() {
    let t = Tmp::new("reader");
    let dir = t.0.join("run");
    drop(SaveDir::acquire(&dir, KEEP).unwrap());
    save(&dir, 1, true);
    stage(&dir, 2, false);
    // killed after the journal and the first change of the roll forward
    assert!(publish_steps(&dir, &mut CrashAfter(2)).is_err());
    assert!(!dir.join(STATE_FILE).exists(), "half moved in");
    let live = lock(&dir).unwrap();
    let e = finish_for_reading(&dir).unwrap_err().to_string();
    assert!(e.contains("in the middle of a save"), "{e}");
    drop(live);
    finish_for_reading(&dir).unwrap();
    assert_eq!(step_of(&dir), "2");
    assert!(!dir.join("model.safetensors.index.json").exists());
    // a plain model directory is read as it is
    finish_for_reading(&t.0).unwrap();
}
