//! [`Dataset`]: the ids a run trains on with, where known, their document
//! index and loss mask (`doc_index.rs`), read and checked together.

use super::corpus::load_tokens;
use super::doc_index::{DocIndex, LossMask, check_stamp, index_path, mask_path};
use super::tokens::{TokenFormat, Tokens};
use crate::error::Result;
use std::path::Path;
use std::sync::Arc;

/// Token ids, where their documents start, and which count as targets.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub tokens: Tokens,
    /// `None`: the ids are one document.
    pub docs: Option<Arc<DocIndex>>,
    /// `None`: every target counts.
    pub mask: Option<LossMask>,
}

/// Ids that are one document, every target counted.
macro_rules! one_document_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Dataset {
            fn from(tokens: $t) -> Dataset {
                Dataset {
                    tokens: tokens.into(),
                    docs: None,
                    mask: None,
                }
            }
        }
    )*};
}
one_document_from!(Tokens, Vec<u32>, Arc<[u32]>);

impl From<&Tokens> for Dataset {
    fn from(tokens: &Tokens) -> Dataset {
        tokens.clone().into()
    }
}

impl Dataset {
    /// `tokens` read from `path`, with the `PATH.docs` and `PATH.mask`
    /// beside it when they exist, each checked against the ids.
    pub fn with_files_beside(tokens: Tokens, path: &Path) -> Result<Dataset> {
        let n = tokens.len() as u64;
        let index = index_path(path);
        let docs = match index.exists() {
            true => Some(Arc::new(DocIndex::open(&index, n)?)),
            false => None,
        };
        if let Some(d) = &docs {
            check_stamp(d.stamp(), &tokens, &index)?;
        }
        let mask = mask_path(path);
        let mask = match mask.exists() {
            true => Some(LossMask::open(&mask, n)?),
            false => None,
        };
        if let Some(m) = &mask {
            check_stamp(m.stamp(), &tokens, &mask_path(path))?;
        }
        Ok(Dataset { tokens, docs, mask })
    }

    /// Ids in the dataset.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no id.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// The data of `train --data`: [`load_tokens`]'s ids, with the document
/// index and loss mask beside a pre-tokenized file when they exist (a file
/// without an index is one document, and `--pack documents` then cuts the
/// same windows as `stream`).
pub fn load_dataset(path: Option<&Path>, tokenizer: Option<&str>, vocab: usize) -> Result<Dataset> {
    let tokens = load_tokens(path, tokenizer, vocab)?;
    let Some(p) = path.filter(|p| TokenFormat::of_path(p).is_some()) else {
        return Ok(tokens.into());
    };
    let data = Dataset::with_files_beside(tokens, p)?;
    if data.docs.is_none() {
        tracing::info!(
            "{} has no document index beside it ({}): its ids are read as one document",
            p.display(),
            index_path(p).display()
        );
    }
    Ok(data)
}
