//! Argument checks every device's ops share (element ranges, element
//! counts, GQA pairs, bias views, token ids) and the out-of-memory error.

use super::mask::AttnMask;
use super::memory::{Bytes, MemoryLedger};
use super::tensor::{MatLayout, Rows, Tensor, TensorDevice};
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

/// The query heads, kv heads and head dim of an attention call of `q`
/// `[sq, hq, d]` over `k` `[sk, hkv, d]` under `mask`: a GQA pair (hq a
/// multiple of hkv, one head dim) of lengths the mask allows.
pub fn attention_heads<B: TensorDevice>(
    q: &Rows<'_, B>,
    k: &Rows<'_, B>,
    mask: &AttnMask,
) -> Result<(usize, usize, usize)> {
    let (hq, hkv, d) = (q.heads(), k.heads(), q.head_dim());
    if hkv == 0 || !hq.is_multiple_of(hkv) || k.head_dim() != d {
        return Err(crate::Error::Backend(format!(
            "attention: q {:?} and k {:?} do not form a GQA pair",
            q.t.shape(),
            k.t.shape()
        )));
    }
    if let Err(why) = mask.check_shape(q.len(), k.len()) {
        return Err(crate::Error::Backend(format!("attention: {why}")));
    }
    Ok((hq, hkv, d))
}

/// The error of an allocation of `requested` bytes that `device` could not
/// make, with the bytes its ledger holds by category.
pub fn out_of_memory(device: &str, ledger: &MemoryLedger, requested: usize) -> crate::Error {
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
