//! Training: data, checkpoints, the optimizer, parameter stores (replicated
//! or FSDP-sharded) and the loop.

pub mod checkpoint;
pub mod data;
pub mod fsdp;
pub mod optim;
pub mod ranged;
pub mod replicated;
pub mod state;
pub mod trainer;
