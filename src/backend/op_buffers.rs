//! What a device's ops take for themselves beside their outputs — a GEMM
//! workspace, uploaded token ids, a reduction's accumulator, attention's
//! scratch and kept workspaces — sized by the device that owns them.
//!
//! A [`Rehearsal`](super::rehearsal::Rehearsal) asks its device these
//! questions and allocates the answers; the device's own module answers
//! them (the CUDA rules live in `backend::cuda::op_buffers`), so nothing
//! here knows any device's sizes. The CPU reference's ops take no buffers
//! of their own: every method's default.

pub use super::attn_args::AttnShape;
use super::grad_write::AttnGradWrites;
use super::tensor::DType;
use crate::error::{Error, Result};

/// An attention backward's dtypes and how it writes its gradients.
#[derive(Debug, Clone, Copy)]
pub struct AttnBwdDtypes {
    /// Of q, o and dO.
    pub inputs: [DType; 3],
    /// Of dQ, dK and dV.
    pub grads: [DType; 3],
    pub writes: AttnGradWrites,
}

/// A workspace an op keeps between calls and grows: to hold `need` bytes it
/// releases the old one and allocates `bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptWorkspace {
    pub need: usize,
    pub bytes: usize,
}

/// What one attention call takes beside its outputs, in the order it takes
/// them: its scratch (held to the end of the call), then its kept
/// workspace grown, then the documents mask's key bounds kept, then a
/// transient workspace taken and freed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttnBuffers {
    /// `(elements, dtype)` of each scratch buffer, freed when the call ends.
    pub scratch: Vec<(usize, DType)>,
    pub kept_workspace: Option<KeptWorkspace>,
    /// The rows' key bounds (`[2·sq]` 4-byte elements) kept for the next
    /// call, replacing the last call's unless they are the same size.
    pub mask_bounds: bool,
    /// Bytes of a workspace taken after the rest and freed at once.
    pub transient_bytes: Option<usize>,
}

/// The buffers a device's ops take for themselves, as the device decides
/// them (module docs). Every default is the CPU reference's: F32 compute,
/// no buffers of its own.
pub trait OpBuffers: Send + Sync {
    /// The dtype the device computes in.
    fn compute_dtype(&self) -> DType {
        DType::F32
    }
    /// The GEMM's workspace bytes, taken at the first non-empty GEMM and
    /// kept (`None`: none); an error where the device refuses the operands'
    /// dtypes `a`, `b` and the output's `c`.
    fn gemm_workspace(&self, _a: DType, _b: DType, _c: DType) -> Result<Option<usize>> {
        Ok(None)
    }
    /// The FP8 GEMM's workspace bytes, taken and kept as
    /// [`gemm_workspace`](Self::gemm_workspace)'s (the same buffer).
    fn fp8_gemm_workspace(&self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// Whether the embedding and the loss upload their token ids (one
    /// 4-byte element each) for the op's duration.
    fn uploads_ids(&self) -> bool {
        false
    }
    /// 4-byte elements of `sum_squares`' transient accumulator.
    fn sum_squares_scratch(&self) -> usize {
        0
    }
    /// What an attention forward of `g` takes (`bf16`: q and o in BF16).
    fn attention_fwd(&self, _g: &AttnShape, _bf16: bool) -> Result<AttnBuffers> {
        Ok(AttnBuffers::default())
    }
    /// What an attention backward of `g` takes.
    fn attention_bwd(&self, _g: &AttnShape, _dt: &AttnBwdDtypes) -> Result<AttnBuffers> {
        Ok(AttnBuffers::default())
    }
    /// As [`Backend::attention_bwd_in_place`](super::Backend::attention_bwd_in_place).
    fn bwd_in_place(&self, _g: &AttnShape) -> bool {
        self.compute_dtype() == DType::F32
    }
}

/// The CPU reference's rules: every [`OpBuffers`] default.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBuffers;

impl OpBuffers for ReferenceBuffers {}

/// The lock error of a kept buffer.
pub(super) fn poisoned(what: &str) -> Error {
    Error::Backend(format!("{what} lock poisoned"))
}
