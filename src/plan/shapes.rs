//! Buffer shapes of the engine, as the planner reads them: the engine's own
//! shape functions (`attention::shapes`, `model::shapes`, which sit below
//! the planner) and the planner's helpers over them.

pub use crate::attention::shapes::{StageShapes, rope_table};
pub use crate::model::shapes::{loss_chunks, mlp_tiles};
use std::ops::Range;

/// The distinct lengths of `ranges`, in order of first appearance: a chunk
/// loop repeats identical buffers, so the planner walks one of each length.
pub fn distinct_lengths(ranges: &[Range<usize>]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for r in ranges {
        if !out.contains(&r.len()) {
            out.push(r.len());
        }
    }
    out
}
