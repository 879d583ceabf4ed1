//! Token sources: the ids a run reads, either held in memory (text tokenized
//! at start-up) or a memory-mapped pre-tokenized file, read window by window
//! and never copied whole.
//!
//! Pre-tokenized formats, told apart by the file name's extension:
//! - `.u32`: raw little-endian uint32 ids;
//! - `.u16` or `.bin`: raw little-endian uint16 ids (the nanoGPT convention),
//!   for vocabularies of at most 65,536 ids.

use crate::error::{Error, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// How ids are stored in a pre-tokenized file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFormat {
    /// Little-endian uint16 (`.u16`, `.bin`).
    U16,
    /// Little-endian uint32 (`.u32`).
    U32,
}

impl TokenFormat {
    /// The format a file name's extension names, `None` for anything else (text).
    pub fn of_path(path: &Path) -> Option<TokenFormat> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("u32") => Some(TokenFormat::U32),
            Some("u16" | "bin") => Some(TokenFormat::U16),
            _ => None,
        }
    }

    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            TokenFormat::U16 => 2,
            TokenFormat::U32 => 4,
        }
    }

    /// The largest vocabulary whose ids the format holds.
    pub fn max_vocab(self) -> usize {
        match self {
            TokenFormat::U16 => 1 << 16,
            TokenFormat::U32 => 1 << 32,
        }
    }

    /// What a file of this format holds, for error messages.
    fn describe(self) -> &'static str {
        match self {
            TokenFormat::U16 => "a .u16/.bin token file holds raw little-endian uint16 ids",
            TokenFormat::U32 => "a .u32 token file holds raw little-endian uint32 ids",
        }
    }

    /// Appends the ids stored in `bytes` (a whole number of ids) to `out`.
    fn decode_into(self, bytes: &[u8], out: &mut Vec<u32>) {
        match self {
            TokenFormat::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
            ),
            TokenFormat::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
    }

    /// Appends `ids` in this format to `out`; an id too large for the
    /// format is an error naming it.
    pub fn encode_into(self, ids: &[u32], out: &mut Vec<u8>) -> Result<()> {
        match self {
            TokenFormat::U32 => out.extend(ids.iter().flat_map(|t| t.to_le_bytes())),
            TokenFormat::U16 => {
                for &id in ids {
                    let id = u16::try_from(id).map_err(|_| {
                        Error::Config(format!(
                            "token id {id} does not fit 16 bits; write a .u32 file instead"
                        ))
                    })?;
                    out.extend(id.to_le_bytes());
                }
            }
        }
        Ok(())
    }
}

/// Where the ids of a [`Tokens`] live.
#[derive(Clone)]
enum Source {
    Memory(Arc<[u32]>),
    Mapped { map: Arc<Mmap>, format: TokenFormat },
}

/// A read-only sequence of token ids: in memory, or a memory-mapped file.
/// Cheap to clone (the ids are shared); reads copy only the window asked for.
#[derive(Clone)]
pub struct Tokens {
    source: Source,
    /// What the ids are (a file name, "the bundled corpus"), for messages.
    name: Arc<str>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.source {
            Source::Memory(_) => "in memory",
            Source::Mapped { .. } => "memory-mapped",
        };
        write!(f, "Tokens({}: {} ids, {kind})", self.name, self.len())
    }
}

impl From<Arc<[u32]>> for Tokens {
    fn from(ids: Arc<[u32]>) -> Tokens {
        Tokens::from_ids(ids, "the token ids")
    }
}

impl From<Vec<u32>> for Tokens {
    fn from(ids: Vec<u32>) -> Tokens {
        Tokens::from_ids(ids, "the token ids")
    }
}

impl Tokens {
    /// Ids held in memory, called `name` in messages.
    pub fn from_ids(ids: impl Into<Arc<[u32]>>, name: &str) -> Tokens {
        Tokens {
            source: Source::Memory(ids.into()),
            name: name.into(),
        }
    }

