//! The retrieval tasks and their prompt templates: what a needle says,
//! what the question asks and what the answer is, as plain text with
//! `{key}` and `{value}` placeholders, and the keys and values drawn for
//! them (made-up words and digit strings).

use crate::error::Result;
use crate::rng::Rng;
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A synthetic retrieval task (`upipe eval --task`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RetrievalTask {
    /// One needle, a number, in the haystack; asked for it.
    Passkey,
    /// Several needles, each a number for a different key; asked for one key's.
    MultiKey,
    /// Several needles giving numbers for the same key; asked for all of
    /// them, in the order they appear.
    MultiValue,
    /// The haystack is a list of `key: value` lines; asked for one line's value.
    Kv,
}

/// Every task, as `--task` names them.
pub const TASKS: [RetrievalTask; 4] = [
    RetrievalTask::Passkey,
    RetrievalTask::MultiKey,
    RetrievalTask::MultiValue,
    RetrievalTask::Kv,
];

impl RetrievalTask {
    pub fn name(self) -> &'static str {
        match self {
            RetrievalTask::Passkey => "passkey",
            RetrievalTask::MultiKey => "multikey",
            RetrievalTask::MultiValue => "multivalue",
            RetrievalTask::Kv => "kv",
        }
    }

    /// Whether the task's needles are hidden in a haystack (`kv`'s context
    /// is its own list of lines).
    pub fn uses_haystack(self) -> bool {
        self != RetrievalTask::Kv
    }

    /// Needles per trial by default (`--needles`).
    pub fn default_needles(self) -> usize {
        match self {
            RetrievalTask::Passkey => 1,
            _ => 4,
        }
    }

    /// The placeholders each template of the task must hold.
    fn required(self) -> [(&'static str, &'static [&'static str]); 4] {
        let keyed: &[&str] = match self {
            RetrievalTask::Passkey => &[],
            _ => &["{key}"],
        };
        let needle: &[&str] = match self {
            RetrievalTask::Passkey => &["{value}"],
            _ => &["{key}", "{value}"],
        };
        [
            ("intro", &[]),
            ("needle", needle),
            ("question", keyed),
            ("answer", &["{value}"]),
        ]
    }
}

impl fmt::Display for RetrievalTask {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RetrievalTask {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match TASKS.iter().find(|t| t.name() == s) {
            Some(&t) => Ok(t),
            None => crate::config_err!(
                "unknown retrieval task '{s}': use one of {}",
                TASKS.map(|t| t.name()).join(", ")
            ),
        }
    }
}

/// The prompt pieces of a trial, in context order: `intro`, the haystack
/// with the needles in it, `question`, then `answer` (the tokens scored).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Templates {
    pub intro: String,
    /// One needle (for `kv`, one line of the list).
    pub needle: String,
    pub question: String,
    /// `{value}` is the answer (`multivalue`: the values joined by `, `).
    pub answer: String,
}

impl Templates {
    /// The default templates of `task`, worded for base models (the
    /// question ends where the answer starts).
    pub fn default_for(task: RetrievalTask) -> Templates {
        let t = |intro: &str, needle: &str, question: &str| Templates {
            intro: intro.into(),
            needle: needle.into(),
            question: question.into(),
            answer: " {value}".into(),
        };
        match task {
            RetrievalTask::Passkey => t(
                "A pass key is hidden in the text below. Remember it.\n",
                " The pass key is {value}. Remember it.",
                "\nWhat is the pass key? The pass key is",
            ),
            RetrievalTask::MultiKey => t(
                "Special numbers for some names are hidden in the text below.\n",
                " The special number for {key} is {value}.",
                "\nWhat is the special number for {key}? The special number for {key} is",
            ),
            RetrievalTask::MultiValue => t(
                "Special numbers for a name are hidden in the text below.\n",
                " One special number for {key} is {value}.",
                "\nWhat are all the special numbers for {key}, in the order they appear? \
                 The special numbers for {key} are",
            ),
            RetrievalTask::Kv => t(
                "Below is a list of keys and their values.\n",
                "{key}: {value}\n",
                "What is the value of {key}? The value of {key} is",
            ),
        }
    }

    /// Checks that every template holds the placeholders `task` fills
    /// (errors name the flag and the fix).
    pub fn check(&self, task: RetrievalTask) -> Result<()> {
        for (piece, needs) in task.required() {
            let text = self.piece(piece);
            if let Some(p) = needs.iter().find(|p| !text.contains(*p)) {
                return crate::config_err!(
                    "--{piece}-template {text:?} has no {p}: the {task} task puts the \
                     needle's {} there; add {p} to it",
                    &p[1..p.len() - 1]
                );
            }
        }
        if self.answer.trim().is_empty() || self.answer.replace("{value}", "") == self.answer {
            return crate::config_err!("--answer-template must hold {{value}}");
        }
        Ok(())
    }

    fn piece(&self, name: &str) -> &str {
        match name {
            "intro" => &self.intro,
            "needle" => &self.needle,
            "question" => &self.question,
            _ => &self.answer,
        }
    }
}

/// `template` with `{key}` and `{value}` filled in.
pub fn render(template: &str, key: &str, value: &str) -> String {
    template.replace("{key}", key).replace("{value}", value)
}

/// Syllables of made-up keys: a consonant then a vowel.
const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
const VOWELS: &[u8] = b"aeiou";

/// A made-up word of `syllables` syllables (`kolimafu`): a key.
pub fn draw_key(rng: &mut Rng, syllables: usize) -> String {
    (0..syllables)
        .flat_map(|_| {
            let c = CONSONANTS[rng.below(CONSONANTS.len() as u64) as usize];
            let v = VOWELS[rng.below(VOWELS.len() as u64) as usize];
            [c as char, v as char]
        })
        .collect()
}

/// A number of `digits` digits, the first not 0: a value.
pub fn draw_value(rng: &mut Rng, digits: usize) -> String {
    (0..digits)
        .map(|i| {
            let d = match i {
                0 => 1 + rng.below(9),
                _ => rng.below(10),
            };
            char::from(b'0' + d as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_parse_by_name_and_refuse_others() {
        for t in TASKS {
            assert_eq!(t.name().parse::<RetrievalTask>().unwrap(), t);
        }
        let e = "needle".parse::<RetrievalTask>().unwrap_err().to_string();
        assert!(e.contains("passkey, multikey, multivalue, kv"), "{e}");
    }

    #[test]
    fn default_templates_pass_their_check_and_a_missing_placeholder_fails() {
        for t in TASKS {
            Templates::default_for(t).check(t).unwrap();
        }
        let mut bad = Templates::default_for(RetrievalTask::MultiKey);
        bad.question = "\nWhich number? It is".into();
        let e = bad.check(RetrievalTask::MultiKey).unwrap_err().to_string();
        assert!(
            e.contains("--question-template") && e.contains("{key}"),
            "{e}"
        );
        let mut bad = Templates::default_for(RetrievalTask::Passkey);
        bad.needle = " The pass key is hidden.".into();
        let e = bad.check(RetrievalTask::Passkey).unwrap_err().to_string();
        assert!(
            e.contains("--needle-template") && e.contains("{value}"),
            "{e}"
        );
    }

    #[test]
    fn keys_and_values_are_drawn_reproducibly() {
        let (a, b) = (
            draw_value(&mut Rng::new(5), 7),
            draw_value(&mut Rng::new(5), 7),
        );
        assert_eq!(a, b);
        assert_eq!(a.len(), 7);
        assert!(a.bytes().all(|c| c.is_ascii_digit()) && !a.starts_with('0'));
        let k = draw_key(&mut Rng::new(5), 4);
        assert_eq!(k.len(), 8);
        assert!(k.bytes().all(|c| c.is_ascii_lowercase()));
        assert_eq!(render("{key}={value}", "ab", "12"), "ab=12");
    }
}
