//! `upipe tokenize`'s engine: a corpus of text and JSONL files
//! ([`Documents`]) to one pre-tokenized file `OUT`, every document ending
//! with the end-of-sequence id (a conversation with its template's end of
//! turn), its document index `OUT.docs` and, when any document is a
//! conversation or a prompt with its completion, its loss mask `OUT.mask`
//! (`doc_index.rs`).
//!
//! Streaming: documents are read in batches of about `batch_bytes`, each
//! batch tokenized in parallel (rayon, the caller's pool) and written in
//! document order, so memory holds one batch and the output is the same for
//! any number of threads. The output goes to `OUT.partial` first and is
//! renamed when complete.

use super::chat::{ChatTemplate, encode_chat};
use super::corpus::Tokenizer;
use super::doc_index::{IndexWriter, MaskWriter, index_path, mask_path};
use super::documents::{Document, Documents};
use super::tokens::TokenFormat;
use crate::error::{Error, Result};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Names of end-of-sequence special tokens, in the order they are looked for.
pub const EOS_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
];

/// `--eos`: an id, or found from the tokenizer's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eos {
    Auto,
    Id(u32),
}

impl std::str::FromStr for Eos {
    type Err = Error;
    fn from_str(s: &str) -> Result<Eos> {
        match s {
            "auto" => Ok(Eos::Auto),
            n => n
                .parse()
                .map(Eos::Id)
                .map_err(|_| Error::Config(format!("--eos {n}: use a token id or auto"))),
        }
    }
}

/// The end-of-sequence id of `tok`, loaded from `path` (`tokenizer.json` or
/// its directory): `Eos::Id` as given (checked against the vocabulary), or
/// for `Eos::Auto` the first of: `eos_token_id` of a `config.json` beside it
/// (the first of a list), `eos_token` of a `tokenizer_config.json` beside
/// it, a special token of `tokenizer.json` named as in [`EOS_NAMES`].
pub fn resolve_eos(tok: &Tokenizer, path: &Path, eos: Eos) -> Result<u32> {
    let vocab = tok.vocab_size();
    let checked = |id: u32, from: &str| match (id as usize) < vocab {
        true => Ok(id),
        false => crate::config_err!(
            "end-of-sequence id {id} ({from}) is outside the tokenizer's vocabulary of {vocab}"
        ),
    };
    if let Eos::Id(id) = eos {
        return checked(id, "--eos");
    }
    if matches!(tok, Tokenizer::Byte(_)) {
        return crate::config_err!(
            "the byte tokenizer has no end-of-sequence token: pass --eos ID (the id that ends each document)"
        );
    }
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let config = dir.join("config.json");
    if let Some(v) = read_json(&config)?.and_then(|v| v.get("eos_token_id").cloned()) {
        let first = v.as_array().and_then(|a| a.first().cloned()).unwrap_or(v);
        let Some(id) = first.as_u64().and_then(|i| u32::try_from(i).ok()) else {
            return crate::config_err!(
                "{}: eos_token_id is not a token id; pass --eos ID",
                config.display()
            );
        };
        return checked(id, &config.display().to_string());
    }
    let tok_config = dir.join("tokenizer_config.json");
    if let Some(v) = read_json(&tok_config)?.and_then(|v| v.get("eos_token").cloned()) {
        let name = v.get("content").unwrap_or(&v).as_str().map(str::to_string);
        if let Some(id) = name.as_deref().and_then(|n| special_id(tok, n, false)) {
            return checked(id, &tok_config.display().to_string());
        }
    }
    if let Some(id) = EOS_NAMES.iter().find_map(|n| special_id(tok, n, true)) {
        return Ok(id);
    }
    crate::config_err!(
        "no end-of-sequence token found for {}: no config.json with eos_token_id beside it, no \
         tokenizer_config.json with eos_token, and no special token named {} in the tokenizer; \
         pass --eos ID (the id that ends each document)",
        path.display(),
        EOS_NAMES.join(", ")
    )
}

/// The JSON in `path`, `None` when there is no such file.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", path.display())))
}

/// The id of token `name` of an HF tokenizer (only a special added token
/// when `special_only`).
fn special_id(tok: &Tokenizer, name: &str, special_only: bool) -> Option<u32> {
    let Tokenizer::Hf(t) = tok else {
        return None;
    };
    if !special_only {
        return t.token_to_id(name);
    }
    t.get_added_tokens_decoder()
        .iter()
        .find(|(_, a)| a.special && a.content == name)
        .map(|(&id, _)| id)
}

