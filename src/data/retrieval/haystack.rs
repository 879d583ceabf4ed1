//! The haystack a retrieval trial hides its needles in: a text the user
//! gives (tokenized sentence by sentence, so a needle goes in between two
//! sentences), a file of token ids (a needle may go anywhere), or the
//! built-in filler repeated as often as a length needs.

use crate::data::{TokenFormat, Tokenizer, Tokens};
use crate::error::{Error, Result};
use crate::rng::Rng;
use std::path::Path;

/// The built-in filler: plain sentences with no digits, repeated to any
/// length (a base model's "haystack" when the user gives none).
pub const FILLER: &str = "The river runs past the old mill and on toward the sea. \
Children play by the water while their parents talk about the weather. \
A baker opens his shop early and the street smells of fresh bread. \
Clouds come in from the west and the afternoon turns grey and quiet. \
In the evening the lamps are lit one by one along the harbour wall.";

/// Haystack ids and where a needle may be put between them.
#[derive(Debug, Clone)]
pub struct Haystack {
    /// What the ids are, as errors name it.
    pub name: String,
    ids: Tokens,
    /// Ascending positions where a sentence starts (`None`: any position).
    breaks: Option<Vec<usize>>,
    /// Whether the ids repeat without end (the filler).
    repeats: bool,
}

/// `budget` haystack ids for one trial and where needles may go in them.
#[derive(Debug, Clone, PartialEq)]
pub struct HaySlice {
    pub ids: Vec<u32>,
    /// Ascending positions in `0..=ids.len()` a needle may be put before.
    pub breaks: Vec<usize>,
}

impl HaySlice {
    /// The break nearest to position `target` (the earlier one on a tie).
    pub fn nearest_break(&self, target: f64) -> usize {
        let i = self.breaks.partition_point(|&b| (b as f64) < target);
        let after = self.breaks.get(i).copied();
        let before = i.checked_sub(1).map(|j| self.breaks[j]);
        match (before, after) {
            (Some(b), Some(a)) if target - b as f64 <= a as f64 - target => b,
            (_, Some(a)) => a,
            (Some(b), None) => b,
            (None, None) => 0,
        }
    }
}

/// Positions in `text` (bytes) where a sentence starts: before the
/// whitespace that follows `.`, `!`, `?` or a newline, so the whitespace
/// goes with the next sentence as byte-level tokenizers attach it.
pub fn sentence_starts(text: &str) -> Vec<usize> {
    let b = text.as_bytes();
    (1..b.len())
        .filter(|&i| b[i].is_ascii_whitespace() && matches!(b[i - 1], b'.' | b'!' | b'?' | b'\n'))
        .collect()
}

impl Haystack {
    /// The built-in [`FILLER`], repeated.
    pub fn filler(tok: &Tokenizer) -> Result<Haystack> {
        // a space first: the last sentence runs into the first again
        let mut h = Self::from_text("the built-in filler", &format!(" {FILLER}"), tok)?;
        if let Some(breaks) = h.breaks.as_mut() {
            breaks.insert(0, 0);
        }
        h.repeats = true;
        Ok(h)
    }

    /// `text` tokenized one sentence at a time (`name`: what errors call it).
    pub fn from_text(name: &str, text: &str, tok: &Tokenizer) -> Result<Haystack> {
        let mut starts = sentence_starts(text);
        starts.push(text.len());
        let (mut ids, mut breaks, mut from) = (Vec::new(), Vec::new(), 0);
        for end in starts {
            if end > from {
                if from > 0 {
                    breaks.push(ids.len());
                }
                ids.extend(tok.encode(&text[from..end])?);
            }
            from = end;
        }
        Ok(Haystack {
            name: name.to_string(),
            ids: Tokens::from_ids(ids, name),
            breaks: Some(breaks),
            repeats: false,
        })
    }

    /// Token ids: a needle may go between any two.
    pub fn from_ids(ids: Tokens) -> Haystack {
        Haystack {
            name: ids.name().to_string(),
            ids,
            breaks: None,
            repeats: false,
        }
    }

    /// `--haystack PATH`: ids (`.u32`, `.u16`, `.bin`, checked against
    /// `vocab`) or UTF-8 text, of which at most `max_bytes` are read.
    pub fn open(path: &Path, tok: &Tokenizer, vocab: usize, max_bytes: usize) -> Result<Haystack> {
        crate::input_path::check_file(path, "--haystack")?;
        if TokenFormat::of_path(path).is_some() {
            return Ok(Self::from_ids(Tokens::open_checked(path, vocab)?));
        }
        let mut bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        bytes.truncate(max_bytes);
        let text = match String::from_utf8(bytes) {
            Ok(t) => t,
            // a cut inside a character: up to the last whole one
            Err(e) if e.utf8_error().error_len().is_none() => {
                let n = e.utf8_error().valid_up_to();
                let mut b = e.into_bytes();
                b.truncate(n);
                String::from_utf8(b).expect("valid up to here")
            }
            Err(e) => {
                return crate::config_err!(
                    "--haystack {} is not UTF-8 text (byte {} is not valid UTF-8): give text, \
                     or token ids as .u32/.u16/.bin",
                    path.display(),
                    e.utf8_error().valid_up_to()
                );
            }
        };
        Self::from_text(&path.display().to_string(), &text, tok)
    }

