//! Training: data (tokenizers, token sources, corpus tokenizing), checkpoints,
//! the optimizer, parameter stores (replicated or FSDP-sharded), the loop,
//! and evaluation.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod divergence;
pub mod documents;
pub mod eval;
pub mod fsdp;
pub mod host_weights;
pub mod offload_optim;
pub mod optim;
pub mod ranged;
pub mod replicated;
pub mod save_dir;
pub mod settling;
pub mod state;
pub mod tokenize;
pub mod tokens;
pub mod trainer;
