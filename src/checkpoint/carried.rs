//! The files of a model directory that are not weights but belong with
//! them (the tokenizer, generation defaults, chat template), carried from
//! the source model (`--init-from`) into every checkpoint, so the
//! checkpoint loads and generates as the source did.

use super::save_dir;
use crate::error::{Error, Result};
use std::path::Path;

/// The files carried from the source model into a checkpoint, where it has them.
pub const CARRIED_FILES: [&str; 5] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Copies into `staged` (the save directory `dir`'s staging) each of
/// [`CARRIED_FILES`] that `from` holds, unless `dir` holds a file of that
/// name that upipe did not write (the owner's own, never replaced: a
/// warning says it is kept). Returns the names copied.
pub fn carry_files(from: &Path, dir: &Path, staged: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in CARRIED_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        if !save_dir::may_write(dir, name)? {
            tracing::warn!(
                "{} is not upipe's, so it is kept as it is (not replaced by {}'s)",
                dir.join(name).display(),
                from.display()
            );
            continue;
        }
        let to = staged.join(name);
        std::fs::copy(&src, &to)
            .map_err(|e| Error::io(format!("copying {} to {}", src.display(), to.display()), e))?;
        copied.push(name.to_string());
    }
    Ok(copied)
}
