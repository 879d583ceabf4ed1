//! Safetensors files read by element ranges: only the header and the bytes
//! asked for are read, so each rank loads its shard of a checkpoint without
//! reading (or holding) whole files.

use super::hf::read_weight_map;
use super::tensor_file::check_finite;
use crate::error::{Error, Result};
use half::{bf16, f16};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One tensor's entry in a safetensors header.
#[derive(Debug, Clone)]
struct Entry {
    dtype: String,
    /// Dimensions whose product fits `usize` ([`parse_entry`] checks).
    shape: Vec<usize>,
    /// Byte range in the data section.
    bytes: Range<u64>,
}

impl Entry {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A safetensors file whose header has been read and checked.
#[derive(Debug)]
pub struct RangedFile {
    path: PathBuf,
    entries: HashMap<String, Entry>,
    /// Offset of the data section in the file.
    data_start: u64,
}

impl RangedFile {
    /// The dtype of the file's first tensor (by offset).
    pub fn first_dtype(&self) -> Option<&str> {
        let entry = self.entries.values().min_by_key(|e| e.bytes.start)?;
        Some(entry.dtype.as_str())
    }

    /// Reads and checks the header of `path` (every tensor must lie inside
    /// the file: a truncated file is an error here, not at the first read).
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |why: String| Error::Checkpoint(format!("{}: {why}", path.display()));
        crate::input_path::check_file(path, "checkpoint file")?;
        let mut f =
            File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let len = f
            .metadata()
            .map_err(|e| Error::io(path.display().to_string(), e))?
            .len();
        let mut n = [0u8; 8];
        f.read_exact(&mut n).map_err(|_| {
            bad("too short for a safetensors header (missing or truncated file?)".into())
        })?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) || n > 100 << 20 {
            return Err(bad(format!(
                "a header of {n} bytes does not fit the file (truncated?)"
            )));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header)
            .map_err(|e| Error::io(path.display().to_string(), e))?;
        let header: BTreeMap<String, Value> =
            serde_json::from_slice(&header).map_err(|e| bad(format!("bad header: {e}")))?;
        let data_start = 8 + n;
        let mut entries = HashMap::new();
        for (name, v) in header.into_iter().filter(|(k, _)| k != "__metadata__") {
            let e = parse_entry(&v).ok_or_else(|| bad(format!("bad header entry for '{name}'")))?;
            if data_start + e.bytes.end > len {
                return Err(bad(format!(
                    "tensor '{name}' ends at byte {} but the file has {len} (truncated?)",
                    data_start + e.bytes.end
                )));
            }
            entries.insert(name, e);
        }
        Ok(RangedFile {
            path: path.to_path_buf(),
            entries,
            data_start,
        })
    }

    /// Whether the file holds tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Every tensor's name and shape (in no order).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &[usize])> {
        let entries = self.entries.iter();
        entries.map(|(n, e)| (n.as_str(), e.shape.as_slice()))
    }

    /// Elements `elems` of tensor `name` (flattened, row-major) as f32,
    /// from F32, BF16 or F16.
    pub fn read(&self, name: &str, elems: Range<usize>) -> Result<Vec<f32>> {
        let bad = |why: String| Error::Checkpoint(format!("{}: {why}", self.path.display()));
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| bad(format!("tensor '{name}' is missing")))?;
        let size: u64 = match e.dtype.as_str() {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => {
                return Err(bad(format!(
                    "tensor '{name}' has dtype {other}; upipe reads F32, BF16 and F16"
                )));
            }
        };
        let numel = e.numel();
        if elems.end > numel
            || (numel as u64).checked_mul(size) != Some(e.bytes.end - e.bytes.start)
        {
            return Err(bad(format!(
                "tensor '{name}': elements {elems:?} of {numel}, or a size that does not match its shape"
            )));
        }
        let mut f =
            File::open(&self.path).map_err(|x| Error::io(self.path.display().to_string(), x))?;
        let at = self.data_start + e.bytes.start + elems.start as u64 * size;
        let reading = |x| Error::io(format!("reading {}", self.path.display()), x);
        f.seek(SeekFrom::Start(at)).map_err(reading)?;
        // converted a chunk at a time: no second copy of the range in memory
        let mut values = Vec::with_capacity(elems.len());
        let mut left = elems.len() * size as usize;
        let mut buf = vec![0u8; left.min(READ_CHUNK)];
        while left > 0 {
            let chunk = &mut buf[..left.min(READ_CHUNK)];
            f.read_exact(chunk).map_err(reading)?;
            decode_into(&e.dtype, chunk, &mut values);
            left -= chunk.len();
        }
        check_finite(&values, name, &self.path, elems.start)?;
        Ok(values)
    }
}

/// Bytes read and converted at a time.
const READ_CHUNK: usize = 1 << 20;

