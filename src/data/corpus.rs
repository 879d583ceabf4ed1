//! Training data: the bundled corpus, tokenizers (bytes or HF `tokenizer.json`),
//! loading text or pre-tokenized files as [`Tokens`], and a deterministic
//! sampler of training windows.

use super::limits::PIECE_BYTES;
use crate::error::{Error, Result};
use crate::input_path::{check_file, check_file_or_dir};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub use super::tokens::{TokenFormat, Tokens};

/// The bundled English corpus (see `assets/README.md` for its provenance).
pub const CORPUS: &str = include_str!("../../assets/corpus.txt");

/// Tokenizer whose ids are the UTF-8 bytes of the text (vocabulary 256).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Number of distinct ids.
    pub const VOCAB: usize = 256;

    /// The bytes of `text` as ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// The text of `ids`; an id above 255 is an error, invalid UTF-8 is replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                u8::try_from(id).map_err(|_| {
                    Error::Config(format!(
                        "token id {id} at position {i} is not a byte; the byte tokenizer has ids 0..=255"
                    ))
                })
            })
            .collect::<Result<Vec<u8>>>()?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// A tokenizer: bytes, or a Hugging Face `tokenizer.json`.
#[derive(Clone)]
pub enum Tokenizer {
    /// UTF-8 bytes, vocabulary 256.
    Byte(ByteTokenizer),
    /// A Hugging Face tokenizer loaded from `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Byte(_) => write!(f, "Tokenizer::Byte"),
            Tokenizer::Hf(t) => write!(f, "Tokenizer::Hf(vocab {})", t.get_vocab_size(true)),
        }
    }
}

impl Tokenizer {
    /// The byte tokenizer.
    pub fn byte() -> Self {
        Tokenizer::Byte(ByteTokenizer)
    }

    /// Loads a Hugging Face `tokenizer.json` (or the one inside a directory).
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        check_file_or_dir(path, "tokenizer")?;
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        check_file(&file, "tokenizer")?;
        let bytes = std::fs::read(&file)
            .map_err(|e| Error::io(format!("reading {}", file.display()), e))?;
        Self::from_hf_bytes(&bytes)
            .map_err(|e| Error::Config(format!("{}: {}", file.display(), config_msg(&e))))
    }

    /// Parses the contents of a Hugging Face `tokenizer.json`.
    pub fn from_hf_bytes(bytes: &[u8]) -> Result<Self> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(|t| Tokenizer::Hf(Box::new(t)))
            .map_err(|e| Error::Config(format!("not a valid tokenizer.json: {e}")))
    }

    /// Resolves a user argument: `byte`, or a path to a `tokenizer.json` or a directory holding one.
    pub fn resolve(arg: &str) -> Result<Self> {
        if arg == "byte" {
            return Ok(Self::byte());
        }
        let path = Path::new(arg);
        if !path.exists() {
            return Err(Error::Config(format!(
                "unknown tokenizer '{arg}': use 'byte' or a path to a tokenizer.json or a directory holding one"
            )));
        }
        Self::from_hf_file(path)
    }

    /// Number of ids the tokenizer can produce (added tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte(_) => ByteTokenizer::VOCAB,
            Tokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Token ids of `text`, without special tokens added; a text longer
    /// than [`PIECE_BYTES`] is encoded in pieces ([`Tokenizer::encode_in_pieces`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_in_pieces(text, false, PIECE_BYTES)
    }

    /// Token ids of one document with the special tokens the tokenizer's
    /// own post-processor adds (a BOS where its `tokenizer.json` says so);
    /// the byte tokenizer adds none. In pieces, as [`Tokenizer::encode`].
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_in_pieces(text, true, PIECE_BYTES)
    }

    /// Token ids of `text` (with the post-processor's special tokens around
    /// them when `special`), an HF tokenizer taking at most about `piece`
    /// bytes at once: its working memory is about 200 times the text it
    /// holds. A longer text is cut at whitespace ([`piece_end`]), where a
    /// byte-level tokenizer (GPT-2, Llama 3, Qwen) splits words anyway, so
    /// its ids are those of the whole text; a tokenizer that merges across
    /// spaces may differ at each cut by a token.
    pub fn encode_in_pieces(&self, text: &str, special: bool, piece: usize) -> Result<Vec<u32>> {
        let t = match self {
            Tokenizer::Byte(b) => return Ok(b.encode(text)),
            Tokenizer::Hf(t) if text.len() <= piece => {
                return t
                    .encode(text, special)
                    .map(|enc| enc.get_ids().to_vec())
                    .map_err(|e| Error::Config(format!("tokenizing text failed: {e}")));
            }
            Tokenizer::Hf(t) => t,
        };
        let failed = |e| Error::Config(format!("tokenizing text failed: {e}"));
        let (mut ids, mut rest) = (Vec::new(), text);
        while !rest.is_empty() {
            let end = piece_end(rest, piece);
            ids.extend_from_slice(t.encode(&rest[..end], false).map_err(failed)?.get_ids());
            rest = &rest[end..];
        }
        if !special {
            return Ok(ids);
        }
        let (before, after) = special_ends(t).map_err(failed)?;
        let mut out = Vec::with_capacity(before.len() + ids.len() + after.len());
        out.extend(before);
        out.extend(ids);
        out.extend(after);
        Ok(out)
    }

    /// The special tokens the tokenizer's post-processor puts before a
    /// document (a BOS for Llama 3; none for Qwen or the byte tokenizer).
    pub fn document_prefix(&self) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte(_) => Ok(Vec::new()),
            Tokenizer::Hf(t) => special_ends(t)
                .map(|(before, _)| before)
                .map_err(|e| Error::Config(format!("tokenizing text failed: {e}"))),
        }
    }

    /// Text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Byte(b) => b.decode(ids),
            Tokenizer::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| Error::Config(format!("decoding ids failed: {e}"))),
        }
    }
}

