//! `upipe report FILE.jsonl [--out report.svg]`: a metrics file
//! (`train --metrics`, `eval --metrics`) as one SVG: loss (and the
//! held-out loss of the steps that evaluated), throughput, model TFLOP/s
//! per rank and the learning rate by step, and rank 0's memory by
//! category at its peak, measured beside `upipe plan`'s prediction.

use crate::backend::Category;
use crate::cli::metrics::{self, StepMetrics};
use crate::cli::svg::{Area, Bar, Series, Svg, line_chart, stacked_bars};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Flags of `upipe report`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReportArgs {
    /// A metrics file written by `upipe train --metrics` (JSON Lines).
    pub metrics: PathBuf,
    /// Where the SVG goes (default: the metrics file with `.svg`).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The curves a report draws, one `<polyline>` each, in order (`eval loss`
/// only where the metrics hold evaluations: `train --eval-data`).
pub const SERIES: [&str; 5] = [
    "loss",
    "eval loss",
    "tokens/s",
    "model TFLOP/s per rank",
    "learning rate",
];

pub fn run(a: ReportArgs) -> Result<i32> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| a.metrics.with_extension("svg"));
    let input = crate::output_path::Input {
        flag: "the metrics file",
        path: &a.metrics,
    };
    crate::output_path::check_outputs(
        &[crate::output_path::Output::file("--out", &out)],
        &[input],
    )?;
    let lines = metrics::read(&a.metrics)?;
    let title = a.metrics.display().to_string();
    std::fs::write(&out, draw(&lines, &title))
        .map_err(|e| Error::io(format!("writing {}", out.display()), e))?;
    println!("{} steps -> {}", lines.len(), out.display());
    Ok(0)
}

/// The report of `lines` as an SVG document.
pub fn draw(lines: &[StepMetrics], title: &str) -> String {
    let mut svg = Svg::new(1000.0, 1040.0);
    svg.text(
        500.0,
        24.0,
        16.0,
        "middle",
        &format!("upipe report: {title}"),
    );
    let curve = |name, f: &dyn Fn(&StepMetrics) -> f64| Series {
        name,
        points: lines.iter().map(|m| (m.step as f64, f(m))).collect(),
    };
    let area = |x, y| Area {
        x,
        y,
        w: 380.0,
        h: 220.0,
    };
    // below one TFLOP/s (small models, the CPU), GFLOP/s
    let top = lines.iter().map(|m| m.tflops_per_rank).fold(0.0, f64::max);
    let (flops_scale, flops_title) = match top < 1.0 {
        true => (1e3, "model GFLOP/s per rank"),
        false => (1.0, "model TFLOP/s per rank"),
    };
    // the held-out loss of the steps that evaluated, beside the training loss
    let eval = Series {
        name: SERIES[1],
        points: (lines.iter())
            .filter_map(|m| m.eval.as_ref().map(|e| (m.step as f64, e.loss)))
            .collect(),
    };
    let (loss_title, losses) = match eval.points.is_empty() {
        true => (SERIES[0], vec![curve(SERIES[0], &|m| m.loss)]),
        false => (
            "loss (training) and eval loss (held-out)",
            vec![curve(SERIES[0], &|m| m.loss), eval],
        ),
    };
    let steps = || lines.iter().filter(|m| m.lr.is_some());
    let lr = Series {
        name: SERIES[4],
        points: steps()
            .map(|m| (m.step as f64, m.lr.unwrap_or(0.0)))
            .collect(),
    };
    let charts = [
        (area(80.0, 60.0), loss_title, losses),
        (
            area(560.0, 60.0),
            SERIES[2],
            vec![curve(SERIES[2], &|m| m.tokens_per_s)],
        ),
        (
            area(80.0, 380.0),
            flops_title,
            vec![curve(SERIES[3], &|m| m.tflops_per_rank * flops_scale)],
        ),
        (area(80.0, 700.0), SERIES[4], vec![lr]),
    ];
    for (at, title, series) in charts {
        line_chart(&mut svg, at, title, ("step", true), &series);
    }
    if let Some(peak) = lines.iter().max_by_key(|m| m.peak_bytes) {
        let mut bars = vec![bar("measured", &peak.peak_by_category)];
        if let Some(p) = &peak.predicted_by_category {
            bars.push(bar("predicted", p));
        }
        let at = Area {
            x: 560.0,
            y: 380.0,
            w: 400.0,
            h: 220.0,
        };
        let title = format!(
            "memory of rank 0 at its peak (step {}), {{unit}}",
            peak.step
        );
        stacked_bars(&mut svg, at, &title, &bars, None);
    }
    svg.finish()
}

