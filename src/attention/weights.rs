//! An attention layer's weights ([`AttentionWeights`]) and their gradients
//! ([`AttentionGrads`]), walked by name in HF order ([`AttnTensors`]).

use super::dims::AttnDims;
use super::lora_delta::{AttnAdapters, LoraPair, LoraPairGrads};
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::Result;

/// Weights of one attention layer in HF layout: `wq [H*d, hidden]`,
/// `wk, wv [Hkv*d, hidden]`, `wo [hidden, H*d]`, norms `[d]`, and the
/// projection biases of families that have them (Qwen2): `bq [H*d]`,
/// `bk, bv [Hkv*d]`, added to the projections before norm and RoPE.
pub struct AttentionWeights<B: Backend> {
    pub wq: Tensor<B>,
    pub wk: Tensor<B>,
    pub wv: Tensor<B>,
    pub wo: Tensor<B>,
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    pub bq: Option<Tensor<B>>,
    pub bk: Option<Tensor<B>>,
    pub bv: Option<Tensor<B>>,
    /// LoRA adapters of the projections (`--lora-rank`; none by default),
    /// added beside the frozen weights' GEMMs, never merged.
    pub lora: AttnAdapters<LoraPair<B>>,
}

/// F32 gradients of [`AttentionWeights`], by shape: `None` for a parameter
/// the layer does not have, or one that is frozen (`model::Freeze`): its
/// weight gradient is not computed.
pub struct AttentionGrads<B: Backend> {
    pub wq: Option<Tensor<B>>,
    pub wk: Option<Tensor<B>>,
    pub wv: Option<Tensor<B>>,
    pub wo: Option<Tensor<B>>,
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    pub bq: Option<Tensor<B>>,
    pub bk: Option<Tensor<B>>,
    pub bv: Option<Tensor<B>>,
    /// The adapters' gradients (where `AttentionWeights::lora` has adapters).
    pub lora: AttnAdapters<LoraPairGrads<B>>,
}

impl<B: Backend> AttentionGrads<B> {
    /// Zero F32 `Grads` tensors for every weight of `dims` (no biases).
    pub fn zeros(b: &B, dims: &AttnDims) -> Result<Self> {
        let (h, d) = (dims.hidden, dims.head_dim);
        let z = |shape: &[usize]| b.zeros(shape, DType::F32, Category::Grads);
        Ok(AttentionGrads {
            wq: Some(z(&[dims.q_width(), h])?),
            wk: Some(z(&[dims.kv_width(), h])?),
            wv: Some(z(&[dims.kv_width(), h])?),
            wo: Some(z(&[h, dims.q_width()])?),
            q_norm: if dims.qk_norm { Some(z(&[d])?) } else { None },
            k_norm: if dims.qk_norm { Some(z(&[d])?) } else { None },
            bq: None,
            bk: None,
            bv: None,
            lora: AttnAdapters::default(),
        })
    }

    /// Every gradient held, with its short name, in the order of
    /// [`AttentionWeights::named`].
    pub fn named(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let s = self;
        let slots = [
            &s.wq, &s.bq, &s.wk, &s.bk, &s.wv, &s.bv, &s.wo, &s.q_norm, &s.k_norm,
        ];
        in_hf_order(slots.map(Option::as_ref))
    }

    /// Every gradient held, owned, in the order of [`named`](Self::named).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let s = self;
        let slots = [s.wq, s.bq, s.wk, s.bk, s.wv, s.bv, s.wo, s.q_norm, s.k_norm];
        in_hf_order(slots).into_iter().map(|(_, t)| t).collect()
    }
}

/// The short names of an attention layer's tensors, in HF order.
const HF_ORDER: [&str; 9] = ["wq", "bq", "wk", "bk", "wv", "bv", "wo", "q_norm", "k_norm"];

