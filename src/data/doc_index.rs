//! The files `upipe tokenize` writes beside a file of ids `IDS` (such as
//! `train.u32`), each with a versioned header and checked against the ids
//! before a run reads them:
//!
//! - the **document index** `IDS.docs`: where each document starts;
//! - the **loss mask** `IDS.mask` (chat and prompt/completion data): which
//!   tokens count as targets.
//!
//! Both are little-endian:
//!
//! ```text
//! IDS.docs                              IDS.mask
//! 0..8    magic  "UPIPEDIX"             0..8    magic  "UPIPEMSK"
//! 8..12   u32    version (1)            8..12   u32    version (1)
//! 12..16  u32    ids stamp (or 0)       12..16  u32    ids stamp (or 0)
//! 16..24  u64    ids in IDS (N)         16..24  u64    ids in IDS (N)
//! 24..32  u64    documents (D)          24..    ceil(N/8) bytes: bit i (byte
//! 32..    D x u64 document starts:              i/8, bit i%8, least
//!         ascending, the first 0,               significant first) is 1 when
//!         each below N                          token i counts as a target
//! ```
//!
//! Document `d` is ids `starts[d]..starts[d+1]` (the last one ends at N).
//!
//! The ids stamp ([`ids_stamp`]: a hash of N and the first and last 4,096
//! ids, never 0) ties both files to the ids they were written with: a run
//! refuses an index or a mask whose stamp is not that of the ids beside it
//! (one `upipe tokenize` killed while it replaced the three files). Files
//! written before the stamp hold 0 there and are checked by N alone.

use crate::error::{Error, Result};
use memmap2::Mmap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Magic bytes of a document index.
pub const INDEX_MAGIC: &[u8; 8] = b"UPIPEDIX";
/// Magic bytes of a loss mask.
pub const MASK_MAGIC: &[u8; 8] = b"UPIPEMSK";
/// The format version both files are written with (and the only one read).
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the document starts of an index.
const INDEX_HEADER: usize = 32;
/// Bytes before the bits of a mask.
const MASK_HEADER: usize = 24;

/// Ids hashed at each end of a stream for its [`ids_stamp`].
pub const STAMP_IDS: usize = 4096;

/// The stamp of a stream of ids that its index and mask carry
/// ([`stamp_of`] its length and ends).
pub fn ids_stamp(tokens: &super::Tokens) -> u32 {
    let n = tokens.len();
    let head = tokens.read(0..n.min(STAMP_IDS));
    let tail = tokens.read(n.saturating_sub(STAMP_IDS)..n);
    stamp_of(n as u64, &head, &tail)
}

/// FNV-1a of `n` ids' count, their first (`head`) and their last (`tail`)
/// `min(n, STAMP_IDS)` ids, folded to 32 bits (1 where that is 0, which
/// means "no stamp").
pub fn stamp_of(n: u64, head: &[u32], tail: &[u32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&n.to_le_bytes());
    head.iter()
        .chain(tail)
        .for_each(|id| eat(&id.to_le_bytes()));
    match (h ^ (h >> 32)) as u32 {
        0 => 1,
        s => s,
    }
}

/// Writes `stamp` into the header of the index or mask at `path`.
pub fn write_stamp(path: &Path, stamp: u32) -> Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| write_err(path, e))?;
    file.seek(SeekFrom::Start(12))
        .and_then(|_| file.write_all(&stamp.to_le_bytes()))
        .and_then(|_| file.sync_all())
        .map_err(|e| write_err(path, e))
}

/// Refuses an index or mask (`what`, stamped `said`) beside ids `ids` of
/// another stamp; 0 (a file written before stamps) is not checked.
pub fn check_stamp(said: u32, ids: &super::Tokens, what: &Path) -> Result<()> {
    if said == 0 || said == ids_stamp(ids) {
        return Ok(());
    }
    crate::config_err!(
        "{} was written with other ids than those of {} (a `upipe tokenize` stopped while it \
         replaced its files, or files of two runs put together): its documents or its loss \
         mask would not fit the ids; run `upipe tokenize` again to write the ids, the index \
         and the mask together",
        what.display(),
        ids.name()
    )
}

/// The stamp in a header (bytes 12..16).
fn header_stamp(bytes: &[u8]) -> u32 {
    u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"))
}

/// The document index of a file of ids beside it: `IDS.docs`.
pub fn index_path(ids: &Path) -> PathBuf {
    PathBuf::from(format!("{}.docs", ids.display()))
}

/// The loss mask of a file of ids beside it: `IDS.mask`.
pub fn mask_path(ids: &Path) -> PathBuf {
    PathBuf::from(format!("{}.mask", ids.display()))
}

