//! The Llama-family decoder: configurations, weights and forward/backward.
pub mod config;
