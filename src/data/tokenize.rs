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
use super::doc_index::{
    IndexWriter, MaskWriter, STAMP_IDS, index_path, mask_path, stamp_of, write_stamp,
};
use super::documents::{Document, Documents, Place};
use super::limits::Limits;
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
    /// Conversations among them (each ending as its chat template ends it,
    /// not with `eos`).
    pub conversations: u64,
    /// Documents left out: a chat template that rendered a conversation as
    /// nothing, or a conversation with no assistant token to train on.
    pub empty_documents: u64,
    pub unanswered_documents: u64,
    /// Where the first few left out are, and why.
    pub left_out: Vec<String>,
    /// The longest run of consecutive ids whose targets the mask does not
    /// count (a prompt), and where: a `train --seq` not above it makes
    /// windows with nothing to train on, which training passes over.
    pub longest_prompt: usize,
    pub longest_prompt_at: Option<String>,
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
                let (ids, mask) =
                    encode_chat(self.tok, chat, messages).map_err(|e| {
                        match messages.iter().position(|m| m["content"].is_array()) {
                            Some(i) => with_note(
                                e,
                                &format!(
                                    "message {i}'s content is a list of parts, which this template \
                                 may not render: give each message's content as one string"
                                ),
                            ),
                            None => e,
                        }
                    })?;
                Ok((ids, Some(mask)))
            }
        }
    }
}

/// A configuration error with `note` after its message.
fn with_note(e: Error, note: &str) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{m} ({note})")),
        other => other,
    }
}

/// A configuration error with the document's place `at` before its message.
fn located(e: Error, at: &str) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{at}: {m}")),
        other => other,
    }
}

/// The inputs of `upipe tokenize` less its own files: the ids, indexes and
/// masks it writes (by name: `.u32`/`.u16`/`.bin` and their `.docs`,
/// `.mask` and `.partial` files, `out`'s among them) are refused when named
/// and left out, with a note, when a directory holds them.
pub fn select_inputs(inputs: &[PathBuf], out: &Path) -> Result<Vec<PathBuf>> {
    if let Some(ids) = inputs.iter().find(|p| !p.is_dir() && is_tokenize_output(p)) {
        return crate::config_err!(
            "input {} is pre-tokenized (by its name: ids, or the index, mask or partial file \
             `upipe tokenize` writes beside them): upipe tokenize reads text and JSONL files; \
             train on ids with --data, or give the text they were made from (--out {} names \
             where the output goes, never an input)",
            ids.display(),
            out.display()
        );
    }
    let all = super::inputs::expand_inputs(inputs)?;
    let (skipped, kept): (Vec<PathBuf>, Vec<PathBuf>) =
        all.into_iter().partition(|p| is_tokenize_output(p));
    if let Some(first) = skipped.first() {
        tracing::warn!(
            "left out {} file(s) of the input directories that upipe tokenize writes (ids, \
             their index, mask or partial files), such as {}: they are not text",
            skipped.len(),
            first.display()
        );
    }
    Ok(kept)
}

/// Whether `path` is named as a file `upipe tokenize` writes.
fn is_tokenize_output(path: &Path) -> bool {
    let name = path.to_string_lossy();
    let mut base: &str = &name;
    for suffix in [".partial", ".docs", ".mask"] {
        base = base.strip_suffix(suffix).unwrap_or(base);
    }
    TokenFormat::of_path(Path::new(base)).is_some()
}

/// Tokenizes the documents of `inputs` (a JSONL line's text under `field`)
/// as `enc` says into `out` (`.u32`, or `.u16`/`.bin` for a vocabulary of
/// at most 65,536), with its index and loss mask beside it, within
/// `limits` (batches of text, the longest document); `progress` gets the
/// input bytes of each batch done.
pub fn tokenize_files(
    inputs: &[PathBuf],
    field: &str,
    enc: &Encoding,
    out: &Path,
    limits: &Limits,
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
    let files = select_inputs(inputs, out)?;
    let mut docs = Documents::bounded(&files, field, *limits)?;
    let outputs = [out.to_path_buf(), index_path(out), mask_path(out)];
    let partial = outputs
        .clone()
        .map(|p| PathBuf::from(format!("{}.partial", p.display())));
    let tally = match write_all(
        &mut docs,
        enc,
        format,
        &partial,
        limits.batch_bytes,
        progress,
    ) {
        Ok(t) => t,
        Err(e) => {
            // best effort: the error is what matters
            for p in &partial {
                let _ = std::fs::remove_file(p);
            }
            return Err(e);
        }
    };
    replace_outputs(&partial, &outputs, tally.stamp)?;
    Ok(tally.summary(enc.eos))
}

