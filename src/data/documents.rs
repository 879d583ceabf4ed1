//! Documents of a corpus, streamed from a list of files in order
//! (directories expanded, compressed files decompressed: `inputs.rs`): a
//! plain text file is one document (read whole); a JSONL file (`.jsonl`,
//! `.ndjson`) holds one document per line (blank lines skipped): its text
//! under a named field, or a conversation (`messages`: a list of
//! `{"role", "content"}`) or a `prompt` and its `completion`, whose loss
//! counts only the answer; a Parquet file (`.parquet`) holds one document
//! per row, its text in the `--field` column. Nothing beyond the current document and the
//! reader's buffer is held in memory, and a document (a text file, a line,
//! a row) longer than [`Limits::max_doc_bytes`] is refused once that much
//! is read, naming the file, the line and `--max-doc-mb`.

use super::inputs::{
    expand_inputs, is_jsonl, is_parquet, open_reader, read_error, read_line_bounded, read_text,
};
use super::limits::Limits;
use super::parquet_input::ParquetDocs;
use crate::error::{Error, Result};
use std::io::BufRead;
use std::path::PathBuf;

/// One document of the corpus.
#[derive(Debug, Clone, PartialEq)]
pub enum Document {
    /// Text: every token counts.
    Text(String),
    /// A conversation, rendered with the model's chat template: only the
    /// assistant's tokens count. Each message is a JSON object with `role`
    /// and `content` (other keys passed to the template as they are).
    Chat(Vec<serde_json::Value>),
    /// A prompt and its completion: only the completion's tokens count.
    PromptCompletion { prompt: String, completion: String },
}

impl Document {
    /// Whether only some of its tokens count (chat, prompt/completion).
    pub fn is_masked(&self) -> bool {
        !matches!(self, Document::Text(_))
    }
}

/// Where a document came from: its file (an index into
/// [`Documents::files`]) and its line or row there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub file: usize,
    pub at: PlaceAt,
}

/// A document's place within its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlaceAt {
    /// The whole file (a text file).
    Whole,
    /// A JSONL line (1-based).
    Line(usize),
    /// A Parquet row (1-based).
    Row(u64),
}