/// Tokens per document, kept as a histogram (exact percentiles in memory
/// bounded by the number of distinct lengths).
#[derive(Debug, Clone, Default)]
struct Lengths {
    counts: BTreeMap<usize, u64>,
    documents: u64,
    tokens: u64,
}

impl Lengths {
    fn add(&mut self, n: usize) {
        *self.counts.entry(n).or_default() += 1;
        self.documents += 1;
        self.tokens += n as u64;
    }

    /// The nearest-rank `p`-th percentile (0 when empty).
    fn percentile(&self, p: f64) -> usize {
        let rank = ((p / 100.0) * self.documents as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (&len, &c) in &self.counts {
            seen += c;
            if seen >= rank {
                return len;
            }
        }
        0
    }
}

/// What [`tokenize_files`] wrote.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenizeSummary {
    pub documents: u64,
    /// Ids written, every document's end-of-sequence id included.
    pub tokens: u64,
    pub eos: u32,
    /// Conversations and prompt/completion documents (whose loss mask
    /// counts only the answer).
    pub masked_documents: u64,
    /// Tokens per document: p50, p90, p99, max.
    pub p50: usize,
    pub p90: usize,
    pub p99: usize,
    pub max: usize,
}

/// How documents become ids.
pub struct Encoding<'a> {
    pub tok: &'a Tokenizer,
    /// Ends every text and every completion.
    pub eos: u32,
    /// Renders conversations; `None`: the tokenizer has none (chat data is
    /// then an error naming `tokenizer`).
    pub chat: Option<&'a ChatTemplate>,
    /// The `--tokenizer` argument, for messages.
    pub tokenizer: &'a str,
}

impl Encoding<'_> {
    /// The ids of `doc`, and for chat or prompt/completion which count.
    pub fn encode(&self, doc: &Document) -> Result<(Vec<u32>, Option<Vec<bool>>)> {
        let with_eos = |mut ids: Vec<u32>| {
            if ids.last() != Some(&self.eos) {
                ids.push(self.eos);
            }
            ids
        };
        match doc {
            Document::Text(t) => Ok((with_eos(self.tok.encode_document(t)?), None)),
            Document::PromptCompletion { prompt, completion } => {
                let mut ids = self.tok.encode_document(prompt)?;
                let answer = with_eos(self.tok.encode(completion)?);
                let mut mask = vec![false; ids.len()];
                mask.resize(ids.len() + answer.len(), true);
                ids.extend(answer);
                Ok((ids, Some(mask)))
            }
            Document::Chat(messages) => {
                let chat = self
                    .chat
                    .ok_or_else(|| ChatTemplate::missing(self.tokenizer))?;
                let (ids, mask) = encode_chat(self.tok, chat, messages)?;
                Ok((ids, Some(mask)))
            }
        }
    }
}

/// Tokenizes the documents of `inputs` (a JSONL line's text under `field`)
/// as `enc` says into `out` (`.u32`, or `.u16`/`.bin` for a vocabulary of
/// at most 65,536), with its index and loss mask beside it; `progress` gets
/// the input bytes of each batch done.
pub fn tokenize_files(
    inputs: &[PathBuf],
    field: &str,
    enc: &Encoding,
    out: &Path,
    batch_bytes: usize,
    progress: &dyn Fn(u64),
) -> Result<TokenizeSummary> {
    let Some(format) = TokenFormat::of_path(out) else {
        return crate::config_err!(
            "--out {}: name the output .u32 (uint32 ids) or .u16/.bin (uint16 ids)",
            out.display()
        );
    };
    if enc.tok.vocab_size() > format.max_vocab() {
        return crate::config_err!(
            "--out {}: the tokenizer has {} ids, more than 16-bit ids hold; name the output .u32",
            out.display(),
            enc.tok.vocab_size()
        );
    }
    // a file of ids read as text is noise, and would be the output itself
    // when named as --out too (replaced by the tokens of its own bytes)
    if let Some(ids) = inputs.iter().find(|p| TokenFormat::of_path(p).is_some()) {
        return crate::config_err!(
            "input {} is pre-tokenized (by its extension): upipe tokenize reads text and JSONL \
             files; train on it with --data {0}, or give the text it was made from",
            ids.display()
        );
    }
    let mut docs = Documents::new(inputs, field)?;
    let outputs = [out.to_path_buf(), index_path(out), mask_path(out)];
    let partial = outputs
        .clone()
        .map(|p| PathBuf::from(format!("{}.partial", p.display())));
    let result = write_all(&mut docs, enc, format, &partial, batch_bytes, progress);
    let (lengths, masked) = match result {
        Ok(l) => l,
        Err(e) => {
            // best effort: the error is what matters
            for p in &partial {
                let _ = std::fs::remove_file(p);
            }
            return Err(e);
        }
    };
    if masked == 0 {
        // no mask this time: one left from an earlier run would not fit the ids
        let _ = std::fs::remove_file(&outputs[2]);
    }
    for (from, to) in partial.iter().zip(&outputs).filter(|(p, _)| p.exists()) {
        std::fs::rename(from, to).map_err(|e| {
            Error::io(
                format!("renaming {} to {}", from.display(), to.display()),
                e,
            )
        })?;
    }
    Ok(TokenizeSummary {
        documents: lengths.documents,
        tokens: lengths.tokens,
        eos: enc.eos,
        masked_documents: masked,
        p50: lengths.percentile(50.0),
        p90: lengths.percentile(90.0),
        p99: lengths.percentile(99.0),
        max: lengths.counts.keys().next_back().copied().unwrap_or(0),
    })
}

