//! How an attention backward writes its gradients: added into, or
//! overwritten by its one call.

/// How [`Backend::attention_bwd`] writes one gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradWrite {
    /// `grad += ...`: ring steps and the stages of a kv phase add up.
    Add,
    /// `grad = ...`: the call is the gradient's only contribution, so its
    /// buffer needs no zeroing and can be in the compute dtype (on cuDNN the
    /// kernel writes it directly, with no scratch and no add).
    Overwrite,
}

/// How [`Backend::attention_bwd`] writes `dq` and `dk`/`dv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnGradWrites {
    pub dq: GradWrite,
    pub dkv: GradWrite,
}

impl AttnGradWrites {
    /// Every gradient added into.
    pub const ADD: AttnGradWrites = AttnGradWrites {
        dq: GradWrite::Add,
        dkv: GradWrite::Add,
    };
}
