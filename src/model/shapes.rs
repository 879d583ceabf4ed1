//! Buffer shapes of the decoder outside attention (MLP tiles, loss chunks),
//! shared by the decoder and the memory planner, so the
//! planner walks the decoder's own chunking.

use std::ops::Range;

/// A tiled MLP's block runs about this many tiles where their size allows.
const MLP_TILES: usize = 16;

/// Rows of one MLP tile over `rows` local tokens: `rows / 16`, but at least
/// `hidden` rows (so a tile's `[tile, ffn]` intermediates are no larger than
/// the block's `[s, hidden]` tensors need to be tiled for) and at most
/// 4·`hidden` (so they stay a small fixed size at any length). Fewer,
/// larger tiles than `hidden` rows each keep the GEMMs large and the
/// per-tile launches few.
pub fn mlp_tile_rows(rows: usize, hidden: usize) -> usize {
    let hidden = hidden.max(1);
    rows.div_ceil(MLP_TILES).clamp(hidden, 4 * hidden)
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
            prop_assert!(first.len() <= 4 * hidden);
            // every tile but the last has the same size, at least `hidden` rows
            for t in &tiles[..tiles.len() - 1] {
                prop_assert_eq!(t.len(), first.len());
                prop_assert!(t.len() >= hidden);
            }
            prop_assert!(last.len() <= first.len());
            // at most 16 tiles unless they have reached 4·hidden rows
            prop_assert!(tiles.len() <= 16 || first.len() == 4 * hidden);
            prop_assert_eq!(mlp_tiles(rows, hidden, false), vec![0..rows]);
        }
    }
}