/// Where the first piece of `text` ends (a byte index, `text.len()` when
/// it is no longer than `piece`): before the last whitespace byte of its
/// second half that a non-whitespace byte follows (a byte-level
/// pre-tokenizer starts a word there, its space with it), else at the last
/// character boundary within `piece` (text with no whitespace for half a
/// piece).
pub fn piece_end(text: &str, piece: usize) -> usize {
    if text.len() <= piece.max(1) {
        return text.len();
    }
    let b = text.as_bytes();
    let end = piece.max(1);
    let space = |c: u8| c.is_ascii_whitespace();
    if let Some(i) = (end / 2..end)
        .rev()
        .find(|&i| i > 0 && space(b[i]) && !space(b[i + 1]))
    {
        return i;
    }
    let mut cut = end;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    match cut {
        0 => text.char_indices().nth(1).map_or(text.len(), |(i, _)| i),
        c => c,
    }
}

/// The special tokens `t`'s post-processor puts before and after one
/// sequence (a BOS, an EOS), found by post-processing a one-token sequence.
fn special_ends(t: &tokenizers::Tokenizer) -> tokenizers::Result<(Vec<u32>, Vec<u32>)> {
    use tokenizers::{Encoding, Token};
    let probe = Encoding::from_tokens(vec![Token::new(0, String::new(), (0, 0))], 0);
    let done = t.post_process(probe, None, true)?;
    // padding (attention mask 0) is left out: a long document is not padded
    let kept = (done.get_ids().iter())
        .zip(done.get_special_tokens_mask())
        .zip(done.get_attention_mask())
        .filter(|(_, attend)| **attend == 1)
        .map(|((&id, &special), _)| (id, special == 1));
    let (mut before, mut after, mut seen) = (Vec::new(), Vec::new(), false);
    for (id, special) in kept {
        match (special, seen) {
            (false, _) => seen = true,
            (true, false) => before.push(id),
            (true, true) => after.push(id),
        }
    }
    Ok((before, after))
}

