//! The longest context that fits: a rank's budget, why a length does not
//! fit, and the search over lengths (`docs/memory.md`).

use super::step::Prediction;
use crate::backend::Category;
use crate::error::Result;

/// Memory available to one rank.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Device bytes usable by the ledger.
    pub device: usize,
    /// Host bytes usable for offloaded activations by one rank (None: unchecked).
    pub host: Option<usize>,
}

/// Why a length does not fit.
#[derive(Debug, Clone, PartialEq)]
pub enum Limit {
    /// Device memory: the category that grew most from the shortest length
    /// to this one (what the length is paying for), and where the peak is.
    Device(Category, &'static str),
    /// Host memory for offloaded activations.
    Host,
}

impl Budget {
    /// Whether `p` fits; `base` (a prediction at a short length) names the
    /// category that grows with the length (without it: the largest at the peak).
    pub fn check(&self, p: &Prediction, base: Option<&Prediction>) -> Option<Limit> {
        if p.peak > self.device {
            let growth =
                |c: Category, bytes: usize| base.map_or(0, |b| bytes.saturating_sub(b.at(c)));
            let cat = p
                .at_peak
                .iter()
                .filter(|(c, _)| c.on_device())
                .max_by_key(|(c, bytes)| growth(*c, *bytes))
                .filter(|(c, bytes)| growth(*c, *bytes) > 0)
                .map_or(p.largest_category(), |x| x.0);
            return Some(Limit::Device(cat, p.peak_at));
        }
        match self.host {
            Some(h) if p.host_peak > h => Some(Limit::Host),
            _ => None,
        }
    }
}

/// The longest context that fits.
#[derive(Debug, Clone)]
pub struct Fit {
    /// Longest fitting length (0: not even one step of `step` tokens).
    pub seq: usize,
    /// The prediction at `seq` (None when nothing fits).
    pub at_fit: Option<Prediction>,
    /// The first length that does not fit, and why.
    pub limit: Option<(usize, Limit, Prediction)>,
}

/// Binary search over multiples of `step` tokens (≤ `max`) for the longest
/// length whose prediction fits `budget`. Peak bytes grow with the length.
pub fn longest_context(
    step: usize,
    max: usize,
    budget: Budget,
    predict: impl Fn(usize) -> Result<Prediction>,
) -> Result<Fit> {
    let step = step.max(1);
    let base = predict(step)?;
    let fits = |k: usize| -> Result<(Prediction, Option<Limit>)> {
        let p = predict(k * step)?;
        let l = budget.check(&p, Some(&base));
        Ok((p, l))
    };
    let (mut lo, mut hi) = (0usize, 1usize);
    let mut best: Option<Prediction> = None;
    let mut fail: Option<(usize, Limit, Prediction)> = None;
    // grow until a length does not fit
    loop {
        if hi.checked_mul(step).is_none_or(|len| len > max) {
            hi = max / step + 1;
            break;
        }
        let (p, l) = fits(hi)?;
        match l {
            None => {
                lo = hi;
                best = Some(p);
                hi *= 2;
            }
            Some(l) => {
                fail = Some((hi * step, l, p));
                break;
            }
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let (p, l) = fits(mid)?;
        match l {
            None => {
                lo = mid;
                best = Some(p);
            }
            Some(l) => {
                hi = mid;
                fail = Some((mid * step, l, p));
            }
        }
    }
    Ok(Fit {
        seq: lo * step,
        at_fit: best,
        limit: fail,
    })
}

/// The longest sequence the planner plans (`plan`, and `train`'s
/// preflight): 16 times the default `--max-seq` and far beyond any context
/// trained. A prediction's time no longer grows with the length (the
/// engine's alike loops collapse on the counting backend); what bounds it
/// is the host memory of the per-token vectors a step still builds (a
/// rank's window of zeros, its positions: 4-8 bytes a token).
pub const MAX_PLANNED_SEQ: usize = 1 << 32;

/// The sequence-length granularity of a plan's layout (see `SeqLayout::new`).
pub fn seq_unit(pu: usize, pr: usize) -> usize {
    if pr > 1 { 2 * pr * pu } else { pu }
}
