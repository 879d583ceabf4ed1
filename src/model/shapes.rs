//! Buffer shapes of the decoder outside attention (MLP tiles, loss chunks),
//! shared by the decoder and the memory planner, so the
//! planner runs the decoder's own chunking.

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

/// Consecutive row ranges of one size over `0..rows`, the last one shorter
/// where the size does not divide `rows`: the MLP's token tiles and the
/// loss's chunks. Held as two numbers, so a loop over millions of tiles
/// (and a rehearsal that runs only the distinct ones,
/// [`for_each_chunk`](crate::model::chunk_loop::for_each_chunk)) never
/// lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowChunks {
    rows: usize,
    size: usize,
}

impl RowChunks {
    /// `0..rows` in ranges of `size` rows (at least 1).
    pub fn new(rows: usize, size: usize) -> Self {
        RowChunks {
            rows,
            size: size.max(1),
        }
    }
    /// How many ranges.
    pub fn len(&self) -> usize {
        self.rows.div_ceil(self.size)
    }
    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }
    /// Range `i` (below [`len`](Self::len)).
    pub fn get(&self, i: usize) -> Range<usize> {
        let start = i * self.size;
        start..(start + self.size).min(self.rows)
    }
}

/// The ranges of a [`RowChunks`], in order.
#[derive(Debug, Clone)]
pub struct RowChunkIter {
    chunks: RowChunks,
    next: usize,
}

impl Iterator for RowChunkIter {
    type Item = Range<usize>;
    fn next(&mut self) -> Option<Range<usize>> {
        (self.next < self.chunks.len()).then(|| {
            self.next += 1;
            self.chunks.get(self.next - 1)
        })
    }
}

impl IntoIterator for RowChunks {
    type Item = Range<usize>;
    type IntoIter = RowChunkIter;
    fn into_iter(self) -> RowChunkIter {
        RowChunkIter {
            chunks: self,
            next: 0,
        }
    }
}

/// Token tiles of the decoder's MLP over `rows` local tokens: one tile, or
/// tiles of [`mlp_tile_rows`] when tiled (the last one may be shorter).
pub fn mlp_tiles(rows: usize, hidden: usize, tiled: bool) -> RowChunks {
    let t = if tiled {
        mlp_tile_rows(rows, hidden)
    } else {
        rows.max(1)
    };
    RowChunks::new(rows, t)
}

/// Row chunks of the fused loss over `rows` local tokens.
pub fn loss_chunks(rows: usize, chunk: usize) -> RowChunks {
    RowChunks::new(rows, chunk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn mlp_tiles_cover_the_rows_in_bounded_tiles(rows in 1usize..2_000_000, hidden in 1usize..9000) {
            let tiles: Vec<_> = mlp_tiles(rows, hidden, true).into_iter().collect();
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
            prop_assert_eq!(mlp_tiles(rows, hidden, false).into_iter().collect::<Vec<_>>(), vec![0..rows]);
        }
    }
}
