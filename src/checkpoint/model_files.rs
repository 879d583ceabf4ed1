//! The weight files of an HF model directory as a checkpoint writes them:
//! in the [`SaveDtype`] asked for, in `model.safetensors` or, past
//! [`ModelFiles::max_file_bytes`], in `model-0000k-of-0000n.safetensors`
//! files with `model.safetensors.index.json` (Hugging Face's convention:
//! `save_pretrained`'s `max_shard_size`, 5 GB by default).

use super::fs::write_atomic;
use super::hf::{INDEX_FILE, SINGLE_FILE};
use super::save_dtype::SaveDtype;
use super::stream::{TensorSource, write_safetensors};
use super::tensor_file::HostTensor;
use crate::error::Result;
use serde_json::json;
use std::ops::Range;
use std::path::Path;

/// The largest weight file written by default (HF's default shard size, 5 GB).
pub const FILE_BYTES: usize = 5_000_000_000;

/// A file size as `--max-shard-size` and `save_pretrained`'s
/// `max_shard_size` spell it: bytes (`5000000000`), or a number with a unit,
/// decimal (`KB`, `MB`, `GB`) or binary (`KiB`, `MiB`, `GiB`): `5GB` is
/// 5·10⁹ bytes, `2GiB` 2·2³⁰.
pub fn parse_file_size(text: &str) -> Result<usize> {
    const UNITS: [(&str, f64); 7] = [
        ("KiB", 1024.0),
        ("MiB", 1048576.0),
        ("GiB", 1073741824.0),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("B", 1.0),
    ];
    let t = text.trim();
    let (number, scale) = UNITS
        .iter()
        .find_map(|(u, f)| t.strip_suffix(u).map(|n| (n.trim(), *f)))
        .unwrap_or((t, 1.0));
    match number.parse::<f64>() {
        Ok(n) if n.is_finite() && n * scale >= 1.0 && n * scale < 1e18 => Ok((n * scale) as usize),
        _ => crate::config_err!(
            "--max-shard-size {text:?}: give a size such as 5GB (HF's default), 500MB, 2GiB \
             or a number of bytes"
        ),
    }
}

/// How a checkpoint stores its model's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelFiles {
    /// The dtype of the stored values.
    pub dtype: SaveDtype,
    /// The largest weight file (a larger tensor gets a file of its own).
    pub max_file_bytes: usize,
}

impl ModelFiles {
    /// F32 in files of at most [`FILE_BYTES`].
    pub fn f32() -> ModelFiles {
        ModelFiles {
            dtype: SaveDtype::F32,
            max_file_bytes: FILE_BYTES,
        }
    }

    /// Bytes `numel` values take in a file.
    pub fn bytes(&self, numel: usize) -> usize {
        numel * self.dtype.size()
    }
}

/// Consecutive items (tensors or units) grouped into files of at most
/// `max` bytes (a larger one gets a file of its own).
pub fn file_groups(item_bytes: &[usize], max: usize) -> Vec<Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &b) in item_bytes.iter().enumerate() {
        if i > start && bytes + b > max {
            groups.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < item_bytes.len() {
        groups.push(start..item_bytes.len());
    }
    groups
}

/// The name of weight file `k` of `n` (`model.safetensors` when alone).
pub fn weight_file_name(k: usize, n: usize) -> String {
    if n == 1 {
        SINGLE_FILE.into()
    } else {
        format!("model-{:05}-of-{n:05}.safetensors", k + 1)
    }
}

/// Writes `model.safetensors.index.json` for weights spread over files
/// (each file with the names of its tensors; `total_bytes` their stored size).
pub fn write_index(dir: &Path, files: &[(String, Vec<String>)], total_bytes: usize) -> Result<()> {
    let mut map = serde_json::Map::new();
    for (file, names) in files {
        for n in names {
            map.insert(n.clone(), json!(file));
        }
    }
    let v = json!({ "metadata": { "total_size": total_bytes }, "weight_map": map });
    let text = serde_json::to_string_pretty(&v).expect("a JSON value always serialises");
    write_atomic(&dir.join(INDEX_FILE), text.as_bytes())
}

/// Writes `tensors` (in model order, in host memory) as the weight files
/// of `dir` ([`write_model_sources`]).
pub fn write_model_files(
    dir: &Path,
    tensors: &[(String, &HostTensor)],
    files: ModelFiles,
) -> Result<()> {
    let sources: Vec<TensorSource> = (tensors.iter())
        .map(|(n, t)| TensorSource::host(n, &t.shape, &t.data))
        .collect();
    write_model_sources(dir, &sources, files)
}

/// Writes `tensors` (in model order) as the weight files of `dir` in
/// `files.dtype`: one file, or files of at most `files.max_file_bytes` and
/// their index; each tensor is fetched when its file is written.
pub fn write_model_sources(dir: &Path, tensors: &[TensorSource], files: ModelFiles) -> Result<()> {
    let bytes: Vec<usize> = tensors.iter().map(|t| files.bytes(t.numel())).collect();
    let groups = file_groups(&bytes, files.max_file_bytes);
    let mut index = Vec::new();
    for (k, g) in groups.iter().enumerate() {
        let file = weight_file_name(k, groups.len());
        let dtype = files.dtype.safetensors();
        write_safetensors(&dir.join(&file), &tensors[g.clone()], dtype)?;
        let names = tensors[g.clone()].iter().map(|t| t.name.clone());
        index.push((file, names.collect()));
    }
    if groups.len() > 1 {
        write_index(dir, &index, bytes.iter().sum())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_sizes_read_as_hf_spells_them() {
        assert_eq!(parse_file_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_file_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_file_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_file_size("1.5 KiB").unwrap(), 1536);
        assert_eq!(parse_file_size("123").unwrap(), 123);
        for bad in ["", "0", "-1GB", "5 GX", "GB", "inf"] {
            assert!(parse_file_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn items_group_into_files_in_order() {
        assert_eq!(file_groups(&[3, 3, 3], 10), vec![0..3]);
        assert_eq!(file_groups(&[3, 3, 3], 6), vec![0..2, 2..3]);
        assert_eq!(file_groups(&[12, 1, 1], 6), vec![0..1, 1..3]);
        assert_eq!(file_groups(&[], 6), Vec::<Range<usize>>::new());
        assert_eq!(weight_file_name(0, 1), "model.safetensors");
        assert_eq!(weight_file_name(1, 3), "model-00002-of-00003.safetensors");
    }
}
