//! Decoder parameters in Hugging Face layout, named by the model's family
//! ([`Family::hf_name`]). Their F32 gradients live in `grads.rs` (none for a
//! frozen parameter).

use super::adapters::MlpAdapters;
use super::config::ModelConfig;
use super::families::{BlockParam, Family, Param};
pub use super::tensor_order::TensorId;
use super::tensor_order::{self, BlockTensors};
use super::unit::Unit;
use crate::attention::lora_delta::LoraPair;
use crate::attention::{AttentionWeights, AttnTensors};
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// One decoder block.
pub struct BlockWeights<B: Backend> {
    /// `input_layernorm [hidden]`.
    pub attn_norm: Tensor<B>,
    pub attn: AttentionWeights<B>,
    /// The attention's post-norm `[hidden]` (post-norm families: Gemma 3's
    /// `post_attention_layernorm`).
    pub post_attn_norm: Option<Tensor<B>>,
    /// The MLP's input norm `[hidden]` (Llama's `post_attention_layernorm`,
    /// Gemma 3's `pre_feedforward_layernorm`).
    pub mlp_norm: Tensor<B>,
    /// `[ffn, hidden]`.
    pub gate: Tensor<B>,
    /// `[ffn, hidden]`.
    pub up: Tensor<B>,
    /// `[hidden, ffn]`.
    pub down: Tensor<B>,
    /// LoRA adapters of gate/up/down (`--lora-rank`; none by default).
    pub mlp_lora: MlpAdapters<LoraPair<B>>,
    /// The MLP's post-norm `[hidden]` (post-norm families:
    /// `post_feedforward_layernorm`).
    pub post_mlp_norm: Option<Tensor<B>>,
}

/// All parameters (or gradients) of a decoder.
pub struct ModelWeights<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed: Tensor<B>,
    pub blocks: Vec<BlockWeights<B>>,
    /// `model.norm [hidden]`.
    pub final_norm: Tensor<B>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Tensor<B>>,
    /// The family that names the tensors.
    pub family: Family,
}

impl<B: Backend> BlockWeights<B> {
    /// Block `i` of `cfg`, each tensor from `t(hf_name, shape)`, in HF order.
    pub fn build_with(
        cfg: &ModelConfig,
        i: usize,
        t: &mut impl FnMut(String, &[usize]) -> Result<Tensor<B>>,
    ) -> Result<Self> {
        // each tensor under its family's name, with its shape
        let mut p = |bp: BlockParam| t(cfg.hf_name(Param::Block(i, bp)), &bp.shape(cfg));
        let (qk_norm, bias, post) = (cfg.qk_norm(), cfg.qkv_bias(), cfg.spec().post_norms);
        let attn_norm = p(BlockParam::AttnNorm)?;
        // in HF order: each projection's bias right after its weight
        let wq = p(BlockParam::Wq)?;
        let bq = bias.then(|| p(BlockParam::Bq)).transpose()?;
        let wk = p(BlockParam::Wk)?;
        let bk = bias.then(|| p(BlockParam::Bk)).transpose()?;
        let wv = p(BlockParam::Wv)?;
        let bv = bias.then(|| p(BlockParam::Bv)).transpose()?;
        let attn = AttentionWeights {
            wq,
            wk,
            wv,
            wo: p(BlockParam::Wo)?,
            q_norm: qk_norm.then(|| p(BlockParam::QNorm)).transpose()?,
            k_norm: qk_norm.then(|| p(BlockParam::KNorm)).transpose()?,
            bq,
            bk,
            bv,
            lora: Default::default(),
        };
        let post_attn_norm = post.then(|| p(BlockParam::PostAttnNorm)).transpose()?;
        Ok(BlockWeights {
            attn_norm,
            attn,
            post_attn_norm,
            mlp_norm: p(BlockParam::MlpNorm)?,
            gate: p(BlockParam::Gate)?,
            up: p(BlockParam::Up)?,
            down: p(BlockParam::Down)?,
            mlp_lora: MlpAdapters::default(),
            post_mlp_norm: post.then(|| p(BlockParam::PostMlpNorm)).transpose()?,
        })
    }

    /// Every tensor by role (`AttnNorm`, ...), in HF order.
    pub fn params(&self) -> Vec<(BlockParam, &Tensor<B>)> {
        let mlp = [&self.mlp_norm, &self.gate, &self.up, &self.down].map(Some);
        let post = [&self.post_attn_norm, &self.post_mlp_norm].map(Option::as_ref);
        tensor_order::block_params(Some(&self.attn_norm), self.attn.named(), mlp, post)
    }

    /// Every tensor, mutable, in the order of [`params`](Self::params).
    pub fn params_mut(&mut self) -> Vec<(BlockParam, &mut Tensor<B>)> {
        self.params_and_adapters_mut().0
    }

