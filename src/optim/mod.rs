//! Optimizers over a rank's parameters, whatever store holds them: the
//! [`Optimizer`] trait and the state it declares ([`StateSpec`]), its
//! [`Slot`]s (a whole parameter, or a rank's FSDP shard of a unit), the one
//! place a run's optimizer is made (`build.rs`: [`build`]), AdamW with its
//! clipping, arithmetic and kernels (`adamw/`, `kernels/`; run by the
//! backend's one fused update) and its learning-rate schedules
//! (`schedule.rs`: cosine, linear, constant, WSD), its state's formats
//! (`state_format.rs`: F32, BF16 or 8-bit moments, F32 masters or none; a
//! slot's moment in its format: `moments.rs`), its state in pinned host
//! memory with the update deferred into the next forward (`host.rs`,
//! `settling.rs`), and the guard that stops a diverged run
//! (`divergence.rs`).

pub mod adamw;
pub mod build;
pub mod divergence;
pub mod host;
pub mod moments;
pub mod optimizer;
pub mod paged;
pub mod schedule;
pub mod settling;
pub mod slot;
pub mod state_format;

pub use adamw::{
    AdamW, AdamWConfig, AdamWOps, AdamWPiece, AdamWSlot, AdamWStep, hyper, state_specs,
};
pub use build::{BuildArgs, OptimConfig, build, state_bytes_per_element, state_per_element};
pub use optimizer::{Optimizer, StateKind, StateSpec, Update};
pub use slot::{Lent, Piece, Slot, slots_through};
pub use state_format::{GradDtype, MasterWeights, MomentFormat, StateFormat};
