//! [`PackedWindow`]: one training window as the model takes it, whatever
//! the packing (`--pack`) that made it.

use crate::backend::IGNORE;
use crate::error::{Error, Result};

/// One window of `seq` tokens: its inputs, its targets and where its
/// documents start.
///
/// Positions restart at every document start and attention is
/// block-diagonal causal over the documents; a window that is one stream
/// (`--pack stream`) has `doc_starts == [0]`, so positions run `0..seq` and
/// attention is plain causal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedWindow {
    /// `[seq]` input ids.
    pub inputs: Vec<u32>,
    /// `[seq]` next-token targets; [`IGNORE`] where no loss is counted (a
    /// target in the next document, padding, an SFT prompt token).
    pub targets: Vec<u32>,
    /// Offsets in `0..seq` where documents start: ascending, the first 0.
    pub doc_starts: Vec<u32>,
}

impl PackedWindow {
    /// A window that is one stream: every target counted, one document.
    pub fn stream(inputs: Vec<u32>, targets: Vec<u32>) -> PackedWindow {
        PackedWindow {
            inputs,
            targets,
            doc_starts: vec![0],
        }
    }

    /// Tokens in the window.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Whether the window holds no token.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Whether attention and positions run across the whole window.
    pub fn is_one_document(&self) -> bool {
        self.doc_starts.len() <= 1
    }

    /// `[seq]` each token's position within its document (RoPE's index).
    pub fn positions(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        let mut next = 1;
        let mut start = 0u32;
        for q in 0..self.len() as u32 {
            if next < self.doc_starts.len() && self.doc_starts[next] == q {
                start = q;
                next += 1;
            }
            out.push(q - start);
        }
        out
    }

    /// Targets that count toward the loss.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }

    /// Checks the window's invariants: inputs and targets of one length,
    /// document starts ascending from 0 and inside the window.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("bad packed window: {why}")));
        if self.targets.len() != self.inputs.len() {
            return bad(format!(
                "{} targets for {} inputs",
                self.targets.len(),
                self.inputs.len()
            ));
        }
        if self.doc_starts.first() != Some(&0) {
            return bad("the first document must start at 0".into());
        }
        for w in self.doc_starts.windows(2) {
            if w[1] <= w[0] {
                return bad(format!(
                    "document starts not ascending ({} then {})",
                    w[0], w[1]
                ));
            }
        }
        match self.doc_starts.last() {
            Some(&last) if last as usize >= self.len().max(1) => bad(format!(
                "a document starts at {last}, past the window of {}",
                self.len()
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_at_each_document() {
        let w = PackedWindow {
            inputs: vec![7; 6],
            targets: vec![1; 6],
            doc_starts: vec![0, 2, 5],
        };
        assert_eq!(w.positions(), vec![0, 1, 0, 1, 2, 0]);
        assert!(!w.is_one_document());
        let s = PackedWindow::stream(vec![1, 2, 3], vec![2, 3, 4]);
        assert_eq!(s.positions(), vec![0, 1, 2]);
        assert!(s.is_one_document() && s.validate().is_ok());
    }

    #[test]
    fn bad_windows_are_refused() {
        let mut w = PackedWindow::stream(vec![1, 2, 3], vec![2, IGNORE, 4]);
        assert_eq!(w.counted(), 2);
        w.doc_starts = vec![0, 2, 2];
        assert!(w.validate().is_err());
        w.doc_starts = vec![0, 3];
        assert!(w.validate().is_err());
        w.doc_starts = vec![1];
        assert!(w.validate().is_err());
        w.doc_starts = vec![0];
        w.targets.pop();
        assert!(w.validate().is_err());
    }
}
