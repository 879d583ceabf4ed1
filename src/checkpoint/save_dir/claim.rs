//! A run's claim on its save directory: who owns what is there, the checks
//! before a run starts, and the lock held while it saves.

use super::folders::{latest, recover_folders, step_in};
use super::journal::recover;
use super::layout::{
    JOURNAL, LOCK, Listing, MANIFEST, STATE_FILE, entries, io, is_checkpoint_file, read_listing,
    work, write_listing,
};
use crate::backend::Bytes;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::Path;

/// Who a save directory belongs to, as found on disk.
#[derive(Debug, Clone, PartialEq)]
enum Owner {
    /// Missing, or empty but for upipe's own work area.
    Empty,
    /// upipe's: the files of its last checkpoint.
    Upipe(Vec<String>),
    /// Files upipe did not list (sorted names).
    Foreign(Vec<String>),
}

fn ownership(dir: &Path) -> Result<Owner> {
    if !dir.exists() {
        return Ok(Owner::Empty);
    }
    if let Some(m) = read_listing(&work(dir).join(MANIFEST))? {
        return Ok(Owner::Upipe(m.files));
    }
    let names = entries(dir)?;
    if names.is_empty() {
        return Ok(Owner::Empty);
    }
    // a checkpoint written before manifests, or copied without `.upipe`
    let complete = names.iter().any(|n| n == STATE_FILE);
    if complete && names.iter().all(|n| is_checkpoint_file(n)) {
        return Ok(Owner::Upipe(names));
    }
    Ok(Owner::Foreign(names))
}

/// The error for a directory holding files upipe did not write.
fn foreign_error(dir: &Path, names: &[String]) -> Error {
    let shown: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
    let more = match names.len() {
        n if n > 4 => format!(" and {} more", n - 4),
        _ => String::new(),
    };
    Error::Config(format!(
        "--save-dir {} holds files upipe did not write ({}{more}); upipe saves into an empty \
         directory or one it saved into before, so nothing of yours is replaced: give a new \
         --save-dir, or add --overwrite to save beside those files (the checkpoint then replaces \
         config.json, model*.safetensors, optimizer*.safetensors, state.json and run.toml there \
         and leaves every other file as it is)",
        dir.display(),
        shown.join(", ")
    ))
}

/// What a run may do with what its save directory holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SaveRules {
    /// `--overwrite`: save beside files upipe did not write, and replace a
    /// checkpoint of an earlier run.
    pub overwrite: bool,
    /// `--resume`: continue the checkpoint there.
    pub resume: bool,
}

