//! What a training run shows while it runs: a progress bar on a terminal
//! (its clock ticking through long steps), a line every few steps without
//! one (plain text: no escape codes), or one JSON object per step
//! (`--json`); and the `--metrics` file and `--tensorboard` events beside
//! any of them. Every line and event carries the run's time, and the bar
//! and lines the time left.

use crate::backend::Bytes;
use crate::cli::metrics::{MetricsFile, RunClock, RunFacts, StepMetrics, flops_text};
use crate::cli::tensorboard::EventWriter;
use crate::error::Result;
use crate::train::trainer::StepReport;
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Mutex;
use std::time::Duration;

/// Without a terminal, a line at least this often (seconds) in long runs.
const LINE_EVERY_S: f64 = 60.0;

/// How steps are shown (only the lead rank shows them).
enum Show {
    Json,
    /// Every `every` steps, the last, and after [`LINE_EVERY_S`] without one.
    Lines {
        every: u32,
    },
    Bar(ProgressBar),
    Nothing,
}

/// Per-step output of one run.
pub struct Progress {
    show: Show,
    steps: u32,
    facts: RunFacts,
    clock: RunClock,
    /// Seconds since the start when step 1 ended and when a line was last
    /// printed.
    times: Mutex<(Option<f64>, f64)>,
    metrics: Option<MetricsFile>,
    tensorboard: Option<EventWriter>,
}

impl Progress {
    /// `json` lines or a bar for `steps` steps (lines when stderr is not a
    /// terminal, e.g. piped or under a launcher); nothing when `lead` is
    /// false. The run's clock starts now.
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
                    let template = "{spinner} {bar:30} {pos}/{len} [{elapsed_precise}] {msg}";
                    bar.set_style(ProgressStyle::with_template(template).expect("valid template"));
                    // the spinner and the clock move through a long step
                    bar.enable_steady_tick(Duration::from_secs(1));
                    Show::Bar(bar)
                }
            }
        };
        Progress {
            show,
            steps,
            facts,
            clock: RunClock::start(),
            times: Mutex::new((None, 0.0)),
            metrics: None,
            tensorboard: None,
        }
    }

    /// Also writes every step to `file`.
    pub fn with_metrics(mut self, file: MetricsFile) -> Self {
        self.metrics = Some(file);
        self
    }

    /// Also writes every step's scalars to a TensorBoard event file.
    pub fn with_tensorboard(mut self, events: EventWriter) -> Self {
        self.tensorboard = Some(events);
        self
    }

    /// Shows step `r` (called on rank 0 after every step).
    pub fn on_step(&self, r: &StepReport) {
        let m = StepMetrics::of_step(r, &self.facts).at(&self.clock);
        if let Some(f) = &self.metrics {
            f.write(&m);
        }
        if let Some(t) = &self.tensorboard {
            t.write(&m);
        }
        let elapsed = m.elapsed_s.unwrap_or(0.0);
        let mut times = self.times.lock().expect("progress poisoned");
        let first_end = *times.0.get_or_insert(elapsed);
        let left = eta_s(r.step, self.steps, elapsed, first_end);
        let msg = format!(
            "loss {:.4}  {:.0} tok/s  {}  peak {}{}  ETA {}",
            r.loss,
            r.tokens_per_s,
            flops_text(m.tflops),
            Bytes(r.peak_bytes),
            eval_text(r),
            duration_text(left)
        );
        match &self.show {
            Show::Json => println!("{}", m.to_line()),
            Show::Lines { every } => {
                let due = r.step.is_multiple_of(*every)
                    || r.step == self.steps
                    || r.eval.is_some()
                    || r.retrieval.is_some()
                    || elapsed - times.1 >= LINE_EVERY_S;
                if due {
                    times.1 = elapsed;
                    let (step, steps) = (r.step, self.steps);
                    let took = duration_text(elapsed);
                    println!("step {step}/{steps}  {msg}  elapsed {took}");
                }
            }
            Show::Bar(bar) => {
                bar.set_position(r.step as u64);
                bar.set_message(msg);
            }
            Show::Nothing => {}
        }
    }

    /// Ends the bar and closes the metrics and event files (their first
    /// write error).
    pub fn finish(self) -> Result<()> {
        if let Show::Bar(bar) = &self.show {
            bar.finish();
        }
        if let Some(t) = self.tensorboard {
            t.finish()?;
        }
        self.metrics.map_or(Ok(()), MetricsFile::finish)
    }
}

/// `  eval 2.8123 (by position 2.95 2.80 2.77 2.75)` after a step that
/// evaluated (`--eval-data`), else nothing.
fn eval_text(r: &StepReport) -> String {
    let retrieval = r.retrieval.as_ref().map_or(String::new(), |p| {
        format!(
            "  {} {}/{} ({:.0} %, answer log-likelihood {:.3})",
            p.task,
            p.passed,
            p.trials,
            100.0 * p.accuracy,
            p.mean_logprob
        )
    });
    let Some(e) = &r.eval else {
        return retrieval;
    };
    let buckets: Vec<String> = e
        .by_position
        .iter()
        .map(|b| format!("{:.2}", b.loss))
        .collect();
    let loss = match buckets.len() {
        0 | 1 => format!("  eval {:.4}", e.loss),
        _ => format!("  eval {:.4} (by position {})", e.loss, buckets.join(" ")),
    };
    loss + &retrieval
}

/// Seconds left after step `step` of `steps`, `elapsed` seconds into the
/// run, step 1 having ended at `first_end`: later steps at their mean pace
/// (step 1 holds one-time setup: kernel compilation, NCCL), or step 1's
/// pace while it is the only one.
pub fn eta_s(step: u32, steps: u32, elapsed: f64, first_end: f64) -> f64 {
    let left = steps.saturating_sub(step) as f64;
    let per_step = match step {
        0 => return f64::NAN,
        1 => first_end,
        s => (elapsed - first_end) / (s - 1) as f64,
    };
    left * per_step.max(0.0)
}

/// `45s`, `12m05s`, `3h07m`; `?` when unknown.
pub fn duration_text(s: f64) -> String {
    if !s.is_finite() || s < 0.0 {
        return "?".into();
    }
    let s = s.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_left_is_the_mean_pace_after_the_first_step() {
        // step 1 took 10 s (setup), steps 2..=5 one second each
        assert_eq!(eta_s(5, 10, 14.0, 10.0), 5.0);
        assert_eq!(eta_s(1, 10, 10.0, 10.0), 90.0);
        assert_eq!(eta_s(10, 10, 19.0, 10.0), 0.0);
        assert!(eta_s(0, 10, 0.0, 0.0).is_nan());
    }

    #[test]
    fn durations_read_in_the_largest_two_units() {
        assert_eq!(duration_text(0.4), "0s");
        assert_eq!(duration_text(59.0), "59s");
        assert_eq!(duration_text(725.0), "12m05s");
        assert_eq!(duration_text(3.0 * 3600.0 + 7.0 * 60.0 + 20.0), "3h07m");
        assert_eq!(duration_text(f64::NAN), "?");
    }
}