fn config_msg(e: &Error) -> String {
    match e {
        Error::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Writes ids as raw little-endian `u32` (the `.u32` format).
pub fn write_u32_tokens(path: &Path, tokens: &[u32]) -> Result<()> {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Loads training tokens for a model of `vocab` ids.
///
/// - pre-tokenized files (`.u32`, `.u16`, `.bin`) are memory-mapped and their
///   ids checked against `vocab`; a `tokenizer` given with them is ignored
///   with a warning (the ids are already tokens);
/// - otherwise `tokenizer` (`byte` when `None`) tokenizes the file, or the
///   bundled corpus when `path` is `None`; a tokenizer with more ids than the
///   model's vocabulary is an error.
pub fn load_tokens(path: Option<&Path>, tokenizer: Option<&str>, vocab: usize) -> Result<Tokens> {
    if let Some(p) = path.filter(|p| TokenFormat::of_path(p).is_some()) {
        if let Some(t) = tokenizer {
            tracing::warn!(
                "--tokenizer {t} is ignored: {} is pre-tokenized, and its ids are checked against \
                 the model's vocabulary of {vocab}",
                p.display()
            );
        }
        return Tokens::open_checked(p, vocab);
    }
    let arg = tokenizer.unwrap_or("byte");
    let tok = Tokenizer::resolve(arg)?;
    if tok.vocab_size() > vocab {
        return crate::config_err!(
            "tokenizer {arg} has {} ids but the model's vocabulary has {vocab}: its ids would not \
             all index the embedding; use the model's own tokenizer.json (or a model whose vocab_size covers it)",
            tok.vocab_size()
        );
    }
    let tokens = match path {
        None => Tokens::from_ids(tok.encode(CORPUS)?, "the bundled corpus"),
        Some(p) => {
            let text = read_text_data(p)?;
            Tokens::from_ids(tok.encode(&text)?, &format!("{} (tokenized)", p.display()))
        }
    };
    tokens.check_vocab(vocab)?;
    Ok(tokens)
}

/// The text of `--data` file `path`: a regular file holding UTF-8 text,
/// not empty; the errors say what the file is instead.
fn read_text_data(path: &Path) -> Result<String> {
    check_file(path, "--data")?;
    let bytes = std::fs::read(path)
        .map_err(|e| Error::io(format!("reading text {}", path.display()), e))?;
    if bytes.is_empty() {
        return crate::config_err!(
            "--data {} is empty: give a file of UTF-8 text, or pre-tokenized ids (.u32, .u16, .bin)",
            path.display()
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        Error::Config(format!(
            "--data {} is not UTF-8 text (byte {} is not valid UTF-8): text data is read as UTF-8; \
             pre-tokenized ids need the extension .u32 (uint32) or .u16/.bin (uint16)",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Errors if any id is `>= vocab`, naming the ids' source, the first such id
/// and its position ([`Tokens::check_vocab`]).
pub fn check_vocab(tokens: &Tokens, vocab: usize) -> Result<()> {
    tokens.check_vocab(vocab)
}

/// One training window of `L + 1` consecutive tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window<'a> {
    /// Position of the window's first token in the data.
    pub start: usize,
    /// The `L + 1` tokens.
    pub tokens: &'a [u32],
}

impl<'a> Window<'a> {
    /// The first `L` tokens (model inputs).
    pub fn inputs(&self) -> &'a [u32] {
        &self.tokens[..self.tokens.len() - 1]
    }

    /// The last `L` tokens (next-token targets).
    pub fn targets(&self) -> &'a [u32] {
        &self.tokens[1..]
    }
}

/// A batch of windows, row-major `[batch, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Number of sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Inputs, `batch * seq_len` ids.
    pub inputs: Vec<u32>,
    /// Targets (inputs shifted by one), `batch * seq_len` ids.
    pub targets: Vec<u32>,
}

/// Where a [`SequenceSampler`] is, for checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Number of completed passes over the data.
    pub epoch: u64,
    /// Windows already taken in the current epoch (by this rank).
    pub cursor: usize,
    /// Windows with no counted target passed over so far (by this rank's
    /// [`PackedSampler`](super::sampler::PackedSampler); 0 elsewhere).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Deterministic sampler of training windows.
///
/// Each epoch cuts the data into `(N - 1) / L` windows of `L + 1` tokens that
/// overlap by one token (so every token is a target exactly once), starting at
/// an offset drawn from the slack at the end, and visits them in a shuffled
/// order. Offsets and orders depend only on `(seed, epoch)`, so a run is
/// reproducible and resumable from a [`SamplerState`]; across epochs the
/// random offset covers the tail too. With `world > 1` ranks, rank `r` takes
/// every `world`-th window of the shared order, so ranks never overlap.
#[derive(Debug, Clone)]
pub struct SequenceSampler {
    tokens: Tokens,
    seq_len: usize,
    seed: u64,
    rank: usize,
    world: usize,
    state: SamplerState,
    offset: usize,
    order: Vec<usize>,
    /// The current window's ids, read from `tokens`.
    window: Vec<u32>,
}

impl SequenceSampler {
    /// A sampler over `tokens` with windows of `seq_len + 1` tokens, for one rank.
    pub fn new(tokens: impl Into<Tokens>, seq_len: usize, seed: u64) -> Result<Self> {
        Self::sharded(tokens, seq_len, seed, 0, 1)
    }

    /// A sampler for data-parallel rank `rank` of `world`.
    pub fn sharded(
        tokens: impl Into<Tokens>,
        seq_len: usize,
        seed: u64,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        let tokens = tokens.into();
        if seq_len == 0 {
            return Err(Error::Config(
                "sequence length is 0; use --seq 1 or more".to_string(),
            ));
        }
        if tokens.len() < seq_len + 1 {
            return Err(Error::Config(format!(
                "the data has {} tokens, fewer than sequence length + 1 = {}; use a shorter --seq (at most {}) \
                 or more data",
                tokens.len(),
                seq_len + 1,
                tokens.len().saturating_sub(1)
            )));
        }
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "data rank {rank} is not below the data-parallel world size {world}"
            )));
        }
        let windows = (tokens.len() - 1) / seq_len;
        if windows < world {
            return Err(Error::Config(format!(
                "the data yields {windows} windows of {} tokens, fewer than the {world} data-parallel ranks; \
                 use a shorter --seq or more data",
                seq_len + 1
            )));
        }
        let mut s = SequenceSampler {
            tokens,
            seq_len,
            seed,
            rank,
            world,
            state: SamplerState {
                epoch: 0,
                cursor: 0,
                skipped: 0,
            },
            offset: 0,
            order: Vec::new(),
            window: Vec::with_capacity(seq_len + 1),
        };
        s.start_epoch(0);
        Ok(s)
    }

    /// Tokens per input sequence (`L`).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Windows this rank takes per epoch.
    pub fn windows_per_epoch(&self) -> usize {
        self.order.len()
    }

    /// The current position, to store in a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Moves to a position previously returned by [`SequenceSampler::state`].
    pub fn restore(&mut self, state: SamplerState) -> Result<()> {
        self.start_epoch(state.epoch);
        if state.cursor > self.order.len() {
            return Err(Error::Checkpoint(format!(
                "sampler cursor {} exceeds the {} windows per epoch; the data or --seq changed since the checkpoint",
                state.cursor,
                self.order.len()
            )));
        }
        self.state.cursor = state.cursor;
        Ok(())
    }

    /// The next window, moving to the next epoch when this one is used up.
    pub fn next_window(&mut self) -> Window<'_> {
        if self.state.cursor == self.order.len() {
            self.start_epoch(self.state.epoch + 1);
        }
        let start = self.offset + self.order[self.state.cursor] * self.seq_len;
        self.state.cursor += 1;
        self.tokens
            .read_into(start..start + self.seq_len + 1, &mut self.window);
        Window {
            start,
            tokens: &self.window,
        }
    }

    /// The next `batch` windows, stacked row-major.
    pub fn next_batch(&mut self, batch: usize) -> Batch {
        let mut inputs = Vec::with_capacity(batch * self.seq_len);
        let mut targets = Vec::with_capacity(batch * self.seq_len);
        for _ in 0..batch {
            let w = self.next_window();
            inputs.extend_from_slice(w.inputs());
            targets.extend_from_slice(w.targets());
        }
        Batch {
            batch,
            seq_len: self.seq_len,
            inputs,
            targets,
        }
    }

    /// Draws the offset and order of `epoch` and resets the cursor.
    fn start_epoch(&mut self, epoch: u64) {
        let n = self.tokens.len();
        let windows = (n - 1) / self.seq_len;
        let slack = n - 1 - windows * self.seq_len;
        let mut rng = Rng::at_state(self.seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F));
        self.offset = rng.below(slack as u64 + 1) as usize;
        self.order = rank_share_of_shuffle(windows, (self.rank, self.world), &mut rng);
        self.state = SamplerState {
            epoch,
            cursor: 0,
            skipped: 0,
        };
    }
}

