//! The bounds on what reading and tokenizing documents may hold or spend,
//! in one place: a document's length (a text file, a JSONL line, a Parquet
//! row, a rendered conversation: `--max-doc-mb`), the text read per batch
//! (`--batch-mb`, which also bounds the rows of a Parquet read), the piece
//! of a long document an HF tokenizer takes at once, a chat template's
//! fuel, and the thread count of `upipe tokenize`. docs/data.md lists them
//! ("Limits").

use crate::error::Result;

/// `--max-doc-mb`'s default: the longest document (or JSONL line) read, in
/// MiB. A million-token document is about 4 MiB of text.
pub const DEFAULT_MAX_DOC_MB: usize = 256;

/// `--batch-mb`'s default: MiB of text read and tokenized per batch.
pub const DEFAULT_BATCH_MB: usize = 16;

/// The text an HF tokenizer encodes at once: a longer document is encoded
/// in pieces cut at whitespace near this size (its working memory is
/// about 200 times the text it holds; measured: 1.6 GB for one 8 MiB
/// document encoded whole).
pub const PIECE_BYTES: usize = 256 << 10;

/// A chat template's fuel per rendering: this much, plus
/// [`CHAT_FUEL_PER_BYTE`] per byte of the conversation's JSON (minijinja
/// charges about one unit per instruction and per byte it creates).
pub const CHAT_FUEL_BASE: u64 = 20_000_000;
pub const CHAT_FUEL_PER_BYTE: u64 = 64;

/// `upipe tokenize --threads` at most: this many per CPU.
pub const THREADS_PER_CPU: usize = 4;

/// The bounds of one `upipe tokenize` (or of reading documents).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest document, JSONL line or rendered conversation, in bytes
    /// (`--max-doc-mb`).
    pub max_doc_bytes: usize,
    /// Text read and tokenized per batch, in bytes (`--batch-mb`).
    pub batch_bytes: usize,
    /// Text an HF tokenizer encodes at once ([`PIECE_BYTES`]).
    pub piece_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_doc_bytes: DEFAULT_MAX_DOC_MB << 20,
            batch_bytes: DEFAULT_BATCH_MB << 20,
            piece_bytes: PIECE_BYTES,
        }
    }
}

impl Limits {
    /// The limits of `--max-doc-mb` and `--batch-mb` (each at least 1 MiB).
    pub fn of_flags(max_doc_mb: usize, batch_mb: usize) -> Result<Limits> {
        let mib = |n: usize, flag: &str| match n.checked_mul(1 << 20) {
            Some(b) if n > 0 => Ok(b),
            _ => crate::config_err!("{flag} {n}: give MiB, at least 1 and below 2^44"),
        };
        Ok(Limits {
            max_doc_bytes: mib(max_doc_mb, "--max-doc-mb")?,
            batch_bytes: mib(batch_mb, "--batch-mb")?,
            piece_bytes: PIECE_BYTES,
        })
    }

    /// The error for `what` (such as "FILE line 3") longer than a document
    /// may be: names the limit and the flag that raises it.
    pub fn too_long(&self, what: &str) -> crate::error::Error {
        crate::error::Error::Config(format!(
            "{what} is longer than {}, the longest document or line upipe reads, and nothing \
             beyond that was read into memory: raise --max-doc-mb, or split the document",
            mib_text(self.max_doc_bytes)
        ))
    }
}

/// The document limit `n` as the flag gives it (`256 MiB (--max-doc-mb
/// 256)`), or in bytes where it is no whole MiB.
pub fn mib_text(n: usize) -> String {
    match n % (1 << 20) {
        0 => format!("{} MiB (--max-doc-mb {})", n >> 20, n >> 20),
        _ => format!("{n} bytes"),
    }
}

/// The most threads `upipe tokenize` starts on this machine.
pub fn max_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.saturating_mul(THREADS_PER_CPU)
}

/// `--threads n`, checked: at least 1 and at most [`max_threads`].
pub fn check_threads(n: usize) -> Result<usize> {
    let cap = max_threads();
    match n {
        0 => crate::config_err!("--threads must be at least 1"),
        n if n > cap => crate::config_err!(
            "--threads {n}: at most {cap} ({THREADS_PER_CPU} per CPU of the {} this machine \
             has); more threads only add memory. Leave --threads out to use every CPU",
            cap / THREADS_PER_CPU
        ),
        n => Ok(n),
    }
}

/// A chat template's fuel for a conversation of `json_bytes` bytes.
pub fn chat_fuel(json_bytes: usize) -> u64 {
    CHAT_FUEL_BASE.saturating_add(CHAT_FUEL_PER_BYTE.saturating_mul(json_bytes as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_limits_and_absurd_ones_are_refused() {
        let l = Limits::of_flags(2, 1).unwrap();
        assert_eq!((l.max_doc_bytes, l.batch_bytes), (2 << 20, 1 << 20));
        for (doc, batch, flag) in [(0, 1, "--max-doc-mb 0"), (1, usize::MAX, "--batch-mb")] {
            let e = Limits::of_flags(doc, batch).unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
        let e = l.too_long("a.jsonl line 3").to_string();
        assert!(
            e.contains("a.jsonl line 3") && e.contains("2 MiB (--max-doc-mb 2)"),
            "{e}"
        );
    }

    #[test]
    fn thread_counts_are_capped_by_the_cpus() {
        assert_eq!(check_threads(1).unwrap(), 1);
        assert!(check_threads(0).is_err());
        let e = check_threads(100_000).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {}", max_threads())), "{e}");
        assert!(chat_fuel(1000) > CHAT_FUEL_BASE);
    }
}
