//! Training: data, checkpoints, sharded optimizer state and the training loop.
pub mod checkpoint;
pub mod data;