/// The total size in bytes of `inputs` (for progress; unreadable ones count 0).
pub fn input_bytes(inputs: &[PathBuf]) -> u64 {
    let files = expand_inputs(inputs).unwrap_or_default();
    files
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// An open JSONL file.
struct JsonlFile {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    /// 1-based number of the line read last.
    line: usize,
}

/// A file of many documents, open.
enum Open {
    Jsonl(JsonlFile),
    Parquet(ParquetDocs),
}

/// A stream of documents over files, in order.
pub struct Documents {
    inputs: Vec<PathBuf>,
    next_input: usize,
    field: String,
    current: Option<Open>,
    buf: Vec<u8>,
    limits: Limits,
    /// Where the document returned last came from.
    place: Place,
    /// Rows read from the current Parquet file.
    rows: u64,
}

impl Documents {
    /// Documents of `inputs` (directories expanded), a JSONL file's text
    /// under `field`. Every input must be a readable file or directory; the
    /// error names the first that is not. The default [`Limits`].
    pub fn new(inputs: &[PathBuf], field: &str) -> Result<Documents> {
        Documents::bounded(inputs, field, Limits::default())
    }

    /// As [`Documents::new`], read within `limits`.
    pub fn bounded(inputs: &[PathBuf], field: &str, limits: Limits) -> Result<Documents> {
        if inputs.is_empty() {
            return crate::config_err!("no input files: name text or JSONL files to tokenize");
        }
        let inputs = expand_inputs(inputs)?;
        if inputs.is_empty() {
            return crate::config_err!(
                "the input directories hold no file: name text or JSONL files to tokenize"
            );
        }
        Ok(Documents {
            inputs,
            next_input: 0,
            field: field.to_string(),
            current: None,
            buf: Vec::new(),
            limits,
            place: Place {
                file: 0,
                at: PlaceAt::Whole,
            },
            rows: 0,
        })
    }

    /// The input files, directories expanded.
    pub fn files(&self) -> &[PathBuf] {
        &self.inputs
    }

    /// Where the document [`Documents::next_doc`] returned last came from.
    pub fn place(&self) -> Place {
        self.place
    }

    /// `place` in words: `FILE line N`, `FILE row N` or `FILE`.
    pub fn describe(&self, place: Place) -> String {
        let file = self.inputs.get(place.file).map(|p| p.display());
        let file = file.map(|f| f.to_string()).unwrap_or_default();
        match place.at {
            PlaceAt::Whole => file,
            PlaceAt::Line(n) => format!("{file} line {n}"),
            PlaceAt::Row(n) => format!("{file} row {n}"),
        }
    }

    /// The next document and how many input bytes it used, or `None` after the last.
    pub fn next_doc(&mut self) -> Result<Option<(Document, u64)>> {
        loop {
            let file = self.next_input.saturating_sub(1);
            let next = match &mut self.current {
                Some(Open::Jsonl(f)) => {
                    next_jsonl_doc(f, &self.field, &mut self.buf, &self.limits)?
                        .map(|d| (d, PlaceAt::Line(f.line)))
                }
                Some(Open::Parquet(p)) => match p.next_text()? {
                    Some(t) => {
                        self.rows += 1;
                        let at = PlaceAt::Row(self.rows);
                        if t.len() > self.limits.max_doc_bytes {
                            let what = self.describe(Place { file, at });
                            return Err(self.limits.too_long(&what));
                        }
                        let n = t.len() as u64;
                        Some(((Document::Text(t), n), at))
                    }
                    None => None,
                },
                None => None,
            };
            if let Some((doc, at)) = next {
                self.place = Place { file, at };
                return Ok(Some(doc));
            }
            self.current = None;
            let Some(path) = self.inputs.get(self.next_input).cloned() else {
                return Ok(None);
            };
            self.next_input += 1;
            if is_parquet(&path) {
                let docs = ParquetDocs::open(&path, &self.field, self.limits.batch_bytes)?;
                self.current = Some(Open::Parquet(docs));
                self.rows = 0;
                continue;
            }
            if !is_jsonl(&path) {
                let used = path.metadata().map(|m| m.len()).unwrap_or(0);
                self.place = Place {
                    file: self.next_input - 1,
                    at: PlaceAt::Whole,
                };
                let text = read_text(&path, &self.limits)?;
                return Ok(Some((Document::Text(text), used)));
            }
            self.current = Some(Open::Jsonl(JsonlFile {
                reader: open_reader(&path)?,
                path,
                line: 0,
            }));
        }
    }
}

/// The next non-blank line's document of `f`, or `None` at its end; a
/// line longer than `limits` allow is refused once that much is read.
fn next_jsonl_doc(
    f: &mut JsonlFile,
    field: &str,
    buf: &mut Vec<u8>,
    limits: &Limits,
) -> Result<Option<(Document, u64)>> {
    let mut used = 0u64;
    loop {
        f.line += 1;
        let at = || format!("{} line {}", f.path.display(), f.line);
        let read = read_line_bounded(f.reader.as_mut(), buf, limits.max_doc_bytes)
            .map_err(|e| read_error(&f.path, &format!("line {}", f.line), e))?;
        let n = match read {
            None => return Ok(None),
            Some(Err(())) => return Err(limits.too_long(&at())),
            Some(Ok(n)) => n,
        };
        used += n as u64;
        let Ok(line) = std::str::from_utf8(buf) else {
            return crate::config_err!("{}: not UTF-8 text", at());
        };
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::Config(format!("{}: not a JSON object: {e}", at())))?;
        return Ok(Some((line_document(&value, field, &at())?, used)));
    }
}

/// The document of one JSONL line (`at` names it): its text under `field`,
/// else its `messages`, else its `prompt` and `completion`.
fn line_document(value: &serde_json::Value, field: &str, at: &str) -> Result<Document> {
    use serde_json::Value;
    let text = |key: &str| match value.get(key) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => crate::config_err!("{at}: field \"{key}\" is not a string"),
        None => Ok(None),
    };
    if let Some(s) = text(field)? {
        return Ok(Document::Text(s));
    }
    if let Some(m) = value.get("messages") {
        return chat_messages(m, at).map(Document::Chat);
    }
    if let Some(c) = value.get("conversations") {
        return sharegpt_messages(c, at).map(Document::Chat);
    }
    if let (Some(prompt), Some(completion)) = (text("prompt")?, text("completion")?) {
        return Ok(Document::PromptCompletion { prompt, completion });
    }
    crate::config_err!(
        "{at}: no field \"{field}\" (nor \"messages\", nor \"conversations\", nor \"prompt\" \
         and \"completion\"); name the field holding the text with --field"
    )
}