/// Where each document of a token stream starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocIndex {
    /// `[D]` first id of each document: ascending, the first 0.
    starts: Vec<u64>,
    /// Ids in the stream.
    tokens: u64,
    /// The ids' stamp its file carries (0: none).
    stamp: u32,
}

impl DocIndex {
    /// The index of a stream of `tokens` ids whose documents start at
    /// `starts`; `what` names the stream in the error when they do not fit.
    pub fn new(starts: Vec<u64>, tokens: u64, what: &str) -> Result<DocIndex> {
        let bad = |why: String| {
            Err(Error::Config(format!(
                "{what}: {why}; the index does not match its ids: write both again with `upipe tokenize`"
            )))
        };
        if tokens > 0 && starts.first() != Some(&0) {
            return bad("the first document does not start at 0".into());
        }
        if let Some(i) = (1..starts.len()).find(|&i| starts[i] <= starts[i - 1]) {
            return bad(format!(
                "document starts out of order: document {i} starts at {} after {}",
                starts[i],
                starts[i - 1]
            ));
        }
        if let Some(&last) = starts.last().filter(|&&s| s >= tokens) {
            return bad(format!(
                "a document starts at {last}, past the end of the {tokens} ids"
            ));
        }
        Ok(DocIndex {
            starts,
            tokens,
            stamp: 0,
        })
    }

    /// The [`ids_stamp`] of the ids its file was written with (0: none).
    pub fn stamp(&self) -> u32 {
        self.stamp
    }

    /// Reads the index at `path` and checks it against `ids` ids.
    pub fn open(path: &Path, ids: u64) -> Result<DocIndex> {
        crate::input_path::check_file(path, "document index")?;
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let what = path.display().to_string();
        let tokens = read_header(&bytes, INDEX_MAGIC, INDEX_HEADER, &what, "document index")?;
        let docs = u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes"));
        let body = &bytes[INDEX_HEADER..];
        if body.len() as u64 != docs.saturating_mul(8) {
            return crate::config_err!(
                "{what}: the header says {docs} documents but the file holds {} bytes of starts \
                 (8 per document); the file is cut short or corrupt: write it again with `upipe tokenize`",
                body.len()
            );
        }
        check_count(tokens, ids, &what)?;
        let starts = body
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let stamp = header_stamp(&bytes);
        DocIndex::new(starts, tokens, &what).map(|d| DocIndex { stamp, ..d })
    }

    /// Number of documents.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    /// Whether the stream has no document.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Ids in the stream the index is of.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The ids of document `d`.
    pub fn span(&self, d: usize) -> std::ops::Range<u64> {
        let end = self.starts.get(d + 1).copied().unwrap_or(self.tokens);
        self.starts[d]..end
    }

    /// The document holding id `id` of the stream.
    pub fn document_of(&self, id: u64) -> usize {
        self.starts.partition_point(|&s| s <= id).saturating_sub(1)
    }

    /// The starts of the documents in `range` of the stream, ascending.
    pub fn starts_in(&self, range: std::ops::Range<u64>) -> &[u64] {
        let lo = self.starts.partition_point(|&s| s < range.start);
        let hi = self.starts.partition_point(|&s| s < range.end);
        &self.starts[lo..hi]
    }
}

/// Which tokens of a stream count as targets.
#[derive(Clone)]
pub struct LossMask {
    bits: MaskBits,
    tokens: u64,
    /// The ids' stamp its file carries (0: none).
    stamp: u32,
}

#[derive(Clone)]
enum MaskBits {
    Owned(Arc<[u8]>),
    Mapped(Arc<Mmap>),
}

impl std::fmt::Debug for LossMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LossMask({} tokens)", self.tokens)
    }
}

impl LossMask {
    /// A mask of one flag per token.
    pub fn from_flags(flags: &[bool]) -> LossMask {
        let mut bits = vec![0u8; flags.len().div_ceil(8)];
        for (i, _) in flags.iter().enumerate().filter(|(_, c)| **c) {
            bits[i / 8] |= 1 << (i % 8);
        }
        LossMask {
            bits: MaskBits::Owned(bits.into()),
            tokens: flags.len() as u64,
            stamp: 0,
        }
    }

    /// Memory-maps the mask at `path` and checks it against `ids` ids.
    pub fn open(path: &Path, ids: u64) -> Result<LossMask> {
        crate::input_path::check_file(path, "loss mask")?;
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        // SAFETY: the file is opened read-only; upipe never writes it while a run maps it.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        let what = path.display().to_string();
        let tokens = read_header(&map, MASK_MAGIC, MASK_HEADER, &what, "loss mask")?;
        let want = tokens.div_ceil(8);
        if (map.len() - MASK_HEADER) as u64 != want {
            return crate::config_err!(
                "{what}: the header says {tokens} tokens ({want} bytes of bits) but the file holds {}; \
                 the mask is cut short or corrupt: write it again with `upipe tokenize`",
                map.len() - MASK_HEADER
            );
        }
        check_count(tokens, ids, &what)?;
        Ok(LossMask {
            stamp: header_stamp(&map),
            bits: MaskBits::Mapped(Arc::new(map)),
            tokens,
        })
    }