/// Checks, before a run allocates anything, that `dir` can take its
/// checkpoints: it is (or can be made) a writable directory, it holds no
/// files upipe did not write unless `overwrite`, no checkpoint unless the
/// run resumes it or `overwrite` replaces it, and its filesystem has
/// room for one more checkpoint of `checkpoint_bytes` beside the last.
/// Creates `dir` and its work area; changes nothing else.
pub fn check(dir: &Path, rules: SaveRules, checkpoint_bytes: u64) -> Result<()> {
    make_work_area(dir, rules)?;
    let probe = work(dir).join(format!("probe-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"") {
        return unusable(dir, format!("cannot write into it ({e})"));
    }
    let _ = std::fs::remove_file(&probe);
    match free_bytes(dir) {
        Some(free) if free < checkpoint_bytes => unusable(
            dir,
            format!(
                "its filesystem has {} free, and a checkpoint of this run takes {} (weights \
                 and AdamW moments in F32) beside the last one until it replaces it (free some \
                 space there)",
                Bytes(free as usize),
                Bytes(checkpoint_bytes as usize)
            ),
        ),
        _ => Ok(()),
    }
}

fn unusable(dir: &Path, why: String) -> Result<()> {
    crate::config_err!(
        "--save-dir {}: {why}; give a directory this run can write",
        dir.display()
    )
}

/// Creates `dir` and its work area, or says why it cannot be; a directory
/// of files upipe did not write is refused, unless `overwrite`, and one
/// holding a checkpoint unless the run resumes or overwrites it, before
/// anything is created in it.
fn make_work_area(dir: &Path, rules: SaveRules) -> Result<()> {
    let overwrite = rules.overwrite;
    if dir.exists() && !dir.is_dir() {
        return unusable(dir, "is not a directory".into());
    }
    if std::fs::symlink_metadata(work(dir)).is_ok_and(|m| m.file_type().is_symlink()) {
        return unusable(
            dir,
            format!(
                "{} is a symbolic link, and upipe's folder must be a directory of its own \
                 (its staging is removed, its lock and manifest written there: through a link \
                 they would land in another directory); remove the link",
                work(dir).display()
            ),
        );
    }
    if work(dir).exists() && !work(dir).is_dir() {
        return unusable(
            dir,
            format!(
                "{} is not upipe's folder (a file of that name is there)",
                work(dir).display()
            ),
        );
    }
    if let (Owner::Foreign(names), false) = (ownership(dir)?, overwrite) {
        return Err(foreign_error(dir, &names));
    }
    refuse_replacing(dir, rules)?;
    match std::fs::create_dir_all(work(dir)) {
        Ok(()) => Ok(()),
        Err(e) => unusable(dir, format!("cannot create it ({e})")),
    }
}

/// Refuses a run that would replace the checkpoint `dir` holds (in itself
/// or in a `checkpoint-STEP` folder) without `--resume` or `--overwrite`;
/// reads only.
pub fn refuse_replacing(dir: &Path, rules: SaveRules) -> Result<()> {
    match (latest(dir), rules.overwrite || rules.resume) {
        (Some(found), false) => Err(replace_error(dir, &found)),
        _ => Ok(()),
    }
}

/// The error for a run that would replace the checkpoint `found` of `dir`.
fn replace_error(dir: &Path, found: &Path) -> Error {
    let step = step_in(found).unwrap_or_default();
    Error::Config(format!(
        "--save-dir {} holds a checkpoint (step {step}, in {}) that this run would replace: add \
         --resume to continue it, or --overwrite to start afresh and replace it at this run's \
         first save (or give another --save-dir)",
        dir.display(),
        found.display()
    ))
}

/// Bytes an unprivileged process can still write on `dir`'s filesystem.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `s` is a valid out-pointer.
    let rc = unsafe { libc::statvfs(path.as_ptr(), s.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `s`.
    let s = unsafe { s.assume_init() };
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

/// A save directory taken by one run for its lifetime: its lock is held
/// until this is dropped (or the process dies).
#[derive(Debug)]
pub struct SaveDir {
    _lock: File,
}

impl SaveDir {
    /// Takes `dir` for a run (rank 0 of a run, once): locks it (a second run
    /// is refused naming the holder), rolls forward a save that a killed run
    /// left half moved in, removes a dead run's staging, and checks who owns
    /// the files there: a checkpoint is refused unless `rules` resume or
    /// overwrite it; files upipe did not write are refused unless
    /// `overwrite`, which adopts the checkpoint-named ones among them
    /// ([`is_checkpoint_file`]) as the previous checkpoint.
    pub fn acquire(dir: &Path, rules: SaveRules) -> Result<SaveDir> {
        let overwrite = rules.overwrite;
        make_work_area(dir, rules)?;
        let lock = lock(dir)?;
        recover(dir)?;
        recover_folders(dir)?;
        // what upipe listed stays its own (carried tokenizer files too); of
        // files it did not list, only checkpoint-named ones are adopted
        let files: Vec<String> = match ownership(dir)? {
            Owner::Foreign(names) if !overwrite => return Err(foreign_error(dir, &names)),
            Owner::Foreign(names) => names
                .into_iter()
                .filter(|n| is_checkpoint_file(n))
                .collect(),
            Owner::Upipe(names) => names,
            Owner::Empty => vec![],
        };
        let manifest = work(dir).join(MANIFEST);
        if read_listing(&manifest)?.map(|l| l.files) != Some(files.clone()) {
            write_listing(
                &manifest,
                &Listing {
                    files,
                    remove: vec![],
                },
            )?;
        }
        Ok(SaveDir { _lock: lock })
    }
}

/// Who holds a save directory's lock.
#[derive(Debug, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    /// Seconds since the Unix epoch.
    started: u64,
}

pub(super) fn lock(dir: &Path) -> Result<File> {
    let path = work(dir).join(LOCK);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    // a lock this process released can stay held for a moment by a child
    // it is starting (the forked child shares the descriptor until its
    // exec closes it): a holder record naming this process is retried
    // for up to a second before it is refused
    let mut tries = 0;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if tries < 20 && held_by_me(&path) => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(std::fs::TryLockError::WouldBlock) => return Err(in_use(dir, &path)),
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(Error::io(format!("locking {}", path.display()), e));
            }
        }
    }
    let me = Holder {
        pid: std::process::id(),
        host: hostname(),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    use std::io::Write;
    let text = serde_json::to_string(&me).expect("a holder always serialises");
    file.set_len(0)
        .and_then(|()| file.write_all(text.as_bytes()))
        .map_err(io(format!("writing {}", path.display())))?;
    Ok(file)
}

/// Whether the lock file's holder record names this process on this host.
fn held_by_me(lock: &Path) -> bool {
    std::fs::read_to_string(lock)
        .ok()
        .and_then(|t| serde_json::from_str::<Holder>(&t).ok())
        .is_some_and(|h| h.pid == std::process::id() && h.host == hostname())
}

/// The error for a save directory another run holds.
fn in_use(dir: &Path, lock: &Path) -> Error {
    let holder = std::fs::read_to_string(lock)
        .ok()
        .and_then(|t| serde_json::from_str::<Holder>(&t).ok());
    let who = match holder {
        Some(h) => {
            let age = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
                .saturating_sub(h.started);
            format!(
                "process {} on host {}, started {age} s ago (at {} s after the Unix epoch)",
                h.pid, h.host, h.started
            )
        }
        None => "another process".to_string(),
    };
    Error::Config(format!(
        "--save-dir {} is in use by another upipe run ({who}): two runs saving into one \
         directory would overwrite each other's checkpoints; wait for that run to end, or give \
         this one another --save-dir",
        dir.display()
    ))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Before `dir` is read as a model directory (`--init-from`, `eval
/// --model-dir`): when a killed run left a save there half moved in,
/// finishes it (under the directory's lock, so never beside a live run),
/// so the files read are all of one step. A directory that is no save
/// directory is left as it is.
pub fn finish_for_reading(dir: &Path) -> Result<()> {
    if !work(dir).join(JOURNAL).is_file() {
        return Ok(());
    }
    let held = lock(dir).map_err(|e| match e {
        Error::Config(why) => Error::Config(format!(
            "{why} (it is in the middle of a save; read {} once that save is done)",
            dir.display()
        )),
        other => other,
    })?;
    recover(dir)?;
    drop(held);
    Ok(())
}