/// The tensors held in `slots` (in [`HF_ORDER`]) with their short names:
/// the one walk of the weights and of their gradients, shared, mutable or owned.
fn in_hf_order<T>(slots: [Option<T>; 9]) -> Vec<(&'static str, T)> {
    let named = HF_ORDER.into_iter().zip(slots);
    named.filter_map(|(n, t)| t.map(|t| (n, t))).collect()
}

/// An attention layer's tensors (its weights, or their gradients) and its
/// adapters, walked mutably in HF order ([`HF_ORDER`]).
pub trait AttnTensors<B: Backend> {
    /// What its adapters hold: the factors, or their gradients.
    type Pair;

    /// Its tensors in [`HF_ORDER`] (`None`: absent, or frozen) and its
    /// adapters, borrowed together.
    #[allow(clippy::type_complexity)]
    fn slots_mut(&mut self) -> ([Option<&mut Tensor<B>>; 9], &mut AttnAdapters<Self::Pair>);

    /// Every tensor held, mutable, with its short name, in HF order.
    fn named_mut(&mut self) -> Vec<(&'static str, &mut Tensor<B>)> {
        self.named_and_lora_mut().0
    }

    /// [`named_mut`](Self::named_mut) and the adapters, borrowed together.
    #[allow(clippy::type_complexity)]
    fn named_and_lora_mut(
        &mut self,
    ) -> (
        Vec<(&'static str, &mut Tensor<B>)>,
        &mut AttnAdapters<Self::Pair>,
    ) {
        let (slots, lora) = self.slots_mut();
        (in_hf_order(slots), lora)
    }
}

impl<B: Backend> AttnTensors<B> for AttentionWeights<B> {
    type Pair = LoraPair<B>;
    fn slots_mut(&mut self) -> ([Option<&mut Tensor<B>>; 9], &mut AttnAdapters<LoraPair<B>>) {
        let s = self;
        let (bq, bk, bv) = (s.bq.as_mut(), s.bk.as_mut(), s.bv.as_mut());
        let (wq, wk, wv) = (Some(&mut s.wq), Some(&mut s.wk), Some(&mut s.wv));
        let (wo, q_norm, k_norm) = (Some(&mut s.wo), s.q_norm.as_mut(), s.k_norm.as_mut());
        let slots = [wq, bq, wk, bk, wv, bv, wo, q_norm, k_norm];
        (slots, &mut s.lora)
    }
}

impl<B: Backend> AttnTensors<B> for AttentionGrads<B> {
    type Pair = LoraPairGrads<B>;
    fn slots_mut(
        &mut self,
    ) -> (
        [Option<&mut Tensor<B>>; 9],
        &mut AttnAdapters<LoraPairGrads<B>>,
    ) {
        let s = self;
        let slots = [
            &mut s.wq,
            &mut s.bq,
            &mut s.wk,
            &mut s.bk,
            &mut s.wv,
            &mut s.bv,
            &mut s.wo,
            &mut s.q_norm,
            &mut s.k_norm,
        ];
        (slots.map(Option::as_mut), &mut s.lora)
    }
}

impl<B: Backend> AttentionWeights<B> {
    /// Every tensor with its short name, in HF order (wq, bq, wk, bk, wv,
    /// bv, wo, q_norm, k_norm; absent ones left out).
    pub fn named(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let s = self;
        let (bq, bk, bv) = (s.bq.as_ref(), s.bk.as_ref(), s.bv.as_ref());
        let (wq, wk, wv, wo) = (Some(&s.wq), Some(&s.wk), Some(&s.wv), Some(&s.wo));
        in_hf_order([
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            wo,
            s.q_norm.as_ref(),
            s.k_norm.as_ref(),
        ])
    }
    /// Every tensor, owned, in the order of [`named`](Self::named).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let s = self;
        let (wq, wk, wv, wo) = (Some(s.wq), Some(s.wk), Some(s.wv), Some(s.wo));
        let slots = [wq, s.bq, wk, s.bk, wv, s.bv, wo, s.q_norm, s.k_norm];
        in_hf_order(slots).into_iter().map(|(_, t)| t).collect()
    }
}
