//! The lines a training run ends with: loss, throughput, and rank 0's
//! measured peak memory by category beside `upipe plan`'s prediction.

use crate::backend::{Bytes, Category};
use crate::cli::metrics::{flops_text, step_ms};
use crate::plan::Prediction;
use crate::train::trainer::TrainSummary;

/// Prints the end of a run of `steps` steps predicted as `predicted`.
pub fn print(summary: &TrainSummary, predicted: &Prediction, steps: u32, flops_per_token: f64) {
    let first = summary.reports.first().map_or(f64::NAN, |r| r.loss);
    let last = summary.reports.last().map_or(f64::NAN, |r| r.loss);
    println!("loss {first:.4} -> {last:.4}");
    // the first step includes one-time setup (kernel compilation, NCCL)
    let mut rates: Vec<f64> = summary
        .reports
        .iter()
        .skip(1)
        .map(|r| r.tokens_per_s)
        .collect();
    if !rates.is_empty() {
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        println!(
            "throughput: median {median:.0} tok/s over steps 2..{steps} ({} ranks), {} per rank (model FLOPs)",
            summary.ranks,
            flops_text(flops_per_token * median / 1e12 / summary.ranks.max(1) as f64)
        );
    }
    print_mixture(summary);
    memory_table(summary, predicted);
}

/// A mixture's realised proportions against its weights (rank 0's data
/// replica's windows over the run).
fn print_mixture(summary: &TrainSummary) {
    let Some(shares) = summary.reports.last().and_then(|r| r.mixture.as_ref()) else {
        return;
    };
    let parts: Vec<String> = shares
        .iter()
        .map(|s| {
            format!(
                "{} {:.3} ({} windows, weight {:.3})",
                s.data, s.share, s.windows, s.weight
            )
        })
        .collect();
    println!("data mixture drawn: {}", parts.join(", "));
}

/// Rank 0's time of the last step by op class (`--profile`), on stdout, or
/// on stderr beside `--json` lines.
pub fn print_profile(summary: &TrainSummary, json: bool) {
    let Some((r, p)) = summary
        .reports
        .last()
        .and_then(|r| r.profile.map(|p| (r, p)))
    else {
        return;
    };
    let wall = step_ms(r);
    let text = format!(
        "time of step {} on rank 0 by op class (wall {wall:.2} ms; classes on other streams overlap compute):\n{}",
        r.step,
        p.table(wall)
    );
    if json {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
}

/// Rank 0's peak against the prediction, then by category.
fn memory_table(summary: &TrainSummary, predicted: &Prediction) {
    let measured = summary.memory.peak;
    println!(
        "peak of rank 0: predicted {} (upipe plan), measured {} ({})",
        Bytes(predicted.peak),
        Bytes(measured),
        against_prediction(measured, predicted.peak)
    );
    println!("memory of rank 0 (peak {}):", Bytes(measured));
    println!(
        "  {:<14} {:>12} {:>12} {:>12}",
        "category", "at peak", "predicted", "now"
    );
    for (cat, at_peak) in &summary.memory.at_peak_by_category {
        let now = summary
            .memory
            .current_by_category
            .iter()
            .find(|(c, _)| c == cat)
            .map_or(0, |x| x.1);
        let peak = if *cat == Category::Offload {
            summary.memory.host_peak
        } else {
            *at_peak
        };
        println!(
            "  {:<14} {:>12} {:>12} {:>12}",
            cat.name(),
            Bytes(peak).to_string(),
            Bytes(predicted.at(*cat)).to_string(),
            Bytes(now).to_string()
        );
    }
}

/// The measured peak beside the predicted one, in words and percent of the
/// prediction: `exact`, `2.10% above the prediction`, `0.52% below`.
fn against_prediction(measured: usize, predicted: usize) -> String {
    if measured == predicted {
        return "exact".into();
    }
    let off = 100.0 * (measured as f64 - predicted as f64).abs() / predicted.max(1) as f64;
    let side = if measured > predicted {
        "above"
    } else {
        "below"
    };
    format!("measured {off:.2}% {side} the prediction")
}

#[cfg(test)]
mod tests {
    use super::against_prediction;

    #[test]
    fn the_difference_says_which_side_of_the_prediction_it_is() {
        assert_eq!(against_prediction(100, 100), "exact");
        assert_eq!(
            against_prediction(110, 100),
            "measured 10.00% above the prediction"
        );
        assert_eq!(
            against_prediction(75, 100),
            "measured 25.00% below the prediction"
        );
    }
}
