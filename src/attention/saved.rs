//! What the attention layer's forward keeps for its backward ([`AttnSaved`]).

use crate::backend::{Backend, Tensor};

/// What forward keeps for backward besides the layer input.
pub struct AttnSaved<B: Backend> {
    /// Attention output before the output projection, canonical heads: `[s_local, H, d]`.
    pub o: Tensor<B>,
    /// One `[shard, u]` F32 LSE per stage.
    pub lse: Vec<Tensor<B>>,
}
