//! The one order of a model's tensors, for the weights and their gradients
//! alike, shared or mutable (each walk is generic over the reference `T`):
//! the embedding; each block's base parameters in HF order (`attn_norm`, the
//! attention's, `mlp_norm`, gate, up, down), then its adapters' factors
//! (`lora_A`, `lora_B` of each target, in target order); the final norm; the
//! LM head. Checkpoints, optimizer slots and the planner depend on it.

use super::families::{BlockParam, Family, Param};
use super::lora::{Factor, LoraTarget, tensor_name};
use super::unit::Unit;

/// What a model tensor is: a base parameter, or a factor of a block's LoRA
/// adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorId {
    Base(Param),
    /// Block, target, factor.
    Adapter(usize, LoraTarget, Factor),
}

impl TensorId {
    /// The unit that holds it.
    pub fn unit(self) -> Unit {
        match self {
            TensorId::Base(p) => p.unit(),
            TensorId::Adapter(l, ..) => Unit::Block(l),
        }
    }

    /// Its name: HF's for a base parameter, PEFT's for an adapter factor.
    pub fn name(self, family: Family) -> String {
        match self {
            TensorId::Base(p) => family.hf_name(p),
            TensorId::Adapter(l, t, f) => tensor_name(l, t, f),
        }
    }
}

/// A block's tensors in model order: its base parameters by role, then its
/// adapters' factors.
pub(super) type BlockTensors<T> = (Vec<(BlockParam, T)>, Vec<(LoraTarget, Factor, T)>);

/// A block's base tensors by role, in HF order: `attn_norm`, the
/// attention's (by short name, `AttentionWeights::named`), the attention's
/// post-norm, then `mlp` (its norm, gate, up, down) and its post-norm;
/// `None`: not held.
pub(super) fn block_params<T>(
    attn_norm: Option<T>,
    attn: Vec<(&'static str, T)>,
    mlp: [Option<T>; 4],
    post: [Option<T>; 2],
) -> Vec<(BlockParam, T)> {
    let [post_attn, post_mlp] = post;
    let mut v: Vec<_> = attn_norm
        .map(|t| (BlockParam::AttnNorm, t))
        .into_iter()
        .collect();
    v.extend(attn.into_iter().map(|(short, t)| (attn_param(short), t)));
    v.extend(post_attn.map(|t| (BlockParam::PostAttnNorm, t)));
    let roles = [
        BlockParam::MlpNorm,
        BlockParam::Gate,
        BlockParam::Up,
        BlockParam::Down,
    ];
    let mlp = roles.into_iter().zip(mlp);
    v.extend(mlp.filter_map(|(bp, t)| t.map(|t| (bp, t))));
    v.extend(post_mlp.map(|t| (BlockParam::PostMlpNorm, t)));
    v
}

/// A block's adapter factors, `lora_A` then `lora_B` of each target, from
/// its adapters' `[A, B]` (or their gradients) in target order.
pub(super) fn factors<T>(
    pairs: impl IntoIterator<Item = (LoraTarget, [T; 2])>,
) -> Vec<(LoraTarget, Factor, T)> {
    let pairs = pairs.into_iter();
    pairs
        .flat_map(|(t, [a, b])| [(t, Factor::A, a), (t, Factor::B, b)])
        .collect()
}

/// Every tensor by identity, in model order, from the model's parts
/// (`None`: not held; `lm_head` also when tied to the embedding).
pub(super) fn model_tensors<T>(
    embed: Option<T>,
    blocks: impl IntoIterator<Item = BlockTensors<T>>,
    final_norm: Option<T>,
    lm_head: Option<T>,
) -> Vec<(TensorId, T)> {
    let mut v: Vec<_> = embed
        .map(|t| (TensorId::Base(Param::Embed), t))
        .into_iter()
        .collect();
    for (l, (base, lora)) in blocks.into_iter().enumerate() {
        v.extend(
            base.into_iter()
                .map(|(bp, t)| (TensorId::Base(Param::Block(l, bp)), t)),
        );
        v.extend(
            lora.into_iter()
                .map(|(tg, f, t)| (TensorId::Adapter(l, tg, f), t)),
        );
    }
    v.extend(final_norm.map(|t| (TensorId::Base(Param::FinalNorm), t)));
    v.extend(lm_head.map(|t| (TensorId::Base(Param::LmHead), t)));
    v
}

/// `tensors` (in model order) by name, HF's or PEFT's for adapter factors
/// ([`TensorId::name`]); only `unit`'s where one is given.
pub(super) fn named<T>(
    family: Family,
    unit: Option<Unit>,
    tensors: Vec<(TensorId, T)>,
) -> Vec<(String, T)> {
    let of_unit = tensors
        .into_iter()
        .filter(|(id, _)| unit.is_none_or(|u| id.unit() == u));
    of_unit.map(|(id, t)| (id.name(family), t)).collect()
}

/// The block parameter of an attention tensor's short name
/// (`AttentionWeights::named`).
fn attn_param(short: &str) -> BlockParam {
    match short {
        "wq" => BlockParam::Wq,
        "wk" => BlockParam::Wk,
        "wv" => BlockParam::Wv,
        "wo" => BlockParam::Wo,
        "q_norm" => BlockParam::QNorm,
        "k_norm" => BlockParam::KNorm,
        "bq" => BlockParam::Bq,
        "bk" => BlockParam::Bk,
        "bv" => BlockParam::Bv,
        other => unreachable!("AttentionWeights names no tensor '{other}'"),
    }
}
