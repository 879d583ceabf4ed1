//! Paths a user gives for writing, checked against the paths the same
//! command reads before anything is opened for writing.
//!
//! A `--metrics` file that names the `--data` file would truncate the
//! corpus the run is reading (a memory-mapped one dies of SIGBUS), a
//! `report --out` that names its metrics file would replace it: every
//! command checks each of its outputs against each of its inputs with
//! [`check_outputs`] first. An output file is refused when it is an input
//! file (the same file, through any path, symlink or hard link: the same
//! device and inode) or lies inside an input directory; an output
//! directory when it is an input directory. Paths that do not exist yet
//! are resolved through their deepest existing ancestor, so a symlinked
//! parent cannot hide an input.

use crate::error::{Error, Result};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A path a command reads, with the flag that names it (`--data`).
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
}

/// A path a command writes, with the flag that names it, and whether it is
/// a directory the command writes files into (`--save-dir`) or one file.
#[derive(Debug, Clone, Copy)]
pub struct Output<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
    pub is_dir: bool,
}

impl<'a> Output<'a> {
    /// An output file.
    pub fn file(flag: &'a str, path: &'a Path) -> Self {
        Output {
            flag,
            path,
            is_dir: false,
        }
    }

    /// An output directory.
    pub fn dir(flag: &'a str, path: &'a Path) -> Self {
        Output {
            flag,
            path,
            is_dir: true,
        }
    }
}

/// The files a `--tokenizer` path stands for: itself, or for a directory
/// the files read from it (an output beside them in that directory is
/// fine).
pub fn tokenizer_files(path: &Path) -> Vec<PathBuf> {
    match path.is_dir() {
        true => [
            "tokenizer.json",
            "tokenizer_config.json",
            "config.json",
            "chat_template.jinja",
        ]
        .iter()
        .map(|f| path.join(f))
        .collect(),
        false => vec![path.to_path_buf()],
    }
}

/// The files a model or adapter directory stands for as an input: those in
/// it a load reads (configs and indexes, weights, tokenizer and template
/// files: `.json`, `.safetensors`, `.jinja`, `.model`); a new file beside
/// them, such as `--metrics`, destroys nothing. A file stands for itself.
pub fn directory_files(path: &Path) -> Vec<PathBuf> {
    let read = |p: &Path| {
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
        p.is_file() && ["json", "safetensors", "jinja", "model"].contains(&ext)
    };
    match std::fs::read_dir(path) {
        Ok(entries) if path.is_dir() => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| read(p))
            .collect(),
        _ => vec![path.to_path_buf()],
    }
}

/// The files of the model or adapter directories `dirs` (flag, path when
/// given) as inputs, each beside its flag ([`directory_files`]).
pub fn directory_inputs<'a>(dirs: &[(&'a str, Option<&Path>)]) -> Vec<(&'a str, PathBuf)> {
    (dirs.iter())
        .filter_map(|&(flag, p)| p.map(|p| (flag, p)))
        .flat_map(|(flag, p)| directory_files(p).into_iter().map(move |f| (flag, f)))
        .collect()
}

/// Refuses any output that would write over an input (see the module
/// docs); an input that does not exist is left to the command's own
/// checks. Opens nothing and creates nothing.
pub fn check_outputs(outputs: &[Output], inputs: &[Input]) -> Result<()> {
    for out in outputs {
        let resolved = resolve(out.path);
        let out_id = file_id(out.path);
        for input in inputs {
            let Ok(meta) = std::fs::metadata(input.path) else {
                continue;
            };
            let same = out_id == Some((meta.dev(), meta.ino()));
            let inside = meta.is_dir()
                && !out.is_dir
                && std::fs::canonicalize(input.path).is_ok_and(|d| resolved.starts_with(d));
            if same || inside {
                return Err(clash(out, input, same));
            }
        }
    }
    Ok(())
}

fn clash(out: &Output, input: &Input, same: bool) -> Error {
    let (o, i) = (out.path.display(), input.path.display());
    let what = match same {
        true => format!("is the same {} as {} {i}", kind(out), input.flag),
        false => format!(
            "lies inside {} {i}, a directory this command reads",
            input.flag
        ),
    };
    Error::Config(format!(
        "{} {o} {what}: writing it would destroy what this command reads; give {} a path \
         outside the inputs",
        out.flag, out.flag
    ))
}

fn kind(out: &Output) -> &'static str {
    match out.is_dir {
        true => "directory",
        false => "file",
    }
}

/// The device and inode of `path` (symlinks followed), when it exists.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// `path` made absolute with symlinks resolved, through its deepest
/// existing ancestor (the part that does not exist yet kept as given).
fn resolve(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut at = path;
    loop {
        let base = match at.as_os_str().is_empty() {
            true => Path::new("."),
            false => at,
        };
        if let Ok(real) = std::fs::canonicalize(base) {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (at.parent(), at.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last.as_os_str().to_os_string());
                at = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_over_an_input_is_refused() {
        let dir = std::env::temp_dir().join(format!("upipe-output-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("model")).unwrap();
        let data = dir.join("data.txt");
        std::fs::write(&data, "x").unwrap();
        let link = dir.join("link.txt");
        std::os::unix::fs::symlink(&data, &link).unwrap();
        let inputs = [
            Input {
                flag: "--data",
                path: &data,
            },
            Input {
                flag: "--init-from",
                path: &dir.join("model"),
            },
        ];
        let e = check_outputs(&[Output::file("--metrics", &link)], &inputs).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("--metrics") && e.contains("same file as --data"),
            "{e}"
        );
        let inside = dir.join("model/sub/../m.jsonl");
        let e = check_outputs(&[Output::file("--trace", &inside)], &inputs).unwrap_err();
        assert!(e.to_string().contains("inside --init-from"), "{e}");
        let e = check_outputs(&[Output::dir("--save-dir", &dir.join("model"))], &inputs);
        assert!(e.unwrap_err().to_string().contains("same directory"));
        // a new file beside the inputs, and a directory below one, are fine
        check_outputs(&[Output::file("--metrics", &dir.join("m.jsonl"))], &inputs).unwrap();
        check_outputs(&[Output::dir("--save-dir", &dir.join("model/ft"))], &inputs).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
