//! The containers of a block's LoRA adapters by projection: the MLP's
//! ([`MlpAdapters`]; the attention's are `attention::lora_delta::AttnAdapters`),
//! generic over what they hold (the factors in the weights, their
//! gradients in the gradients), and the walks over both in target order.

use super::lora::LoraTarget;
use crate::attention::lora_delta::AttnAdapters;

/// A block's MLP adapters by projection (`None`: not adapted).
pub struct MlpAdapters<P> {
    pub gate: Option<P>,
    pub up: Option<P>,
    pub down: Option<P>,
}

impl<P> Default for MlpAdapters<P> {
    fn default() -> Self {
        MlpAdapters {
            gate: None,
            up: None,
            down: None,
        }
    }
}

/// The slot of `target` in a block's attention and MLP adapters.
pub fn slot_mut<'a, P>(
    attn: &'a mut AttnAdapters<P>,
    mlp: &'a mut MlpAdapters<P>,
    target: LoraTarget,
) -> &'a mut Option<P> {
    match target {
        LoraTarget::Q => &mut attn.q,
        LoraTarget::K => &mut attn.k,
        LoraTarget::V => &mut attn.v,
        LoraTarget::O => &mut attn.o,
        LoraTarget::Gate => &mut mlp.gate,
        LoraTarget::Up => &mut mlp.up,
        LoraTarget::Down => &mut mlp.down,
    }
}

/// A block's adapters in target order ([`LoraTarget::ALL`]), the absent left out.
pub fn block_pairs<'a, P>(
    attn: &'a AttnAdapters<P>,
    mlp: &'a MlpAdapters<P>,
) -> Vec<(LoraTarget, &'a P)> {
    let all = [
        (LoraTarget::Q, &attn.q),
        (LoraTarget::K, &attn.k),
        (LoraTarget::V, &attn.v),
        (LoraTarget::O, &attn.o),
        (LoraTarget::Gate, &mlp.gate),
        (LoraTarget::Up, &mlp.up),
        (LoraTarget::Down, &mlp.down),
    ];
    all.into_iter()
        .filter_map(|(t, p)| p.as_ref().map(|p| (t, p)))
        .collect()
}

/// [`block_pairs`], mutable.
pub fn block_pairs_mut<'a, P>(
    attn: &'a mut AttnAdapters<P>,
    mlp: &'a mut MlpAdapters<P>,
) -> Vec<(LoraTarget, &'a mut P)> {
    let all = [
        (LoraTarget::Q, &mut attn.q),
        (LoraTarget::K, &mut attn.k),
        (LoraTarget::V, &mut attn.v),
        (LoraTarget::O, &mut attn.o),
        (LoraTarget::Gate, &mut mlp.gate),
        (LoraTarget::Up, &mut mlp.up),
        (LoraTarget::Down, &mut mlp.down),
    ];
    all.into_iter()
        .filter_map(|(t, p)| p.as_mut().map(|p| (t, p)))
        .collect()
}
