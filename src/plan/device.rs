//! The device a prediction is for: its dtypes, what its backend keeps
//! resident, and which attention kernels take which calls (on cuDNN: the
//! version whose limits decide it).

use crate::backend::cuda::cudnn::select::version_text;
use crate::backend::cuda::cudnn::{AttentionKernel, AttnKernel, ragged::FIRST_RAGGED_VERSION};
use crate::plan::PLANNED_CUDNN_VERSION;

const F32: usize = 4;

/// Device bytes per GPU outside the ledger that a run leaves free (`upipe
/// train`'s preflight and `auto` choices, `upipe plan --reserve`'s
/// default): the CUDA context and the libraries' handles and modules
/// (measured 0.65-0.70 GiB on an H100 with CUDA 13.0 and cuDNN 9.14), and
/// the device pool's fragmentation near the top of the GPU, which the
/// ledger does not see (0.33-0.44 GiB measured there after a trim, in
/// rehearsals of Llama3-8B at 535,552 tokens and Llama 3.2 1B at 2,644,992).
pub const GPU_RESERVE_BYTES: usize = 3 << 29;

/// Which backend's dtypes the prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// CPU reference: everything f32.
    Cpu,
    /// CUDA: bf16 activations and weights, f32 gradients, moments and master
    /// weights; attention on cuDNN SDPA of version `cudnn` (e.g. 91400)
    /// where that version takes the call (the default `--attn-kernel
    /// auto`), on our kernels otherwise.
    Cuda { cudnn: usize },
    /// CUDA with our attention kernels only (`--attn-kernel native`).
    CudaNative,
    /// CUDA with our attention kernels under documents masks (`--pack
    /// documents|bfd` over data with a document index, under `--attn-kernel
    /// native` or a cuDNN before 9.10): each call's per-row key bounds kept
    /// on the device.
    CudaDocuments,
    /// CUDA with cuDNN attention of version `cudnn` (9.10 or newer) under
    /// documents masks (`--pack documents|bfd`): calls of several documents
    /// over their own rows on cuDNN's ragged path (their tables in its
    /// workspace), ring blocks and windows on our kernels with their bounds.
    CudnnDocuments { cudnn: usize },
}

impl DeviceKind {
    /// CUDA with cuDNN attention at the planned default version
    /// ([`PLANNED_CUDNN_VERSION`]: what a plan assumes when no cuDNN is
    /// loaded).
    pub const CUDA: DeviceKind = DeviceKind::Cuda {
        cudnn: PLANNED_CUDNN_VERSION,
    };
    /// [`DeviceKind::CudnnDocuments`] at the planned default version.
    pub const CUDNN_DOCUMENTS: DeviceKind = DeviceKind::CudnnDocuments {
        cudnn: PLANNED_CUDNN_VERSION,
    };

    /// Bytes per element of the compute dtype.
    pub fn act_bytes(self) -> usize {
        match self {
            DeviceKind::Cpu => 4,
            DeviceKind::Cuda { .. }
            | DeviceKind::CudaNative
            | DeviceKind::CudaDocuments
            | DeviceKind::CudnnDocuments { .. } => 2,
        }
    }
    /// Whether this is a CUDA device (either attention kernel choice).
    pub fn is_cuda(self) -> bool {
        self != DeviceKind::Cpu
    }
    /// The device kind of the attention kernel choice `--attn-kernel`, with
    /// cuDNN at the planned default version ([`Self::with_cudnn`] plans
    /// another).
    pub fn cuda_with(kernel: AttnKernel) -> Self {
        match kernel {
            AttnKernel::Native => DeviceKind::CudaNative,
            _ => DeviceKind::CUDA,
        }
    }
    /// This device with cuDNN of `version` (e.g. 91900) where it has cuDNN
    /// attention: a documents run below 9.10, where cuDNN takes no
    /// documents masks, runs on our kernels (`cudnn::decide_run_kernel`
    /// decides the same); devices without cuDNN are unchanged.
    pub fn with_cudnn(self, version: usize) -> Self {
        match self {
            DeviceKind::Cuda { .. } => DeviceKind::Cuda { cudnn: version },
            DeviceKind::CudnnDocuments { .. } if version < FIRST_RAGGED_VERSION => {
                DeviceKind::CudaDocuments
            }
            DeviceKind::CudnnDocuments { .. } => DeviceKind::CudnnDocuments { cudnn: version },
            other => other,
        }
    }
    /// The cuDNN version whose limits put attention calls on cuDNN (`Cuda`,
    /// `CudnnDocuments`); `None` where none runs there.
    pub fn cudnn(self) -> Option<usize> {
        match self {
            DeviceKind::Cuda { cudnn } | DeviceKind::CudnnDocuments { cudnn } => Some(cudnn),
            DeviceKind::Cpu | DeviceKind::CudaNative | DeviceKind::CudaDocuments => None,
        }
    }
    /// Whether the run's windows may hold several documents.
    pub fn documents(self) -> bool {
        matches!(
            self,
            DeviceKind::CudaDocuments | DeviceKind::CudnnDocuments { .. }
        )
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
            _ => crate::backend::cuda::gemm::WORKSPACE_BYTES,
        }
    }
    /// The device of a run whose attention kernel was decided
    /// (`cudnn::decide_run_kernel`; `None`: on the CPU), `documents` when
    /// its windows may hold several documents: cuDNN runs are planned with
    /// the decided cuDNN's version where it takes the call, the others on
    /// our kernels.
    pub fn of_kernel(kernel: Option<AttentionKernel>, documents: bool) -> Self {
        match (kernel, documents) {
            (None, _) => DeviceKind::Cpu,
            (Some(AttentionKernel::Cudnn { version }), false) => {
                DeviceKind::CUDA.with_cudnn(version)
            }
            (Some(AttentionKernel::Cudnn { version }), true) => {
                DeviceKind::CUDNN_DOCUMENTS.with_cudnn(version)
            }
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
    pub fn of_run(cuda: bool, kernel: AttnKernel) -> Self {
        if cuda {
            Self::cuda_with(kernel)
        } else {
            DeviceKind::Cpu
        }
    }
    /// Of `memory` bytes per rank, what the ledger may use: on CUDA
    /// [`GPU_RESERVE_BYTES`] stay outside it (the CUDA context, library
    /// handles, the pool's fragmentation).
    pub fn ledger_budget(self, memory: usize) -> usize {
        if self.is_cuda() {
            memory.saturating_sub(GPU_RESERVE_BYTES)
        } else {
            memory
        }
    }
    /// What the plan assumes: the dtypes and the attention kernels (with
    /// the cuDNN version planned).
    pub fn name(self) -> String {
        let cuda = "cuda (bf16 weights and activations;";
        match self {
            DeviceKind::Cpu => "cpu (f32)".into(),
            DeviceKind::Cuda { cudnn } => format!(
                "{cuda} cuDNN {} attention where it applies)",
                version_text(cudnn)
            ),
            DeviceKind::CudaNative => format!("{cuda} our attention kernels)"),
            DeviceKind::CudaDocuments => {
                format!("{cuda} our attention kernels, documents masks)")
            }
            DeviceKind::CudnnDocuments { cudnn } => format!(
                "{cuda} cuDNN {} attention where it applies, documents masks)",
                version_text(cudnn)
            ),
        }
    }
}
