//! Safetensors files on host memory: [`HostTensor`] (dense row-major f32),
//! saved in F32/BF16/F16 and read back (memory-mapped) with every value
//! checked finite.

use super::save_dtype::SaveDtype;
use super::stream::{TensorSource, write_safetensors};
use crate::error::{Error, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

/// A dense row-major f32 tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A tensor from its shape and data; errors if the lengths disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(Error::Checkpoint(format!(
                "shape {shape:?} holds {numel} values but {} were given",
                data.len()
            )));
        }
        Ok(HostTensor { shape, data })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let numel = shape.iter().product();
        HostTensor {
            shape,
            data: vec![0.0; numel],
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` to a safetensors file in `dtype` (bf16 and fp16 round to
/// nearest even), atomically: a temporary file is written, then renamed over
/// `path`.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, &HostTensor)],
    dtype: impl Into<SaveDtype>,
) -> Result<()> {
    let dtype = dtype.into();
    let mut seen = HashSet::new();
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(Error::Checkpoint(format!(
                "tensor '{name}' is given twice for {}",
                path.display()
            )));
        }
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(Error::Checkpoint(format!(
                "tensor '{name}' has shape {:?} but {} values",
                t.shape,
                t.data.len()
            )));
        }
    }
    let sources: Vec<TensorSource> = tensors
        .iter()
        .map(|(name, t)| TensorSource::host(name, &t.shape, &t.data))
        .collect();
    write_safetensors(path, &sources, dtype.safetensors())
}

/// Reads every tensor of a safetensors file as f32 (from F32, BF16 or F16).
pub fn load_safetensors(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    load_safetensors_filtered(path, |_| true)
}

/// Reads the tensors of a safetensors file whose names pass `want`, as f32.
pub fn load_safetensors_filtered(
    path: &Path,
    want: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, HostTensor>> {
    Ok(read_safetensors(path, want)?.0)
}

/// The tensors of a safetensors file whose names pass `want`, as f32 (each
/// checked finite), and the names of the others. The file is memory-mapped:
/// only the tensors wanted are read, each converted straight from the page
/// cache (no second copy of the file in memory).
pub(super) fn read_safetensors(
    path: &Path,
    want: impl Fn(&str) -> bool,
) -> Result<(BTreeMap<String, HostTensor>, Vec<String>)> {
    crate::input_path::check_file(path, "checkpoint file")?;
    let file = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    // SAFETY: the map is only read; a checkpoint changed under a running
    // load is refused by the save directory's lock (`save_dir.rs`), and
    // safetensors checks every offset against the map's length.
    let bytes = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::Checkpoint(format!(
            "{} is not a valid safetensors file: {e}",
            path.display()
        ))
    })?;
    let mut out = BTreeMap::new();
    let mut skipped = Vec::new();
    for (name, view) in st.iter() {
        if !want(name) {
            skipped.push(name.to_string());
            continue;
        }
        let data = decode(view.dtype(), view.data()).map_err(|dtype| {
            Error::Checkpoint(format!(
                "tensor '{name}' in {} has dtype {dtype:?}; upipe reads F32, BF16 and F16",
                path.display()
            ))
        })?;
        check_finite(&data, name, path, 0)?;
        let tensor = HostTensor {
            shape: view.shape().to_vec(),
            data,
        };
        out.insert(name.to_string(), tensor);
    }
    Ok((out, skipped))
}

/// Errors at the first NaN or infinity of `values`, elements `first..` of
/// tensor `name` in `file`: one such weight makes every loss NaN.
pub fn check_finite(values: &[f32], name: &str, file: &Path, first: usize) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::Checkpoint(format!(
            "tensor '{name}' in {} holds {} at element {} (flat, row-major): a weight or \
             optimizer state must be finite; the file is corrupt or was saved from a diverged \
             run, so load an earlier checkpoint",
            file.display(),
            values[i],
            first + i
        ))),
    }
}

/// Little-endian bytes of `dtype` as f32 values; an unsupported dtype is returned as the error.
fn decode(dtype: StDtype, bytes: &[u8]) -> std::result::Result<Vec<f32>, StDtype> {
    Ok(match dtype {
        StDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StDtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => return Err(other),
    })
}
