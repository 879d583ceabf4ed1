//! The lines a training run ends with: loss, throughput, and rank 0's
//! measured peak memory by category beside `upipe plan`'s prediction.

use crate::backend::{Bytes, Category};
use crate::cli::metrics::{flops_text, step_ms};
use crate::plan::Prediction;
use crate::train::trainer::TrainSummary;

/// Prints the end of a run of `steps` steps predicted as `predicted`.
pub fn print(summary: &TrainSummary, predicted: &Prediction, flops_per_token: f64) {
    let losses: Vec<(u32, f64)> = summary.reports.iter().map(|r| (r.step, r.loss)).collect();
    if let Some(line) = loss_line(&losses) {
        println!("{line}");
    }
    // the first step includes one-time setup (kernel compilation, NCCL)
    let mut rates: Vec<f64> = summary
        .reports
        .iter()
        .skip(1)
        .map(|r| r.tokens_per_s)
        .collect();
    // the steps this process ran (a resumed run starts past 1)
    let from = summary.reports.get(1).map_or(0, |r| r.step);
    let to = summary.reports.last().map_or(0, |r| r.step);
    if !rates.is_empty() {
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        println!(
            "throughput: median {median:.0} tok/s over steps {from}..{to} ({} ranks), {} per rank (model FLOPs)",
            summary.ranks,
            flops_text(flops_per_token * median / 1e12 / summary.ranks.max(1) as f64)
        );
    }
    print_mixture(summary);
    memory_table(summary, predicted);
}

/// Steps in each of the windows the closing loss line averages: a tenth
/// of the run's, 1 to 10 (one step's loss is noise).
fn loss_window(steps: usize) -> usize {
    (steps / 10).clamp(1, 10)
}

/// `loss A -> B (mean of steps 1-10 -> mean of steps 91-100)`: the mean
/// loss over the first and the last window of the run's `(step, loss)`
/// (steps whose loss was not finite left out), or `None` for no step.
pub fn loss_line(losses: &[(u32, f64)]) -> Option<String> {
    let finite: Vec<(u32, f64)> = losses.iter().copied().filter(|l| l.1.is_finite()).collect();
    if finite.is_empty() {
        return None;
    }
    let w = loss_window(finite.len());
    let mean = |part: &[(u32, f64)]| part.iter().map(|l| l.1).sum::<f64>() / part.len() as f64;
    let span = |part: &[(u32, f64)]| match part {
        [one] => format!("step {}", one.0),
        _ => format!("mean of steps {}-{}", part[0].0, part[part.len() - 1].0),
    };
    let (head, tail) = (&finite[..w], &finite[finite.len() - w..]);
    Some(format!(
        "loss {:.4} -> {:.4} ({} -> {})",
        mean(head),
        mean(tail),
        span(head),
        span(tail)
    ))
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
    if let Some(pool) = summary.pool {
        println!(
            "device pool of rank 0: {} reserved at most ({} above the peak: fragmentation), \
             {} outside the pool (the CUDA context and libraries)",
            Bytes(pool.reserved_peak),
            Bytes(pool.reserved_peak.saturating_sub(measured)),
            Bytes(pool.outside)
        );
    }
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
    use super::{against_prediction, loss_line};

    #[test]
    fn the_loss_line_compares_windows_of_steps() {
        let losses: Vec<(u32, f64)> = (1..=100).map(|s| (s, f64::from(s))).collect();
        assert_eq!(
            loss_line(&losses).unwrap(),
            "loss 5.5000 -> 95.5000 (mean of steps 1-10 -> mean of steps 91-100)"
        );
        assert_eq!(
            loss_line(&[(51, 2.0), (52, 1.0)]).unwrap(),
            "loss 2.0000 -> 1.0000 (step 51 -> step 52)"
        );
        assert_eq!(loss_line(&[]), None);
    }

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
