//! A model's parameters (and per-parameter optimizer state) copied
//! between a backend and host tensors named by their HF names: what
//! checkpoints are written from and loaded into.

use crate::backend::{Backend, Category, DType};
use crate::checkpoint::HostTensor;
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

/// Host copies of one kind of per-parameter optimizer state, named like
/// `w`, as F32 values decoded from the optimizer's format; `slots[i]` is
/// the slot of `w`'s i-th tensor in `ModelWeights::named` order (`None`:
/// frozen, no state).
pub(crate) fn state_to_host<B: Backend>(
    b: &B,
    w: &ModelWeights<B>,
    slots: &[Option<usize>],
    opt: &dyn Optimizer<B>,
    kind: StateKind,
) -> Result<BTreeMap<String, HostTensor>> {
    w.named()
        .into_iter()
        .zip(slots)
        .filter_map(|(named, slot)| slot.map(|k| (k, named)))
        .map(|(k, (n, t))| {
            let missing = || Error::Backend(format!("the optimizer keeps no state for {n}"));
            let values = opt.state_values(b, k, kind)?.ok_or_else(missing)?;
            Ok((n, HostTensor::new(t.shape().to_vec(), values)?))
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
