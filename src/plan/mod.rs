//! The memory planner: peak bytes per rank of a training step, by ledger
//! [`Category`], before anything runs, and the longest context that fits.
//!
//! One source of truth: the engine. Every prediction (`train`'s preflight,
//! `--rehearse`, `upipe plan`, every `auto` choice and the longest-context
//! search) is the engine's own step ([`engine`]: the trainer's rehearsal on
//! a counting backend and counting process groups, `backend::counting`,
//! `comm::counting`), its ledger read with
//! [`MemoryLedger`](crate::backend::MemoryLedger)'s peak rule. Nothing in
//! this folder restates what the engine allocates: a change to the
//! engine's allocations changes the plan and touches no file here. On the
//! CPU backend the prediction equals the measured ledger peak
//! (`tests/integration/plan.rs`), on a GPU the measured one
//! (`tests/integration/gpu_plan.rs`).
//!
//! What is here: the searches over lengths and choices ([`search`],
//! [`resolve`], [`checkpoint_every`], [`offload`], [`offload_optim`], [`save_attention`],
//! [`stage_width`]), the device a plan is for ([`DeviceKind`], the cuDNN
//! version it routes by), the mesh fit and the preflight.
//!
//! [`Category`]: crate::backend::Category

pub mod checkpoint_every;
mod cudnn_version;
mod device;
pub mod engine;
pub mod mesh;
pub mod offload;
pub mod offload_optim;
pub mod predict;
pub mod preflight;
pub mod resolve;
mod save_attention;
mod search;
pub mod shapes;
pub mod sizes;
pub mod stage_width;
pub mod step;

pub use checkpoint_every::CheckpointEvery;
pub use cudnn_version::{CudnnVersion, PLANNED_CUDNN_VERSION};
pub use device::{DeviceKind, GPU_RESERVE_BYTES};
pub use engine::{EvalForward, EvalSpec};
pub use mesh::resolve_plan;
pub use offload::OffloadBlocks;
pub use offload_optim::{HostUpdateChoice, OptimizerOffload};
pub use predict::{predict_attention_trial, predict_eval, predict_step, predict_step_rank};
pub use resolve::{
    Depth, EveryBudget, FsdpMode, MemoryChoices, RankBudget, ResolvedRun, RunRequest, StageChoices,
    checkpoint_every_auto, resolve_checkpoint_every, resolve_run,
};
pub use save_attention::{SaveAttention, save_attention_auto};
pub use search::{Budget, Fit, Limit, MAX_PLANNED_SEQ, longest_context, seq_unit};
pub use sizes::{checkpoint_bytes, trained_state_bytes};
pub use stage_width::{widest_fitting, widest_free_forward};
pub use step::{Prediction, StepSpec};
