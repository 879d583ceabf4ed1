//! FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over
//! every rank of the mesh, one unit (embedding, block, head) at a time.
//! `store` the per-rank shards and the step's gathers and reduce-scatters,
//! `sharded` a rank's sharded model (start, step, save). The index math is
//! `model::flat_layout`, the shards' files `checkpoint::sharded`; the
//! optimizer updates the shards as its slots (`FsdpStore::slots`).

pub mod adapters;
pub mod sharded;
pub mod store;

pub use crate::model::flat_layout::{UnitLayout, model_layouts};
pub use sharded::Sharded;
pub use store::{FsdpStore, check_whole_units};
