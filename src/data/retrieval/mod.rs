//! Synthetic retrieval trials (`upipe eval --task`): needles hidden at a
//! chosen depth of a haystack, a question, and the answer whose tokens are
//! scored. Tasks and templates live in `task.rs`, the haystack in
//! `haystack.rs`, the lengths × depths grid in `grid.rs`, and the training
//! corpus of trials (`--write-corpus`) in `corpus.rs`; here a trial is
//! built, its ids exactly `length` long (`kv`: at most).
//!
//! A trial's needles are drawn so that they cannot be found anywhere else:
//! the ids of every key, every value and the scored answer are checked
//! not to occur in the haystack ids around them, and drawn again if they
//! do. Every draw comes from the trial's seed, so a trial is reproducible
//! from `(seed, length, depth, index)` alone.

pub mod corpus;
pub mod grid;
pub mod haystack;
pub mod task;

pub use grid::{Grid, TrialAt, parse_lengths};
pub use haystack::{FILLER, HaySlice, Haystack};
pub use task::{RetrievalTask, TASKS, Templates};

use crate::data::Tokenizer;
use crate::data::chat::ChatTemplate;
use crate::error::Result;
use crate::rng::Rng;
use std::ops::Range;
use std::path::Path;

/// Draws of needles that collide with the haystack before giving up.
const MAX_DRAWS: usize = 64;

/// What a retrieval evaluation asks.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    pub task: RetrievalTask,
    pub templates: Templates,
    /// Needles per trial (`multikey`: keys, one asked; `multivalue`:
    /// values of the one key); 1 for `passkey`.
    pub needles: usize,
    /// Digits of a value.
    pub digits: usize,
}

impl TaskSpec {
    /// `task` with its default templates and needles, values of 7 digits.
    pub fn new(task: RetrievalTask) -> TaskSpec {
        TaskSpec {
            task,
            templates: Templates::default_for(task),
            needles: task.default_needles(),
            digits: 7,
        }
    }

    /// Checks the spec (errors name the flag and the fix).
    pub fn check(&self) -> Result<()> {
        self.templates.check(self.task)?;
        if self.digits == 0 || self.digits > 18 {
            return crate::config_err!("--digits {} must be between 1 and 18", self.digits);
        }
        match (self.task, self.needles) {
            (RetrievalTask::Passkey, 1) => Ok(()),
            (RetrievalTask::Passkey, n) => crate::config_err!(
                "--needles {n}: the passkey task hides one needle; use --task multikey or \
                 multivalue for several"
            ),
            (RetrievalTask::MultiKey | RetrievalTask::MultiValue, n) if n < 2 => {
                crate::config_err!(
                    "--needles {n}: the {} task needs at least 2 needles",
                    self.task
                )
            }
            _ => Ok(()),
        }
    }
}

/// One trial: the ids the model reads and where its answer is.
#[derive(Debug, Clone, PartialEq)]
pub struct Trial {
    /// Every id: intro, haystack with needles, question, answer.
    pub ids: Vec<u32>,
    /// Positions of the answer's ids in `ids` (the last ids).
    pub answer: Range<usize>,
    /// Position in `ids` where the asked needle starts.
    pub needle_at: usize,
    /// Where the asked needle went, as a fraction of the haystack (or of
    /// `kv`'s list) before it.
    pub placed_depth: f64,
    /// The key asked for (empty for `passkey`).
    pub key: String,
    /// The answer's text (`{value}` of the answer template).
    pub expected: String,
}

/// Builds the trials of one task on one haystack with one tokenizer.
pub struct TrialMaker<'a> {
    pub spec: &'a TaskSpec,
    pub haystack: Option<&'a Haystack>,
    pub tok: &'a Tokenizer,
    /// The ids before the intro: the tokenizer's special ids before a
    /// document (a BOS), or a chat frame's before the user's message.
    prefix: Vec<u32>,
    /// The ids after the question (a chat frame's generation prompt).
    suffix: Vec<u32>,
}

