//! Safetensors files written one tensor at a time: a [`TensorSource`]
//! names a tensor and its shape and fetches its values (from the device,
//! the optimizer or host memory) only when the writer reaches it, so a
//! save holds one tensor in host memory however large the model. The
//! header is known before any value is (every shape and dtype is), and is
//! the `safetensors` crate's own, so the files are byte for byte those
//! `safetensors::serialize` writes.

use super::fs::{follow_umask, rename, temp_path};
use crate::error::{Error, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;

/// Values converted and written per write call (a bounded byte buffer
/// beside the one tensor's F32 values).
const CHUNK_VALUES: usize = 1 << 16;

/// Fetches one tensor's F32 values.
type Fetch<'a> = Box<dyn Fn() -> Result<Vec<f32>> + 'a>;

/// A tensor to write, whose values are fetched when its turn comes.
pub struct TensorSource<'a> {
    /// Its name in the file.
    pub name: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    fetch: Fetch<'a>,
}

impl<'a> TensorSource<'a> {
    /// A tensor named `name` of `shape` whose values `fetch` returns
    /// (`shape`'s product of them, row-major).
    pub fn new(
        name: impl Into<String>,
        shape: Vec<usize>,
        fetch: impl Fn() -> Result<Vec<f32>> + 'a,
    ) -> Self {
        TensorSource {
            name: name.into(),
            shape,
            fetch: Box::new(fetch),
        }
    }

    /// A tensor already in host memory (copied when written).
    pub fn host(name: impl Into<String>, shape: &[usize], values: &'a [f32]) -> Self {
        TensorSource::new(name, shape.to_vec(), move || Ok(values.to_vec()))
    }

    /// The same values under another name (fetched through this one).
    pub fn renamed<'s>(&'s self, name: impl Into<String>) -> TensorSource<'s> {
        TensorSource::new(name, self.shape.clone(), move || self.values())
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Fetches the values, checked against the shape.
    pub fn values(&self) -> Result<Vec<f32>> {
        let values = (self.fetch)()?;
        if values.len() != self.numel() {
            return Err(Error::Checkpoint(format!(
                "tensor '{}' has shape {:?} but {} values were fetched",
                self.name,
                self.shape,
                values.len()
            )));
        }
        Ok(values)
    }
}

/// The order a safetensors file stores its tensors in (the crate's:
/// by descending dtype, then by name; one dtype here, so by name), as
/// indices into `tensors`.
pub fn file_order(tensors: &[TensorSource]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].name.cmp(&tensors[b].name));
    order
}

/// The header of a file of `tensors` in `dtype`, in the order `order`:
/// the `safetensors` crate's JSON (with `"format": "pt"`, which
/// transformers asks for), padded with spaces to a multiple of 8 bytes.
fn header(tensors: &[TensorSource], order: &[usize], dtype: Dtype, path: &Path) -> Result<Vec<u8>> {
    let mut offset = 0;
    let mut infos = Vec::with_capacity(order.len());
    for &i in order {
        let t = &tensors[i];
        let bytes = t.numel() * bytes_of(dtype);
        let info = TensorInfo {
            dtype,
            shape: t.shape.clone(),
            data_offsets: (offset, offset + bytes),
        };
        offset += bytes;
        infos.push((t.name.clone(), info));
    }
    let bad = |e: String| Error::Checkpoint(format!("writing {}: {e}", path.display()));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let metadata = Metadata::new(Some(metadata), infos).map_err(|e| bad(e.to_string()))?;
    let mut text = serde_json::to_vec(&metadata).map_err(|e| bad(e.to_string()))?;
    text.resize(text.len().next_multiple_of(8), b' ');
    Ok(text)
}

/// Errors when two of `tensors` share a name.
fn check_unique(tensors: &[TensorSource], path: &Path) -> Result<()> {
    let mut seen = HashSet::new();
    match tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
        Some(t) => Err(Error::Checkpoint(format!(
            "tensor '{}' is given twice for {}",
            t.name,
            path.display()
        ))),
        None => Ok(()),
    }
}