    /// The [`ids_stamp`] of the ids its file was written with (0: none).
    pub fn stamp(&self) -> u32 {
        self.stamp
    }

    /// Tokens the mask covers.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Whether any token of `range` counts as a target.
    pub fn counts_any(&self, range: std::ops::Range<u64>) -> bool {
        let end = range.end.min(self.tokens);
        let mut i = range.start;
        while i < end {
            if i.is_multiple_of(8) && end - i >= 8 {
                // a whole byte at once
                if self.byte(i / 8) != 0 {
                    return true;
                }
                i += 8;
                continue;
            }
            if self.counts(i) {
                return true;
            }
            i += 1;
        }
        false
    }

    fn byte(&self, b: u64) -> u8 {
        match &self.bits {
            MaskBits::Owned(bits) => bits[b as usize],
            MaskBits::Mapped(m) => m[MASK_HEADER + b as usize],
        }
    }

    /// Whether token `i` counts as a target.
    pub fn counts(&self, i: u64) -> bool {
        self.byte(i / 8) >> (i % 8) & 1 == 1
    }
}

/// Checks magic, version and size of a header of `len` bytes; the ids it
/// says the file covers.
fn read_header(bytes: &[u8], magic: &[u8; 8], len: usize, what: &str, kind: &str) -> Result<u64> {
    if bytes.len() < len || &bytes[..8] != magic {
        return crate::config_err!(
            "{what} is not a upipe {kind} (no {} header); write it with `upipe tokenize`",
            String::from_utf8_lossy(magic)
        );
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return crate::config_err!(
            "{what}: {kind} format version {version}, but this upipe reads version {FORMAT_VERSION}; \
             write it again with this upipe's `upipe tokenize`"
        );
    }
    Ok(u64::from_le_bytes(
        bytes[16..24].try_into().expect("8 bytes"),
    ))
}

/// A file made for `said` ids read beside a file of `ids` ids.
fn check_count(said: u64, ids: u64, what: &str) -> Result<()> {
    match said == ids {
        true => Ok(()),
        false => crate::config_err!(
            "{what} was written for {said} ids but its ids file holds {ids}; the files do not \
             belong together: write both again with `upipe tokenize`"
        ),
    }
}

/// Writes a document index as documents arrive (the counts in the header
/// are filled in by [`IndexWriter::finish`]).
pub struct IndexWriter {
    w: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    documents: u64,
}

impl IndexWriter {
    pub fn create(path: &Path) -> Result<IndexWriter> {
        let mut w = create(path)?;
        let header = header(INDEX_MAGIC, 0, INDEX_HEADER);
        w.write_all(&header).map_err(|e| write_err(path, e))?;
        Ok(IndexWriter {
            w,
            path: path.to_path_buf(),
            documents: 0,
        })
    }

    /// A document starts at id `start`.
    pub fn push(&mut self, start: u64) -> Result<()> {
        self.documents += 1;
        let path = &self.path;
        self.w
            .write_all(&start.to_le_bytes())
            .map_err(|e| write_err(path, e))
    }

    /// Writes the counts: `tokens` ids in the stream.
    pub fn finish(self, tokens: u64) -> Result<()> {
        let mut counts = tokens.to_le_bytes().to_vec();
        counts.extend(self.documents.to_le_bytes());
        finish(self.w, &self.path, &counts)
    }
}

/// Writes a loss mask token by token.
pub struct MaskWriter {
    w: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    tokens: u64,
    byte: u8,
}

impl MaskWriter {
    pub fn create(path: &Path) -> Result<MaskWriter> {
        let mut w = create(path)?;
        let header = header(MASK_MAGIC, 0, MASK_HEADER);
        w.write_all(&header).map_err(|e| write_err(path, e))?;
        Ok(MaskWriter {
            w,
            path: path.to_path_buf(),
            tokens: 0,
            byte: 0,
        })
    }

    /// The next tokens' flags (whether each counts as a target).
    pub fn push(&mut self, flags: &[bool]) -> Result<()> {
        for &f in flags {
            self.byte |= u8::from(f) << (self.tokens % 8);
            self.tokens += 1;
            if self.tokens.is_multiple_of(8) {
                let b = std::mem::take(&mut self.byte);
                self.w
                    .write_all(&[b])
                    .map_err(|e| write_err(&self.path, e))?;
            }
        }
        Ok(())
    }