/// The batch loop: read, tokenize in parallel, write ids, index and mask in
/// order (`paths`: ids, index, mask). The lengths and the masked documents.
fn write_all(
    docs: &mut Documents,
    enc: &Encoding,
    format: TokenFormat,
    paths: &[PathBuf; 3],
    batch_bytes: usize,
    progress: &dyn Fn(u64),
) -> Result<(Lengths, u64)> {
    let io = |e| Error::io(format!("writing {}", paths[0].display()), e);
    let file = std::fs::File::create(&paths[0]).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut index = IndexWriter::create(&paths[1])?;
    let mut mask: Option<MaskWriter> = None;
    let (mut lengths, mut masked) = (Lengths::default(), 0u64);
    let mut bytes = Vec::new();
    loop {
        let (batch, used) = read_batch(docs, batch_bytes)?;
        if batch.is_empty() {
            break;
        }
        let encoded: Vec<(Vec<u32>, Option<Vec<bool>>)> = batch
            .par_iter()
            .map(|d| enc.encode(d))
            .collect::<Result<_>>()?;
        bytes.clear();
        // a document of no id (a template that rendered nothing) has no start
        for (ids, flags) in encoded.iter().filter(|(ids, _)| !ids.is_empty()) {
            index.push(lengths.tokens)?;
            if flags.is_some() {
                masked += 1;
                if mask.is_none() {
                    // every id before the first masked document counts
                    let mut m = MaskWriter::create(&paths[2])?;
                    m.push(&vec![true; lengths.tokens as usize])?;
                    mask = Some(m);
                }
            }
            if let Some(m) = &mut mask {
                match flags {
                    Some(f) => m.push(f)?,
                    None => m.push(&vec![true; ids.len()])?,
                }
            }
            format.encode_into(ids, &mut bytes)?;
            lengths.add(ids.len());
        }
        w.write_all(&bytes).map_err(io)?;
        progress(used);
    }
    w.flush().map_err(io)?;
    index.finish(lengths.tokens)?;
    if let Some(m) = mask {
        m.finish()?;
    }
    Ok((lengths, masked))
}

/// Documents until about `batch_bytes` of text (at least one), and the input bytes they used.
fn read_batch(docs: &mut Documents, batch_bytes: usize) -> Result<(Vec<Document>, u64)> {
    let (mut batch, mut text, mut used) = (Vec::new(), 0, 0);
    while text < batch_bytes.max(1) {
        let Some((doc, n)) = docs.next_doc()? else {
            break;
        };
        text += n.max(1) as usize;
        used += n;
        batch.push(doc);
    }
    Ok((batch, used))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut l = Lengths::default();
        for n in 1..=100 {
            l.add(n);
        }
        assert_eq!(
            (l.percentile(50.0), l.percentile(90.0), l.percentile(99.0)),
            (50, 90, 99)
        );
        let mut one = Lengths::default();
        one.add(7);
        assert_eq!(one.percentile(50.0), 7);
        assert_eq!(Lengths::default().percentile(50.0), 0);
    }

    #[test]
    fn eos_flag_parses() {
        assert_eq!("auto".parse::<Eos>().unwrap(), Eos::Auto);
        assert_eq!("2".parse::<Eos>().unwrap(), Eos::Id(2));
        let e = "end".parse::<Eos>().unwrap_err().to_string();
        assert!(e.contains("token id or auto"), "{e}");
    }
}
