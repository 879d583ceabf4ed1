//! `upipe eval --task`: synthetic retrieval trials (passkey, multikey,
//! multivalue, kv) over a grid of context lengths × needle depths, each
//! scored teacher-forced in one forward pass (`train::retrieval`), on the
//! ranks and devices `upipe eval` runs on; a table of accuracy by depth ×
//! length, and under `--out` the trials (JSONL), the summary (JSON) and
//! the heatmap (SVG). `--write-corpus` writes trials as training data
//! instead (`data::retrieval::corpus`).

use super::args::EvalArgs;
use super::place::Placed;
use super::preflight::{Placement, preflight};
use super::task_args::TaskArgs;
use super::task_report::Scores;
use crate::checkpoint::HostTensor;
use crate::cli::train::Route;
use crate::data::Tokenizer;
use crate::data::retrieval::corpus::{CorpusSpec, write_corpus};
use crate::data::retrieval::{
    ChatFrame, Grid, Haystack, RetrievalTask, TaskSpec, TrialAt, TrialMaker, parse_lengths,
};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::plan::EvalForward;
use crate::train::retrieval::{RetrievalRun, Scored, retrieval_cpu, retrieval_threads};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a retrieval run needs before its weights load.
struct TaskRun {
    spec: TaskSpec,
    grid: Grid,
    tok: Tokenizer,
    haystack: Option<Haystack>,
    /// The chat template's frame (`None`: plain text) and its file.
    chat: Option<(ChatFrame, String)>,
}

impl TaskRun {
    /// The maker of the run's trials.
    fn maker(&self) -> Result<TrialMaker<'_>> {
        let maker = TrialMaker::new(&self.spec, self.haystack.as_ref(), &self.tok)?;
        Ok(match &self.chat {
            Some((frame, _)) => maker.with_chat(frame),
            None => maker,
        })
    }
}

/// `upipe eval --task` with `upipe eval`'s flags `a`.
pub fn run(a: &EvalArgs) -> Result<i32> {
    let t = &a.task;
    let task = build_task(a)?;
    if let Some(path) = &t.write_corpus {
        return corpus(&task, path, t.documents);
    }
    if a.tokens.is_some() {
        return crate::config_err!(
            "--tokens is what `upipe eval` measures the loss on; --task makes its own trials: \
             leave out one of them"
        );
    }
    let Some(model_dir) = a.model_dir.as_deref() else {
        return crate::config_err!(
            "upipe eval --task needs --model-dir (or [eval] model-dir in --config), or \
             --write-corpus to write trials without a model"
        );
    };
    let model = super::place::open_model(model_dir)?;
    check_model(&task, &model)?;
    let maker = task.maker()?;
    probe(&maker, &task.grid)?;
    let longest = task.grid.lengths.iter().copied().max().unwrap_or(1);
    let placed = super::place::place(a, &model, longest)?;
    let at = Placement {
        route: &placed.route,
        device: placed.device,
        kernel: placed.kernel,
        gpus: placed.gpus,
        documents: false,
    };
    let planned = preflight(&placed.cfg, &task.grid.lengths, EvalForward::Trial, &at)?;
    if let Route::SelfLaunch { nproc } = placed.route {
        tracing::info!(
            "{} GPUs visible: starting {nproc} processes, one per GPU (NCCL)",
            placed.gpus
        );
        let child = crate::cli::launch::own_command("eval")?;
        return crate::cli::launch::run_local(nproc, child);
    }
    let host = super::place::load_weights(a, model_dir, &placed.cfg.model)?;
    let make = |at: &TrialAt| maker.trial(at);
    let run = RetrievalRun {
        cfg: &placed.cfg,
        grid: &task.grid,
        make: &make,
    };
    let scored = execute(&run, &placed, &host)?;
    if placed.lead() {
        let scores = Scores {
            scored: &scored,
            predicted: &planned.predictions,
            chat_template: task.chat.as_ref().map(|c| c.1.as_str()),
        };
        super::task_report::report(a, (&task.spec, &task.grid, &task.tok), &scores)?;
    }
    Ok(0)
}

/// The task, grid, tokenizer and haystack from the flags, checked.
fn build_task(a: &EvalArgs) -> Result<TaskRun> {
    let t = &a.task;
    let name = t.task.as_deref().unwrap_or_default();
    let task: RetrievalTask = name.parse()?;
    let mut spec = TaskSpec::new(task);
    spec.needles = t.needles.unwrap_or(spec.needles);
    spec.digits = t.digits;
    let tp = &mut spec.templates;
    for (given, into) in [
        (&t.intro_template, &mut tp.intro),
        (&t.needle_template, &mut tp.needle),
        (&t.question_template, &mut tp.question),
        (&t.answer_template, &mut tp.answer),
    ] {
        if let Some(text) = given {
            *into = text.replace("\\n", "\n");
        }
    }
    let grid = grid(t)?;
    let tok = tokenizer(a)?;
    let chat = chat_frame(a, &tok)?;
    if chat.is_some() && t.answer_template.is_none() {
        // the answer starts the assistant's turn, with no space before it
        spec.templates.answer = "{value}".into();
    }
    spec.check()?;
    let longest = grid.lengths.iter().copied().max().unwrap_or(1);
    let haystack = match (&t.haystack, task.uses_haystack()) {
        (Some(_), false) => {
            return crate::config_err!(
                "--haystack: the kv task's context is its own list of key-value lines; leave \
                 out --haystack"
            );
        }
        (None, false) => None,
        (None, true) => Some(Haystack::filler(&tok)?),
        (Some(path), true) => {
            let vocab = tok.vocab_size();
            let h = Haystack::open(path, &tok, vocab, longest.saturating_mul(16))?;
            h.check_fills(longest, longest)?;
            Some(h)
        }
    };
    Ok(TaskRun {
        spec,
        grid,
        tok,
        haystack,
        chat,
    })
}

