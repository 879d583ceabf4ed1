//! `--data a.u32:0.7,b.u32:0.3`: a weighted mixture of corpora.
//!
//! Each training window is drawn whole from one corpus (its own windows,
//! packed as `--pack` says, with its own document index and loss mask); the
//! corpus of the next window is chosen as Megatron-LM's blended datasets
//! choose it: the one furthest behind its share, `argmax_j (w_j · (n + 1) −
//! taken_j)` after `n` windows (ties to the first named). So after any `n`
//! windows of a data replica every corpus has had its share to within one
//! window, `|taken_j − w_j · n| < 1`, and the sequence depends only on the
//! weights. Which windows of a corpus come, and in which order, is its own
//! [`PackedSampler`]'s, from the seed (corpus `j > 0` mixes `j` into it).
//! The state saved in a checkpoint is every corpus's sampler state and the
//! windows taken from each, so a resumed run continues the same sequence.
//! One corpus is not a mixture: its sampler and its saved state are the
//! plain [`PackedSampler`]'s, bit for bit.

use super::corpus::SamplerState;
use super::dataset::{Dataset, load_dataset};
use super::packing::PackMode;
use super::sampler::PackedSampler;
use super::tokens::Tokens;
use super::window::PackedWindow;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The corpora a run trains on and their weights (normalized to sum 1).
#[derive(Debug, Clone)]
pub struct Mixture {
    /// `[corpora]`, in the order `--data` names them.
    pub corpora: Vec<Dataset>,
    /// `[corpora]` share of the windows each is drawn for; sums to 1.
    pub weights: Vec<f64>,
}

/// One corpus: every window is its.
macro_rules! one_corpus_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Mixture {
            fn from(data: $t) -> Mixture {
                Mixture { corpora: vec![data.into()], weights: vec![1.0] }
            }
        }
    )*};
}
one_corpus_from!(Dataset, Tokens, Vec<u32>, Arc<[u32]>);

impl Mixture {
    /// Corpora with their `--data` weights: each finite and not negative,
    /// at least one above 0 (the errors name `--data` and the fix).
    pub fn new(parts: Vec<(Dataset, f64)>) -> Result<Mixture> {
        if parts.is_empty() {
            return crate::config_err!("--data names no corpus: write --data a.u32:0.7,b.u32:0.3");
        }
        for (d, w) in &parts {
            if !w.is_finite() || *w < 0.0 {
                return crate::config_err!(
                    "--data {}: weight {w} is not a number of 0 or more; give each corpus a \
                     non-negative weight, as in --data a.u32:0.7,b.u32:0.3",
                    d.tokens.name()
                );
            }
        }
        let total: f64 = parts.iter().map(|(_, w)| w).sum();
        if total <= 0.0 {
            return crate::config_err!(
                "--data: every corpus has weight 0, so no window could be drawn; give at least \
                 one corpus a weight above 0, as in --data a.u32:0.7,b.u32:0.3"
            );
        }
        let (corpora, weights) = parts.into_iter().map(|(d, w)| (d, w / total)).unzip();
        Ok(Mixture { corpora, weights })
    }

    /// Whether it mixes more than one corpus.
    pub fn is_mixture(&self) -> bool {
        self.corpora.len() > 1
    }

    /// Ids in every corpus together.
    pub fn len(&self) -> usize {
        self.corpora.iter().map(Dataset::len).sum()
    }

    /// Whether no corpus holds an id.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Errors if an id of any corpus is `>= vocab` ([`Tokens::check_vocab`]).
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        self.corpora
            .iter()
            .try_for_each(|d| d.tokens.check_vocab(vocab))
    }

    /// Errors if the corpora's documents end with different ids: each
    /// corpus with a document index whose documents (nearly) all end with
    /// one id ends them with its tokenizer's end-of-sequence token, so two
    /// such ids differing mean two tokenizers (or two `--eos`).
    pub fn check_same_tokenizer(&self) -> Result<()> {
        let ends: Vec<(&str, u32)> = self
            .corpora
            .iter()
            .filter_map(|d| document_end_id(d).map(|id| (d.tokens.name(), id)))
            .collect();
        let Some(&(first, id)) = ends.first() else {
            return Ok(());
        };
        match ends.iter().find(|(_, other)| *other != id) {
            None => Ok(()),
            Some((name, other)) => crate::config_err!(
                "--data mixes corpora of different tokenizers: the documents of {first} end with \
                 id {id}, those of {name} with id {other} (each its end-of-sequence token); \
                 tokenize every corpus with the model's tokenizer and --eos \
                 (`upipe tokenize --tokenizer ...`) before mixing them"
            ),
        }
    }
}