/// The turn a chat template wraps a trial in: the ids before the user's
/// message (the context and the question) and those after it up to where
/// the assistant's answer starts (the generation prompt).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatFrame {
    pub before: Vec<u32>,
    pub after: Vec<u32>,
}

impl ChatFrame {
    /// The frame `template` renders around one user message, with the
    /// generation prompt, tokenized by `tok` (no special tokens added: the
    /// template writes them); as the haystack, each side is tokenized apart
    /// from the message.
    pub fn of(template: &ChatTemplate, tok: &Tokenizer) -> Result<ChatFrame> {
        const MARK: &str = "\u{E002}";
        let messages = [serde_json::json!({"role": "user", "content": MARK})];
        let (text, _) = template.render(&messages, true)?;
        let Some((before, after)) = text.split_once(MARK) else {
            return crate::config_err!(
                "the chat template {} does not write the user's message into its rendering; \
                 give one that does, or --chat-template none for plain text",
                template.path().display()
            );
        };
        Ok(ChatFrame {
            before: tok.encode(before)?,
            after: tok.encode(after)?,
        })
    }

    /// The frame `flag` (`auto`, `none` or a Jinja file) chooses for trials
    /// tokenized by `tok`, whose files lie in `tokenizer` (a
    /// `tokenizer.json` or its directory; `None`: the byte tokenizer):
    /// `auto` the tokenizer's own template when it has one, else plain
    /// text (`None`). Says on stderr which it chose. With the frame, the
    /// template's file.
    pub fn choose(
        (flag, choice): (&str, &str),
        tokenizer: Option<&Path>,
        tok: &Tokenizer,
    ) -> Result<Option<(ChatFrame, String)>> {
        let template = match choice {
            "none" => return Ok(None),
            "auto" | "" => match tokenizer.map(ChatTemplate::find).transpose()?.flatten() {
                Some(t) => t,
                None => {
                    tracing::info!(
                        "{flag} auto: the tokenizer has no chat template, so trials are plain text"
                    );
                    return Ok(None);
                }
            },
            path => ChatTemplate::from_file(Path::new(path), tokenizer)?,
        };
        let file = template.path().display().to_string();
        tracing::info!(
            "{flag} {choice}: each trial's context and question are the user's turn of {file}, \
             the answer after its generation prompt ({flag} none: plain text)"
        );
        Ok(Some((ChatFrame::of(&template, tok)?, file)))
    }
}

/// The pieces of a trial as ids, needles not yet placed.
struct Pieces {
    head: Vec<u32>,
    needles: Vec<Vec<u32>>,
    question: Vec<u32>,
    /// The ids no haystack id run may equal: keys, values.
    unique: Vec<Vec<u32>>,
    key: String,
    /// The answer's text and ids.
    expected: String,
    answer: Vec<u32>,
}

impl<'a> TrialMaker<'a> {
    /// A maker; `haystack` is `None` only for `kv`.
    pub fn new(
        spec: &'a TaskSpec,
        haystack: Option<&'a Haystack>,
        tok: &'a Tokenizer,
    ) -> Result<Self> {
        spec.check()?;
        if spec.task.uses_haystack() && haystack.is_none() {
            return crate::config_err!("the {} task needs a haystack", spec.task);
        }
        Ok(TrialMaker {
            spec,
            haystack,
            tok,
            prefix: tok.document_prefix()?,
            suffix: Vec::new(),
        })
    }

    /// This maker with each trial's context and question as the user's
    /// message of `frame` (the template writes its own special tokens),
    /// the answer after its generation prompt.
    pub fn with_chat(mut self, frame: &ChatFrame) -> Self {
        self.prefix.clone_from(&frame.before);
        self.suffix.clone_from(&frame.after);
        self
    }

    /// The question's ids, the chat frame's generation prompt after them.
    fn question_ids(&self, key: &str) -> Result<Vec<u32>> {
        let mut ids = self
            .tok
            .encode(&task::render(&self.spec.templates.question, key, ""))?;
        ids.extend_from_slice(&self.suffix);
        Ok(ids)
    }

