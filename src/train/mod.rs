//! Training: data, checkpoints, the optimizer and the loop.

pub mod checkpoint;
pub mod data;
pub mod eval;
pub mod optim;
pub mod tokens;
pub mod trainer;