/// The corpora and weights of a `--data` value `a.u32:0.7,b.u32:0.3`;
/// `None` when it names one file (a path that exists, or one without a
/// `:WEIGHT`), which is not a mixture. Errors name `--data` and the fix.
pub fn parse_data_spec(spec: &Path) -> Result<Option<Vec<(PathBuf, f64)>>> {
    let text = spec.to_string_lossy();
    let weighted = |part: &str| {
        part.rsplit_once(':')
            .is_some_and(|(_, w)| w.parse::<f64>().is_ok())
    };
    if spec.exists() || !(text.contains(',') || weighted(&text)) {
        return Ok(None);
    }
    let example = "write --data a.u32:0.7,b.u32:0.3 (each file, a colon, its weight)";
    text.split(',')
        .map(|part| {
            let Some((path, w)) = part.rsplit_once(':') else {
                return crate::config_err!(
                    "--data {text}: corpus '{part}' has no weight; {example}"
                );
            };
            let Ok(weight) = w.trim().parse::<f64>() else {
                return crate::config_err!(
                    "--data {text}: the weight '{w}' of {path} is not a number; {example}"
                );
            };
            if path.is_empty() {
                return crate::config_err!("--data {text}: a weight without a file; {example}");
            }
            Ok((PathBuf::from(path), weight))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The data of `train --data`: one corpus ([`load_dataset`]), or the
/// mixture a `--data a.u32:0.7,b.u32:0.3` names, each corpus loaded as one
/// would be and checked against the model's vocabulary and the others'
/// tokenizer ([`Mixture::check_same_tokenizer`]).
pub fn load_mixture(spec: Option<&Path>, tokenizer: Option<&str>, vocab: usize) -> Result<Mixture> {
    let Some(parts) = spec.map(parse_data_spec).transpose()?.flatten() else {
        return load_dataset(spec, tokenizer, vocab).map(Mixture::from);
    };
    let parts = parts
        .into_iter()
        .map(|(path, w)| {
            check_mixture_file(&path, tokenizer)?;
            Ok((load_dataset(Some(&path), tokenizer, vocab)?, w))
        })
        .collect::<Result<Vec<_>>>()?;
    let mix = Mixture::new(parts)?;
    mix.check_same_tokenizer()?;
    Ok(mix)
}

/// Checks one corpus file of a mixture before it is read.
pub fn check_mixture_file(path: &Path, tokenizer: Option<&str>) -> Result<()> {
    if !path.exists() {
        return crate::config_err!(
            "--data: the corpus {} does not exist; name an existing file of ids (.u32, .u16,              .bin) or text in each FILE:WEIGHT of --data",
            path.display()
        );
    }
    crate::data::inputs::refuse_untokenized(path, tokenizer)?;
    crate::input_path::check_file(path, "--data")
}

/// The id (nearly) every text document of `data` ends with: of up to 256
/// documents spread over its index, the last id of at least 90% of those
/// whose first id the loss mask counts (a conversation's first id, its
/// prompt's, is not counted: it ends as its chat template ends it, not
/// with the end-of-sequence id); `None` without an index or such an id.
fn document_end_id(data: &Dataset) -> Option<u32> {
    let docs = data.docs.as_ref()?;
    let n = docs.len();
    let sample = n.min(256);
    let mut counts = std::collections::BTreeMap::<u32, usize>::new();
    let mut last = Vec::new();
    let mut texts = 0;
    for i in 0..sample {
        let span = docs.span(i * n / sample);
        if data.mask.as_ref().is_some_and(|m| !m.counts(span.start)) {
            continue;
        }
        texts += 1;
        data.tokens
            .read_into(span.end as usize - 1..span.end as usize, &mut last);
        *counts.entry(last[0]).or_default() += 1;
    }
    let (&id, &count) = counts.iter().max_by_key(|(_, c)| **c)?;
    (count * 10 >= texts * 9).then_some(id)
}

/// Where a [`MixtureSampler`] of several corpora is, for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixtureState {
    /// `[corpora]` each corpus's sampler.
    pub corpora: Vec<SamplerState>,
    /// `[corpora]` windows drawn from each.
    pub taken: Vec<u64>,
    /// `[corpora]` the weights (normalized) they were drawn by.
    pub weights: Vec<f64>,
}

/// One corpus's share of the windows a data replica drew so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixShare {
    /// The corpus (its file).
    pub data: String,
    /// Its weight, normalized.
    pub weight: f64,
    /// Windows drawn from it.
    pub windows: u64,
    /// Its share of every window drawn (the realised proportion).
    pub share: f64,
}

/// Windows of a [`Mixture`], each from one corpus, for one data replica.
#[derive(Debug, Clone)]
pub struct MixtureSampler {
    /// `[corpora]`
    samplers: Vec<PackedSampler>,
    weights: Vec<f64>,
    taken: Vec<u64>,
    names: Vec<String>,
}

impl MixtureSampler {
    /// A sampler of windows of `seq` inputs for data-parallel rank `rank`
    /// of `world`: one [`PackedSampler`] per corpus (corpus `j`'s seed
    /// `seed` for the first, mixed with `j` for the others).
    pub fn sharded(
        mix: impl Into<Mixture>,
        mode: PackMode,
        seq: usize,
        seed: u64,
        rank: usize,
        world: usize,
    ) -> Result<MixtureSampler> {
        let mix = mix.into();
        let several = mix.is_mixture();
        let names: Vec<String> = mix.corpora.iter().map(|d| d.tokens.name().into()).collect();
        let samplers = mix
            .corpora
            .into_iter()
            .enumerate()
            .map(|(j, d)| {
                let seed = seed ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                PackedSampler::sharded(d, mode, seq, seed, rank, world).map_err(|e| match several {
                    true => Error::Config(format!("--data corpus {}: {}", names[j], bare(&e))),
                    false => e,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MixtureSampler {
            taken: vec![0; samplers.len()],
            samplers,
            weights: mix.weights,
            names,
        })
    }

    /// The next window.
    pub fn next_packed(&mut self) -> PackedWindow {
        let j = next_corpus(&self.weights, &self.taken);
        self.taken[j] += 1;
        self.samplers[j].next_packed()
    }

    /// Windows with no counted target passed over so far, every corpus's
    /// ([`PackedSampler::next_packed`]).
    pub fn skipped_windows(&self) -> u64 {
        self.samplers
            .iter()
            .map(PackedSampler::skipped_windows)
            .sum()
    }

    /// The corpus each of the next `n` windows will come from.
    pub fn corpus_sequence(&self, n: usize) -> Vec<usize> {
        let mut taken = self.taken.clone();
        (0..n)
            .map(|_| {
                let j = next_corpus(&self.weights, &taken);
                taken[j] += 1;
                j
            })
            .collect()
    }

    /// The realised proportions so far; `None` for one corpus.
    pub fn shares(&self) -> Option<Vec<MixShare>> {
        if self.samplers.len() < 2 {
            return None;
        }
        let n = self.taken.iter().sum::<u64>().max(1) as f64;
        let shares = (0..self.samplers.len())
            .map(|j| MixShare {
                data: self.names[j].clone(),
                weight: self.weights[j],
                windows: self.taken[j],
                share: self.taken[j] as f64 / n,
            })
            .collect();
        Some(shares)
    }

    /// The current position, to store in a checkpoint: one corpus's
    /// [`SamplerState`] as it is, several as a [`MixtureState`].
    pub fn state(&self) -> serde_json::Value {
        let json = |v: std::result::Result<serde_json::Value, serde_json::Error>| {
            v.expect("sampler states serialize")
        };
        match self.samplers.as_slice() {
            [one] => json(serde_json::to_value(one.state())),
            _ => json(serde_json::to_value(MixtureState {
                corpora: self.samplers.iter().map(PackedSampler::state).collect(),
                taken: self.taken.clone(),
                weights: self.weights.clone(),
            })),
        }
    }

    /// Moves to a position previously returned by [`MixtureSampler::state`];
    /// a checkpoint of another mixture (other corpora or weights) is an error.
    pub fn restore(&mut self, saved: &serde_json::Value) -> Result<()> {
        let bad = |why: String| {
            Err(Error::Checkpoint(format!(
                "{why}; resume with the --data (corpora and weights) the run was started with"
            )))
        };
        if saved.is_null() {
            return bad("the checkpoint holds no sampler state".into());
        }
        if let [one] = self.samplers.as_mut_slice() {
            return match serde_json::from_value::<SamplerState>(saved.clone()) {
                Ok(s) => one.restore(s),
                Err(_) => bad(
                    "the checkpoint was trained on a mixture of corpora, this run on \
                               one --data"
                        .into(),
                ),
            };
        }
        let Ok(s) = serde_json::from_value::<MixtureState>(saved.clone()) else {
            return bad(format!(
                "the checkpoint was not trained on a mixture, this run mixes {} corpora",
                self.samplers.len()
            ));
        };
        let same_weights = s.weights.len() == self.weights.len()
            && s.weights
                .iter()
                .zip(&self.weights)
                .all(|(a, b)| (a - b).abs() < 1e-12);
        if !same_weights || s.corpora.len() != s.taken.len() {
            return bad(format!(
                "the checkpoint's mixture has weights {:?}, this run's {:?}",
                s.weights, self.weights
            ));
        }
        for (sampler, state) in self.samplers.iter_mut().zip(s.corpora) {
            sampler.restore(state)?;
        }
        self.taken = s.taken;
        Ok(())
    }
}

/// The corpus of the next window after `taken` of each: the one furthest
/// behind its share of `weights` (ties to the first).
fn next_corpus(weights: &[f64], taken: &[u64]) -> usize {
    let n = taken.iter().sum::<u64>() as f64;
    let behind = |j: usize| weights[j] * (n + 1.0) - taken[j] as f64;
    (1..weights.len()).fold(0, |best, j| match behind(j) > behind(best) {
        true => j,
        false => best,
    })
}

/// The message of a configuration error, without its kind's prefix.
fn bare(e: &Error) -> String {
    match e {
        Error::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
#[path = "mixture_tests.rs"]
mod tests;