    /// Memory-maps a pre-tokenized file (format by extension, see the module
    /// docs). Empty files and sizes that are not a whole number of ids are
    /// errors. The ids are not checked: see [`Tokens::open_checked`].
    pub fn open(path: &Path) -> Result<Tokens> {
        let Some(format) = TokenFormat::of_path(path) else {
            return crate::config_err!(
                "{} is not a pre-tokenized file: use the extension .u32 (uint32 ids) or .u16/.bin (uint16 ids)",
                path.display()
            );
        };
        crate::input_path::check_file(path, "token file")?;
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("reading the size of {}", path.display()), e))?
            .len();
        if len == 0 {
            return crate::config_err!(
                "{} is empty: {}; make one with `upipe tokenize`",
                path.display(),
                format.describe()
            );
        }
        if len % format.width() as u64 != 0 {
            return crate::config_err!(
                "{} has {len} bytes, not a multiple of {}: {}",
                path.display(),
                format.width(),
                format.describe()
            );
        }
        // SAFETY: the map is read-only and private to this process; the file
        // must not be truncated or rewritten while a run reads it (as with
        // any memory-mapped data loader).
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::io(format!("memory-mapping {}", path.display()), e))?;
        Ok(Tokens {
            source: Source::Mapped {
                map: Arc::new(map),
                format,
            },
            name: path.display().to_string().into(),
        })
    }

    /// [`Tokens::open`], then checks that the format can hold a vocabulary of
    /// `vocab` ids and that every id is below `vocab` (the model's `vocab_size`).
    pub fn open_checked(path: &Path, vocab: usize) -> Result<Tokens> {
        if let Some(format) = TokenFormat::of_path(path)
            && vocab > format.max_vocab()
        {
            return crate::config_err!(
                "{} holds 16-bit ids, but the model's vocabulary of {vocab} ids does not fit 16 bits \
                 (at most 65536); write the ids as .u32 (`upipe tokenize ... --out data.u32`)",
                path.display()
            );
        }
        let tokens = Tokens::open(path)?;
        tokens.check_vocab(vocab)?;
        Ok(tokens)
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        match &self.source {
            Source::Memory(ids) => ids.len(),
            Source::Mapped { map, format } => map.len() / format.width(),
        }
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the ids are (a file name, or a description), for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the ids are a memory-mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self.source, Source::Mapped { .. })
    }

    /// Replaces `out` with the ids at positions `range`.
    ///
    /// # Panics
    /// When `range` reaches past [`Tokens::len`], as slice indexing does.
    pub fn read_into(&self, range: Range<usize>, out: &mut Vec<u32>) {
        out.clear();
        match &self.source {
            Source::Memory(ids) => out.extend_from_slice(&ids[range]),
            Source::Mapped { map, format } => {
                let w = format.width();
                format.decode_into(&map[range.start * w..range.end * w], out);
            }
        }
    }

    /// The ids at positions `range` (see [`Tokens::read_into`]).
    pub fn read(&self, range: Range<usize>) -> Vec<u32> {
        let mut out = Vec::with_capacity(range.len());
        self.read_into(range, &mut out);
        out
    }

    /// Errors if any id is `>= vocab`, naming the ids' source, the first such
    /// id and its position. Scans in parallel, block by block.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        const BLOCK: usize = 1 << 20;
        let bad = |ids: &[u32], first: usize| {
            ids.iter()
                .position(|&t| t as usize >= vocab)
                .map(|i| (first + i, ids[i]))
        };
        let found = (0..self.len().div_ceil(BLOCK))
            .into_par_iter()
            .find_map_first(|blk| {
                let range = blk * BLOCK..((blk + 1) * BLOCK).min(self.len());
                match &self.source {
                    Source::Memory(ids) => bad(&ids[range.clone()], range.start),
                    Source::Mapped { .. } => bad(&self.read(range.clone()), range.start),
                }
            });
        match found {
            None => Ok(()),
            Some((i, id)) => crate::config_err!(
                "{}: token id {id} at position {i} is outside the vocabulary of {vocab} (ids 0..={}); \
                 use data made with the model's tokenizer, or a model whose vocab_size covers it",
                self.name,
                vocab.saturating_sub(1)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("upipe-tokens-{}-{name}", std::process::id()))
    }

    fn write(path: &Path, ids: &[u32], format: TokenFormat) {
        let mut bytes = Vec::new();
        format.encode_into(ids, &mut bytes).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn formats_come_from_the_extension() {
        let f = |p: &str| TokenFormat::of_path(Path::new(p));
        assert_eq!(f("a/train.u32"), Some(TokenFormat::U32));
        assert_eq!(f("train.u16"), Some(TokenFormat::U16));
        assert_eq!(f("train.bin"), Some(TokenFormat::U16));
        assert_eq!(f("train.txt"), None);
        assert_eq!(f("train"), None);
    }

    #[test]
    fn mapped_windows_equal_the_in_memory_ids() {
        let ids: Vec<u32> = (0..5000u32).map(|i| (i * 7919) % 70_000).collect();
        let path = temp_file("windows.u32");
        write(&path, &ids, TokenFormat::U32);
        let mapped = Tokens::open(&path).unwrap();
        let memory = Tokens::from(ids.clone());
        assert!(mapped.is_mapped() && !memory.is_mapped());
        assert_eq!(mapped.len(), 5000);
        let mut buf = vec![1, 2, 3];
        for r in [0..1, 17..4000, 4999..5000, 100..100] {
            mapped.read_into(r.clone(), &mut buf);
            assert_eq!(buf, &ids[r.clone()]);
            assert_eq!(memory.read(r.clone()), &ids[r]);
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn u16_files_read_as_ids() {
        let ids: Vec<u32> = vec![0, 1, 255, 256, 65_535, 40_000];
        for name in ["ids.u16", "ids.bin"] {
            let path = temp_file(name);
            write(&path, &ids, TokenFormat::U16);
            assert_eq!(
                std::fs::read(&path).unwrap()[..8],
                [0, 0, 1, 0, 255, 0, 0, 1]
            );
            let t = Tokens::open_checked(&path, 65_536).unwrap();
            assert_eq!(t.read(0..t.len()), ids);
            let err = Tokens::open_checked(&path, 128_256)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("16-bit ids") && err.contains("128256") && err.contains(".u32"),
                "{err}"
            );
            std::fs::remove_file(&path).unwrap();
        }
        let mut out = Vec::new();
        let err = TokenFormat::U16
            .encode_into(&[65_536], &mut out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("65536") && err.contains(".u32"), "{err}");
    }

    #[test]
    fn empty_odd_and_unknown_files_are_refused() {
        let path = temp_file("empty.u32");
        std::fs::write(&path, []).unwrap();
        let err = Tokens::open(&path).unwrap_err().to_string();
        assert!(err.contains("is empty") && err.contains("uint32"), "{err}");
        std::fs::write(&path, [1u8, 2, 3, 4, 5, 6]).unwrap();
        let err = Tokens::open(&path).unwrap_err().to_string();
        assert!(
            err.contains("6 bytes") && err.contains("multiple of 4"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
        let odd = temp_file("odd.u16");
        std::fs::write(&odd, [1u8, 2, 3]).unwrap();
        let err = Tokens::open(&odd).unwrap_err().to_string();
        assert!(
            err.contains("3 bytes") && err.contains("multiple of 2") && err.contains("uint16"),
            "{err}"
        );
        std::fs::remove_file(&odd).unwrap();
        let err = Tokens::open(Path::new("data.txt")).unwrap_err().to_string();
        assert!(err.contains(".u32") && err.contains(".bin"), "{err}");
        let err = Tokens::open(Path::new("/no/such/data.u32"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/no/such/data.u32"), "{err}");
    }

    #[test]
    fn ids_outside_the_vocabulary_are_named() {
        let path = temp_file("vocab.u32");
        let mut ids: Vec<u32> = (0..3_000_000).map(|i| i % 1000).collect();
        ids[2_500_000] = 1000;
        ids[2_900_000] = 5000;
        write(&path, &ids, TokenFormat::U32);
        let err = Tokens::open_checked(&path, 1000).unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string())
                && err.contains("token id 1000 at position 2500000")
                && err.contains("vocabulary of 1000"),
            "{err}"
        );
        Tokens::open_checked(&path, 5001).unwrap();
        let err = Tokens::from_ids(ids, "corpus.txt (tokenized)")
            .check_vocab(1000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("corpus.txt (tokenized): token id 1000"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