/// ShareGPT's speakers (`from`) and the roles they are.
const SHAREGPT_ROLES: [(&str, &str); 7] = [
    ("system", "system"),
    ("human", "user"),
    ("user", "user"),
    ("gpt", "assistant"),
    ("assistant", "assistant"),
    ("tool", "tool"),
    ("function_response", "tool"),
];

/// A ShareGPT conversation (`conversations`: objects with `from` and
/// `value`) as messages of `role` and `content`.
fn sharegpt_messages(c: &serde_json::Value, at: &str) -> Result<Vec<serde_json::Value>> {
    let Some(list) = c.as_array().filter(|l| !l.is_empty()) else {
        return crate::config_err!("{at}: \"conversations\" is not a non-empty list of turns");
    };
    let known = || SHAREGPT_ROLES.map(|(f, _)| f).join(", ");
    let mut messages = Vec::with_capacity(list.len());
    for (i, turn) in list.iter().enumerate() {
        let (Some(from), Some(value)) = (
            turn.get("from").and_then(|f| f.as_str()),
            turn.get("value").and_then(|v| v.as_str()),
        ) else {
            return crate::config_err!(
                "{at}: turn {i} of \"conversations\" has no string \"from\" and \"value\"; \
                 each ShareGPT turn is {{\"from\": \"human\"|\"gpt\"|..., \"value\": \"...\"}}"
            );
        };
        let Some((_, role)) = SHAREGPT_ROLES.iter().find(|(f, _)| *f == from) else {
            return crate::config_err!(
                "{at}: turn {i} of \"conversations\" is from \"{from}\", which upipe does not \
                 know as a role; use one of {}",
                known()
            );
        };
        messages.push(serde_json::json!({"role": role, "content": value}));
    }
    Ok(messages)
}

/// A conversation's messages: objects with a string `role` and `content`.
fn chat_messages(m: &serde_json::Value, at: &str) -> Result<Vec<serde_json::Value>> {
    let Some(list) = m.as_array().filter(|l| !l.is_empty()) else {
        return crate::config_err!("{at}: \"messages\" is not a non-empty list of messages");
    };
    for (i, msg) in list.iter().enumerate() {
        let ok = msg.get("role").is_some_and(|r| r.is_string())
            && msg
                .get("content")
                .is_some_and(|c| c.is_string() || c.is_array());
        if !ok {
            return crate::config_err!(
                "{at}: message {i} has no string \"role\" and \"content\"; each message is \
                 {{\"role\": \"user\"|\"assistant\"|..., \"content\": \"...\"}}"
            );
        }
    }
    Ok(list.clone())
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
            match doc {
                Document::Text(t) => out.push(t),
                other => out.push(format!("{other:?}")),
            }
        }
        Ok(out)
    }

    #[test]
    fn chat_and_prompt_completion_lines_are_told_apart() {
        let p = temp(
            "chat.jsonl",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n\
             {\"prompt\": \"2+2=\", \"completion\": \"4\"}\n\
             {\"messages\": [{\"content\": \"x\"}]}\n",
        );
        let mut d = Documents::new(std::slice::from_ref(&p), "text").unwrap();
        let (first, _) = d.next_doc().unwrap().unwrap();
        assert!(matches!(&first, Document::Chat(m) if m.len() == 1) && first.is_masked());
        let (second, _) = d.next_doc().unwrap().unwrap();
        assert_eq!(
            second,
            Document::PromptCompletion {
                prompt: "2+2=".into(),
                completion: "4".into()
            }
        );
        let e = d.next_doc().unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("message 0"), "{e}");
        std::fs::remove_file(&p).unwrap();
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