/// Appends the values of little-endian `bytes` of `dtype` (F32, BF16, else
/// F16) to `out`.
fn decode_into(dtype: &str, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        "F32" => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        "BF16" => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        _ => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
    }
}

fn parse_entry(v: &Value) -> Option<Entry> {
    let dtype = v.get("dtype")?.as_str()?.to_string();
    let shape = v
        .get("shape")?
        .as_array()?
        .iter()
        .map(|d| d.as_u64().map(|d| d as usize))
        .collect::<Option<Vec<_>>>()?;
    // a shape whose element count overflows is malformed, as the
    // safetensors crate itself says of it
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
    let off = v.get("data_offsets")?.as_array()?;
    let (a, b) = (off.first()?.as_u64()?, off.get(1)?.as_u64()?);
    (a <= b).then_some(Entry {
        dtype,
        shape,
        bytes: a..b,
    })
}

/// The weights of an HF model directory (`model.safetensors`, or the files
/// `model.safetensors.index.json` lists), read by ranges.
pub struct RangedModel {
    files: Vec<RangedFile>,
    by_name: HashMap<String, usize>,
}

impl RangedModel {
    /// Opens every weight file of `dir` (headers only).
    pub fn open(dir: &Path) -> Result<Self> {
        crate::input_path::check_dir(dir, "model directory")?;
        crate::checkpoint::save_dir::finish_for_reading(dir)?;
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index.exists() {
            // the files the index names, each inside the directory
            let mut files: Vec<String> = read_weight_map(&index)?.into_values().collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let files = names
            .iter()
            .map(|p| RangedFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let mut by_name = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.entries.keys() {
                by_name.insert(name.clone(), i);
            }
        }
        Ok(RangedModel { files, by_name })
    }

    /// The names of every tensor of every file.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Every tensor's name and shape (in no order).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.files.iter().flat_map(|f| f.tensors())
    }

    /// The dtype name (`BF16`, `F32`, ...) of the first tensor stored in
    /// the first file, if there is one.
    pub fn first_dtype(&self) -> Option<&str> {
        self.files.first()?.first_dtype()
    }

    /// Checks that `name` is there with `shape`.
    pub fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        match self
            .by_name
            .get(name)
            .and_then(|&i| self.files[i].shape(name))
        {
            Some(s) if s == shape => Ok(()),
            Some(s) => Err(Error::Checkpoint(format!(
                "tensor {name} has shape {s:?}, the model needs {shape:?}"
            ))),
            None => Err(Error::Checkpoint(format!(
                "tensor {name} is missing from the checkpoint (is it a checkpoint of this model?)"
            ))),
        }
    }

    /// Elements `elems` of tensor `name`.
    pub fn read(&self, name: &str, elems: Range<usize>) -> Result<Vec<f32>> {
        let i = *self.by_name.get(name).ok_or_else(|| {
            Error::Checkpoint(format!("tensor {name} is missing from the checkpoint"))
        })?;
        self.files[i].read(name, elems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DType;
    use crate::checkpoint::{HostTensor, save_safetensors};

    #[test]
    fn ranges_read_what_the_whole_file_holds_and_truncation_is_named() {
        let dir = std::env::temp_dir().join(format!("upipe-ranged-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = HostTensor::new(vec![3, 4], (0..12).map(|x| x as f32 * 0.5).collect()).unwrap();
        let b = HostTensor::new(vec![5], vec![1.0, -2.0, 3.0, 4.5, 8.0]).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let path = dir.join("t.safetensors");
            save_safetensors(&path, &[("a".into(), &a), ("b".into(), &b)], dtype).unwrap();
            let f = RangedFile::open(&path).unwrap();
            assert_eq!(f.read("a", 0..12).unwrap(), a.data);
            assert_eq!(f.read("a", 5..9).unwrap(), a.data[5..9].to_vec());
            assert_eq!(f.read("b", 2..5).unwrap(), b.data[2..5].to_vec());
            assert!(
                f.read("c", 0..1)
                    .unwrap_err()
                    .to_string()
                    .contains("'c' is missing")
            );
            assert!(f.read("b", 0..6).is_err());
            let bytes = std::fs::read(&path).unwrap();
            std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
            let e = RangedFile::open(&path).unwrap_err().to_string();
            assert!(e.contains("truncated"), "{e}");
        }
        // a shape whose element count overflows is refused at the header
        let header =
            br#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        let path = dir.join("overflow.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let e = RangedFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("bad header entry for 'a'"), "{e}");
        // an index naming a file outside the directory is refused
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "../t.safetensors"}}"#,
        )
        .unwrap();
        let e = RangedModel::open(&dir).err().unwrap().to_string();
        assert!(e.contains("not a file name in the directory"), "{e}");
        let e = RangedFile::open(&dir.join("none.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("none.safetensors"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
