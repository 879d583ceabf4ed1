//! What a training run shows while it runs: a progress bar on a terminal,
//! a line every few steps without one, or one JSON object per step
//! (`--json`); and the `--metrics` file beside any of them.

use crate::backend::Bytes;
use crate::cli::metrics::{MetricsFile, RunFacts, StepMetrics, flops_text};
use crate::error::Result;
use crate::train::trainer::StepReport;
use indicatif::{ProgressBar, ProgressStyle};

/// How steps are shown (only the lead rank shows them).
enum Show {
    Json,
    Lines { every: u32 },
    Bar(ProgressBar),
    Nothing,
}

/// Per-step output of one run.
pub struct Progress {
    show: Show,
    steps: u32,
    facts: RunFacts,
    metrics: Option<MetricsFile>,
}

impl Progress {
    /// `json` lines or a bar for `steps` steps (lines when there is no
    /// terminal, e.g. under a launcher); nothing when `lead` is false.
    pub fn new(json: bool, lead: bool, steps: u32, facts: RunFacts) -> Self {
        let show = match (lead, json) {
            (false, _) => Show::Nothing,
            (true, true) => Show::Json,
            (true, false) => {
                let bar = ProgressBar::new(steps as u64);
                if bar.is_hidden() {
                    Show::Lines {
                        every: (steps / 20).max(1),
                    }
                } else {
                    bar.set_style(
                        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                            .expect("valid template"),
                    );
                    Show::Bar(bar)
                }
            }
        };
        Progress {
            show,
            steps,
            facts,
            metrics: None,
        }
    }

    /// Also writes every step to `file`.
    pub fn with_metrics(mut self, file: MetricsFile) -> Self {
        self.metrics = Some(file);
        self
    }

    /// Shows step `r` (called on rank 0 after every step).
    pub fn on_step(&self, r: &StepReport) {
        let m = StepMetrics::of_step(r, &self.facts);
        if let Some(f) = &self.metrics {
            f.write(&m);
        }
        let msg = || {
            format!(
                "loss {:.4}  {:.0} tok/s  {}  peak {}{}",
                r.loss,
                r.tokens_per_s,
                flops_text(m.tflops),
                Bytes(r.peak_bytes),
                eval_text(r)
            )
        };
        match &self.show {
            Show::Json => println!("{}", m.to_line()),
            Show::Lines { every } => {
                if r.step.is_multiple_of(*every) || r.step == self.steps || r.eval.is_some() {
                    println!("step {}/{}  {}", r.step, self.steps, msg());
                }
            }
            Show::Bar(bar) => {
                bar.set_position(r.step as u64);
                bar.set_message(msg());
            }
            Show::Nothing => {}
        }
    }

    /// Ends the bar and closes the metrics file (its first write error).
    pub fn finish(self) -> Result<()> {
        if let Show::Bar(bar) = &self.show {
            bar.finish();
        }
        self.metrics.map_or(Ok(()), MetricsFile::finish)
    }
}

/// `  eval 2.8123 (by position 2.95 2.80 2.77 2.75)` after a step that
/// evaluated (`--eval-data`), else nothing.
fn eval_text(r: &StepReport) -> String {
    let Some(e) = &r.eval else {
        return String::new();
    };
    let buckets: Vec<String> = e
        .by_position
        .iter()
        .map(|b| format!("{:.2}", b.loss))
        .collect();
    match buckets.len() {
        0 | 1 => format!("  eval {:.4}", e.loss),
        _ => format!("  eval {:.4} (by position {})", e.loss, buckets.join(" ")),
    }
}