    /// Writes the last bits and the count.
    pub fn finish(mut self) -> Result<()> {
        if !self.tokens.is_multiple_of(8) {
            let b = self.byte;
            self.w
                .write_all(&[b])
                .map_err(|e| write_err(&self.path, e))?;
        }
        finish(self.w, &self.path, &self.tokens.to_le_bytes())
    }
}

fn header(magic: &[u8; 8], tokens: u64, len: usize) -> Vec<u8> {
    let mut h = magic.to_vec();
    h.extend(FORMAT_VERSION.to_le_bytes());
    h.extend(0u32.to_le_bytes());
    h.extend(tokens.to_le_bytes());
    h.resize(len, 0);
    h
}

fn create(path: &Path) -> Result<std::io::BufWriter<std::fs::File>> {
    let file = std::fs::File::create(path).map_err(|e| write_err(path, e))?;
    Ok(std::io::BufWriter::with_capacity(1 << 20, file))
}

/// Flushes `w` and writes `counts` at byte 16 of the header.
fn finish(w: std::io::BufWriter<std::fs::File>, path: &Path, counts: &[u8]) -> Result<()> {
    let mut file = w
        .into_inner()
        .map_err(|e| write_err(path, e.into_error()))?;
    file.seek(SeekFrom::Start(16))
        .and_then(|_| file.write_all(counts))
        .and_then(|_| file.sync_all())
        .map_err(|e| write_err(path, e))
}

fn write_err(path: &Path, e: std::io::Error) -> Error {
    Error::io(format!("writing {}", path.display()), e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("upipe-docidx-{}-{name}", std::process::id()))
    }

    #[test]
    fn index_and_mask_round_trip() {
        let p = temp("rt.u32");
        let mut w = IndexWriter::create(&index_path(&p)).unwrap();
        for s in [0, 3, 4, 9] {
            w.push(s).unwrap();
        }
        w.finish(12).unwrap();
        let idx = DocIndex::open(&index_path(&p), 12).unwrap();
        assert_eq!((idx.len(), idx.span(1), idx.span(3)), (4, 3..4, 9..12));
        assert_eq!(idx.starts_in(3..9), &[3, 4]);
        let flags: Vec<bool> = (0..13).map(|i| i % 3 == 0).collect();
        let mut m = MaskWriter::create(&mask_path(&p)).unwrap();
        m.push(&flags[..5]).unwrap();
        m.push(&flags[5..]).unwrap();
        m.finish().unwrap();
        let mask = LossMask::open(&mask_path(&p), 13).unwrap();
        let read: Vec<bool> = (0..13).map(|i| mask.counts(i)).collect();
        assert_eq!(read, flags);
        let owned = LossMask::from_flags(&flags);
        assert!((0..13).all(|i| owned.counts(i) == flags[i as usize]));
        // a mask or an index beside ids of another length is refused
        let e = LossMask::open(&mask_path(&p), 12).unwrap_err().to_string();
        assert!(
            e.contains("written for 13 ids") && e.contains("holds 12"),
            "{e}"
        );
        let e = DocIndex::open(&index_path(&p), 11).unwrap_err().to_string();
        assert!(e.contains(".docs") && e.contains("upipe tokenize"), "{e}");
        std::fs::remove_file(index_path(&p)).unwrap();
        std::fs::remove_file(mask_path(&p)).unwrap();
    }

    #[test]
    fn bad_indexes_are_refused_naming_the_file() {
        let p = temp("bad.docs");
        let write = |starts: &[u64], tokens: u64| {
            let mut w = IndexWriter::create(&p).unwrap();
            for &s in starts {
                w.push(s).unwrap();
            }
            w.finish(tokens).unwrap();
            DocIndex::open(&p, tokens)
                .map(|_| ())
                .unwrap_err()
                .to_string()
        };
        let e = write(&[0, 5, 3], 10);
        assert!(
            e.contains("out of order") && e.contains(&p.display().to_string()),
            "{e}"
        );
        let e = write(&[0, 10], 10);
        assert!(e.contains("past the end"), "{e}");
        let e = write(&[2], 10);
        assert!(e.contains("does not start at 0"), "{e}");
        // cut short: the header counts more starts than the file holds
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[24] = 7;
        std::fs::write(&p, &bytes).unwrap();
        let e = DocIndex::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("7 documents") && e.contains("cut short"), "{e}");
        bytes[8] = 2;
        std::fs::write(&p, &bytes).unwrap();
        let e = DocIndex::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("version 2"), "{e}");
        std::fs::write(&p, b"not an index at all, no header").unwrap();
        let e = DocIndex::open(&p, 10).unwrap_err().to_string();
        assert!(e.contains("not a upipe document index"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }
}
