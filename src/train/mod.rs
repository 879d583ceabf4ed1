//! Training: data (tokenizers, token sources, corpus tokenizing), checkpoints,
//! the optimizer, the loop, and evaluation.

pub mod checkpoint;
pub mod data;
pub mod documents;
pub mod eval;
pub mod optim;
pub mod tokenize;
pub mod tokens;
pub mod trainer;
