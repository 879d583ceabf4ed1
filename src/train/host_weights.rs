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

/// Host copies of per-parameter state tensors (moments), named like `w`.
pub(crate) fn tensors_to_host<B: Backend>(
    b: &B,
    w: &ModelWeights<B>,
    ts: &[Tensor<B>],
) -> Result<BTreeMap<String, HostTensor>> {
    w.named()
        .into_iter()
        .zip(ts)
        .map(|((n, _), t)| Ok((n, HostTensor::new(t.shape().to_vec(), b.to_host(t)?)?)))
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