    /// The trial at `at` (errors name the fix: a length too short for the
    /// pieces, a haystack too short for the length).
    pub fn trial(&self, at: &TrialAt) -> Result<Trial> {
        let mut rng = Rng::new(at.seed);
        if self.spec.task == RetrievalTask::Kv {
            return self.kv_trial(at, &mut rng);
        }
        let hay = self.haystack.expect("checked in new");
        for _ in 0..MAX_DRAWS {
            let pieces = self.draw_pieces(&mut rng)?;
            let fixed = pieces.head.len()
                + pieces.needles.iter().map(Vec::len).sum::<usize>()
                + pieces.question.len()
                + pieces.answer.len();
            let budget = self.budget(at.length, fixed)?;
            hay.check_fills(budget, at.length)?;
            let slice = hay.take(budget, &mut rng)?;
            if pieces.unique.iter().any(|u| occurs(&slice.ids, u)) {
                continue;
            }
            return self.assemble(pieces, slice, at, &mut rng);
        }
        crate::config_err!(
            "no needle of {} digits could be drawn that the haystack does not already hold \
             ({MAX_DRAWS} draws); use more --digits",
            self.spec.digits
        )
    }

    /// Haystack ids left for a trial of `length` with `fixed` ids of pieces.
    fn budget(&self, length: usize, fixed: usize) -> Result<usize> {
        match length.checked_sub(fixed) {
            Some(b) if b > 0 => Ok(b),
            _ => crate::config_err!(
                "--lengths {length} leaves no room for the haystack: the {} task's prompt \
                 pieces take {fixed} tokens; give lengths above {fixed}",
                self.spec.task
            ),
        }
    }

    /// The answer's ids: `values` joined by `, ` into the answer template.
    fn answer_ids(&self, values: &[String]) -> Result<(String, Vec<u32>)> {
        let text = values.join(", ");
        let ids = self
            .tok
            .encode(&task::render(&self.spec.templates.answer, "", &text))?;
        Ok((text, ids))
    }

    /// Keys, values and the needles', question's and intro's ids.
    fn draw_pieces(&self, rng: &mut Rng) -> Result<Pieces> {
        let (spec, t) = (self.spec, &self.spec.templates);
        let key_of = |rng: &mut Rng| match spec.task {
            RetrievalTask::Passkey => String::new(),
            _ => task::draw_key(rng, 4),
        };
        let (mut keys, mut values) = (Vec::new(), Vec::<String>::new());
        let shared_key = key_of(rng);
        while values.len() < spec.needles {
            let key = match spec.task {
                RetrievalTask::MultiKey => key_of(rng),
                _ => shared_key.clone(),
            };
            let value = task::draw_value(rng, spec.digits);
            let repeated = values.contains(&value)
                || (spec.task == RetrievalTask::MultiKey && keys.contains(&key));
            if !repeated {
                keys.push(key);
                values.push(value);
            }
        }
        let enc = |s: &str| self.tok.encode(s);
        let mut head = self.prefix.clone();
        head.extend(enc(&t.intro)?);
        let needles = (keys.iter().zip(&values))
            .map(|(k, v)| enc(&task::render(&t.needle, k, v)))
            .collect::<Result<Vec<_>>>()?;
        let mut unique = Vec::new();
        for s in keys.iter().filter(|k| !k.is_empty()).chain(&values) {
            unique.push(enc(s)?);
        }
        // multivalue: every value, in the order the needles appear
        let asked = match spec.task {
            RetrievalTask::MultiValue => &values[..],
            _ => &values[..1],
        };
        let (expected, answer) = self.answer_ids(asked)?;
        unique.push(answer.clone());
        Ok(Pieces {
            head,
            needles,
            question: self.question_ids(&keys[0])?,
            unique,
            key: keys[0].clone(),
            expected,
            answer,
        })
    }

