//! A LoRA run's adapters under FSDP: each block's adapters are an adapter
//! unit of their own (`UnitLayout::adapters`: the block's `lora_A`/`lora_B`
//! factors end to end under PEFT's names), sharded, gathered together with
//! the frozen block and reduce-scattered after the block's backward, with F32
//! gradient shards and optimizer slots over the adapter shard only. Here:
//! the gathered factors attached to the block as the replicated path attaches
//! them (`AttentionWeights::lora`, `BlockWeights::mlp_lora`), their F32
//! gradients beside the block's, taken back out for the reduce-scatter, and
//! the host values a run starts its adapter shards from.

use crate::attention::lora_delta::LoraPair;
use crate::backend::{Backend, Tensor};
use crate::error::{Error, Result};
use crate::model::adapters::slot_mut;
use crate::model::lora::{Factor, LoraConfig, LoraWeights, tensor_name};
use crate::model::{BlockGrads, BlockWeights, ModelConfig};
use std::collections::BTreeMap;
use std::ops::Range;

/// The index of block `layer`'s adapter unit among a store's layouts
/// (`flat_layout::layouts_with_adapters`: after every base unit).
pub fn adapter_unit(layers: usize, layer: usize) -> usize {
    layers + 2 + layer
}

/// Attaches block `layer`'s gathered adapters to `w`, each factor from
/// `take(peft_name, shape)` (a tensor split out of the gathered flat buffer).
pub fn attach_gathered<B: Backend>(
    cfg: &ModelConfig,
    lora: &LoraConfig,
    layer: usize,
    w: &mut BlockWeights<B>,
    take: &mut impl FnMut(String, &[usize]) -> Result<Tensor<B>>,
) -> Result<()> {
    for &t in &lora.targets {
        let [sa, sb] = lora.factor_shapes(cfg, t);
        let pair = LoraPair {
            a: take(tensor_name(layer, t, Factor::A), &sa)?,
            b: take(tensor_name(layer, t, Factor::B), &sb)?,
            scale: lora.scale(),
        };
        *slot_mut(&mut w.attn.lora, &mut w.mlp_lora, t) = Some(pair);
    }
    Ok(())
}

/// Zero F32 gradients of a gathered block's adapters, beside its gradients.
pub use crate::model::lora_params::attach_block_adapter_grads as attach_grads;

/// Takes the adapters' gradients out of `g`, in the adapter unit's order
/// (`dA` then `dB` of each target of `lora`).
pub fn take_grads<B: Backend>(lora: &LoraConfig, g: &mut BlockGrads<B>) -> Result<Vec<Tensor<B>>> {
    let mut out = Vec::with_capacity(2 * lora.targets.len());
    for &t in &lora.targets {
        let pair = slot_mut(&mut g.attn.lora, &mut g.mlp_lora, t)
            .take()
            .ok_or_else(|| {
                Error::Backend(format!("FSDP: no {} adapter gradients", t.peft_name()))
            })?;
        out.push(pair.da);
        out.push(pair.db);
    }
    Ok(out)
}

/// Every factor of `lora` on the host, by PEFT name (flattened, row-major):
/// what a run's adapter shards start from.
pub fn host_values(lora: &LoraWeights) -> BTreeMap<String, Vec<f32>> {
    let mut out = BTreeMap::new();
    for (l, factors) in lora.layers.iter().enumerate() {
        for (&t, f) in lora.config.targets.iter().zip(factors) {
            out.insert(tensor_name(l, t, Factor::A), f.a.clone());
            out.insert(tensor_name(l, t, Factor::B), f.b.clone());
        }
    }
    out
}

/// The elements `elems` of factor `name` in `values`, or `None` when
/// `name` is no factor there (a base parameter).
pub fn values_of(
    values: &BTreeMap<String, Vec<f32>>,
    name: &str,
    elems: Range<usize>,
) -> Option<Result<Vec<f32>>> {
    let v = values.get(name)?;
    Some(match v.get(elems.clone()) {
        Some(s) => Ok(s.to_vec()),
        None => Err(Error::Checkpoint(format!(
            "{name}: elements {elems:?} of {} values",
            v.len()
        ))),
    })
}
