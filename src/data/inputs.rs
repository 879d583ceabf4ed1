//! The inputs `upipe tokenize` reads: which kind of file each is (text,
//! JSONL, Parquet), whether it is compressed (gzip `.gz`, zstd `.zst`), directories
//! expanded into their files (recursively, in sorted order), and a reader
//! that decompresses; and the refusal of `train --data` on such inputs,
//! which names the `upipe tokenize` command that makes ids of them.

use crate::error::{Error, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// How an input file is compressed (by its last extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub fn of_path(path: &Path) -> Compression {
        match path.extension().and_then(|e| e.to_str()) {
            Some("gz") => Compression::Gzip,
            Some("zst" | "zstd") => Compression::Zstd,
            _ => Compression::None,
        }
    }
}

/// The file name without a compression extension (`a.jsonl.gz` → `a.jsonl`).
pub fn uncompressed_name(path: &Path) -> PathBuf {
    match Compression::of_path(path) {
        Compression::None => path.to_path_buf(),
        _ => path.with_extension(""),
    }
}

/// Whether `path` names a JSONL file (`.jsonl`, `.ndjson`, compressed or not).
pub fn is_jsonl(path: &Path) -> bool {
    matches!(
        uncompressed_name(path).extension().and_then(|e| e.to_str()),
        Some("jsonl" | "ndjson")
    )
}

/// Whether `path` names a Parquet file (`.parquet`).
pub fn is_parquet(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "parquet")
}

/// Whether `path` holds documents that `upipe tokenize` reads but `train
/// --data` does not: a directory, JSONL, Parquet, or a compressed file.
pub fn is_document_input(path: &Path) -> bool {
    path.is_dir()
        || is_jsonl(path)
        || Compression::of_path(path) != Compression::None
        || is_parquet(path)
}

/// `train --data PATH` on documents to tokenize: an error naming the
/// `upipe tokenize` command that writes their ids (`tokenizer` as given to
/// `train`; the byte tokenizer, which has no end-of-sequence token, with
/// `--eos 0`).
pub fn refuse_untokenized(path: &Path, tokenizer: Option<&str>) -> Result<()> {
    if !is_document_input(path) {
        return Ok(());
    }
    let out = ids_name(path);
    let tok = match tokenizer {
        None | Some("byte") => "--tokenizer byte --eos 0".to_string(),
        Some(t) => format!("--tokenizer {t}"),
    };
    crate::config_err!(
        "--data {} holds documents to tokenize, not ids or text: upipe never trains on raw JSON. \
         Write its ids (with the document index, and the loss mask for chat data) once with \
         `upipe tokenize {} {tok} --out {}` (add --field NAME when a JSONL line's text is not \
         under \"text\"), then train with --data {}",
        path.display(),
        path.display(),
        out.display(),
        out.display()
    )
}

/// Where the ids of `path` go by default: beside it, named `.u32`.
fn ids_name(path: &Path) -> PathBuf {
    let trimmed = PathBuf::from(path.to_string_lossy().trim_end_matches('/'));
    let base = uncompressed_name(&trimmed);
    match base.is_dir() || base.extension().is_none() {
        true => PathBuf::from(format!("{}.u32", base.display())),
        false => base.with_extension("u32"),
    }
}

/// `inputs` with every directory replaced by the files under it,
/// recursively, in sorted order (hidden files, those starting with `.`,
/// skipped). Every path must be a regular file or a directory.
pub fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in inputs {
        crate::input_path::check_file_or_dir(p, "input")?;
        match p.is_dir() {
            true => walk(p, &mut out)?,
            false => out.push(p.clone()),
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let read =
        std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut entries = read
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    entries.sort();
    for p in entries {
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'))
        {
            continue;
        }
        match p.is_dir() {
            true => walk(&p, out)?,
            false => {
                crate::input_path::check_file(&p, "input")?;
                out.push(p);
            }
        }
    }
    Ok(())
}

/// A buffered reader of `path`, decompressed as its extension says; a read
/// error of a compressed stream names the file and the fix ([`read_error`]).
pub fn open_reader(path: &Path) -> Result<Box<dyn BufRead + Send>> {
    let file = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let file = BufReader::with_capacity(1 << 20, file);
    Ok(match Compression::of_path(path) {
        Compression::None => Box::new(file),
        Compression::Gzip => Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(file))),
        Compression::Zstd => {
            let decoder = ruzstd::decoding::StreamingDecoder::new(file).map_err(|e| {
                Error::Config(format!(
                    "{}: not a zstd stream ({e}); check it with `zstd -t {0}`, or write it again",
                    path.display()
                ))
            })?;
            Box::new(BufReader::new(decoder))
        }
    })
}

