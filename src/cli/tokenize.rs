//! `upipe tokenize`: text and JSONL files (directories of them, gzip or
//! zstd compressed) to a pre-tokenized `.u32` (or `.u16`/`.bin`) file with
//! a model's tokenizer, each document ending with its end-of-sequence id,
//! the document index and (for chat and prompt/completion data) the loss
//! mask beside it, in parallel and streaming; prints a summary.

use crate::data::Tokenizer;
use crate::data::chat::ChatTemplate;
use crate::data::doc_index::{index_path, mask_path};
use crate::data::documents::input_bytes;
use crate::data::limits::{Limits, check_threads};
use crate::data::tokenize::{Encoding, Eos, TokenizeSummary, resolve_eos, tokenize_files};
use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Flags of `upipe tokenize`.
#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// Input files or directories (their files, recursively, in sorted
    /// order): plain text (each file one document, read whole) or JSONL
    /// (`.jsonl`, `.ndjson`: one document per line, streamed: its text under
    /// --field, or a conversation under `messages`, or a `prompt` and its
    /// `completion`), or Parquet (`.parquet`: one document per row, its text
    /// in the --field column); text and JSONL gzip (`.gz`) or zstd (`.zst`)
    /// compressed.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// An HF tokenizer.json (or a directory holding one), or `byte`.
    #[arg(long)]
    pub tokenizer: String,
    /// Output: `.u32` (little-endian uint32 ids) or `.u16`/`.bin` (uint16, for
    /// vocabularies of at most 65,536).
    #[arg(long)]
    pub out: PathBuf,
    /// Id that ends every document, or `auto`: `eos_token_id` of a config.json
    /// beside the tokenizer, else `eos_token` of a tokenizer_config.json, else
    /// a special token such as <|endoftext|> or </s> of the tokenizer.
    #[arg(long, default_value = "auto")]
    pub eos: String,
    /// The JSONL field (or Parquet column) holding a document's text.
    #[arg(long, default_value = "text")]
    pub field: String,
    /// Threads (default: all cores; at most 4 per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// MiB of text read and tokenized per batch (a Parquet file is read a
    /// few rows at a time, about this much text).
    #[arg(long, default_value_t = crate::data::limits::DEFAULT_BATCH_MB)]
    pub batch_mb: usize,
    /// The longest document read, in MiB: a text file, a JSONL line, a
    /// Parquet row (each decompressed) or a conversation as its chat
    /// template renders it; a longer one is refused, naming it, once this
    /// much is read.
    #[arg(long, default_value_t = crate::data::limits::DEFAULT_MAX_DOC_MB)]
    pub max_doc_mb: usize,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: TokenizeArgs) -> Result<i32> {
    check_outputs(&a)?;
    let limits = Limits::of_flags(a.max_doc_mb, a.batch_mb)?;
    let threads = a.threads.map(check_threads).transpose()?;
    let eos: Eos = a.eos.parse()?;
    let tok = Tokenizer::resolve(&a.tokenizer)?;
    let tok_path = std::path::Path::new(&a.tokenizer);
    let eos = resolve_eos(&tok, tok_path, eos)?;
    let chat = match a.tokenizer.as_str() {
        "byte" => None,
        _ => ChatTemplate::find(tok_path)?.map(|c| c.with_max_output(limits.max_doc_bytes)),
    };
    let enc = Encoding {
        tok: &tok,
        eos,
        chat: chat.as_ref(),
        tokenizer: &a.tokenizer,
    };
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    let pool = pool
        .build()
        .map_err(|e| Error::Config(format!("starting the tokenizer threads: {e}")))?;
    let bar = ProgressBar::new(input_bytes(&a.inputs));
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    let summary = pool
        .install(|| tokenize_files(&a.inputs, &a.field, &enc, &a.out, &limits, &|n| bar.inc(n)))?;
    bar.finish_and_clear();
    print_summary(&a, &summary);
    Ok(0)
}

/// The documents left out, counted and the first few named (on stderr).
fn print_left_out(s: &TokenizeSummary) {
    let n = s.empty_documents + s.unanswered_documents;
    if n == 0 {
        return;
    }
    eprintln!(
        "warning: left out {n} documents ({} rendered as nothing by the chat template, {} with \
         no assistant token to train on); the first:",
        s.empty_documents, s.unanswered_documents
    );
    for at in &s.left_out {
        eprintln!("  {at}");
    }
}

/// `--out` and the index and mask written beside it write over none of
/// the inputs (a file given, or any file inside a directory given) nor
/// the tokenizer.
fn check_outputs(a: &TokenizeArgs) -> Result<()> {
    use crate::output_path::{Input, Output, check_outputs};
    let (index, mask) = (index_path(&a.out), mask_path(&a.out));
    let outputs = [
        Output::file("--out", &a.out),
        Output::file("--out's document index", &index),
        Output::file("--out's loss mask", &mask),
    ];
    let mut inputs: Vec<Input> = (a.inputs.iter())
        .map(|path| Input {
            flag: "the input",
            path,
        })
        .collect();
    let tokenizer = crate::output_path::tokenizer_files(std::path::Path::new(&a.tokenizer));
    inputs.extend(tokenizer.iter().map(|path| Input {
        flag: "--tokenizer",
        path,
    }));
    check_outputs(&outputs, &inputs)
}

fn print_summary(a: &TokenizeArgs, s: &TokenizeSummary) {
    if a.json {
        let text = serde_json::to_string(s).expect("a summary always serialises");
        println!("{text}");
        print_left_out(s);
        return;
    }
    let ends = match s.conversations {
        0 => format!("each document ending with id {}", s.eos),
        n if n == s.documents => "each conversation ending as its chat template ends it".into(),
        n => format!(
            "each text ending with id {}, the {n} conversations as their chat template ends them",
            s.eos
        ),
    };
    println!(
        "wrote {}: {} documents, {} tokens ({ends}); document index {}",
        a.out.display(),
        s.documents,
        s.tokens,
        index_path(&a.out).display()
    );
    if s.masked_documents > 0 {
        println!(
            "loss mask {}: {} chat or prompt/completion documents count only their answers; \
             the longest prompt, {} tokens, is {} (train with a --seq above it, or windows \
             inside it have nothing to train on and are passed over)",
            mask_path(&a.out).display(),
            s.masked_documents,
            s.longest_prompt,
            s.longest_prompt_at.as_deref().unwrap_or("-"),
        );
    }
    print_left_out(s);
    println!(
        "tokens per document: p50 {}  p90 {}  p99 {}  max {}",
        s.p50, s.p90, s.p99, s.max
    );
}
