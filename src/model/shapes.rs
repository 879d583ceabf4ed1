//! Buffer shapes of the decoder outside attention (MLP tiles, loss chunks),
//! shared by the decoder and the memory planner, so the
//! planner walks the decoder's own chunking.

use std::ops::Range;

/// Rows of one MLP tile over `rows` local tokens: a quarter of them, but
/// at least `hidden` and at most 4·`hidden`. A tile's `[tile, ffn]`
/// intermediates are then at most a quarter of the untiled ones and have a
/// small fixed size at long lengths, while its GEMMs stay large and the
/// per-tile launches few (tiles of `hidden` rows cost 3-5 % of a
/// checkpointed step on one H200).
pub fn mlp_tile_rows(rows: usize, hidden: usize) -> usize {
    let hidden = hidden.max(1);
    rows.div_ceil(4).clamp(hidden, 4 * hidden)
}

/// Token tiles of the decoder's MLP over `rows` local tokens: one tile, or
/// tiles of [`mlp_tile_rows`] when tiled (the last one may be shorter).
pub fn mlp_tiles(rows: usize, hidden: usize, tiled: bool) -> Vec<Range<usize>> {
    let t = if tiled {
        mlp_tile_rows(rows, hidden)
    } else {
        rows.max(1)
    };
    (0..rows).step_by(t).map(|r| r..(r + t).min(rows)).collect()
}

/// Row chunks of the fused loss over `rows` local tokens.
pub fn loss_chunks(rows: usize, chunk: usize) -> Vec<Range<usize>> {
    (0..rows)
        .step_by(chunk.max(1))
        .map(|r| r..(r + chunk.max(1)).min(rows))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn mlp_tiles_cover_the_rows_in_bounded_tiles(rows in 1usize..2_000_000, hidden in 1usize..9000) {
            let tiles = mlp_tiles(rows, hidden, true);
            prop_assert_eq!(tiles[0].start, 0);
            prop_assert_eq!(tiles.last().unwrap().end, rows);
            for w in tiles.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            let (first, last) = (&tiles[0], tiles.last().unwrap());
            // every tile but the last has one size, hidden to 4·hidden rows
            let t = first.len();
            for tile in &tiles[..tiles.len() - 1] {
                prop_assert_eq!(tile.len(), t);
            }
            prop_assert!(last.len() <= t);
            prop_assert!(t <= 4 * hidden && (t >= hidden || tiles.len() == 1));
            // at least 4 tiles, or tiles of hidden rows
            prop_assert!(tiles.len() >= 4 || t <= hidden || tiles.len() == 1);
            prop_assert!(tiles.len() <= 4 || t == 4 * hidden);
            prop_assert_eq!(mlp_tiles(rows, hidden, false), vec![0..rows]);
        }
    }
}
