//! AdamW: the optimizer over any store's slots (`optimizer.rs`: its
//! config, state and steps), its arithmetic (`adamw_step.rs`: one update's
//! hyper-parameters; `host_adamw.rs`: the F32 update on host threads;
//! `compact_adamw.rs`: BF16 and 8-bit moments, stochastic rounding), its
//! multi-tensor slots (`adamw_multi.rs`) and how a device runs them: the
//! ops ([`AdamWOps`], `ops.rs`) over the backend's one fused update, with
//! its kernels (`kernel.rs`, laid out by `slot_layout.rs`; on a GPU the
//! program in `optim/kernels/` launched as `cuda_multi.rs` and
//! `cuda_compact.rs` describe).

pub mod adamw_multi;
pub mod adamw_step;
pub mod compact_adamw;
pub mod cuda_compact;
pub mod cuda_multi;
pub mod host_adamw;
pub mod host_compact;
pub mod kernel;
pub mod ops;
pub mod optimizer;
pub mod slot_layout;

pub use adamw_multi::{AdamWPiece, AdamWSlot};
pub use adamw_step::AdamWStep;
pub use ops::AdamWOps;
pub use optimizer::{AdamW, AdamWConfig, hyper, state_specs};
