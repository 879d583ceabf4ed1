//! F32 parameter gradients, shaped like the weights (`weights.rs`), with
//! no tensor for a frozen parameter (`--freeze`, [`Freeze`]): the backward
//! computes no weight gradient where there is none to add into.

use super::adapters::MlpAdapters;
use super::config::ModelConfig;
use super::families::{BlockParam, Family, Param};
use super::freeze::Freeze;
use super::lora::{Factor, LoraTarget};
use super::unit::Unit;
use super::weights::TensorId;
use crate::attention::AttentionGrads;
use crate::attention::lora_delta::LoraPairGrads;
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// One decoder block's gradients (`None`: frozen).
pub struct BlockGrads<B: Backend> {
    pub attn_norm: Option<Tensor<B>>,
    pub attn: AttentionGrads<B>,
    pub mlp_norm: Option<Tensor<B>>,
    pub gate: Option<Tensor<B>>,
    pub up: Option<Tensor<B>>,
    pub down: Option<Tensor<B>>,
    /// The MLP adapters' gradients (where `BlockWeights::mlp_lora` has adapters).
    pub mlp_lora: MlpAdapters<LoraPairGrads<B>>,
}

/// A whole model's gradients (`None`: frozen).
pub struct ModelGrads<B: Backend> {
    pub embed: Option<Tensor<B>>,
    pub blocks: Vec<BlockGrads<B>>,
    pub final_norm: Option<Tensor<B>>,
    /// `None` when tied to `embed`, or frozen.
    pub lm_head: Option<Tensor<B>>,
    pub family: Family,
}

/// A zero F32 gradient of `shape` for `p`, or none when `frozen` freezes it.
fn zero_unless_frozen<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    frozen: &Freeze,
    p: Param,
    shape: &[usize],
) -> Result<Option<Tensor<B>>> {
    if frozen.is_frozen(cfg, p) {
        return Ok(None);
    }
    b.zeros(shape, DType::F32, Category::Grads).map(Some)
}

impl<B: Backend> BlockGrads<B> {
    /// Block `i`'s gradients, each present parameter's from `t(param,
    /// shape)`, in HF order (the order `BlockWeights::build_with` allocates).
    pub fn build_with(
        cfg: &ModelConfig,
        i: usize,
        t: &mut impl FnMut(Param, &[usize]) -> Result<Option<Tensor<B>>>,
    ) -> Result<Self> {
        let has = cfg.family.block_params();
        let mut p = |bp: BlockParam| -> Result<Option<Tensor<B>>> {
            match has.contains(&bp) {
                true => t(Param::Block(i, bp), &bp.shape(cfg)),
                false => Ok(None),
            }
        };
        use BlockParam::*;
        let attn_norm = p(AttnNorm)?;
        let (wq, bq) = (p(Wq)?, p(Bq)?);
        let (wk, bk) = (p(Wk)?, p(Bk)?);
        let (wv, bv) = (p(Wv)?, p(Bv)?);
        let wo = p(Wo)?;
        let (q_norm, k_norm) = (p(QNorm)?, p(KNorm)?);
        let attn = AttentionGrads {
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            bq,
            bk,
            bv,
            lora: Default::default(),
        };
        Ok(BlockGrads {
            attn_norm,
            attn,
            mlp_norm: p(MlpNorm)?,
            gate: p(Gate)?,
            up: p(Up)?,
            down: p(Down)?,
            mlp_lora: MlpAdapters::default(),
        })
    }

    /// Zero gradients of block `i`'s trainable parameters.
    pub fn zeros(b: &B, cfg: &ModelConfig, i: usize, frozen: &Freeze) -> Result<Self> {
        Self::build_with(cfg, i, &mut |p, s| zero_unless_frozen(b, cfg, frozen, p, s))
    }

    /// Every gradient held, by role, in HF order.
    pub fn params(&self) -> Vec<(BlockParam, &Tensor<B>)> {
        let mut v: Vec<(BlockParam, &Tensor<B>)> = Vec::new();
        v.extend(self.attn_norm.as_ref().map(|t| (BlockParam::AttnNorm, t)));
        for (short, t) in self.attn.named() {
            v.push((super::weights::attn_param(short), t));
        }
        v.extend(self.mlp_norm.as_ref().map(|t| (BlockParam::MlpNorm, t)));
        v.extend(self.gate.as_ref().map(|t| (BlockParam::Gate, t)));
        v.extend(self.up.as_ref().map(|t| (BlockParam::Up, t)));
        v.extend(self.down.as_ref().map(|t| (BlockParam::Down, t)));
        v
    }

    /// Every gradient held, mutable, in the order of [`params`](Self::params).
    pub fn params_mut(&mut self) -> Vec<(BlockParam, &mut Tensor<B>)> {
        self.params_and_adapters_mut().0
    }

    /// [`params_mut`](Self::params_mut) and the adapters' gradients
    /// (`BlockGrads::adapter_tensors` order), borrowed together.
    #[allow(clippy::type_complexity)]
    pub fn params_and_adapters_mut(
        &mut self,
    ) -> (
        Vec<(BlockParam, &mut Tensor<B>)>,
        Vec<(LoraTarget, Factor, &mut Tensor<B>)>,
    ) {
        let (attn, attn_lora) = self.attn.named_and_lora_mut();
        let mut v: Vec<(BlockParam, &mut Tensor<B>)> = Vec::new();
        v.extend(self.attn_norm.as_mut().map(|t| (BlockParam::AttnNorm, t)));
        for (short, t) in attn {
            v.push((super::weights::attn_param(short), t));
        }
        v.extend(self.mlp_norm.as_mut().map(|t| (BlockParam::MlpNorm, t)));
        v.extend(self.gate.as_mut().map(|t| (BlockParam::Gate, t)));
        v.extend(self.up.as_mut().map(|t| (BlockParam::Up, t)));
        v.extend(self.down.as_mut().map(|t| (BlockParam::Down, t)));
        let pairs = super::adapters::block_pairs_mut(attn_lora, &mut self.mlp_lora);
        let lora = pairs
            .into_iter()
            .flat_map(|(t, g)| [(t, Factor::A, &mut g.da), (t, Factor::B, &mut g.db)])
            .collect();
        (v, lora)
    }

