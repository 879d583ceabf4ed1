//! A training corpus of retrieval trials (`upipe eval --task T
//! --write-corpus OUT.u32`): documents that are trials at lengths drawn
//! from the given ones and depths drawn uniformly, written as `upipe
//! tokenize` writes ids (the ids, their document index and a loss mask that
//! counts only the answer's tokens), ready for `upipe train --data OUT.u32
//! --pack bfd`.

use super::{TrialAt, TrialMaker};
use crate::data::doc_index::{
    IndexWriter, MaskWriter, ids_stamp, index_path, mask_path, write_stamp,
};
use crate::error::Result;
use crate::rng::Rng;
use std::path::Path;

/// What a corpus holds.
#[derive(Debug, Clone)]
pub struct CorpusSpec {
    /// Lengths a document is drawn from.
    pub lengths: Vec<usize>,
    /// Documents (trials).
    pub documents: usize,
    pub seed: u64,
}

/// What was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CorpusWritten {
    pub documents: usize,
    pub tokens: u64,
    /// Tokens the loss mask counts (the answers').
    pub counted: u64,
}

/// Trial `d` of the corpus: its length and depth drawn from its own seed.
pub fn corpus_trial_at(spec: &CorpusSpec, d: usize) -> TrialAt {
    let mut rng = Rng::new(spec.seed ^ (d as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25));
    let length_index = rng.below(spec.lengths.len() as u64) as usize;
    TrialAt {
        length: spec.lengths[length_index],
        depth: rng.uniform(),
        length_index,
        depth_index: 0,
        index: d,
        seed: rng.next_u64(),
    }
}

/// Writes `spec.documents` trials of `maker` to `path` (a `.u32` file)
/// with the document index and loss mask beside it.
pub fn write_corpus(path: &Path, maker: &TrialMaker, spec: &CorpusSpec) -> Result<CorpusWritten> {
    if path.extension().is_none_or(|e| e != "u32") {
        return crate::config_err!(
            "--write-corpus {}: the corpus is written as token ids; name a .u32 file",
            path.display()
        );
    }
    if spec.documents == 0 {
        return crate::config_err!("--documents 0: write at least one document");
    }
    let mut ids: Vec<u32> = Vec::new();
    let mut index = IndexWriter::create(&index_path(path))?;
    let mut mask = MaskWriter::create(&mask_path(path))?;
    let mut counted = 0u64;
    for d in 0..spec.documents {
        let trial = maker.trial(&corpus_trial_at(spec, d))?;
        index.push(ids.len() as u64)?;
        let flags: Vec<bool> = (0..trial.ids.len())
            .map(|i| trial.answer.contains(&i))
            .collect();
        mask.push(&flags)?;
        counted += trial.answer.len() as u64;
        ids.extend(trial.ids);
    }
    let n = ids.len() as u64;
    index.finish(n)?;
    mask.finish()?;
    crate::data::write_u32_tokens(path, &ids)?;
    let stamp = ids_stamp(&crate::data::Tokens::from_ids(ids, "the corpus"));
    write_stamp(&index_path(path), stamp)?;
    write_stamp(&mask_path(path), stamp)?;
    Ok(CorpusWritten {
        documents: spec.documents,
        tokens: n,
        counted,
    })
}
