//! Parameter gradients, shaped like the weights (`weights.rs`), with no
//! tensor for a frozen parameter (`--freeze`, [`Freeze`]): the backward
//! computes no weight gradient where there is none to add into. The weight
//! matrices' gradients are F32 or BF16 (`--grad-dtype`, [`GradSpec`]);
//! every other is F32.

use super::adapters::MlpAdapters;
use super::config::ModelConfig;
use super::families::{BlockParam, Family, Param};
use super::freeze::Freeze;
use super::tensor_order::{self, BlockTensors};
use super::unit::Unit;
use super::weights::TensorId;
use crate::attention::lora_delta::LoraPairGrads;
use crate::attention::{AttentionGrads, AttnTensors};
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// One decoder block's gradients (`None`: frozen).
pub struct BlockGrads<B: Backend> {
    pub attn_norm: Option<Tensor<B>>,
    pub attn: AttentionGrads<B>,
    pub post_attn_norm: Option<Tensor<B>>,
    pub mlp_norm: Option<Tensor<B>>,
    pub gate: Option<Tensor<B>>,
    pub up: Option<Tensor<B>>,
    pub down: Option<Tensor<B>>,
    /// The MLP adapters' gradients (where `BlockWeights::mlp_lora` has adapters).
    pub mlp_lora: MlpAdapters<LoraPairGrads<B>>,
    pub post_mlp_norm: Option<Tensor<B>>,
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

/// Which gradients a backward writes, and in what dtype.
#[derive(Debug, Clone, Copy)]
pub struct GradSpec<'f> {
    /// What has no gradient (`--freeze`).
    pub frozen: &'f Freeze,
    /// The weight matrices' ([`GradSpec::dtype_of`]): F32 or BF16.
    pub matrices: DType,
}

impl<'f> GradSpec<'f> {
    /// F32 gradients of what `frozen` leaves trained.
    pub fn f32(frozen: &'f Freeze) -> Self {
        GradSpec {
            frozen,
            matrices: DType::F32,
        }
    }

    /// The dtype of `p`'s gradient: `matrices` for the projections', the
    /// MLP's and the LM head's, which GEMMs accumulate into; F32 for the
    /// norms, the biases and the embedding (a scatter-add of rows).
    pub fn dtype_of(&self, p: Param) -> DType {
        use BlockParam::*;
        match p {
            Param::LmHead | Param::Block(_, Wq | Wk | Wv | Wo | Gate | Up | Down) => self.matrices,
            _ => DType::F32,
        }
    }

    /// A zero gradient of `shape` for `p`, or none when `p` is frozen.
    fn zero_unless_frozen<B: Backend>(
        &self,
        b: &B,
        cfg: &ModelConfig,
        p: Param,
        shape: &[usize],
    ) -> Result<Option<Tensor<B>>> {
        if self.frozen.is_frozen(cfg, p) {
            return Ok(None);
        }
        b.zeros(shape, self.dtype_of(p), Category::Grads).map(Some)
    }
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
        let post_attn_norm = p(PostAttnNorm)?;
        Ok(BlockGrads {
            attn_norm,
            attn,
            post_attn_norm,
            mlp_norm: p(MlpNorm)?,
            gate: p(Gate)?,
            up: p(Up)?,
            down: p(Down)?,
            mlp_lora: MlpAdapters::default(),
            post_mlp_norm: p(PostMlpNorm)?,
        })
    }

    /// Zero gradients of block `i`'s trainable parameters.
    pub fn zeros(b: &B, cfg: &ModelConfig, i: usize, spec: GradSpec) -> Result<Self> {
        Self::build_with(cfg, i, &mut |p, s| spec.zero_unless_frozen(b, cfg, p, s))
    }

    /// Every gradient held, by role, in HF order.
    pub fn params(&self) -> Vec<(BlockParam, &Tensor<B>)> {
        let mlp = [&self.mlp_norm, &self.gate, &self.up, &self.down].map(Option::as_ref);
        let post = [&self.post_attn_norm, &self.post_mlp_norm].map(Option::as_ref);
        tensor_order::block_params(self.attn_norm.as_ref(), self.attn.named(), mlp, post)
    }

    /// Every gradient held, mutable, in the order of [`params`](Self::params).
    pub fn params_mut(&mut self) -> Vec<(BlockParam, &mut Tensor<B>)> {
        self.params_and_adapters_mut().0
    }

    /// [`params_mut`](Self::params_mut) and the adapters' gradients
    /// (`BlockGrads::adapter_tensors` order), borrowed together.
    pub fn params_and_adapters_mut(&mut self) -> BlockTensors<&mut Tensor<B>> {
        let s = self;
        let (attn, attn_lora) = s.attn.named_and_lora_mut();
        let mlp = [&mut s.mlp_norm, &mut s.gate, &mut s.up, &mut s.down].map(Option::as_mut);
        let post = [&mut s.post_attn_norm, &mut s.post_mlp_norm].map(Option::as_mut);
        let base = tensor_order::block_params(s.attn_norm.as_mut(), attn, mlp, post);
        let pairs = super::adapters::block_pairs_mut(attn_lora, &mut s.mlp_lora);
        let pairs = pairs.into_iter().map(|(t, g)| (t, [&mut g.da, &mut g.db]));
        (base, tensor_order::factors(pairs))
    }

    /// Every gradient held, owned, in the order of [`params`](Self::params).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let mut v: Vec<Tensor<B>> = self.attn_norm.into_iter().collect();
        v.extend(self.attn.into_tensors());
        v.extend(self.post_attn_norm);
        v.extend(
            [self.mlp_norm, self.gate, self.up, self.down]
                .into_iter()
                .flatten(),
        );
        v.extend(self.post_mlp_norm);
        v
    }
}

