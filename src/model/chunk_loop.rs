//! The loops of a step whose iterations are alike (the MLP's token tiles,
//! the loss's chunks): run whole on a backend that computes, and on a
//! rehearsal (`train --rehearse`, the memory planner) collapsed to the
//! iterations that can allocate differently, so that predicting a step of
//! billions of tokens costs what a step of a few tiles does.
//!
//! Why collapsing is exact: an iteration runs the same code on ranges of
//! one length, so what it allocates depends only on the ledger state it
//! starts from (kept workspaces included: they are ledger bytes). Once one
//! iteration ends in the state it began in, every later iteration of its
//! length starts there too and repeats it allocation for allocation: the
//! same peak, reached first by the iteration already run, the same bytes
//! per category, nothing left behind. So the rehearsal runs iterations
//! until one leaves the ledger as it found it, then only the shorter last
//! range, if there is one. Nothing here knows what an iteration allocates.

use super::shapes::RowChunks;
use crate::backend::Backend;
use crate::error::Result;
use std::ops::Range;

/// Runs `body` on every range of `chunks` in order; on a rehearsal, skips
/// the ranges that repeat one already run (see the module doc).
pub fn for_each_chunk<B: Backend>(
    b: &B,
    chunks: RowChunks,
    mut body: impl FnMut(Range<usize>) -> Result<()>,
) -> Result<()> {
    let n = chunks.len();
    let mut i = 0;
    while i < n {
        let range = chunks.get(i);
        let before = b.ledger().state();
        body(range.clone())?;
        i = if b.collapses_alike_iterations() && b.ledger().state() == before {
            next_unlike(&chunks, i)
        } else {
            i + 1
        };
    }
    Ok(())
}

/// The index after `i` of the first range whose length differs from range
/// `i`'s (only the last can), or the number of ranges.
fn next_unlike(chunks: &RowChunks, i: usize) -> usize {
    let n = chunks.len();
    let last = n - 1;
    if i < last && chunks.get(last).len() != chunks.get(i).len() {
        last
    } else {
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Category;
    use crate::backend::DType;
    use crate::backend::counting::CountingBackend;
    use crate::backend::cpu::CpuBackend;

    /// Runs a loop whose first iteration grows a kept buffer to the largest
    /// range seen and whose every iteration allocates a transient of its
    /// range's rows: the ranges it ran and the ledger peak.
    fn run<B: Backend>(b: &B, chunks: RowChunks) -> (Vec<Range<usize>>, usize) {
        let mut ran = Vec::new();
        let mut kept: Option<crate::backend::Tensor<B>> = None;
        for_each_chunk(b, chunks, |r| {
            if kept.as_ref().is_none_or(|k| k.numel() < r.len()) {
                kept = Some(b.zeros(&[r.len()], DType::F32, Category::Workspace)?);
            }
            let _t = b.zeros(&[r.len(), 3], DType::F32, Category::Activations)?;
            ran.push(r);
            Ok(())
        })
        .unwrap();
        (ran, b.ledger().peak())
    }

    #[test]
    fn a_rehearsal_runs_the_distinct_iterations_and_reaches_the_same_peak() {
        for (rows, size) in [(10, 3), (9, 3), (1, 4), (7, 7), (1000, 16), (0, 5)] {
            let chunks = RowChunks::new(rows, size);
            let cpu = CpuBackend::new();
            let (all, cpu_peak) = run(&cpu, chunks);
            assert_eq!(all.len(), chunks.len());
            let rehearsal = CountingBackend::reference();
            let (ran, peak) = run(&rehearsal, chunks);
            assert_eq!(peak, cpu_peak, "{rows} rows in {size}");
            // the first (grows the kept buffer), the second (leaves the
            // ledger as it found it), and a shorter last one
            let want: Vec<_> = all
                .iter()
                .enumerate()
                .filter(|(i, r)| *i < 2 || r.len() != size)
                .map(|(_, r)| r.clone())
                .collect();
            assert_eq!(ran, want, "{rows} rows in {size}");
            let every = CountingBackend::reference().every_iteration();
            assert_eq!(run(&every, chunks), (all, cpu_peak));
        }
    }

    #[test]
    fn an_iteration_that_leaves_bytes_behind_is_never_skipped() {
        let chunks = RowChunks::new(12, 3);
        let b = CountingBackend::reference();
        let mut kept = Vec::new();
        let mut ran = 0;
        for_each_chunk(&b, chunks, |r| {
            kept.push(b.zeros(&[r.len()], DType::F32, Category::Activations)?);
            ran += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(ran, 4);
        assert_eq!(b.ledger().current(), 12 * 4);
    }
}
