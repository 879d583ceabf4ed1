//! FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over
//! every rank of the mesh, one unit (embedding, block, head) at a time.
//! `layout` is the index math, `store` the per-rank shards and the step's
//! gathers and reduce-scatters, `optim` AdamW on the shards, `sharded` a
//! rank's sharded model (start, step, save), `checkpoint` its files.

pub mod checkpoint;
pub mod layout;
pub mod optim;
pub mod sharded;
pub mod store;

pub use layout::{UnitLayout, model_layouts};
pub use optim::ShardedAdamW;
pub use sharded::Sharded;
pub use store::FsdpStore;