/// Writes `tensors` to a safetensors file in `dtype` (F32, or BF16 and
/// F16 rounded to nearest even), fetching each when its turn comes and
/// dropping it once written: a temporary file is written, then renamed
/// over `path`.
pub fn write_safetensors(path: &Path, tensors: &[TensorSource], dtype: Dtype) -> Result<()> {
    if ![Dtype::F32, Dtype::BF16, Dtype::F16].contains(&dtype) {
        return Err(Error::Checkpoint(format!(
            "writing {}: upipe writes F32, BF16 and F16, not {dtype:?}",
            path.display()
        )));
    }
    check_unique(tensors, path)?;
    let order = file_order(tensors);
    let header = header(tensors, &order, dtype, path)?;
    let tmp = temp_path(path);
    let written = write_file(&tmp, &header, order.iter().map(|&i| &tensors[i]), dtype);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    follow_umask(&tmp)?;
    rename(&tmp, path)
}

/// Writes the header and then each tensor's values into `tmp`.
fn write_file<'t, 'a: 't>(
    tmp: &Path,
    header: &[u8],
    tensors: impl Iterator<Item = &'t TensorSource<'a>>,
    dtype: Dtype,
) -> Result<()> {
    let io = |e: std::io::Error| Error::io(format!("writing {}", tmp.display()), e);
    let file = std::fs::File::create(tmp).map_err(io)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(header))
        .map_err(io)?;
    let mut bytes = Vec::with_capacity(CHUNK_VALUES * bytes_of(dtype));
    for t in tensors {
        let values = t.values()?;
        for chunk in values.chunks(CHUNK_VALUES) {
            bytes.clear();
            encode(chunk, dtype, &mut bytes);
            out.write_all(&bytes).map_err(io)?;
        }
    }
    out.flush().map_err(io)
}

/// Bytes of one value of `dtype` (F32, BF16 or F16).
fn bytes_of(dtype: Dtype) -> usize {
    dtype.bitsize() / 8
}

/// Appends `values` in `dtype`'s little-endian bytes to `out` (BF16, F16,
/// else F32: [`write_safetensors`] takes no other).
fn encode(values: &[f32], dtype: Dtype, out: &mut Vec<u8>) {
    match dtype {
        Dtype::BF16 => out.extend(values.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes())),
        Dtype::F16 => out.extend(values.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes())),
        _ => out.extend(values.iter().flat_map(|x| x.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::View;
    use std::borrow::Cow;

    /// A tensor's shape and values.
    type Shaped = (Vec<usize>, Vec<f32>);

    /// A tensor as the `safetensors` crate writes one.
    struct Whole<'a>(&'a Shaped, Dtype);

    impl View for Whole<'_> {
        fn dtype(&self) -> Dtype {
            self.1
        }
        fn shape(&self) -> &[usize] {
            &self.0.0
        }
        fn data(&self) -> Cow<'_, [u8]> {
            let mut out = Vec::new();
            encode(&self.0.1, self.1, &mut out);
            Cow::Owned(out)
        }
        fn data_len(&self) -> usize {
            self.0.1.len() * bytes_of(self.1)
        }
    }

    #[test]
    fn streamed_files_are_the_bytes_safetensors_writes() {
        let dir = std::env::temp_dir().join(format!("upipe-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let values = |n: usize, s: f32| (0..n).map(|i| (i as f32 - 3.3) * s).collect();
        let tensors = [
            ("model.layers.10.mlp.up_proj.weight", vec![3, 5]),
            ("model.layers.2.mlp.up_proj.weight", vec![5, 3]),
            ("lm_head.weight", vec![7, 2]),
            ("model.norm.weight", vec![9]),
            ("a \"quoted\" name", vec![1, 1, 1]),
        ];
        let host: Vec<(String, Shaped)> = (tensors.iter().enumerate())
            .map(|(k, (n, s))| {
                let v = values(s.iter().product(), 0.37 + k as f32);
                (n.to_string(), (s.clone(), v))
            })
            .collect();
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let path = dir.join("t.safetensors");
            let sources: Vec<TensorSource> = (host.iter())
                .map(|(n, (s, v))| TensorSource::host(n, s, v))
                .collect();
            write_safetensors(&path, &sources, dtype).unwrap();
            let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
            let views = host.iter().map(|(n, t)| (n.as_str(), Whole(t, dtype)));
            let expected = safetensors::serialize(views, Some(metadata)).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), expected, "{dtype:?}");
        }
        // a fetch that fails leaves no file, and names the tensor's problem
        let path = dir.join("failed.safetensors");
        let short = TensorSource::new("short", vec![4], || Ok(vec![1.0; 3]));
        let e = write_safetensors(&path, &[short], Dtype::F32).unwrap_err();
        assert!(e.to_string().contains("'short' has shape [4] but 3"), "{e}");
        assert!(!path.exists() && !temp_path(&path).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
