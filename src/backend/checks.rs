//! Argument checks every device's ops share (element ranges, element
//! counts, bias views, token ids) and the out-of-memory error.

use super::memory::{Bytes, MemoryLedger};
use super::tensor::{MatLayout, Tensor, TensorDevice};
use crate::error::Result;

/// Checks that every token id indexes a `vocab`-row embedding table.
pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= vocab) {
        Some(id) => Err(crate::Error::Config(format!(
            "token id {id} is outside the vocabulary of {vocab}; check the tokenizer matches the model"
        ))),
        None => Ok(()),
    }
}

/// Checks that `elems` lies inside a tensor of `numel` elements (`op` names the caller).
pub fn check_elems(elems: &std::ops::Range<usize>, numel: usize, op: &str) -> Result<()> {
    if elems.start > elems.end || elems.end > numel {
        return Err(crate::Error::Backend(format!(
            "{op}: elements {elems:?} are outside a tensor of {numel}"
        )));
    }
    Ok(())
}

/// Checks that `a` and `b` hold as many elements (`op` names the caller).
pub fn check_same_numel<B: TensorDevice>(a: &Tensor<B>, b: &Tensor<B>, op: &str) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(crate::Error::Backend(format!(
            "{op}: element counts differ ({:?} vs {:?})",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

/// The error of an allocation of `requested` bytes that `device` could not
/// make, with the bytes its ledger holds by category and what its allocator
/// adds (`device_state`, empty or starting with `; `).
pub fn out_of_memory(
    device: &str,
    ledger: &MemoryLedger,
    requested: usize,
    device_state: String,
) -> crate::Error {
    let s = ledger.stats();
    let by = s
        .current_by_category
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(c, b)| format!("{}: {}", c.name(), Bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ");
    crate::Error::OutOfMemory {
        device: device.to_string(),
        requested,
        in_use: s.current,
        by_category: by,
        device_state,
    }
}

/// Checks the views of [`Backend::add_bias_rows`] / [`Backend::bias_grad`]:
/// `bias` one untransposed row as wide as `x`, `x` untransposed.
pub fn check_bias_views(x: &MatLayout, bias: &MatLayout, op: &str) -> Result<()> {
    if bias.rows != 1 || bias.cols != x.cols || bias.trans || x.trans {
        return Err(crate::Error::Backend(format!(
            "{op}: a bias row {bias:?} for the rows of {x:?}"
        )));
    }
    Ok(())
}
