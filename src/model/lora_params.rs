//! A model's LoRA adapters as trainable device parameters: each block's
//! [`LoraPair`]s live beside its frozen weights (the attention's in
//! `AttentionWeights::lora`, the MLP's in `BlockWeights::mlp_lora`), in the
//! weight dtype like the base weights (F32 masters and moments belong to the
//! optimizer's slots), with F32 gradients beside the block's gradients;
//! uploaded from and read back into the host [`LoraWeights`].
//! The arithmetic on them is `attention/lora_delta.rs`.

use super::adapters::{block_pairs, slot_mut};
use super::grads::{BlockGrads, ModelGrads};
use super::lora::{Factor, LoraConfig, LoraDims, LoraFactors, LoraTarget, LoraWeights};
use super::tensor_order::factors;
use super::weights::{BlockWeights, ModelWeights};
use crate::attention::lora_delta::{LoraPair, LoraPairGrads};
use crate::backend::{Backend, DType, Tensor};
use crate::error::{Error, Result};

impl<B: Backend> BlockWeights<B> {
    /// The block's adapters in target order.
    pub fn adapters(&self) -> Vec<(LoraTarget, &LoraPair<B>)> {
        block_pairs(&self.attn.lora, &self.mlp_lora)
    }

    /// The block's adapter tensors, `lora_A` then `lora_B` of each target.
    pub fn adapter_tensors(&self) -> Vec<(LoraTarget, Factor, &Tensor<B>)> {
        let pairs = self.adapters().into_iter();
        factors(pairs.map(|(t, p)| (t, [&p.a, &p.b])))
    }
}

impl<B: Backend> BlockGrads<B> {
    /// The adapters' gradients, in the order of `BlockWeights::adapter_tensors`.
    pub fn adapter_tensors(&self) -> Vec<(LoraTarget, Factor, &Tensor<B>)> {
        let pairs = block_pairs(&self.attn.lora, &self.mlp_lora).into_iter();
        factors(pairs.map(|(t, g)| (t, [&g.da, &g.db])))
    }
}

/// Uploads `lora`'s factors (in `dtype`) beside every block's weights.
pub fn attach_adapters<B: Backend>(
    dev: &B,
    w: &mut ModelWeights<B>,
    lora: &LoraWeights,
    dtype: DType,
) -> Result<()> {
    let scale = lora.config.scale();
    if lora.layers.len() != w.blocks.len() {
        return Err(Error::Config(format!(
            "the adapter has {} blocks, the model {}",
            lora.layers.len(),
            w.blocks.len()
        )));
    }
    for (blk, factors) in w.blocks.iter_mut().zip(&lora.layers) {
        for (&t, f) in lora.config.targets.iter().zip(factors) {
            let d = f.dims;
            let shapes = [[d.rank, d.in_features], [d.out_features, d.rank]];
            let pair = LoraPair::upload(dev, &f.a, &f.b, shapes, dtype, scale)?;
            *slot_mut(&mut blk.attn.lora, &mut blk.mlp_lora, t) = Some(pair);
        }
    }
    Ok(())
}

/// Zero F32 gradients for every adapter of `w`, beside `g`'s.
pub fn attach_adapter_grads<B: Backend>(
    dev: &B,
    w: &ModelWeights<B>,
    g: &mut ModelGrads<B>,
) -> Result<()> {
    for (blk, grads) in w.blocks.iter().zip(&mut g.blocks) {
        attach_block_adapter_grads(dev, blk, grads)?;
    }
    Ok(())
}

/// Zero F32 gradients for every adapter of block `w`, beside its gradients `g`.
pub fn attach_block_adapter_grads<B: Backend>(
    dev: &B,
    w: &BlockWeights<B>,
    g: &mut BlockGrads<B>,
) -> Result<()> {
    for (t, pair) in w.adapters() {
        let zeros = LoraPairGrads::zeros(dev, pair)?;
        *slot_mut(&mut g.attn.lora, &mut g.mlp_lora, t) = Some(zeros);
    }
    Ok(())
}

/// The adapters of `w` on the host, as f32 ([`LoraWeights`] of `config`).
pub fn adapters_to_host<B: Backend>(
    dev: &B,
    w: &ModelWeights<B>,
    config: &LoraConfig,
) -> Result<LoraWeights> {
    let mut layers = Vec::new();
    for blk in &w.blocks {
        let mut factors = Vec::new();
        for &t in &config.targets {
            let pair = blk.adapters().into_iter().find(|(x, _)| *x == t);
            let (_, pair) = pair.ok_or_else(|| {
                Error::Config(format!("the model has no {} adapter", t.peft_name()))
            })?;
            let (rank, in_features, out_features) = pair.dims();
            factors.push(LoraFactors {
                dims: LoraDims {
                    rank,
                    in_features,
                    out_features,
                },
                a: dev.to_host(&pair.a)?,
                b: dev.to_host(&pair.b)?,
            });
        }
        layers.push(factors);
    }
    Ok(LoraWeights {
        config: config.clone(),
        layers,
    })
}