    /// Ids in the haystack (one period of the filler).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the haystack holds no id.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether the haystack repeats to any length.
    pub fn repeats(&self) -> bool {
        self.repeats
    }

    /// Checks that `budget` ids can be taken (errors name the fix).
    pub fn check_fills(&self, budget: usize, length: usize) -> Result<()> {
        if (self.repeats && !self.is_empty()) || budget <= self.len() {
            return Ok(());
        }
        crate::config_err!(
            "--lengths {length}: a trial of {length} tokens needs {budget} haystack tokens but {} \
             holds {}; give a longer --haystack, shorter --lengths, or leave out --haystack to \
             repeat the built-in filler",
            self.name,
            self.len()
        )
    }

    /// `budget` ids for one trial: the filler from its start, or a stretch
    /// of the text starting at a sentence `rng` draws.
    pub fn take(&self, budget: usize, rng: &mut Rng) -> Result<HaySlice> {
        self.check_fills(budget, budget)?;
        let n = self.len();
        if self.repeats {
            let base = self.ids.read(0..n);
            let breaks = self.breaks.as_deref().unwrap_or_default();
            let ids = (0..budget).map(|i| base[i % n]).collect();
            let breaks = (0..budget.div_ceil(n) + 1)
                .flat_map(|r| breaks.iter().map(move |&b| r * n + b))
                .filter(|&b| b <= budget)
                .collect();
            return Ok(HaySlice { ids, breaks });
        }
        let last_start = n - budget;
        let start = match &self.breaks {
            None => rng.below(last_start as u64 + 1) as usize,
            Some(br) => {
                let fit = br.partition_point(|&b| b <= last_start);
                match fit {
                    0 => 0,
                    k => br[rng.below(k as u64) as usize],
                }
            }
        };
        let ids = self.ids.read(start..start + budget);
        let breaks = match &self.breaks {
            None => (0..=budget).collect(),
            Some(br) => std::iter::once(0)
                .chain(
                    br.iter()
                        .filter(|&&b| b > start && b <= start + budget)
                        .map(|&b| b - start),
                )
                .collect(),
        };
        Ok(HaySlice { ids, breaks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_start_before_their_whitespace() {
        let t = "One. Two! Three?\nFour";
        assert_eq!(sentence_starts(t), vec![4, 9, 16]);
        let h = Haystack::from_text("t", t, &Tokenizer::byte()).unwrap();
        assert_eq!(h.len(), t.len());
        assert_eq!(h.breaks.as_deref(), Some(&[4, 9, 16][..]));
    }

    #[test]
    fn the_filler_repeats_with_breaks_at_each_sentence() {
        let tok = Tokenizer::byte();
        let h = Haystack::filler(&tok).unwrap();
        let n = h.len();
        let s = h.take(3 * n + 5, &mut Rng::new(1)).unwrap();
        assert_eq!(s.ids.len(), 3 * n + 5);
        assert_eq!(&s.ids[..n], &s.ids[n..2 * n]);
        assert!(s.breaks.contains(&0) && s.breaks.contains(&n) && s.breaks.contains(&(2 * n)));
        let text = tok.decode(&s.ids[..n]).unwrap();
        assert!(text.starts_with(" The river") && !text.chars().any(|c| c.is_ascii_digit()));
        for &b in s.breaks.iter().filter(|&&b| b < s.ids.len()) {
            // every break is before the space after a sentence
            assert_eq!(s.ids[b], u32::from(b' '), "break {b}");
        }
    }

    #[test]
    fn a_text_too_short_is_an_error_naming_the_fix() {
        let h =
            Haystack::from_text("short.txt", "Only this. And that.", &Tokenizer::byte()).unwrap();
        let e = h.take(100, &mut Rng::new(0)).unwrap_err().to_string();
        assert!(
            e.contains("short.txt") && e.contains("leave out --haystack"),
            "{e}"
        );
        let s = h.take(10, &mut Rng::new(3)).unwrap();
        assert_eq!(s.ids.len(), 10);
        assert_eq!(s.breaks[0], 0);
    }

    #[test]
    fn the_nearest_break_is_chosen() {
        let s = HaySlice {
            ids: vec![0; 10],
            breaks: vec![0, 4, 10],
        };
        assert_eq!(s.nearest_break(0.0), 0);
        assert_eq!(s.nearest_break(2.0), 0);
        assert_eq!(s.nearest_break(3.0), 4);
        assert_eq!(s.nearest_break(9.0), 10);
        assert_eq!(s.nearest_break(50.0), 10);
    }
}
