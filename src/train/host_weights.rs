//! A model's parameters (and per-parameter optimizer state) copied
//! between a backend and host tensors named by their HF names: what
//! checkpoints are written from and loaded into.

use crate::backend::{Backend, Category, DType, Tensor};
use crate::checkpoint::HostTensor;
use crate::error::{Error, Result};
use crate::model::{ModelConfig, ModelWeights};
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

/// Host copies of one kind of per-parameter optimizer state, named like
/// `w`: `state(k)` is the state of slot k, and `slots[i]` the slot of
/// `w`'s i-th tensor in `ModelWeights::named` order (`None`: frozen, no
/// state).
pub(crate) fn tensors_to_host<'t, B: Backend>(
    b: &B,
    w: &ModelWeights<B>,
    slots: &[Option<usize>],
    state: impl Fn(usize) -> Option<&'t Tensor<B>>,
) -> Result<BTreeMap<String, HostTensor>> {
    w.named()
        .into_iter()
        .zip(slots)
        .filter_map(|(named, slot)| slot.map(|k| (k, named)))
        .map(|(k, (n, _))| {
            let missing = || Error::Backend(format!("the optimizer keeps no state for {n}"));
            let t = state(k).ok_or_else(missing)?;
            Ok((n, HostTensor::new(t.shape().to_vec(), b.to_host(t)?)?))
        })
        .collect()
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
        let t = host
            .get(name)
            .ok_or_else(|| Error::Checkpoint(format!("tensor {name} is missing")))?;
        if t.shape != shape {
            return Err(Error::Checkpoint(format!(
                "tensor {name} has shape {:?}, the model needs {shape:?}",
                t.shape
            )));
        }
        Ok(t.data.clone())
    })
}