/// A bar of bytes by category, in [`Category::ALL`] order.
fn bar(label: &str, bytes: &BTreeMap<String, usize>) -> Bar {
    Bar {
        label: label.into(),
        segments: Category::ALL
            .iter()
            .map(|c| {
                let b = bytes.get(c.name()).copied().unwrap_or(0);
                (c.name().to_string(), b as f64)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::svg::layout::{Rect, text_width};

    fn line(step: u32, loss: f64) -> StepMetrics {
        let cats = |scale| {
            Category::ALL
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name().to_string(), scale * (i + 1)))
                .collect()
        };
        StepMetrics {
            step,
            time_unix_s: None,
            elapsed_s: None,
            loss,
            lr: Some(1e-3),
            skipped_steps: None,
            grad_norm: Some(1.0),
            tokens: 256,
            counted_tokens: None,
            attn_flop_fraction: None,
            tokens_per_s: 1000.0 + step as f64,
            attention_kernel: None,
            optim_state: None,
            precision: None,
            tflops: 1.0,
            tflops_per_rank: 0.25,
            ranks: 4,
            peak_bytes: 1000 * step as usize,
            peak_by_category: cats(step as usize),
            predicted_peak_bytes: Some(5000),
            predicted_by_category: Some(cats(1)),
            profile: None,
            eval: None,
            retrieval: None,
            mixture: None,
            skipped_windows: None,
        }
    }

    #[test]
    fn one_curve_per_series_and_two_bars_at_the_peak() {
        let lines: Vec<_> = (1..=5).map(|s| line(s, 5.0 - s as f64 * 0.5)).collect();
        let svg = draw(&lines, "m.jsonl");
        // no evaluation in the metrics: every curve but eval loss
        assert_eq!(svg.matches("<polyline").count(), SERIES.len() - 1);
        assert!(svg.contains("<title>learning rate</title>"));
        // every category of both bars (measured, predicted) is a rect with a tooltip
        assert_eq!(
            svg.matches("<title>measured: ").count(),
            Category::ALL.len()
        );
        assert_eq!(
            svg.matches("<title>predicted: ").count(),
            Category::ALL.len()
        );
        assert!(
            svg.contains("at its peak (step 5)"),
            "the peak is the last step"
        );
        // five points on the loss curve
        let loss = svg
            .lines()
            .find(|l| l.contains("<title>loss</title>"))
            .unwrap();
        let points = loss.split('"').nth(1).unwrap();
        assert_eq!(points.split(' ').count(), 5);
    }

    #[test]
    fn a_diverged_step_leaves_its_point_out() {
        let mut lines: Vec<_> = (1..=3).map(|s| line(s, 2.0)).collect();
        lines[1].loss = f64::NAN;
        let svg = draw(&lines, "m.jsonl");
        let loss = svg
            .lines()
            .find(|l| l.contains("<title>loss</title>"))
            .unwrap();
        assert_eq!(loss.split('"').nth(1).unwrap().split(' ').count(), 2);
        assert!(!svg.contains("NaN"));
    }

    /// The boxes of a document's texts, by their anchor and an upper
    /// estimate of their width.
    fn text_boxes(svg: &str) -> Vec<(String, Rect)> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        let num = |n: &roxmltree::Node, a| n.attribute(a).unwrap().parse::<f64>().unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| {
                let (x, y, size) = (num(&n, "x"), num(&n, "y"), num(&n, "font-size"));
                let text = n.text().unwrap_or("").to_string();
                let w = text_width(&text, size);
                let left = match n.attribute("text-anchor") {
                    Some("middle") => x - w / 2.0,
                    Some("end") => x - w,
                    _ => x,
                };
                let r = Rect {
                    x: left,
                    y: y - 0.8 * size,
                    w,
                    h: size,
                };
                (text, r)
            })
            .collect()
    }

    #[test]
    fn no_two_labels_of_a_report_overlap() {
        // a long run with wide values and a flat, tiny TFLOP/s curve
        let lines: Vec<_> = (1..=2000)
            .map(|s| {
                let mut l = line(s, 11.0 - s as f64 * 1e-3);
                l.tokens_per_s = 1.2e6 + s as f64;
                l.tflops_per_rank = 0.0012;
                l
            })
            .collect();
        let svg = draw(&lines, "runs/a-long-name/metrics.jsonl");
        let boxes = text_boxes(&svg);
        assert!(boxes.len() > 40, "{}", boxes.len());
        for (i, (a, ra)) in boxes.iter().enumerate() {
            assert!(ra.x >= 0.0 && ra.x + ra.w <= 1000.0, "{a} leaves the page");
            for (b, rb) in &boxes[i + 1..] {
                assert!(!ra.overlaps(rb), "{a:?} {ra:?} overlaps {b:?} {rb:?}");
            }
        }
        // no axis repeats a label
        let labels: Vec<&str> = boxes.iter().map(|b| b.0.as_str()).collect();
        assert!(
            labels.contains(&"2000"),
            "the step axis ends at the last step"
        );
        assert!(labels.contains(&"1.2005M"), "{labels:?}");
    }
}
