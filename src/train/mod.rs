//! Training: parameter stores (replicated or FSDP-sharded), what a rank
//! keeps of its model (`state.rs`), the loop, and evaluation (`eval.rs`;
//! during training: `eval_during.rs`; retrieval trials scored
//! teacher-forced: `retrieval.rs`).

pub mod config;
pub mod eval;
pub mod eval_during;
pub mod fsdp;
pub mod host_weights;
pub mod lora_base;
pub mod lora_run;
pub mod replicated;
pub mod retrieval;
pub mod retrieval_during;
pub mod state;
pub mod step_windows;
pub mod trainer;
