//! File-system steps every checkpoint writer shares: create, remove,
//! write to a temporary name and rename over.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub(super) fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))
}

pub(crate) fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", path.display()), e))
        }
        _ => Ok(()),
    }
}

/// `path` with `.tmp-<pid>` appended, in the same directory (so rename is atomic).
pub(super) fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

pub(super) fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|e| {
        let _ = std::fs::remove_file(from);
        Error::io(
            format!("renaming {} to {}", from.display(), to.display()),
            e,
        )
    })
}

/// Gives a file written through a temporary file of mode 0600 (as
/// `safetensors` writes them) the mode every other file upipe writes has:
/// 0666 less the process's umask, so a checkpoint is as readable as its
/// `config.json` and as the files of every HF tool.
pub(super) fn follow_umask(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = 0o666 & !umask();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(format!("setting the mode of {}", path.display()), e))
}

/// The process's umask, read from `/proc/self/status` (Linux 4.7 and
/// later; reading it with `umask(2)` would change it for a moment under
/// the other threads), else the usual 022.
fn umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .unwrap_or(0o022)
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`.
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    rename(&tmp, path)
}

/// Whether `f` names a file directly inside the directory (no separators, no `..`).
pub(super) fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains(['/', '\\'])
}