impl<B: Backend> ModelGrads<B> {
    /// Zero gradients of every trainable parameter of `cfg`, in HF order.
    pub fn zeros(b: &B, cfg: &ModelConfig, spec: GradSpec) -> Result<Self> {
        let (v, h) = (cfg.vocab, cfg.hidden);
        let embed = spec.zero_unless_frozen(b, cfg, Param::Embed, &[v, h])?;
        let blocks = (0..cfg.layers)
            .map(|i| BlockGrads::zeros(b, cfg, i, spec))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = spec.zero_unless_frozen(b, cfg, Param::FinalNorm, &[h])?;
        let lm_head = match cfg.tie_embeddings {
            true => None,
            false => spec.zero_unless_frozen(b, cfg, Param::LmHead, &[v, h])?,
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
        let blocks = self
            .blocks
            .iter()
            .map(|b| (b.params(), b.adapter_tensors()));
        let (embed, norm) = (self.embed.as_ref(), self.final_norm.as_ref());
        tensor_order::model_tensors(embed, blocks, norm, self.lm_head.as_ref())
    }

    /// [`tensors`](Self::tensors), mutable.
    pub fn tensors_mut(&mut self) -> Vec<(TensorId, &mut Tensor<B>)> {
        let blocks = self.blocks.iter_mut();
        let blocks = blocks.map(BlockGrads::params_and_adapters_mut);
        let (embed, norm) = (self.embed.as_mut(), self.final_norm.as_mut());
        tensor_order::model_tensors(embed, blocks, norm, self.lm_head.as_mut())
    }

    /// The gradients of `unit` held, with their names, in model order.
    pub fn unit_named(&self, unit: Unit) -> Vec<(String, &Tensor<B>)> {
        tensor_order::named(self.family, Some(unit), self.tensors())
    }

    /// The gradients of `unit` held, mutable, in the order of [`unit_named`](Self::unit_named).
    pub fn unit_named_mut(&mut self, unit: Unit) -> Vec<(String, &mut Tensor<B>)> {
        tensor_order::named(self.family, Some(unit), self.tensors_mut())
    }

    /// Every gradient held with its name, in model order.
    pub fn named(&self) -> Vec<(String, &Tensor<B>)> {
        tensor_order::named(self.family, None, self.tensors())
    }

    /// Every gradient held, mutable, in the order of [`named`](Self::named).
    pub fn named_mut(&mut self) -> Vec<(String, &mut Tensor<B>)> {
        tensor_order::named(self.family, None, self.tensors_mut())
    }
}