/// `--lengths`, `--depths`, `--trials`, `--seed`.
fn grid(t: &TaskArgs) -> Result<Grid> {
    let Some(lengths) = &t.lengths else {
        return crate::config_err!(
            "--task needs --lengths: the context lengths to test, e.g. 4K,32K,128K"
        );
    };
    let lengths = parse_lengths(lengths)?;
    let mut seen = std::collections::BTreeSet::new();
    if let Some(l) = lengths.iter().find(|&&l| !seen.insert(l)) {
        return crate::config_err!("--lengths names {l} twice; give each length once");
    }
    if t.trials == 0 {
        return crate::config_err!("--trials 0: give at least 1 trial per length and depth");
    }
    Ok(Grid {
        lengths,
        depths: Grid::even_depths(t.depths)?,
        trials: t.trials,
        seed: t.seed,
    })
}

/// `--tokenizer`, else the model directory's `tokenizer.json`, else bytes
/// for a model of 256 ids.
fn tokenizer(a: &EvalArgs) -> Result<Tokenizer> {
    if let Some(t) = &a.task.tokenizer {
        return Tokenizer::resolve(t);
    }
    let dir = a.model_dir.as_deref();
    if let Some(file) = dir
        .map(|d| d.join("tokenizer.json"))
        .filter(|f| f.is_file())
    {
        return Tokenizer::from_hf_file(&file);
    }
    let vocab = match dir {
        Some(d) => ModelConfig::resolve(&d.to_string_lossy())?.vocab,
        None => 0,
    };
    match vocab {
        256 => Ok(Tokenizer::byte()),
        _ => crate::config_err!(
            "--task needs the model's tokenizer: give --tokenizer (a tokenizer.json, a directory \
             holding one, or byte), or a --model-dir with its tokenizer.json"
        ),
    }
}

/// Where the tokenizer's files are (`--tokenizer`, else the model
/// directory); `None` for the byte tokenizer.
fn tokenizer_dir(a: &EvalArgs) -> Option<PathBuf> {
    match a.task.tokenizer.as_deref() {
        Some("byte") => None,
        Some(t) => Some(PathBuf::from(t)),
        None => a.model_dir.clone(),
    }
}

/// `--chat-template`: the frame of the model's (or a file's) chat
/// template, or `None` for plain text; says on stderr which it chose.
fn chat_frame(a: &EvalArgs, tok: &Tokenizer) -> Result<Option<(ChatFrame, String)>> {
    let choice = ("--chat-template", a.task.chat_template.as_str());
    ChatFrame::choose(choice, tokenizer_dir(a).as_deref(), tok)
}

/// The model can read the tokenizer's ids and every length asked.
fn check_model(task: &TaskRun, model: &ModelConfig) -> Result<()> {
    if task.tok.vocab_size() > model.vocab {
        return crate::config_err!(
            "the tokenizer has {} ids but the model's vocabulary has {}: give the model's own \
             tokenizer (--tokenizer)",
            task.tok.vocab_size(),
            model.vocab
        );
    }
    let longest = task.grid.lengths.iter().copied().max().unwrap_or(1);
    if longest > model.max_position {
        return crate::config_err!(
            "--lengths {longest} is longer than the model's context of {} tokens \
             (max_position_embeddings); give --lengths up to {}",
            model.max_position,
            model.max_position
        );
    }
    Ok(())
}

/// Builds the first trial of the shortest and of the longest length, so a
/// length too short for the prompt or too long for the haystack is an
/// error before any weight is loaded.
fn probe(maker: &TrialMaker, grid: &Grid) -> Result<()> {
    let by_length = |pick: fn(&[usize]) -> Option<usize>| pick(&grid.lengths).unwrap_or(0);
    let shortest = by_length(|l| (0..l.len()).min_by_key(|&i| l[i]));
    let longest = by_length(|l| (0..l.len()).max_by_key(|&i| l[i]));
    for li in [shortest, longest] {
        maker.trial(&grid.at(li, 0))?;
    }
    Ok(())
}

/// `--write-corpus PATH`: `documents` trials at lengths drawn from
/// `--lengths` and depths drawn uniformly.
fn corpus(task: &TaskRun, path: &Path, documents: usize) -> Result<i32> {
    let maker = task.maker()?;
    let spec = CorpusSpec {
        lengths: task.grid.lengths.clone(),
        documents,
        seed: task.grid.seed,
    };
    let w = write_corpus(path, &maker, &spec)?;
    println!(
        "wrote {} {} trials to {} ({} tokens, {} of them answers counted by its loss mask)",
        w.documents,
        task.spec.task,
        path.display(),
        w.tokens,
        w.counted
    );
    Ok(0)
}

/// Scores every trial where the route says.
fn execute(
    run: &RetrievalRun,
    placed: &Placed,
    host: &BTreeMap<String, HostTensor>,
) -> Result<Scored> {
    match &placed.route {
        Route::ProcessRank => {
            let env = placed
                .env
                .as_ref()
                .ok_or_else(|| Error::Config("a launched run has its environment".into()))?;
            crate::train::trainer::retrieval_process_rank(run, host, env, placed.kernel)
        }
        Route::GpuThreads { gpus, why } => {
            tracing::info!("thread ranks on GPUs: {why}");
            retrieval_threads(run, host, super::place::gpu_backends(*gpus, placed.kernel)?)
        }
        _ => retrieval_cpu(run, host),
    }
}
