//! Buffer shapes of the decoder outside attention (MLP tiles, loss chunks),
//! shared by the decoder and the memory planner, so the
//! planner walks the decoder's own chunking.

use std::ops::Range;

/// Token tiles of the decoder's MLP over `rows` local tokens: one tile, or
/// tiles of `hidden` rows when tiled (the last one may be shorter).
pub fn mlp_tiles(rows: usize, hidden: usize, tiled: bool) -> Vec<Range<usize>> {
    let t = if tiled { hidden.max(1) } else { rows.max(1) };
    (0..rows).step_by(t).map(|r| r..(r + t).min(rows)).collect()
}

/// Row chunks of the fused loss over `rows` local tokens.
pub fn loss_chunks(rows: usize, chunk: usize) -> Vec<Range<usize>> {
    (0..rows)
        .step_by(chunk.max(1))
        .map(|r| r..(r + chunk.max(1)).min(rows))
        .collect()
}
