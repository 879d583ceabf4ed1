//! A model's parameters (and per-parameter optimizer state) copied
//! between a backend and host tensors named by their HF names: what
//! checkpoints are written from and loaded into. A save's sources and a
//! resume's reads go one tensor at a time ([`weight_sources`],
//! [`state_sources`], [`weights_from_saved`]).

use crate::backend::{Backend, Category, DType};
use crate::checkpoint::saved_state::SavedState;
use crate::checkpoint::{HostTensor, TensorSource};
use crate::error::{Error, Result};
use crate::model::{ModelConfig, ModelWeights};
use crate::optim::{Optimizer, StateKind};
use std::collections::BTreeMap;

/// Copies every parameter to the host by HF name.
pub fn weights_to_host<B: Backend>(
    b: &B,
    w: &ModelWeights<B>,
) -> Result<BTreeMap<String, HostTensor>> {
    w.named()
        .into_iter()
        .map(|(n, t)| Ok((n, HostTensor::new(t.shape().to_vec(), b.to_host(t)?)?)))
        .collect()
}

/// Every parameter by HF name, in model order, each copied to the host
/// only when a save writes it.
pub fn weight_sources<'a, B: Backend>(b: &'a B, w: &'a ModelWeights<B>) -> Vec<TensorSource<'a>> {
    let named = w.named().into_iter();
    named
        .map(|(n, t)| TensorSource::new(n, t.shape().to_vec(), move || b.to_host(t)))
        .collect()
}

/// One kind of per-parameter optimizer state named like `w` (as
/// [`state_to_host`]), each decoded to F32 only when a save writes it.
pub(crate) fn state_sources<'a, B: Backend>(
    b: &'a B,
    w: &'a ModelWeights<B>,
    slots: &[Option<usize>],
    opt: &'a dyn Optimizer<B>,
    kind: StateKind,
) -> Vec<TensorSource<'a>> {
    let named = w.named().into_iter().zip(slots);
    let trained = named.filter_map(|(named, slot)| slot.map(|k| (k, named)));
    trained
        .map(|(k, (n, t))| {
            let missing = format!("the optimizer keeps no state for {n}");
            let fetch = move || {
                let values = opt.state_values(b, k, kind)?;
                values.ok_or_else(|| Error::Backend(missing.clone()))
            };
            TensorSource::new(n, t.shape().to_vec(), fetch)
        })
        .collect()
}

/// Builds weights from a checkpoint's values ([`SavedState::value`]: the
/// F32 masters where it kept them), reading each tensor as it is built.
pub fn weights_from_saved<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    saved: &SavedState,
    dtype: DType,
    cat: Category,
) -> Result<ModelWeights<B>> {
    ModelWeights::build(b, cfg, dtype, cat, |name, shape| {
        match saved.shape(name) {
            None => return Err(missing(name)),
            Some(found) if found != shape => return Err(wrong_shape(name, found, shape)),
            Some(_) => {}
        }
        Ok(saved.value(name)?.data)
    })
}

fn missing(name: &str) -> Error {
    Error::Checkpoint(format!("tensor {name} is missing"))
}

fn wrong_shape(name: &str, found: &[usize], needed: &[usize]) -> Error {
    Error::Checkpoint(format!(
        "tensor {name} has shape {found:?}, the model needs {needed:?}"
    ))
}

/// Builds weights from host tensors by HF name (shapes were checked when loading).
pub fn weights_from_host<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    host: &BTreeMap<String, HostTensor>,
    dtype: DType,
    cat: Category,
) -> Result<ModelWeights<B>> {
    ModelWeights::build(b, cfg, dtype, cat, |name, shape| {
        let t = host.get(name).ok_or_else(|| missing(name))?;
        if t.shape != shape {
            return Err(wrong_shape(name, &t.shape, shape));
        }
        Ok(t.data.clone())
    })
}