/// Stamps the index and mask written at `partial` with the ids' `stamp`
/// and renames them over `outputs` (ids, index, mask): the mask first, the
/// ids last, so that a kill at any point leaves files a run refuses
/// (stamps that differ) or the old or the new set whole; a mask of an
/// earlier run with none now is removed last (until then its stamp is
/// refused beside the new ids).
fn replace_outputs(partial: &[PathBuf; 3], outputs: &[PathBuf; 3], stamp: u32) -> Result<()> {
    let has_mask = partial[2].exists();
    write_stamp(&partial[1], stamp)?;
    if has_mask {
        write_stamp(&partial[2], stamp)?;
    }
    for i in [2, 1, 0].into_iter().filter(|&i| i != 2 || has_mask) {
        let (from, to) = (&partial[i], &outputs[i]);
        std::fs::rename(from, to).map_err(|e| {
            Error::io(
                format!("renaming {} to {}", from.display(), to.display()),
                e,
            )
        })?;
    }
    if !has_mask && outputs[2].exists() {
        std::fs::remove_file(&outputs[2])
            .map_err(|e| Error::io(format!("removing {}", outputs[2].display()), e))?;
    }
    Ok(())
}

/// What [`write_all`] counted.
#[derive(Default)]
struct Tally {
    lengths: Lengths,
    masked: u64,
    conversations: u64,
    empty: u64,
    unanswered: u64,
    left_out: Vec<String>,
    longest_prompt: usize,
    longest_prompt_at: Option<String>,
    /// The ids' first and last [`STAMP_IDS`], for their stamp.
    head: Vec<u32>,
    tail: std::collections::VecDeque<u32>,
    stamp: u32,
}

/// Names kept of the documents left out.
const LEFT_OUT_NAMED: usize = 5;

impl Tally {
    /// Counts a document that is left out (`why`), naming the first few.
    fn leave_out(&mut self, at: String, empty: bool) {
        let why = match empty {
            true => "the chat template rendered the conversation as nothing",
            false => "no assistant token to train on (a conversation with no assistant turn)",
        };
        *(if empty {
            &mut self.empty
        } else {
            &mut self.unanswered
        }) += 1;
        if self.left_out.len() < LEFT_OUT_NAMED {
            self.left_out.push(format!("{at}: {why}"));
        }
    }

    /// Keeps the ids' ends for their stamp.
    fn see_ids(&mut self, ids: &[u32]) {
        let room = STAMP_IDS.saturating_sub(self.head.len());
        self.head.extend(ids.iter().take(room));
        for &id in ids.iter().rev().take(STAMP_IDS).rev() {
            if self.tail.len() == STAMP_IDS {
                self.tail.pop_front();
            }
            self.tail.push_back(id);
        }
    }

    /// The longest run of uncounted flags of a document at `at`.
    fn see_prompt(&mut self, flags: &[bool], at: impl FnOnce() -> String) {
        let mut run = 0;
        let longest = flags.iter().fold(0, |best, &f| {
            run = if f { 0 } else { run + 1 };
            best.max(run)
        });
        if longest > self.longest_prompt {
            self.longest_prompt = longest;
            self.longest_prompt_at = Some(at());
        }
    }

    fn summary(self, eos: u32) -> TokenizeSummary {
        let l = &self.lengths;
        TokenizeSummary {
            documents: l.documents,
            tokens: l.tokens,
            eos,
            masked_documents: self.masked,
            conversations: self.conversations,
            empty_documents: self.empty,
            unanswered_documents: self.unanswered,
            left_out: self.left_out,
            longest_prompt: self.longest_prompt,
            longest_prompt_at: self.longest_prompt_at,
            p50: l.percentile(50.0),
            p90: l.percentile(90.0),
            p99: l.percentile(99.0),
            max: l.counts.keys().next_back().copied().unwrap_or(0),
        }
    }
}

