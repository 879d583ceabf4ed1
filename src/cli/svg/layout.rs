//! The arithmetic of the charts' layout: axis ticks at round values with
//! labels that differ, the width text takes, legends that flow into rows
//! without overlapping, and the binary unit (KiB, MiB, GiB) bytes are
//! drawn in.

/// An axis: its range (the outer ticks) and its ticks with their labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub ticks: Vec<f64>,
    pub labels: Vec<String>,
}

impl Axis {
    /// Where `v` falls on an axis drawn from `from` (at `lo`) to `to` (at `hi`).
    pub fn place(&self, v: f64, from: f64, to: f64) -> f64 {
        from + (to - from) * (v - self.lo) / (self.hi - self.lo)
    }
}

/// An axis over the finite values of `values` with at most `max_ticks`
/// ticks (at least 2), spaced 1, 2 or 5 times a power of ten (whole numbers
/// when `integer`), the range widened to the outer ticks. A single value
/// gets room around it; no value gives 0..1.
pub fn axis(values: impl Iterator<Item = f64>, max_ticks: usize, integer: bool) -> Axis {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    let (lo, hi) = match (lo.is_finite(), hi - lo) {
        (false, _) => (0.0, 1.0),
        (true, d) if d <= 1e-9 * lo.abs().max(f64::MIN_POSITIVE) => {
            let pad = match (integer, lo == 0.0) {
                (true, _) | (false, true) => 1.0,
                (false, false) => lo.abs() * 0.1,
            };
            // a single step 0 (an evaluation's line) keeps its axis at 0 and up
            let floor = if integer && lo >= 0.0 { 0.0 } else { f64::MIN };
            ((lo - pad).max(floor), hi + pad)
        }
        _ => (lo, hi),
    };
    let intervals = max_ticks.max(2) - 1;
    let step = tick_step((hi - lo) / intervals as f64, integer);
    // a value a rounding error past a tick is on it
    let first = (lo / step + 1e-9).floor();
    let last = (hi / step - 1e-9).ceil();
    let n = (last - first).round().max(1.0) as usize;
    let ticks: Vec<f64> = (0..=n).map(|i| (first + i as f64) * step).collect();
    let labels = tick_labels(&ticks, step);
    Axis {
        lo: ticks[0],
        hi: ticks[n],
        ticks,
        labels,
    }
}

/// The smallest of 1, 2, 5 times a power of ten at least `raw` (at least 1
/// when `integer`).
fn tick_step(raw: f64, integer: bool) -> f64 {
    let raw = if integer { raw.max(1.0) } else { raw };
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-12))
        .unwrap_or(10.0 * mag)
}

/// Labels of `ticks` spaced `step`: in K, M or G past ten thousand, with
/// the decimals the step needs, so that no two are alike.
fn tick_labels(ticks: &[f64], step: f64) -> Vec<String> {
    let top = ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
    let (div, suffix) = match top {
        t if t >= 1e9 => (1e9, "G"),
        t if t >= 1e6 => (1e6, "M"),
        t if t >= 1e4 => (1e3, "K"),
        _ => (1.0, ""),
    };
    let decimals = (-(step / div).log10() - 1e-9).ceil().clamp(0.0, 15.0) as usize;
    ticks
        .iter()
        .map(|t| {
            let text = format!("{:.*}", decimals, t / div);
            // no "-0" or "-0.00"
            let zero = text
                .trim_start_matches('-')
                .chars()
                .all(|c| c == '0' || c == '.');
            match zero {
                true => "0".into(),
                false => format!("{text}{suffix}"),
            }
        })
        .collect()
}

/// The width `text` takes at font size `size` (sans-serif; an upper
/// estimate of the average glyph).
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.62
}

/// A rectangle, in pixels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rect {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
}

impl Rect {
    /// Whether the two share any area.
    pub fn overlaps(&self, o: &Rect) -> bool {
        self.x < o.x + o.w && o.x < self.x + self.w && self.y < o.y + o.h && o.y < self.y + self.h
    }
}

/// Side of a legend's colour swatch, and the gaps after it and after a name.
pub const SWATCH: f64 = 10.0;
const SWATCH_GAP: f64 = 4.0;
const ITEM_GAP: f64 = 14.0;

/// Legend entries (a swatch and a name each, at font `size`) flowed into
/// rows from `(x, y)` within width `w`: each entry's box, in order. An
/// entry wider than `w` takes a row of its own.
pub fn legend(names: &[String], x: f64, y: f64, w: f64, size: f64) -> Vec<Rect> {
    let row_h = size.max(SWATCH) + 4.0;
    let (mut cx, mut cy) = (x, y);
    let mut boxes = Vec::with_capacity(names.len());
    for name in names {
        let bw = SWATCH + SWATCH_GAP + text_width(name, size);
        if cx > x && cx + bw > x + w {
            cx = x;
            cy += row_h;
        }
        boxes.push(Rect {
            x: cx,
            y: cy,
            w: bw,
            h: row_h - 4.0,
        });
        cx += bw + ITEM_GAP;
    }
    boxes
}

