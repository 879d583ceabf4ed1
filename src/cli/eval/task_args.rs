//! The flags of `upipe eval --task` (retrieval trials), a group of
//! `upipe eval`'s flags.

use std::path::PathBuf;

/// Flags of the retrieval tasks.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = "Retrieval tasks (--task; docs/evaluation.md)")]
pub struct TaskArgs {
    /// Score a synthetic retrieval task instead of the loss over --tokens:
    /// passkey (one number hidden in the haystack), multikey (numbers for
    /// several names, one asked), multivalue (several numbers for one name,
    /// all asked in order), kv (a list of key-value lines, one asked).
    /// Each trial is one forward pass; it passes when the model's argmax
    /// is the answer at every answer token.
    #[arg(long)]
    pub task: Option<String>,
    /// Context lengths in tokens, separated by commas; K is 1024 and M
    /// 1024² (4K,32K,128K,1M). Each trial is exactly this long (kv: up to
    /// a line shorter).
    #[arg(long)]
    pub lengths: Option<String>,
    /// Needle depths: this many, evenly spaced from 0 % (the haystack's
    /// start) to 100 % (its end); 1 is 50 %.
    #[arg(long, default_value_t = 11)]
    pub depths: usize,
    /// Trials per length and depth, each with its own needles.
    #[arg(long, default_value_t = 4)]
    pub trials: usize,
    /// Seed of every trial (a trial is reproducible from the seed, its
    /// length, depth and index).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The haystack: a UTF-8 text file (needles go between its sentences)
    /// or token ids (.u32, .u16, .bin); default: built-in filler
    /// sentences, repeated. Not for kv (its context is its own list).
    #[arg(long)]
    pub haystack: Option<PathBuf>,
    /// The tokenizer of the prompt pieces: a tokenizer.json, a directory
    /// holding one, or byte; default: the model directory's
    /// tokenizer.json (bytes for a model of 256 ids).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// How the prompt is framed: `auto` (the default) wraps the context and
    /// question in the user's turn of the model's chat template (its
    /// `chat_template.jinja` or the `chat_template` of its
    /// `tokenizer_config.json`, beside the tokenizer) with the generation
    /// prompt, the answer after it, when the tokenizer has one, else plain
    /// text (stderr says which); `none`: plain text; or a Jinja file.
    #[arg(long, default_value = "auto", value_name = "auto|none|PATH")]
    pub chat_template: String,
    /// Needles per trial (multikey: names, one asked; multivalue: numbers
    /// of the one name); default 4 (passkey: 1).
    #[arg(long)]
    pub needles: Option<usize>,
    /// Digits of each hidden number.
    #[arg(long, default_value_t = 7)]
    pub digits: usize,
    /// The text before the haystack (`\n` is a newline).
    #[arg(long)]
    pub intro_template: Option<String>,
    /// One needle, with {value} (and {key} but for passkey).
    #[arg(long)]
    pub needle_template: Option<String>,
    /// The question after the haystack, ending where the answer starts
    /// (with {key} but for passkey).
    #[arg(long)]
    pub question_template: Option<String>,
    /// The answer, whose tokens are scored, with {value} (multivalue: the
    /// numbers joined by ", ").
    #[arg(long)]
    pub answer_template: Option<String>,
    /// Write DIR/trials.jsonl (one record per trial), DIR/summary.json and
    /// DIR/heatmap.svg (accuracy by depth and length).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Instead of evaluating, write --documents trials (lengths drawn from
    /// --lengths, depths uniform) as training data: token ids FILE.u32
    /// with its document index and a loss mask counting only the answers,
    /// for `upipe train --data FILE.u32 --pack bfd`. Needs no model
    /// (give --tokenizer).
    #[arg(long, value_name = "FILE.u32")]
    pub write_corpus: Option<PathBuf>,
    /// Trials --write-corpus writes.
    #[arg(long, default_value_t = 1000)]
    pub documents: usize,
}

impl TaskArgs {
    crate::cli::config::run_keys! {
        task => eval.task,
        lengths => eval.lengths,
        depths => eval.depths,
        trials => eval.trials,
        seed => run.seed,
        haystack => eval.haystack,
        tokenizer => data.tokenizer,
        chat_template => eval.chat_template,
        needles => eval.needles,
        digits => eval.digits,
        intro_template => eval.intro_template,
        needle_template => eval.needle_template,
        question_template => eval.question_template,
        answer_template => eval.answer_template,
        out => eval.out,
        write_corpus => eval.write_corpus,
        documents => eval.documents
    }

    /// The first flag given that only --task reads, when --task is not given.
    pub fn given_without_task(&self) -> Option<&'static str> {
        let given = [
            (self.lengths.is_some(), "--lengths"),
            (self.haystack.is_some(), "--haystack"),
            (self.out.is_some(), "--out"),
            (self.write_corpus.is_some(), "--write-corpus"),
            (self.needle_template.is_some(), "--needle-template"),
            (self.question_template.is_some(), "--question-template"),
            (
                !matches!(self.chat_template.as_str(), "auto" | ""),
                "--chat-template",
            ),
        ];
        given.into_iter().find(|g| g.0).map(|g| g.1)
    }
}
