//! Paths a user gives for reading, checked before they are opened.
//!
//! Opening a FIFO no one writes blocks forever, and reading a character
//! device such as `/dev/zero` never ends: every file upipe reads on a
//! user's word (data, tokenizers, model configs, run files, checkpoints)
//! goes through [`check_file`] (or [`check_dir`] where a directory is
//! expected) first. `std::fs::metadata` follows symlinks and does not
//! open the path, so it cannot block.

use crate::error::{Error, Result};
use std::fs::FileType;
use std::path::Path;

/// What a path must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    File,
    Dir,
    FileOrDir,
}

impl Expect {
    fn accepts(self, t: &FileType) -> bool {
        match self {
            Expect::File => t.is_file(),
            Expect::Dir => t.is_dir(),
            Expect::FileOrDir => t.is_file() || t.is_dir(),
        }
    }

    fn wanted(self) -> &'static str {
        match self {
            Expect::File => "a regular file",
            Expect::Dir => "a directory",
            Expect::FileOrDir => "a regular file or a directory",
        }
    }
}

/// Checks that `path` (`what` names it in the error, e.g. `--data`) is a
/// regular file, after following symlinks.
pub fn check_file(path: &Path, what: &str) -> Result<()> {
    check(path, what, Expect::File)
}

/// Checks that `path` is a directory.
pub fn check_dir(path: &Path, what: &str) -> Result<()> {
    check(path, what, Expect::Dir)
}

/// Checks that `path` is a regular file or a directory.
pub fn check_file_or_dir(path: &Path, what: &str) -> Result<()> {
    check(path, what, Expect::FileOrDir)
}

/// A missing path (or a symlink loop) is an I/O error naming it; anything
/// else than what is expected is a configuration error saying what it is.
fn check(path: &Path, what: &str, expect: Expect) -> Result<()> {
    let meta =
        std::fs::metadata(path).map_err(|e| Error::io(format!("{what} {}", path.display()), e))?;
    let kind = meta.file_type();
    if expect.accepts(&kind) {
        return Ok(());
    }
    let (is, why) = describe(&kind);
    crate::config_err!(
        "{what} {} is {is}, not {}{why}",
        path.display(),
        expect.wanted()
    )
}

/// What a file type is, in words, and why reading it would not do.
fn describe(kind: &FileType) -> (&'static str, &'static str) {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        ("a directory", "")
    } else if kind.is_file() {
        ("a regular file", "")
    } else if kind.is_fifo() {
        (
            "a FIFO (named pipe)",
            " (opening one blocks until something writes to it)",
        )
    } else if kind.is_char_device() {
        ("a character device", " (reading one may never end)")
    } else if kind.is_block_device() {
        ("a block device", "")
    } else if kind.is_socket() {
        ("a socket", "")
    } else {
        ("a special file", "")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_files_are_named_and_refused() {
        let dir = std::env::temp_dir().join(format!("upipe-input-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("a.txt");
        std::fs::write(&file, "x").unwrap();
        check_file(&file, "--data").unwrap();
        check_file_or_dir(&dir, "--tokenizer").unwrap();
        check_dir(&dir, "--init-from").unwrap();
        let e = check_file(Path::new("/dev/zero"), "--data").unwrap_err();
        assert!(
            e.to_string()
                .contains("--data /dev/zero is a character device"),
            "{e}"
        );
        let e = check_file(&dir, "--data").unwrap_err().to_string();
        assert!(e.contains("is a directory, not a regular file"), "{e}");
        let e = check_dir(&file, "--init-from").unwrap_err().to_string();
        assert!(e.contains("is a regular file, not a directory"), "{e}");
        let fifo = dir.join("fifo.u32");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let e = check_file(&fifo, "--data").unwrap_err().to_string();
            assert!(e.contains("FIFO"), "{e}");
        }
        let (a, b) = (dir.join("loop-a"), dir.join("loop-b"));
        std::os::unix::fs::symlink(&a, &b).unwrap();
        std::os::unix::fs::symlink(&b, &a).unwrap();
        let e = check_file(&a, "--data").unwrap_err().to_string();
        assert!(e.contains("loop-a") && e.contains("symbolic links"), "{e}");
        let e = check_file(&dir.join("none"), "--data")
            .unwrap_err()
            .to_string();
        assert!(e.contains("none") && e.contains("No such file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