/// The error of a failed read of `path` (at `at`, such as "line 3"): for a
/// compressed file, a corrupt or cut-short stream and how to check it.
pub fn read_error(path: &Path, at: &str, e: std::io::Error) -> Error {
    let check = match Compression::of_path(path) {
        Compression::None => return Error::io(format!("reading {at} of {}", path.display()), e),
        Compression::Gzip => "gzip -t",
        Compression::Zstd => "zstd -t",
    };
    Error::Config(format!(
        "{}: reading {at}: the compressed stream is corrupt or cut short ({e}); check it with \
         `{check} {0}`, or write it again",
        path.display()
    ))
}

/// The whole text of `path`, decompressed, at most `max` bytes: a longer
/// text is refused after `max + 1` bytes are read ([`Limits::too_long`]),
/// never read whole.
///
/// [`Limits::too_long`]: super::limits::Limits::too_long
pub fn read_text(path: &Path, limits: &super::limits::Limits) -> Result<String> {
    let r = open_reader(path)?;
    let mut bytes = Vec::new();
    r.take(limits.max_doc_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| read_error(path, "the text", e))?;
    if bytes.len() > limits.max_doc_bytes {
        let what = match Compression::of_path(path) {
            Compression::None => format!("{} (one document)", path.display()),
            _ => format!("{} (one document, decompressed)", path.display()),
        };
        return Err(limits.too_long(&what));
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::Config(format!(
            "{}: not UTF-8 text (byte {} is not valid UTF-8)",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Reads the next line of `r` into `buf` (cleared first; its newline
/// kept), at most `max` bytes before the newline: `Ok(None)` at the end,
/// `Ok(Some(bytes read))`, or `Err(())` for a longer line, of which no more
/// than `max + 1` bytes were read.
pub fn read_line_bounded(
    r: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<std::result::Result<usize, ()>>> {
    buf.clear();
    let n = (&mut *r).take(max as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    let content = n - usize::from(buf.last() == Some(&b'\n'));
    Ok(Some(if content > max { Err(()) } else { Ok(n) }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("upipe-inputs-{}-{name}", std::process::id()))
    }

    #[test]
    fn directories_expand_recursively_in_sorted_order() {
        let d = temp("dir");
        std::fs::create_dir_all(d.join("b/c")).unwrap();
        for f in ["z.txt", "a.txt", "b/c/x.jsonl", "b/m.txt", ".hidden"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        let files = expand_inputs(std::slice::from_ref(&d)).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|p| p.strip_prefix(&d).unwrap().to_owned())
            .collect();
        let want: Vec<PathBuf> = ["a.txt", "b/c/x.jsonl", "b/m.txt", "z.txt"]
            .map(PathBuf::from)
            .into();
        assert_eq!(names, want);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn gzip_and_zstd_decompress_and_corrupt_streams_name_the_file() {
        let gz = temp("a.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"{\"text\": \"hi\"}\n").unwrap();
        let bytes = enc.finish().unwrap();
        std::fs::write(&gz, &bytes).unwrap();
        assert!(is_jsonl(&gz) && is_document_input(&gz));
        let limits = super::super::limits::Limits::default();
        let read_text = |p: &Path| read_text(p, &limits);
        assert_eq!(read_text(&gz).unwrap(), "{\"text\": \"hi\"}\n");
        std::fs::write(&gz, &bytes[..bytes.len() / 2]).unwrap();
        let e = read_text(&gz).unwrap_err().to_string();
        assert!(
            e.contains(&gz.display().to_string()) && e.contains("gzip -t"),
            "{e}"
        );
        std::fs::remove_file(&gz).unwrap();
        // a zstd frame of "hi\n" (raw block), then one cut short
        let zst = temp("b.txt.zst");
        let frame = [
            0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x03, 0x19, 0x00, 0x00, b'h', b'i', b'\n',
        ];
        std::fs::write(&zst, frame).unwrap();
        assert_eq!(read_text(&zst).unwrap(), "hi\n");
        std::fs::write(&zst, &frame[..10]).unwrap();
        let e = read_text(&zst).unwrap_err().to_string();
        assert!(e.contains("zstd -t"), "{e}");
        std::fs::write(&zst, b"not zstd at all").unwrap();
        let e = read_text(&zst).unwrap_err().to_string();
        assert!(e.contains("not a zstd stream"), "{e}");
        std::fs::remove_file(&zst).unwrap();
    }

    #[test]
    fn train_on_documents_is_refused_with_the_tokenize_command() {
        let e = refuse_untokenized(Path::new("data/chat.jsonl.zst"), Some("tok.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "`upipe tokenize data/chat.jsonl.zst --tokenizer tok.json --out data/chat.u32`"
            ) && e.contains("--data data/chat.u32"),
            "{e}"
        );
        let e = refuse_untokenized(Path::new("corpus.parquet"), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--tokenizer byte --eos 0 --out corpus.u32"),
            "{e}"
        );
        assert!(refuse_untokenized(Path::new("train.u32"), None).is_ok());
        assert!(refuse_untokenized(Path::new("book.txt"), None).is_ok());
    }
}