    /// [`params_mut`](Self::params_mut) and the adapters' factors
    /// (`BlockWeights::adapter_tensors` order), borrowed together.
    pub fn params_and_adapters_mut(&mut self) -> BlockTensors<&mut Tensor<B>> {
        let s = self;
        let (attn, attn_lora) = s.attn.named_and_lora_mut();
        let mlp = [&mut s.mlp_norm, &mut s.gate, &mut s.up, &mut s.down].map(Some);
        let post = [&mut s.post_attn_norm, &mut s.post_mlp_norm].map(Option::as_mut);
        let base = tensor_order::block_params(Some(&mut s.attn_norm), attn, mlp, post);
        let pairs = super::adapters::block_pairs_mut(attn_lora, &mut s.mlp_lora);
        let pairs = pairs.into_iter().map(|(t, p)| (t, [&mut p.a, &mut p.b]));
        (base, tensor_order::factors(pairs))
    }
}

impl<B: Backend> ModelWeights<B> {
    /// Builds every tensor from `init(hf_name, shape)`; a rehearsing
    /// backend (`Backend::rehearsing`) allocates them unwritten, and
    /// `init` is not called.
    pub fn build(
        b: &B,
        cfg: &ModelConfig,
        dtype: DType,
        cat: Category,
        mut init: impl FnMut(&str, &[usize]) -> Result<Vec<f32>>,
    ) -> Result<Self> {
        let mut t = |name: String, shape: &[usize]| -> Result<Tensor<B>> {
            if b.rehearsing() {
                return b.empty(shape, dtype, cat);
            }
            let v = init(&name, shape)?;
            b.from_host(&v, shape, dtype, cat)
        };
        Self::build_with(cfg, &mut t)
    }

    /// Builds every tensor from `t(hf_name, shape)`, in HF order.
    pub fn build_with(
        cfg: &ModelConfig,
        t: &mut impl FnMut(String, &[usize]) -> Result<Tensor<B>>,
    ) -> Result<Self> {
        let (h, name) = (cfg.hidden, |p: Param| cfg.hf_name(p));
        let embed = t(name(Param::Embed), &[cfg.vocab, h])?;
        let blocks = (0..cfg.layers)
            .map(|i| BlockWeights::build_with(cfg, i, t))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = t(name(Param::FinalNorm), &[h])?;
        let lm_head = if cfg.tie_embeddings {
            None
        } else {
            Some(t(name(Param::LmHead), &[cfg.vocab, h])?)
        };
        Ok(ModelWeights {
            embed,
            blocks,
            final_norm,
            lm_head,
            family: cfg.family,
        })
    }

    /// Seeded random initialisation (normal(0, 0.02) matrices, unit norms), HF style.
    pub fn random(b: &B, cfg: &ModelConfig, seed: u64) -> Result<Self> {
        let init = RandomInit::new(cfg, seed);
        Self::build(
            b,
            cfg,
            b.compute_dtype(),
            Category::Weights,
            |name, shape| Ok(init.values(name, 0..shape.iter().product())),
        )
    }

    /// The LM head matrix (the embedding when tied).
    pub fn head(&self) -> &Tensor<B> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
    /// Mutable LM head (the embedding when tied).
    pub fn head_mut(&mut self) -> &mut Tensor<B> {
        self.lm_head.as_mut().unwrap_or(&mut self.embed)
    }

    /// Every tensor by role, in model (HF) order.
    pub fn params(&self) -> Vec<(Param, &Tensor<B>)> {
        let mut v = vec![(Param::Embed, &self.embed)];
        for (l, blk) in self.blocks.iter().enumerate() {
            v.extend(
                blk.params()
                    .into_iter()
                    .map(|(bp, t)| (Param::Block(l, bp), t)),
            );
        }
        v.push((Param::FinalNorm, &self.final_norm));
        v.extend(self.lm_head.iter().map(|t| (Param::LmHead, t)));
        v
    }

    /// Every tensor by role, mutable, in the order of [`params`](Self::params).
    pub fn params_mut(&mut self) -> Vec<(Param, &mut Tensor<B>)> {
        let mut v = vec![(Param::Embed, &mut self.embed)];
        for (l, blk) in self.blocks.iter_mut().enumerate() {
            let block = blk.params_mut().into_iter();
            v.extend(block.map(|(bp, t)| (Param::Block(l, bp), t)));
        }
        v.push((Param::FinalNorm, &mut self.final_norm));
        v.extend(self.lm_head.iter_mut().map(|t| (Param::LmHead, t)));
        v
    }

    /// Every tensor by identity, in model order: each block's base
    /// parameters, then its LoRA adapters' (`lora_A`, `lora_B` of each target).
    pub fn tensors(&self) -> Vec<(TensorId, &Tensor<B>)> {
        let blocks = self
            .blocks
            .iter()
            .map(|b| (b.params(), b.adapter_tensors()));
        let (embed, norm) = (Some(&self.embed), Some(&self.final_norm));
        tensor_order::model_tensors(embed, blocks, norm, self.lm_head.as_ref())
    }

