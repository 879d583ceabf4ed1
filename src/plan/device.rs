//! The device a prediction is for: its dtypes, what its backend keeps
//! resident, and which attention kernels take which calls.

use super::*;

/// Which backend's dtypes the prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// CPU reference: everything f32.
    Cpu,
    /// CUDA: bf16 activations and weights, f32 gradients, moments and master
    /// weights; attention on cuDNN SDPA where it takes the call (the default
    /// `--attn-kernel auto`), on our kernels otherwise.
    Cuda,
    /// CUDA with our attention kernels only (`--attn-kernel native`).
    CudaNative,
    /// CUDA with our attention kernels under documents masks (`--pack
    /// documents|bfd` over data with a document index, under `--attn-kernel
    /// native` or a cuDNN before 9.10): each call's per-row key bounds kept
    /// on the device.
    CudaDocuments,
    /// CUDA with cuDNN attention under documents masks (`--pack
    /// documents|bfd` on cuDNN 9.10 or newer): calls of several documents
    /// over their own rows on cuDNN's ragged path (their tables in its
    /// workspace), ring blocks and windows on our kernels with their bounds.
    CudnnDocuments,
}

impl DeviceKind {
    /// Bytes per element of the compute dtype.
    pub fn act_bytes(self) -> usize {
        match self {
            DeviceKind::Cpu => 4,
            DeviceKind::Cuda
            | DeviceKind::CudaNative
            | DeviceKind::CudaDocuments
            | DeviceKind::CudnnDocuments => 2,
        }
    }
    /// Whether this is a CUDA device (either attention kernel choice).
    pub fn is_cuda(self) -> bool {
        self != DeviceKind::Cpu
    }
    /// The device kind of the attention kernel choice `--attn-kernel`.
    pub fn cuda_with(kernel: crate::backend::cuda::cudnn::AttnKernel) -> Self {
        match kernel {
            crate::backend::cuda::cudnn::AttnKernel::Native => DeviceKind::CudaNative,
            _ => DeviceKind::Cuda,
        }
    }
    /// Whether attention calls cuDNN takes run there (`Cuda`, `CudnnDocuments`).
    pub fn on_cudnn(self) -> bool {
        matches!(self, DeviceKind::Cuda | DeviceKind::CudnnDocuments)
    }
    /// Whether the run's windows may hold several documents.
    pub fn documents(self) -> bool {
        matches!(self, DeviceKind::CudaDocuments | DeviceKind::CudnnDocuments)
    }
    /// Whether AdamW keeps f32 master weights (compute dtype is not f32).
    pub fn master_weights(self) -> bool {
        self.act_bytes() != F32
    }
    /// Bytes the backend allocates for itself through the ledger and keeps
    /// (CUDA: the cuBLASLt workspace, allocated at the first GEMM).
    pub fn backend_resident(self) -> usize {
        match self {
            DeviceKind::Cpu => 0,
            DeviceKind::Cuda
            | DeviceKind::CudaNative
            | DeviceKind::CudaDocuments
            | DeviceKind::CudnnDocuments => crate::backend::cuda::gemm::WORKSPACE_BYTES,
        }
    }
    /// The device of a run whose attention kernel was decided
    /// (`cudnn::decide_run_kernel`; `None`: on the CPU), `documents` when
    /// its windows may hold several documents: cuDNN runs are planned with
    /// cuDNN where it takes the call, the others on our kernels.
    pub fn of_kernel(
        kernel: Option<crate::backend::cuda::cudnn::AttentionKernel>,
        documents: bool,
    ) -> Self {
        use crate::backend::cuda::cudnn::AttentionKernel;
        match (kernel, documents) {
            (None, _) => DeviceKind::Cpu,
            (Some(AttentionKernel::Cudnn { .. }), false) => DeviceKind::Cuda,
            (Some(AttentionKernel::Cudnn { .. }), true) => DeviceKind::CudnnDocuments,
            (Some(AttentionKernel::Flash | AttentionKernel::Naive), false) => {
                DeviceKind::CudaNative
            }
            (Some(AttentionKernel::Flash | AttentionKernel::Naive), true) => {
                DeviceKind::CudaDocuments
            }
        }
    }
    /// The device of a run on the CPU or, with `cuda`, on GPUs with the
    /// attention kernels `kernel` (`--attn-kernel`).
    pub fn of_run(cuda: bool, kernel: crate::backend::cuda::cudnn::AttnKernel) -> Self {
        if cuda {
            Self::cuda_with(kernel)
        } else {
            DeviceKind::Cpu
        }
    }
    /// Of `memory` bytes per rank, what the ledger may use: on CUDA
    /// [`GPU_RESERVE_BYTES`] stay outside it (the CUDA context, library
    /// handles, pool slack).
    pub fn ledger_budget(self, memory: usize) -> usize {
        if self.is_cuda() {
            memory.saturating_sub(GPU_RESERVE_BYTES)
        } else {
            memory
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu (f32)",
            DeviceKind::Cuda => {
                "cuda (bf16 activations, f32 grads/optimizer/master; cuDNN attention where it applies)"
            }
            DeviceKind::CudaNative => {
                "cuda (bf16 activations, f32 grads/optimizer/master; our attention kernels)"
            }
            DeviceKind::CudaDocuments => {
                "cuda (bf16 activations, f32 grads/optimizer/master; our attention kernels, documents masks)"
            }
            DeviceKind::CudnnDocuments => {
                "cuda (bf16 activations, f32 grads/optimizer/master; cuDNN attention where it applies, documents masks)"
            }
        }
    }
}