    /// Every gradient held, owned, in the order of [`params`](Self::params).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let mut v: Vec<Tensor<B>> = self.attn_norm.into_iter().collect();
        v.extend(self.attn.into_tensors());
        v.extend(
            [self.mlp_norm, self.gate, self.up, self.down]
                .into_iter()
                .flatten(),
        );
        v
    }
}

impl<B: Backend> ModelGrads<B> {
    /// Zero gradients of every trainable parameter of `cfg`, in HF order.
    pub fn zeros(b: &B, cfg: &ModelConfig, frozen: &Freeze) -> Result<Self> {
        let (v, h) = (cfg.vocab, cfg.hidden);
        let embed = zero_unless_frozen(b, cfg, frozen, Param::Embed, &[v, h])?;
        let blocks = (0..cfg.layers)
            .map(|i| BlockGrads::zeros(b, cfg, i, frozen))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = zero_unless_frozen(b, cfg, frozen, Param::FinalNorm, &[h])?;
        let lm_head = match cfg.tie_embeddings {
            true => None,
            false => zero_unless_frozen(b, cfg, frozen, Param::LmHead, &[v, h])?,
        };
        Ok(ModelGrads {
            embed,
            blocks,
            final_norm,
            lm_head,
            family: cfg.family,
        })
    }

    /// Every gradient held, by identity, in model order (each block's
    /// base parameters, then its adapters'; `ModelWeights::tensors`).
    pub fn tensors(&self) -> Vec<(TensorId, &Tensor<B>)> {
        let mut v: Vec<(TensorId, &Tensor<B>)> = Vec::new();
        v.extend(self.embed.iter().map(|t| (TensorId::Base(Param::Embed), t)));
        for (l, blk) in self.blocks.iter().enumerate() {
            let base = blk.params().into_iter();
            v.extend(base.map(|(bp, t)| (TensorId::Base(Param::Block(l, bp)), t)));
            let lora = blk.adapter_tensors().into_iter();
            v.extend(lora.map(|(tg, f, t)| (TensorId::Adapter(l, tg, f), t)));
        }
        v.extend(
            self.final_norm
                .iter()
                .map(|t| (TensorId::Base(Param::FinalNorm), t)),
        );
        v.extend(
            self.lm_head
                .iter()
                .map(|t| (TensorId::Base(Param::LmHead), t)),
        );
        v
    }

    /// [`tensors`](Self::tensors), mutable.
    pub fn tensors_mut(&mut self) -> Vec<(TensorId, &mut Tensor<B>)> {
        let mut v: Vec<(TensorId, &mut Tensor<B>)> = Vec::new();
        v.extend(
            self.embed
                .iter_mut()
                .map(|t| (TensorId::Base(Param::Embed), t)),
        );
        for (l, blk) in self.blocks.iter_mut().enumerate() {
            let (base, lora) = blk.params_and_adapters_mut();
            v.extend(
                base.into_iter()
                    .map(|(bp, t)| (TensorId::Base(Param::Block(l, bp)), t)),
            );
            v.extend(
                lora.into_iter()
                    .map(|(tg, f, t)| (TensorId::Adapter(l, tg, f), t)),
            );
        }
        let norm = self.final_norm.iter_mut();
        v.extend(norm.map(|t| (TensorId::Base(Param::FinalNorm), t)));
        v.extend(
            self.lm_head
                .iter_mut()
                .map(|t| (TensorId::Base(Param::LmHead), t)),
        );
        v
    }

    /// The gradients of `unit` held, with their names, in model order.
    pub fn unit_named(&self, unit: Unit) -> Vec<(String, &Tensor<B>)> {
        let family = self.family;
        let all = self
            .tensors()
            .into_iter()
            .filter(|(id, _)| id.unit() == unit);
        all.map(|(id, t)| (id.name(family), t)).collect()
    }

    /// The gradients of `unit` held, mutable, in the order of [`unit_named`](Self::unit_named).
    pub fn unit_named_mut(&mut self, unit: Unit) -> Vec<(String, &mut Tensor<B>)> {
        let family = self.family;
        let all = self.tensors_mut().into_iter();
        let all = all.filter(|(id, _)| id.unit() == unit);
        all.map(|(id, t)| (id.name(family), t)).collect()
    }

    /// Every gradient held with its name, in model order.
    pub fn named(&self) -> Vec<(String, &Tensor<B>)> {
        let family = self.family;
        let all = self.tensors().into_iter();
        all.map(|(id, t)| (id.name(family), t)).collect()
    }

    /// Every gradient held, mutable, in the order of [`named`](Self::named).
    pub fn named_mut(&mut self) -> Vec<(String, &mut Tensor<B>)> {
        let family = self.family;
        let all = self.tensors_mut().into_iter();
        all.map(|(id, t)| (id.name(family), t)).collect()
    }
}
