//! Buffer shapes of the engine, as the planner reads them: the engine's own
//! shape functions (`attention::shapes`, `model::shapes`, which sit below
//! the planner).

pub use crate::attention::shapes::{StageShapes, rope_table};
pub use crate::model::shapes::{loss_chunks, mlp_tiles};
