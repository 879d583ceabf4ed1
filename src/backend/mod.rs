//! Backends: the only code that touches memory and kernels.
//!
//! A [`Backend`] owns one device (one rank). It hands out [`Tensor`]s whose
//! bytes are recorded in its [`MemoryLedger`], and runs the ops the model
//! needs on them. Strategies and the model are written once against this
//! trait; the CPU f32 backend is the reference every other backend is tested
//! against.

pub mod arena;
pub mod attn_args;
pub mod bounded_mask;
pub mod cast;
pub mod checks;
pub mod copy_done;
pub mod counting;
pub mod cpu;
pub mod cuda;
pub mod fp8;
pub mod fused_update;
pub mod grad_write;
pub mod mask;
pub mod memory;
pub mod narrow;
pub mod norm_args;
pub mod op_buffers;
pub mod op_kinds;
pub mod ops;
pub mod phase_guard;
pub mod profile;
pub mod rehearsal;
pub mod tensor;

pub use attn_args::{AttentionBwd, AttentionFwd, AttnShape, LseMerge};
pub use cast::{cast, cast_ref};
pub use checks::{check_bias_views, check_elems, check_same_numel, check_token_ids, out_of_memory};
pub use copy_done::{ComputePoint, CopyDone, InFlight};
pub use fused_update::{UpdateKernel, UpdateSlot};
pub use grad_write::{AttnGradWrites, GradWrite};
pub use mask::{AttnMask, BoundedMask, RowPositions};
pub use memory::{Bytes, Category, MemoryLedger, MemoryStats, PoolReport};
pub use norm_args::{AddRmsNormFwd, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
pub use op_buffers::OpBuffers;
pub use op_kinds::{GatedAct, RmsNorm};
pub use ops::{Backend, HostValues, HostValuesMut, IGNORE};
pub use phase_guard::PhaseGuard;
pub use tensor::{DType, Mat, MatLayout, MatMut, Rows, RowsMut, Tensor, TensorDevice, TensorRef};
