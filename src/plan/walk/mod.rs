//! The engine's allocation order, walked through a [`Sim`](super::sim::Sim)
//! with the engine's buffer sizes ([`super::shapes`]): one attention layer
//! (`attention.rs`) and the decoder's step around it (`decoder.rs`). Each
//! function names the engine function it follows; `tests/integration/plan.rs` holds every
//! walk to the allocator ledger of a real run (exact on the CPU backend), and
//! `tests/integration/plan_engine.rs` the step's walk to the engine's own step run on a
//! counting backend. The walk stays beside the engine path for its speed:
//! it takes one MLP tile and one loss chunk of each length where the engine
//! runs them all (`plan::walk_step_rank`).

mod attention;
mod decoder;
pub mod lora;

pub use attention::{AttnFwd, AttnWalk, PLANNED_CUDNN_VERSION};
pub use decoder::DecoderWalk;
pub use lora::Adapters;
