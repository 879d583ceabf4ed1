//! Optimizers: AdamW with its schedule and clipping on the device
//! (`adamw.rs`), its state in pinned host memory with the update deferred
//! into the next forward (`host.rs`, `settling.rs`), AdamW on FSDP shards
//! (`sharded.rs`), and the guard that stops a diverged run
//! (`divergence.rs`).

pub mod adamw;
pub mod divergence;
pub mod host;
pub mod settling;
pub mod sharded;

pub use adamw::*;