    /// The trial's ids: the asked needle at the break nearest `at.depth`
    /// of the haystack, the others at breaks drawn at random (`multivalue`:
    /// its needles in the order of their values, wherever the asked one
    /// went); then the question and the answer.
    fn assemble(&self, p: Pieces, slice: HaySlice, at: &TrialAt, rng: &mut Rng) -> Result<Trial> {
        let budget = slice.ids.len();
        let asked = slice.nearest_break(at.depth * budget as f64);
        // (break, whether it is the asked needle's)
        let mut places: Vec<(usize, bool)> = vec![(asked, true)];
        for _ in 1..p.needles.len() {
            let b = slice.breaks[rng.below(slice.breaks.len() as u64) as usize];
            places.push((b, false));
        }
        places.sort_by_key(|&(b, is_asked)| (b, !is_asked));
        let mut others = 1..p.needles.len();
        let mut ids = p.head;
        let (mut from, mut needle_at) = (0, 0);
        for (k, &(b, is_asked)) in places.iter().enumerate() {
            ids.extend_from_slice(&slice.ids[from..b]);
            let n = match (self.spec.task, is_asked) {
                (RetrievalTask::MultiValue, _) => k,
                (_, true) => 0,
                (_, false) => others.next().expect("one needle per place"),
            };
            if is_asked {
                needle_at = ids.len();
            }
            ids.extend_from_slice(&p.needles[n]);
            from = b;
        }
        ids.extend_from_slice(&slice.ids[from..]);
        ids.extend(p.question);
        let start = ids.len();
        ids.extend(p.answer);
        debug_assert_eq!(ids.len(), at.length);
        Ok(Trial {
            answer: start..ids.len(),
            ids,
            needle_at,
            placed_depth: asked as f64 / budget.max(1) as f64,
            key: p.key,
            expected: p.expected,
        })
    }
}

impl TrialMaker<'_> {
    /// A `kv` trial: a list of `key: value` lines (every key and every
    /// value different) as long as fits, the asked line at the line
    /// nearest `at.depth` of the list.
    fn kv_trial(&self, at: &TrialAt, rng: &mut Rng) -> Result<Trial> {
        let t = &self.spec.templates;
        let enc = |s: &str| self.tok.encode(s);
        let (key, value) = (
            task::draw_key(rng, 4),
            task::draw_value(rng, self.spec.digits),
        );
        let mut head = self.prefix.clone();
        head.extend(enc(&t.intro)?);
        let question = self.question_ids(&key)?;
        let (expected, answer) = self.answer_ids(std::slice::from_ref(&value))?;
        let asked_line = enc(&task::render(&t.needle, &key, &value))?;
        let fixed = head.len() + question.len() + answer.len() + asked_line.len();
        let mut room = self.budget(at.length, fixed)?;
        let mut keys = std::collections::HashSet::from([key.clone()]);
        let mut values = std::collections::HashSet::from([value]);
        let mut lines = Vec::new();
        let mut repeats = 0;
        loop {
            let (k, v) = (
                task::draw_key(rng, 4),
                task::draw_value(rng, self.spec.digits),
            );
            if keys.contains(&k) || values.contains(&v) {
                repeats += 1;
                if repeats == MAX_DRAWS {
                    return crate::config_err!(
                        "--lengths {}: the kv task ran out of different values of {} digits; \
                         use more --digits",
                        at.length,
                        self.spec.digits
                    );
                }
                continue;
            }
            repeats = 0;
            let line = enc(&task::render(&t.needle, &k, &v))?;
            if line.len() > room {
                break;
            }
            room -= line.len();
            keys.insert(k);
            values.insert(v);
            lines.push(line);
        }
        let at_line = (at.depth * lines.len() as f64).round() as usize;
        let mut ids = head;
        for line in &lines[..at_line] {
            ids.extend_from_slice(line);
        }
        let needle_at = ids.len();
        ids.extend(asked_line);
        for line in &lines[at_line..] {
            ids.extend_from_slice(line);
        }
        ids.extend(question);
        let start = ids.len();
        ids.extend(answer);
        Ok(Trial {
            answer: start..ids.len(),
            ids,
            needle_at,
            placed_depth: at_line as f64 / lines.len().max(1) as f64,
            key,
            expected,
        })
    }
}

/// Whether `needle` occurs in `hay` as a run of consecutive ids.
pub fn occurs(hay: &[u32], needle: &[u32]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests;