/// Shuffles `0..n` (Fisher-Yates, drawing from `rng`) and deals it out to
/// `world` ranks in turn: rank `rank`'s `n / world` indices, in order (the
/// `n % world` left over are nobody's this epoch).
pub(super) fn rank_share_of_shuffle(
    n: usize,
    (rank, world): (usize, usize),
    rng: &mut Rng,
) -> Vec<usize> {
    let mut all: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        all.swap(i, rng.below(i as u64 + 1) as usize);
    }
    all.into_iter()
        .skip(rank)
        .step_by(world)
        .take(n / world)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("upipe-data-{}-{name}", std::process::id()))
    }

    #[test]
    fn pieces_are_cut_before_a_word_and_encode_as_the_whole_text() {
        assert_eq!(piece_end("ab cd", 100), 5);
        assert_eq!(
            piece_end("abcd efgh ijkl", 8),
            4,
            "before the space of \" efgh\""
        );
        assert_eq!(piece_end("aaaaaaaaaa", 4), 4, "no whitespace: at the piece");
        assert_eq!(piece_end("ééééé", 3), 2, "at a character boundary");
        assert_eq!(piece_end("ab  \n cd", 6), 5, "the last space before a word");
        // the bundled byte-level tokenizer with merges across letters and a leading space
        let mut json: serde_json::Value =
            serde_json::from_slice(include_bytes!("../../assets/tokenizer.json")).unwrap();
        let merges = [("t", "h"), ("th", "e"), ("\u{120}", "the"), ("a", "n")];
        let merges = merges
            .iter()
            .chain(&[("an", "d"), ("\u{120}", "and"), ("\u{120}", "a")]);
        for (i, (a, b)) in merges.clone().enumerate() {
            json["model"]["vocab"][format!("{a}{b}")] = (300 + i).into();
        }
        json["model"]["merges"] = merges.map(|(a, b)| format!("{a} {b}")).collect();
        let tok = Tokenizer::from_hf_bytes(json.to_string().as_bytes()).unwrap();
        let text = &CORPUS[..20_000];
        let whole = tok.encode_in_pieces(text, false, usize::MAX).unwrap();
        assert!(whole.len() < 19_500, "merged: {} ids", whole.len());
        for piece in [64, 1000, 4096] {
            assert_eq!(
                tok.encode_in_pieces(text, false, piece).unwrap(),
                whole,
                "pieces of {piece} bytes"
            );
        }
        // the post-processor's BOS and EOS once around the whole document
        let ends = serde_json::json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "B", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"A": {"id": "A", "ids": [1], "tokens": ["A"]},
                               "B": {"id": "B", "ids": [2], "tokens": ["B"]}}});
        json["post_processor"] = ends;
        let tok = Tokenizer::from_hf_bytes(json.to_string().as_bytes()).unwrap();
        let whole = tok.encode_in_pieces(text, true, usize::MAX).unwrap();
        assert_eq!((whole[0], whole[whole.len() - 1]), (1, 2));
        assert_eq!(tok.encode_in_pieces(text, true, 500).unwrap(), whole);
    }

    #[test]
    fn corpus_is_bundled_prose() {
        assert!((100_000..=300_000).contains(&CORPUS.len()));
        assert!(CORPUS.contains("Alice"));
        let tokens = load_tokens(None, None, 256).unwrap();
        assert_eq!(tokens.len(), CORPUS.len());
        assert!(!tokens.is_mapped());
    }

    #[test]
    fn byte_tokenizer_round_trips() {
        let tok = Tokenizer::byte();
        let text = "Down the Rabbit-Hole — naïve café\n";
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert!(ids.iter().all(|&i| i < 256));
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert_eq!(tok.vocab_size(), 256);
        let err = tok.decode(&[65, 300]).unwrap_err().to_string();
        assert!(err.contains("300") && err.contains("position 1"), "{err}");
    }

    #[test]
    fn u32_files_round_trip_and_are_mapped() {
        let path = temp_file("round.u32");
        let tokens = vec![0, 1, 255, 65_536, u32::MAX];
        write_u32_tokens(&path, &tokens).unwrap();
        assert_eq!(std::fs::read(&path).unwrap()[..8], [0, 0, 0, 0, 1, 0, 0, 0]);
        let t = Tokens::open(&path).unwrap();
        assert!(t.is_mapped());
        assert_eq!(t.read(0..t.len()), tokens);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn load_tokens_checks_the_models_vocabulary() {
        let path = temp_file("vocab.u32");
        write_u32_tokens(&path, &[1, 2, 256, 999]).unwrap();
        // the ids of a .u32 file index the model's vocabulary, not the byte tokenizer's
        let t = load_tokens(Some(&path), None, 1000).unwrap();
        assert!(t.is_mapped());
        assert_eq!(t.read(0..4), [1, 2, 256, 999]);
        // a tokenizer given with pre-tokenized data is ignored (with a warning)
        load_tokens(Some(&path), Some("/no/such/tokenizer.json"), 1000).unwrap();
        let err = load_tokens(Some(&path), None, 999).unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string())
                && err.contains("token id 999 at position 3")
                && err.contains("vocabulary of 999"),
            "{err}"
        );
        std::fs::remove_file(&path).unwrap();
        let text = temp_file("text.txt");
        std::fs::write(&text, "abc").unwrap();
        let t = load_tokens(Some(&text), None, 256).unwrap();
        assert_eq!(t.read(0..3), vec![97, 98, 99]);
        // the byte tokenizer's 256 ids do not fit a model of 100
        let err = load_tokens(Some(&text), Some("byte"), 100)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer byte has 256 ids") && err.contains("vocabulary has 100"),
            "{err}"
        );
        std::fs::remove_file(&text).unwrap();
    }

    const WORD_LEVEL_JSON: &str = r#"{
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {
            "type": "WordLevel",
            "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, ".": 4},
            "unk_token": "[UNK]"
        }
    }"#;

    const BPE_JSON: &str = r#"{
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": null,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "vocab": {"h": 0, "i": 1, " ": 2, "hi": 3},
            "merges": ["h i"]
        }
    }"#;

    #[test]
    fn hf_tokenizer_json_loads_and_encodes() {
        let path = temp_file("tokenizer.json");
        std::fs::write(&path, WORD_LEVEL_JSON).unwrap();
        let tok = Tokenizer::resolve(path.to_str().unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(tok.vocab_size(), 5);
        let ids = tok.encode("the cat sat.").unwrap();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        assert_eq!(tok.encode("the dog").unwrap(), vec![1, 0]);
        assert_eq!(tok.decode(&[1, 2, 3]).unwrap(), "the cat sat");

        let bpe = Tokenizer::from_hf_bytes(BPE_JSON.as_bytes()).unwrap();
        assert_eq!(bpe.encode("hi hi").unwrap(), vec![3, 2, 3]);
        assert_eq!(bpe.encode("ih").unwrap(), vec![1, 0]);
    }

    #[test]
    fn bad_tokenizer_inputs_are_refused() {
        let err = Tokenizer::from_hf_bytes(b"{\"model\": 3}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        let err = Tokenizer::resolve("/no/such/tokenizer.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("'byte'"), "{err}");
    }

    fn collect_starts(s: &mut SequenceSampler, n: usize) -> Vec<usize> {
        (0..n).map(|_| s.next_window().start).collect()
    }

    #[test]
    fn sampler_is_deterministic_per_seed() {
        let tokens: Vec<u32> = (0..1000).collect();
        let mut a = SequenceSampler::new(tokens.clone(), 16, 7).unwrap();
        let mut b = SequenceSampler::new(tokens.clone(), 16, 7).unwrap();
        let mut c = SequenceSampler::new(tokens, 16, 8).unwrap();
        let (sa, sb, sc) = (
            collect_starts(&mut a, 200),
            collect_starts(&mut b, 200),
            collect_starts(&mut c, 200),
        );
        assert_eq!(sa, sb);
        assert_ne!(sa, sc);
    }

    #[test]
    fn sampler_windows_are_in_bounds_and_shifted() {
        let tokens: Vec<u32> = (0..103).map(|i| i * 3).collect();
        let mut s = SequenceSampler::new(tokens.clone(), 10, 1).unwrap();
        assert_eq!(s.windows_per_epoch(), 10);
        for _ in 0..50 {
            let w = s.next_window();
            assert_eq!(w.tokens.len(), 11);
            assert!(w.start + 11 <= tokens.len());
            assert_eq!(w.tokens, &tokens[w.start..w.start + 11]);
            assert_eq!(w.inputs()[1..], w.targets()[..9]);
        }
        let batch = s.next_batch(3);
        assert_eq!((batch.inputs.len(), batch.targets.len()), (30, 30));
        for r in 0..3 {
            assert_eq!(batch.inputs[r * 10 + 1], batch.targets[r * 10]);
        }
    }

    #[test]
    fn sampler_covers_every_target_once_per_epoch() {
        // 1 + 8 * 16 tokens: no slack, so one epoch covers every target exactly once.
        let tokens: Vec<u32> = (0..129).collect();
        let mut s = SequenceSampler::new(tokens, 16, 3).unwrap();
        let mut seen = vec![0u32; 129];
        for _ in 0..s.windows_per_epoch() {
            for &t in s.next_window().targets() {
                seen[t as usize] += 1;
            }
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1..].iter().all(|&n| n == 1));
        assert_eq!(
            s.state(),
            SamplerState {
                epoch: 0,
                cursor: 8,
                skipped: 0,
            }
        );
        s.next_window();
        assert_eq!(s.state().epoch, 1);
    }

    #[test]
    fn sampler_offsets_reach_the_tail_over_epochs() {
        let tokens: Vec<u32> = (0..40).collect();
        let mut s = SequenceSampler::new(tokens, 16, 11).unwrap();
        let ends: Vec<usize> = (0..200).map(|_| s.next_window().start + 17).collect();
        assert!(
            ends.contains(&40),
            "the last token should be a target in some epoch"
        );
        assert!(ends.iter().any(|&e| e < 40));
    }

    #[test]
    fn sampler_resumes_from_state() {
        let tokens: Vec<u32> = (0..500).collect();
        let mut a = SequenceSampler::new(tokens.clone(), 8, 5).unwrap();
        collect_starts(&mut a, 77);
        let state = a.state();
        let mut b = SequenceSampler::new(tokens, 8, 5).unwrap();
        b.restore(state).unwrap();
        assert_eq!(collect_starts(&mut a, 100), collect_starts(&mut b, 100));
        let bad = SamplerState {
            epoch: 0,
            cursor: 1000,
            skipped: 0,
        };
        assert!(matches!(b.restore(bad), Err(Error::Checkpoint(_))));
    }

    /// A saved run redraws its epoch's windows on resume, so the draw stays
    /// what it was: the offset, then Fisher-Yates, from SplitMix64 at state
    /// `seed ^ epoch · 0xA076_1D64_78BD_642F`, dealt to the ranks in turn
    /// (written out here independently of `Rng`).
    #[test]
    fn sampler_draws_the_windows_it_always_drew() {
        fn splitmix(state: &mut u64) -> u64 {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        let below =
            |st: &mut u64, n: usize| ((u128::from(splitmix(st)) * n as u128) >> 64) as usize;
        let (seq, windows, slack) = (8, 13, 5);
        let tokens: Vec<u32> = (0..(1 + windows * seq + slack) as u32).collect();
        for (seed, world) in [(7u64, 1usize), (11, 3)] {
            for rank in 0..world {
                let mut s =
                    SequenceSampler::sharded(tokens.clone(), seq, seed, rank, world).unwrap();
                for epoch in 0..3u64 {
                    let mut st = seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F);
                    let offset = below(&mut st, slack + 1);
                    let mut all: Vec<usize> = (0..windows).collect();
                    for i in (1..windows).rev() {
                        all.swap(i, below(&mut st, i + 1));
                    }
                    let want: Vec<usize> = (0..windows / world)
                        .map(|k| offset + all[rank + k * world] * seq)
                        .collect();
                    assert_eq!(
                        collect_starts(&mut s, windows / world),
                        want,
                        "{seed} {rank} {epoch}"
                    );
                }
            }
        }
    }

    #[test]
    fn sampler_shards_are_disjoint() {
        let tokens: Vec<u32> = (0..1 + 10 * 4).collect();
        let mut r0 = SequenceSampler::sharded(tokens.clone(), 4, 9, 0, 3).unwrap();
        let mut r1 = SequenceSampler::sharded(tokens.clone(), 4, 9, 1, 3).unwrap();
        let mut r2 = SequenceSampler::sharded(tokens, 4, 9, 2, 3).unwrap();
        assert_eq!(r0.windows_per_epoch(), 3);
        let mut all: Vec<usize> = [&mut r0, &mut r1, &mut r2]
            .into_iter()
            .flat_map(|s| collect_starts(s, 3))
            .collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 9);
    }

    #[test]
    fn sampler_refuses_too_little_data() {
        let err = SequenceSampler::new(vec![1u32; 100], 100, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("100 tokens") && err.contains("101") && err.contains("--seq"),
            "{err}"
        );
        assert!(SequenceSampler::new(vec![1u32; 101], 100, 0).is_ok());
        assert!(SequenceSampler::new(vec![1u32; 10], 0, 0).is_err());
        assert!(SequenceSampler::sharded(vec![1u32; 10], 4, 0, 2, 2).is_err());
        let err = SequenceSampler::sharded(vec![1u32; 10], 4, 0, 0, 3)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 windows"), "{err}");
    }
}
