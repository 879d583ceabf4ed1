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

mod claim;
mod folders;
mod journal;
mod layout;

pub use claim::{SaveDir, SaveRules, check, finish_for_reading, refuse_replacing};
pub use folders::{Kept, Retention, best, folder_of, folders, latest, retain};
pub use journal::{publish, retire_own, staged_bytes};
pub use layout::{is_checkpoint_file, may_write, staging};

#[cfg(test)]
mod tests;
