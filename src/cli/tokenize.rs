//! `upipe tokenize`: text and JSONL files to a pre-tokenized `.u32` (or
//! `.u16`/`.bin`) file with a model's tokenizer, documents separated by its
//! end-of-sequence id, in parallel and streaming; prints a summary.

use crate::data::Tokenizer;
use crate::data::documents::input_bytes;
use crate::data::tokenize::{Eos, TokenizeSummary, resolve_eos, tokenize_files};
use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Flags of `upipe tokenize`.
#[derive(clap::Args, Debug, Clone)]
pub struct TokenizeArgs {
    /// Input files: plain text (each file one document, read whole) or JSONL
    /// (`.jsonl`, `.ndjson`: one document per line, its text under --field,
    /// streamed).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// An HF tokenizer.json (or a directory holding one), or `byte`.
    #[arg(long)]
    pub tokenizer: String,
    /// Output: `.u32` (little-endian uint32 ids) or `.u16`/`.bin` (uint16, for
    /// vocabularies of at most 65,536).
    #[arg(long)]
    pub out: PathBuf,
    /// Id put between documents, or `auto`: `eos_token_id` of a config.json
    /// beside the tokenizer, else `eos_token` of a tokenizer_config.json, else
    /// a special token such as <|endoftext|> or </s> of the tokenizer.
    #[arg(long, default_value = "auto")]
    pub eos: String,
    /// The JSONL field holding a document's text.
    #[arg(long, default_value = "text")]
    pub field: String,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// MiB of text read and tokenized per batch.
    #[arg(long, default_value_t = 16)]
    pub batch_mb: usize,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: TokenizeArgs) -> Result<i32> {
    let eos: Eos = a.eos.parse()?;
    let tok = Tokenizer::resolve(&a.tokenizer)?;
    let eos = resolve_eos(&tok, std::path::Path::new(&a.tokenizer), eos)?;
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = a.threads {
        if n == 0 {
            return crate::config_err!("--threads must be at least 1");
        }
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
    let summary = pool.install(|| {
        tokenize_files(
            &a.inputs,
            &a.field,
            &tok,
            eos,
            &a.out,
            a.batch_mb.max(1) << 20,
            &|n| bar.inc(n),
        )
    })?;
    bar.finish_and_clear();
    print_summary(&a, &summary);
    Ok(0)
}

fn print_summary(a: &TokenizeArgs, s: &TokenizeSummary) {
    if a.json {
        let text = serde_json::to_string(s).expect("a summary always serialises");
        println!("{text}");
        return;
    }
    println!(
        "wrote {}: {} documents, {} tokens ({} separators of id {})",
        a.out.display(),
        s.documents,
        s.tokens,
        s.documents.saturating_sub(1),
        s.eos
    );
    println!(
        "tokens per document: p50 {}  p90 {}  p99 {}  max {}",
        s.p50, s.p90, s.p99, s.max
    );
}
