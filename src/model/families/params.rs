//! The parameters of a decoder by role ([`Param`], [`BlockParam`]).

use crate::model::unit::Unit;

/// A parameter of a decoder, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    /// The token embedding `[vocab, hidden]` (also the LM head when tied).
    Embed,
    /// Parameter `.1` of block `.0`.
    Block(usize, BlockParam),
    /// The final RMSNorm `[hidden]`.
    FinalNorm,
    /// The LM head `[vocab, hidden]` (absent when tied).
    LmHead,
}

impl Param {
    /// The [`Unit`] that holds it.
    pub fn unit(self) -> Unit {
        match self {
            Param::Embed => Unit::Embed,
            Param::Block(l, _) => Unit::Block(l),
            Param::FinalNorm | Param::LmHead => Unit::Head,
        }
    }
}

/// A parameter of one decoder block, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockParam {
    /// RMSNorm before attention `[hidden]`.
    AttnNorm,
    /// `[H·d, hidden]`.
    Wq,
    /// `[Hkv·d, hidden]`.
    Wk,
    /// `[Hkv·d, hidden]`.
    Wv,
    /// The q projection's bias `[H·d]` (Qwen2).
    Bq,
    /// The k projection's bias `[Hkv·d]` (Qwen2).
    Bk,
    /// The v projection's bias `[Hkv·d]` (Qwen2).
    Bv,
    /// `[hidden, H·d]`.
    Wo,
    /// Per-head RMSNorm of q `[d]` (QK-norm families).
    QNorm,
    /// Per-head RMSNorm of k `[d]` (QK-norm families).
    KNorm,
    /// RMSNorm of the attention's output before its residual add
    /// `[hidden]` (post-norm families: Gemma 3).
    PostAttnNorm,
    /// RMSNorm before the MLP `[hidden]`.
    MlpNorm,
    /// `[ffn, hidden]`.
    Gate,
    /// `[ffn, hidden]`.
    Up,
    /// `[hidden, ffn]`.
    Down,
    /// RMSNorm of the MLP's output before its residual add `[hidden]`
    /// (post-norm families).
    PostMlpNorm,
}
