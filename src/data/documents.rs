//! Documents of a text corpus, streamed from a list of files in order:
//! a plain text file is one document (read whole); a JSONL file (`.jsonl`,
//! `.ndjson`) holds one document per line, its text under a named field
//! (blank lines are skipped). Nothing beyond the current document and the
//! reader's buffer is held in memory.

use crate::error::{Error, Result};
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Whether `path` names a JSONL file (by extension).
pub fn is_jsonl(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "ndjson")
    )
}

/// The total size in bytes of `inputs` (for progress; unreadable ones count 0).
pub fn input_bytes(inputs: &[PathBuf]) -> u64 {
    inputs
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// An open JSONL file.
struct JsonlFile {
    path: PathBuf,
    reader: std::io::BufReader<std::fs::File>,
    /// 1-based number of the line read last.
    line: usize,
}

/// A stream of documents over files, in order.
pub struct Documents {
    inputs: Vec<PathBuf>,
    next_input: usize,
    field: String,
    current: Option<JsonlFile>,
    buf: String,
}

impl Documents {
    /// Documents of `inputs`, a JSONL file's text under `field`. Every input
    /// must be a readable file; the error names the first that is not.
    pub fn new(inputs: &[PathBuf], field: &str) -> Result<Documents> {
        if inputs.is_empty() {
            return crate::config_err!("no input files: name text or JSONL files to tokenize");
        }
        for p in inputs {
            crate::input_path::check_file(p, "input")?;
        }
        Ok(Documents {
            inputs: inputs.to_vec(),
            next_input: 0,
            field: field.to_string(),
            current: None,
            buf: String::new(),
        })
    }

    /// The next document and how many input bytes it used, or `None` after the last.
    pub fn next_doc(&mut self) -> Result<Option<(String, u64)>> {
        loop {
            if let Some(f) = &mut self.current {
                if let Some(doc) = next_jsonl_doc(f, &self.field, &mut self.buf)? {
                    return Ok(Some(doc));
                }
                self.current = None;
            }
            let Some(path) = self.inputs.get(self.next_input).cloned() else {
                return Ok(None);
            };
            self.next_input += 1;
            if !is_jsonl(&path) {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    Error::io(format!("reading {} as UTF-8 text", path.display()), e)
                })?;
                let n = text.len() as u64;
                return Ok(Some((text, n)));
            }
            let file = std::fs::File::open(&path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            self.current = Some(JsonlFile {
                path,
                reader: std::io::BufReader::with_capacity(1 << 20, file),
                line: 0,
            });
        }
    }
}

/// The next non-blank line's document of `f`, or `None` at its end.
fn next_jsonl_doc(
    f: &mut JsonlFile,
    field: &str,
    buf: &mut String,
) -> Result<Option<(String, u64)>> {
    let mut used = 0u64;
    loop {
        buf.clear();
        f.line += 1;
        let n = f.reader.read_line(buf).map_err(|e| {
            Error::io(
                format!("reading line {} of {}", f.line, f.path.display()),
                e,
            )
        })?;
        if n == 0 {
            return Ok(None);
        }
        used += n as u64;
        if buf.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", f.path.display(), f.line);
        let value: serde_json::Value = serde_json::from_str(buf)
            .map_err(|e| Error::Config(format!("{}: not a JSON object: {e}", at())))?;
        return match value.get(field) {
            Some(serde_json::Value::String(s)) => Ok(Some((s.clone(), used))),
            Some(_) => crate::config_err!("{}: field \"{field}\" is not a string", at()),
            None => crate::config_err!(
                "{}: no field \"{field}\"; name the field holding the text with --field",
                at()
            ),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("upipe-docs-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn all(d: &mut Documents) -> Result<Vec<String>> {
        let mut out = Vec::new();
        while let Some((doc, _)) = d.next_doc()? {
            out.push(doc);
        }
        Ok(out)
    }

    #[test]
    fn text_files_and_jsonl_lines_are_documents_in_order() {
        let a = temp("a.txt", "first\nfile\n");
        let b = temp(
            "b.jsonl",
            "{\"text\": \"one\"}\n\n{\"text\": \"two\", \"id\": 3}\n",
        );
        let c = temp("c.txt", "");
        let inputs = [a.clone(), b.clone(), c.clone()];
        assert_eq!(input_bytes(&inputs), 11 + 42);
        let mut d = Documents::new(&inputs, "text").unwrap();
        assert_eq!(all(&mut d).unwrap(), ["first\nfile\n", "one", "two", ""]);
        for p in [a, b, c] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn bad_jsonl_lines_name_file_and_line() {
        let p = temp("bad.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
        let mut d = Documents::new(std::slice::from_ref(&p), "text").unwrap();
        let err = all(&mut d).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{} line 2", p.display()))
                && err.contains("no field \"text\"")
                && err.contains("--field"),
            "{err}"
        );
        let mut d = Documents::new(std::slice::from_ref(&p), "body").unwrap();
        let err = all(&mut d).unwrap_err().to_string();
        assert!(
            err.contains("line 1") && err.contains("no field \"body\""),
            "{err}"
        );
        std::fs::write(&p, "{\"text\": 3}\nnot json\n").unwrap();
        let mut d = Documents::new(std::slice::from_ref(&p), "text").unwrap();
        let err = all(&mut d).unwrap_err().to_string();
        assert!(
            err.contains("line 1") && err.contains("not a string"),
            "{err}"
        );
        std::fs::write(&p, "\nnot json\n").unwrap();
        let mut d = Documents::new(std::slice::from_ref(&p), "text").unwrap();
        let err = all(&mut d).unwrap_err().to_string();
        assert!(
            err.contains("line 2") && err.contains("not a JSON object"),
            "{err}"
        );
        std::fs::remove_file(&p).unwrap();
        let err = Documents::new(&[PathBuf::from("/no/such.txt")], "text")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("/no/such.txt"), "{err}");
        assert!(Documents::new(&[], "text").is_err());
    }
}
