//! A model's LoRA adapters as trainable device parameters: every block's
//! [`LoraPair`]s (in the weight dtype, like the base weights; F32 masters
//! and moments belong to the optimizer's slots) and their F32 gradients,
//! uploaded from and read back into the host [`LoraWeights`]; and the
//! `--freeze` that leaves only the adapters to train ([`lora_base_freeze`]).
//! The arithmetic on them is `attention/lora_delta.rs`.

use super::config::ModelConfig;
use super::freeze::Freeze;
use super::lora::{LoraFactors, LoraTarget, LoraWeights};
use crate::attention::lora_delta::{LoraPair, LoraPairGrads};
use crate::backend::{Backend, DType};
use crate::error::Result;

/// One block's adapters, one [`LoraPair`] per target, in block order.
pub struct BlockAdapters<B: Backend> {
    pub targets: Vec<(LoraTarget, LoraPair<B>)>,
}

/// One block's adapter gradients, in the order of its [`BlockAdapters`].
pub struct BlockAdapterGrads<B: Backend> {
    pub targets: Vec<(LoraTarget, LoraPairGrads<B>)>,
}

impl<B: Backend> BlockAdapters<B> {
    /// Block `layer`'s adapters of `weights`, uploaded in `dtype`.
    pub fn upload(
        dev: &B,
        weights: &LoraWeights,
        layer: usize,
        dtype: DType,
    ) -> Result<BlockAdapters<B>> {
        let scale = weights.config.scale();
        let mut targets = Vec::new();
        for (&t, f) in weights.config.targets.iter().zip(&weights.layers[layer]) {
            let d = f.dims;
            let shapes = [[d.rank, d.in_features], [d.out_features, d.rank]];
            let pair = LoraPair::upload(dev, &f.a, &f.b, shapes, dtype, scale)?;
            targets.push((t, pair));
        }
        Ok(BlockAdapters { targets })
    }

    /// The adapter of `target`, if this block has one.
    pub fn get(&self, target: LoraTarget) -> Option<&LoraPair<B>> {
        self.targets
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, p)| p)
    }

    /// Zero F32 gradients for every adapter of the block.
    pub fn zero_grads(&self, dev: &B) -> Result<BlockAdapterGrads<B>> {
        let mut targets = Vec::new();
        for (t, pair) in &self.targets {
            targets.push((*t, LoraPairGrads::zeros(dev, pair)?));
        }
        Ok(BlockAdapterGrads { targets })
    }

    /// The block's factors on the host, as f32, in block order.
    pub fn to_host(&self, dev: &B) -> Result<Vec<LoraFactors>> {
        let mut out = Vec::new();
        for (_, pair) in &self.targets {
            let (rank, in_features, out_features) = pair.dims();
            out.push(LoraFactors {
                dims: super::lora::LoraDims {
                    rank,
                    in_features,
                    out_features,
                },
                a: dev.to_host(&pair.a)?,
                b: dev.to_host(&pair.b)?,
            });
        }
        Ok(out)
    }
}

impl<B: Backend> BlockAdapterGrads<B> {
    /// The gradients of `target`'s adapter, if this block has one.
    pub fn get_mut(&mut self, target: LoraTarget) -> Option<&mut LoraPairGrads<B>> {
        let found = self.targets.iter_mut().find(|(t, _)| *t == target);
        found.map(|(_, g)| g)
    }
}

/// Every block's adapters of `weights` on the device, in `dtype`.
pub fn upload_adapters<B: Backend>(
    dev: &B,
    cfg: &ModelConfig,
    weights: &LoraWeights,
    dtype: DType,
) -> Result<Vec<BlockAdapters<B>>> {
    (0..cfg.layers)
        .map(|l| BlockAdapters::upload(dev, weights, l, dtype))
        .collect()
}

/// The `--freeze` of a LoRA run: every base parameter, so only the
/// adapters train ([`Freeze::whole_base`]).
pub fn lora_base_freeze() -> Freeze {
    Freeze::whole_base()
}
