//! Buffer shapes of the engine, as the planner's attention walk reads them:
//! the engine's own shape functions (`attention::shapes`, which sits below
//! the planner).

pub use crate::attention::shapes::{StageShapes, rope_table};
