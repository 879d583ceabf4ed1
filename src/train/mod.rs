//! Training: data, checkpoints, the optimizer and the loop.

pub mod checkpoint;
pub mod data;
pub mod optim;
pub mod tokens;
pub mod trainer;
