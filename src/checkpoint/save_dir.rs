//! A checkpoint directory shared with its owner: upipe replaces exactly the
//! files it wrote and never touches the others (a tokenizer copied in,
//! notes, a metrics file).
//!
//! Layout of a save directory `DIR`:
//! - the checkpoint's files (an HF model directory, the optimizer's state,
//!   `state.json`, `run.toml`), each listed in
//! - `.upipe/manifest.json`: what upipe wrote; a save replaces or removes
//!   only these;
//! - `.upipe/lock`: an advisory lock held by the run that saves here for its
//!   whole life (released by the kernel when the process dies), naming it;
//! - `.upipe/staging/`: the next checkpoint while the ranks write it;
//! - `.upipe/commit.json`: the journal of a save being moved into place.
//!
//! A save ([`publish`]): every file written into staging (`state.json` last)
//! is flushed to disk, the journal (new files, old files to remove) is
//! written durably, and then rolled forward: the old `state.json` goes
//! first (so `DIR` is never a complete mix of two steps), the new files are
//! renamed over the old, stale old files are removed, the new `state.json`
//! comes last, then the manifest. A run killed at any point leaves either
//! the old checkpoint (no journal yet) or a journal that the next
//! [`SaveDir::acquire`] rolls forward to the new one.
//!
//! A run keeps its checkpoints in `DIR` itself, or with `--keep-last` /
//! `--keep-best` in `DIR/checkpoint-STEP/` folders, each a save directory
//! of its own (`folders.rs`). A directory holding a checkpoint is never
//! taken by a run that neither resumes it nor was told to replace it
//! ([`SaveRules`]).

mod folders;

pub use folders::{Kept, Retention, best, folder_of, folders, latest, retain};

use super::fs::{is_plain_file_name, remove_if_exists};
use crate::backend::Bytes;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

const WORK: &str = ".upipe";
const MANIFEST: &str = "manifest.json";
const JOURNAL: &str = "commit.json";
const STAGING: &str = "staging";
const LOCK: &str = "lock";
const STATE_FILE: &str = "state.json";

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

fn work(dir: &Path) -> PathBuf {
    dir.join(WORK)
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

/// What `.upipe/manifest.json` and `.upipe/commit.json` hold.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
struct Listing {
    /// The checkpoint's files, by name inside `DIR`.
    files: Vec<String>,
    /// (journal only) the old checkpoint's files that the new one lacks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    remove: Vec<String>,
}

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

/// The names in `dir` other than upipe's work area, sorted.
fn entries(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    let read = std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?;
    for e in read {
        let e = e.map_err(io(format!("reading {}", dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != WORK && !folders::is_folder(dir, &name) {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

fn read_listing(path: &Path) -> Result<Option<Listing>> {
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
fn plain(f: &str) -> bool {
    is_plain_file_name(f) && f != WORK
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
    let step = folders::step_in(found).unwrap_or_default();
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
        folders::recover_folders(dir)?;
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

fn lock(dir: &Path) -> Result<File> {
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

/// Finishes a save a killed run left journaled, and removes a dead run's
/// staging (never published: its files may be of any step, or partial).
fn recover(dir: &Path) -> Result<()> {
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
trait Steps {
    fn next(&mut self) -> Result<()>;
}

struct Unlimited;

impl Steps for Unlimited {
    fn next(&mut self) -> Result<()> {
        Ok(())
    }
}

fn publish_steps(dir: &Path, steps: &mut dyn Steps) -> Result<()> {
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

/// Writes `listing` to `path` durably: a flushed temporary file renamed
/// into place, and the directory flushed.
fn write_listing(path: &Path, listing: &Listing) -> Result<()> {
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
fn sync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("flushing {}", path.display())))
}

/// Flushes a directory's entries (renames, new files) to disk.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("flushing {}", dir.display())))
}

fn remove_dir_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", path.display()), e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
