//! FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over
//! every rank of the mesh, one unit (embedding, block, head) at a time.
//! `store` the per-rank shards and the step's gathers and reduce-scatters,
//! `sharded` a rank's sharded model (start, step, save). The index math is
//! `model::flat_layout`, AdamW on the shards `optim::sharded`, the shards'
//! files `checkpoint::sharded`.

pub mod sharded;
pub mod store;

pub use crate::model::flat_layout::{UnitLayout, model_layouts};
pub use crate::optim::sharded::ShardedAdamW;
pub use sharded::Sharded;
pub use store::FsdpStore;