    /// [`tensors`](Self::tensors), mutable.
    pub fn tensors_mut(&mut self) -> Vec<(TensorId, &mut Tensor<B>)> {
        let blocks = self.blocks.iter_mut();
        let blocks = blocks.map(BlockWeights::params_and_adapters_mut);
        let (embed, norm) = (Some(&mut self.embed), Some(&mut self.final_norm));
        tensor_order::model_tensors(embed, blocks, norm, self.lm_head.as_mut())
    }

    /// The tensors of `unit` with their names (HF's; PEFT's for adapters),
    /// in model order (a tied embedding belongs to [`Unit::Embed`] only).
    pub fn unit_named(&self, unit: Unit) -> Vec<(String, &Tensor<B>)> {
        tensor_order::named(self.family, Some(unit), self.tensors())
    }

    /// The tensors of `unit`, mutable, in the order of [`unit_named`](Self::unit_named).
    pub fn unit_named_mut(&mut self, unit: Unit) -> Vec<(String, &mut Tensor<B>)> {
        tensor_order::named(self.family, Some(unit), self.tensors_mut())
    }

    /// Every tensor with its name, in model order ([`tensors`](Self::tensors)).
    pub fn named(&self) -> Vec<(String, &Tensor<B>)> {
        tensor_order::named(self.family, None, self.tensors())
    }

    /// Every tensor, mutable, in the order of [`named`](Self::named).
    pub fn named_mut(&mut self) -> Vec<(String, &mut Tensor<B>)> {
        tensor_order::named(self.family, None, self.tensors_mut())
    }
}

/// The seeded initial values of [`ModelWeights::random`], for any range of
/// any parameter: one normal stream runs through the matrices in HF order
/// (norm weights are ones and draw nothing), so a shard of a parameter is
/// drawn without drawing the rest of the model.
pub struct RandomInit {
    seed: u64,
    /// Every norm weight's value: the one that scales by one (`1 − the
    /// family's weight offset`: 1 for Llama, 0 for Gemma's `1 + w`).
    norm_init: f32,
    /// Normal values drawn before each matrix, by HF name.
    drawn_before: std::collections::HashMap<String, u64>,
}

impl RandomInit {
    pub fn new(cfg: &ModelConfig, seed: u64) -> Self {
        let mut drawn = 0u64;
        let mut drawn_before = std::collections::HashMap::new();
        for (name, shape) in cfg.hf_param_shapes() {
            if !is_norm(&name, &shape) {
                drawn_before.insert(name, drawn);
                drawn += shape.iter().product::<usize>() as u64;
            }
        }
        RandomInit {
            seed,
            norm_init: 1.0 - cfg.norm().weight_offset,
            drawn_before,
        }
    }

    /// Elements `elems` (flattened, row-major) of parameter `name`.
    pub fn values(&self, name: &str, elems: std::ops::Range<usize>) -> Vec<f32> {
        match self.drawn_before.get(name) {
            None => vec![self.norm_init; elems.len()],
            // the generator is a counter: each block of values starts where it
            // falls in the draw, so blocks drawn in parallel give the serial values
            Some(&before) => {
                use rayon::prelude::*;
                let mut out = vec![0.0f32; elems.len()];
                out.par_chunks_mut(INIT_BLOCK)
                    .enumerate()
                    .for_each(|(i, block)| {
                        let mut rng = crate::rng::Rng::new(self.seed);
                        rng.skip_normals(before + (elems.start + i * INIT_BLOCK) as u64);
                        for v in block {
                            *v = rng.normal() as f32 * 0.02;
                        }
                    });
                out
            }
        }
    }
}

/// Values of a parameter drawn per parallel task (`RandomInit::values`).
const INIT_BLOCK: usize = 1 << 18;

/// Norm weights start at the scale one (1-D tensors named `...norm.weight`).
fn is_norm(name: &str, shape: &[usize]) -> bool {
    shape.len() == 1 && name.ends_with("norm.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any range of a parameter's initial values, drawn in parallel blocks,
    /// equals that part of the serial draw from the parameter's offset.
    #[test]
    fn random_init_ranges_equal_the_serial_draw() {
        let mut cfg = ModelConfig::resolve("tiny").unwrap();
        cfg.vocab = 3 * INIT_BLOCK / cfg.hidden + 1; // the embedding spans 3+ blocks
        let init = RandomInit::new(&cfg, 7);
        let name = "model.embed_tokens.weight";
        let n = cfg.vocab * cfg.hidden;
        let whole = init.values(name, 0..n);
        let before = init.drawn_before[name];
        let mut rng = crate::rng::Rng::new(7);
        rng.skip_normals(before);
        assert_eq!(whole, rng.normal_vec(n, 0.02));
        for r in [3..INIT_BLOCK + 5, n / 2..n, INIT_BLOCK..2 * INIT_BLOCK] {
            let r = r.start.min(n)..r.end.min(n);
            assert_eq!(init.values(name, r.clone()), whole[r]);
        }
    }
}
