//! upipe: long-context transformer training with UPipe context parallelism.
//!
//! Layout follows the architecture: [`backend`] (memory and kernels), [`comm`]
//! (process groups and collectives), [`attention`] (context-parallel attention
//! strategies), [`model`], [`train`], [`plan`] and the [`cli`].

pub mod attention;
pub mod backend;
pub mod checkpoint;
pub mod cli;
pub mod comm;
pub mod data;
pub mod error;
pub mod input_path;
pub mod model;
pub mod optim;
pub mod output_path;
pub mod plan;
pub mod rng;
pub mod train;

pub use error::{Error, Result};