/// The height of the legend [`legend`] lays out (0 for none).
pub fn legend_height(boxes: &[Rect]) -> f64 {
    let top = boxes.iter().map(|b| b.y).fold(f64::INFINITY, f64::min);
    let bottom = boxes.iter().map(|b| b.y + b.h).fold(0.0, f64::max);
    if boxes.is_empty() { 0.0 } else { bottom - top }
}

/// The binary unit to draw bytes up to `max` in: `(bytes per unit, name)`,
/// as the terminal's tables choose them.
pub fn byte_unit(max: f64) -> (f64, &'static str) {
    const K: f64 = 1024.0;
    match max {
        m if m >= K * K * K => (K * K * K, "GiB"),
        m if m >= K * K => (K * K, "MiB"),
        m if m >= K => (K, "KiB"),
        _ => (1.0, "B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_axis(a: &Axis, lo: f64, hi: f64, max_ticks: usize, integer: bool) {
        let n = a.ticks.len();
        assert!((2..=max_ticks.max(2) + 2).contains(&n), "{n} ticks: {a:?}");
        let step = a.ticks[1] - a.ticks[0];
        let slack = 1e-6 * step;
        assert!(
            a.lo <= lo + slack && a.hi >= hi - slack,
            "{a:?} covers {lo}..{hi}"
        );
        assert!(a.ticks.windows(2).all(|w| w[1] > w[0]), "{a:?}");
        let mut labels = a.labels.clone();
        labels.dedup();
        assert_eq!(labels.len(), n, "distinct labels: {a:?}");
        let mantissa = step / 10f64.powf(step.log10().floor());
        assert!(
            [1.0, 2.0, 5.0, 10.0]
                .iter()
                .any(|m| (m - mantissa).abs() < 1e-6),
            "step {step}: {a:?}"
        );
        if integer {
            assert!(a.ticks.iter().all(|t| t.fract() == 0.0), "{a:?}");
            assert!(
                a.labels
                    .iter()
                    .all(|l| !l.contains('.') || l.ends_with(['K', 'M', 'G']))
            );
        }
        assert!(a.labels.iter().all(|l| l.len() <= 12), "{a:?}");
    }

    #[test]
    fn the_axes_the_report_got_wrong() {
        // a TFLOP/s axis once read 0.001 four times
        let a = axis([0.0011, 0.0013, 0.00125].into_iter(), 5, false);
        assert_eq!(
            a.labels,
            ["0.00110", "0.00115", "0.00120", "0.00125", "0.00130"]
        );
        // a step axis of one step once read 1.000
        let a = axis([1.0].into_iter(), 6, true);
        assert_eq!(a.labels, ["0", "1", "2"]);
        let a = axis([0.0].into_iter(), 6, true);
        assert_eq!(a.labels, ["0", "1"]);
        let a = axis((1..=100).map(f64::from), 6, true);
        assert_eq!(a.labels, ["0", "20", "40", "60", "80", "100"]);
        let a = axis([2.5e6, 9.9e6].into_iter(), 5, false);
        assert_eq!(a.labels, ["2M", "4M", "6M", "8M", "10M"]);
        let a = axis([-0.3, 0.2].into_iter(), 6, false);
        assert_eq!(a.labels, ["-0.3", "-0.2", "-0.1", "0", "0.1", "0.2"]);
        assert_eq!(
            axis(std::iter::empty(), 5, false).labels.first().unwrap(),
            "0"
        );
    }

    proptest! {
        #[test]
        fn ticks_are_round_distinct_and_cover_the_values(
            lo in -1e12f64..1e12,
            span_exp in -3.0f64..3.0,
            max_ticks in 2usize..9,
            integer: bool,
        ) {
            let lo = if integer { lo.round() } else { lo };
            // spans from a thousandth of the values' size to a thousand times it
            let span = lo.abs().max(1.0) * 10f64.powf(span_exp);
            let hi = if integer { (lo + span).round() } else { lo + span };
            let a = axis([lo, hi].into_iter(), max_ticks, integer);
            check_axis(&a, lo, hi, max_ticks, integer);
        }

        #[test]
        fn legend_boxes_never_overlap_and_stay_in_their_width(
            names in prop::collection::vec("[a-z_]{1,24}", 1..12),
            w in 120f64..900.0,
            size in 8f64..14.0,
        ) {
            let names: Vec<String> = names;
            let boxes = legend(&names, 10.0, 20.0, w, size);
            prop_assert_eq!(boxes.len(), names.len());
            for (i, a) in boxes.iter().enumerate() {
                let fits = a.x + a.w <= 10.0 + w + 1e-9 || a.x == 10.0;
                prop_assert!(fits, "{:?} past the width {}", a, w);
                for b in &boxes[i + 1..] {
                    prop_assert!(!a.overlaps(b), "{:?} and {:?}", a, b);
                }
            }
        }
    }

    #[test]
    fn bytes_take_the_unit_of_the_largest() {
        assert_eq!(byte_unit(3.0 * (1u64 << 30) as f64).1, "GiB");
        assert_eq!(byte_unit(2.5e6).1, "MiB");
        assert_eq!(byte_unit(1000.0).1, "B");
    }
}
