//! The CUDA backend: one GPU, one stream, bf16 compute.
//!
//! - [`libs`]: finds and loads the CUDA libraries (never panics when one is missing);
//! - [`device`]: driver queries (`upipe info`);
//! - [`pool`]: the stream-ordered pool allocator behind every tensor;
//! - [`nvrtc`] + [`kernels`]: our CUDA C kernels, compiled at run time to a
//!   cubin for the device's arch and cached on disk;
//! - [`gemm`]: cuBLASLt GEMM on row-major views;
//! - [`attention`] + [`flash`]: attention; the native FlashAttention-2 kernels
//!   (compiled on first use, through the same disk cache) for bf16 with head
//!   dim 64/128/256 on sm_90+, the naive kernels for everything else.
//!
//! [`CudaBackend`] (opening the device, streams, synchronisation) is in
//! `backend.rs`, and its one `impl Backend` in `ops.rs`, which hands each
//! heavy op to the file of its family: `memory_ops.rs` (allocation,
//! uploads/downloads, copies), `attention_ops.rs` (attention routing,
//! `lse_merge`), `elementwise_ops.rs` (fill, axpy, norms, RoPE, SwiGLU,
//! embedding, loss), `fused_update.rs` (an optimizer's update: its
//! program compiled on first use, its launches run) and `gemm_ops.rs`
//! (`gemm`, on [`gemm`]'s cuBLASLt). This file only declares the modules and re-exports.
//!
//! Every op is queued on the backend's stream; `to_host`, `sum_squares` and
//! `synchronize` wait for it.

pub mod attention;
mod attention_fp8;
mod attention_ops;
mod attn_operands;
mod backend;
pub mod counted;
pub mod cudnn;
pub mod device;
mod elementwise_ops;
pub mod flash;
mod fp8_ops;
mod fused_update;
pub mod gemm;
mod gemm_ops;
pub mod host_pool;
pub mod kernels;
pub mod libs;
mod memory_ops;
pub mod nvrtc;
pub mod op_buffers;
mod ops;
pub mod pinned;
pub mod pool;
pub mod profile;
mod rehearsal;
pub mod tuning;

pub use self::attention::AttentionKernels;
pub use self::attention_ops::AttentionCalls;
pub use self::backend::CudaBackend;
pub use self::pool::CudaStorage as Storage;