/// The files [`write_all`] writes into.
struct Writers<'a> {
    ids: std::io::BufWriter<std::fs::File>,
    index: IndexWriter,
    mask: Option<MaskWriter>,
    paths: &'a [PathBuf; 3],
}

/// The batch loop: read, tokenize in parallel, write ids, index and mask in
/// order (`paths`: ids, index, mask). What it counted, the ids' stamp set.
fn write_all(
    docs: &mut Documents,
    enc: &Encoding,
    format: TokenFormat,
    paths: &[PathBuf; 3],
    batch_bytes: usize,
    progress: &dyn Fn(u64),
) -> Result<Tally> {
    let io = |e| Error::io(format!("writing {}", paths[0].display()), e);
    let file = std::fs::File::create(&paths[0]).map_err(io)?;
    let mut w = Writers {
        ids: std::io::BufWriter::with_capacity(1 << 20, file),
        index: IndexWriter::create(&paths[1])?,
        mask: None,
        paths,
    };
    let mut tally = Tally::default();
    let mut bytes = Vec::new();
    loop {
        let (batch, used) = read_batch(docs, batch_bytes)?;
        if batch.is_empty() {
            break;
        }
        let encoded = batch
            .par_iter()
            .map(|(d, place)| enc.encode(d).map_err(|e| (*place, e)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|(place, e)| located(e, &docs.describe(place)))?;
        bytes.clear();
        for ((doc, place), (ids, flags)) in batch.iter().zip(&encoded) {
            let at = || docs.describe(*place);
            if ids.is_empty() || flags.as_ref().is_some_and(|f| !f.contains(&true)) {
                tally.leave_out(at(), ids.is_empty());
                continue;
            }
            w.index.push(tally.lengths.tokens)?;
            push_mask(&mut w, &tally, ids.len(), flags.as_deref())?;
            if let Some(f) = flags {
                tally.masked += 1;
                tally.conversations += u64::from(matches!(doc, Document::Chat(_)));
                tally.see_prompt(f, at);
            }
            format.encode_into(ids, &mut bytes)?;
            tally.see_ids(ids);
            tally.lengths.add(ids.len());
        }
        w.ids.write_all(&bytes).map_err(io)?;
        progress(used);
    }
    w.ids.flush().map_err(io)?;
    w.index.finish(tally.lengths.tokens)?;
    if let Some(m) = w.mask {
        m.finish()?;
    }
    let tail: Vec<u32> = tally.tail.iter().copied().collect();
    tally.stamp = stamp_of(tally.lengths.tokens, &tally.head, &tail);
    Ok(tally)
}

/// The mask's flags of a document of `n` ids (`flags`: which count; `None`:
/// all), the mask created at the first masked document (every id before it
/// counted).
fn push_mask(w: &mut Writers, tally: &Tally, n: usize, flags: Option<&[bool]>) -> Result<()> {
    if flags.is_some() && w.mask.is_none() {
        let mut m = MaskWriter::create(&w.paths[2])?;
        m.push(&vec![true; tally.lengths.tokens as usize])?;
        w.mask = Some(m);
    }
    match (&mut w.mask, flags) {
        (Some(m), Some(f)) => m.push(f),
        (Some(m), None) => m.push(&vec![true; n]),
        (None, _) => Ok(()),
    }
}

/// Documents until about `batch_bytes` of text (at least one), each with
/// its place, and the input bytes they used.
fn read_batch(docs: &mut Documents, batch_bytes: usize) -> Result<(Vec<(Document, Place)>, u64)> {
    let (mut batch, mut text, mut used) = (Vec::new(), 0, 0);
    while text < batch_bytes.max(1) {
        let Some((doc, n)) = docs.next_doc()? else {
            break;
        };
        text += n.max(1) as usize;
        used += n;
        batch.push((doc, docs.place()));
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
