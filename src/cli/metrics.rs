//! `--metrics FILE.jsonl`: one JSON object per training step (or one per
//! evaluation), written as the run goes; `--json` prints the same objects,
//! and `upipe report` draws them.

use crate::backend::Category;
use crate::error::{Error, Result};
use crate::plan::Prediction;
use crate::train::eval::EvalReport;
use crate::train::trainer::StepReport;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// One line of a metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u32,
    /// When the line was written: seconds since 1970-01-01 UTC (the run's
    /// start by the wall clock plus [`StepMetrics::elapsed_s`], so it never
    /// goes back within a run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_unix_s: Option<f64>,
    /// Seconds since the run started (a monotonic clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_s: Option<f64>,
    /// Mean next-token cross-entropy over the step's tokens (nats).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Learning rate of the step (none for an evaluation).
    pub lr: Option<f64>,
    /// Steps of the run so far whose loss or gradient norm was not finite,
    /// so not applied (`--skip-nonfinite`; none for an evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u32>,
    /// Global gradient norm before clipping (none for an evaluation).
    pub grad_norm: Option<f64>,
    /// Tokens of the step (every sequence of every data replica).
    pub tokens: usize,
    /// Targets counted toward the loss: `tokens` less the masked ones
    /// (document ends, padding, SFT prompts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted_tokens: Option<usize>,
    /// The share of the `seq × seq` attention scores the step's masks let
    /// the kernels compute (½ for causal windows of one document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_flop_fraction: Option<f64>,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    /// The attention kernel the run decided on before it planned
    /// (`cudnn 9.14.0`, `flash`, `naive`; none on the CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_kernel: Option<String>,
    /// How AdamW keeps its state when it is not exact F32
    /// (`moments 8bit, master none`; `--optim-state`, `--master-weights`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optim_state: Option<String>,
    /// What the linear layers compute in when not the default bf16
    /// (`fp8`; `--precision`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// Model TFLOP/s of the whole run (`model::flops`: 6·N plus causal
    /// attention per trained token; forward only for an evaluation).
    #[serde(deserialize_with = "nan_if_null")]
    pub tflops: f64,
    /// `tflops` over the ranks.
    #[serde(deserialize_with = "nan_if_null")]
    pub tflops_per_rank: f64,
    pub ranks: usize,
    /// Rank 0's device peak so far (ledger bytes).
    pub peak_bytes: usize,
    /// Rank 0's bytes by category at that peak (`offload_host`: its host peak).
    pub peak_by_category: BTreeMap<String, usize>,
    /// What `upipe plan` predicts for rank 0's peak (none when it cannot).
    pub predicted_peak_bytes: Option<usize>,
    pub predicted_by_category: Option<BTreeMap<String, usize>>,
    /// Rank 0's time of the step by op class, ms (`--profile`):
    /// `gemm_ms`, `attn_fwd_ms`, ..., `idle_ms`, and the step's `wall_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<BTreeMap<String, f64>>,
    /// The held-out evaluation after this step (`train --eval-data`,
    /// `--eval-every`): its `loss`, `by_position`, as `upipe eval` prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalReport>,
    /// The retrieval trials after this step (`train --eval-task`): the
    /// task, `accuracy`, `mean_logprob`, `passed` of `trials`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retrieval: Option<crate::train::retrieval::RetrievalPoint>,
    /// A mixture of corpora's realised proportions so far (`--data
    /// a.u32:0.7,b.u32:0.3`; rank 0's data replica): each corpus's
    /// `data`, `weight`, `windows` drawn and `share` of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixture: Option<Vec<crate::data::mixture::MixShare>>,
    /// Windows with no counted target passed over so far (rank 0's data
    /// replica; an SFT prompt longer than `--seq`); absent while none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_windows: Option<u64>,
}

/// serde_json writes a NaN as `null`: read it back as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// What every line of one run shares.
#[derive(Debug, Clone)]
pub struct RunFacts {
    /// Model FLOPs per token (`model::flops`) of causal windows.
    pub flops_per_token: f64,
    /// The attention's part of `flops_per_token`, which a step's masks
    /// scale (`StepReport::attn_flop_fraction` over the causal ½).
    pub attention_flops_per_token: f64,
    pub ranks: usize,
    pub predicted: Option<Prediction>,
    /// The run's attention kernel, as the run header names it (GPUs).
    pub attention_kernel: Option<String>,
    /// The optimizer's state format, when not exact F32.
    pub optim_state: Option<String>,
    /// `--precision`, when not bf16.
    pub precision: Option<String>,
}

/// A run's clock: its start by the wall clock, and a monotonic clock
/// since, so that the times it gives never go back (a wall clock may).
#[derive(Debug, Clone, Copy)]
pub struct RunClock {
    start: Instant,
    start_unix: f64,
}

impl RunClock {
    /// The clock of a run starting now.
    pub fn start() -> Self {
        RunClock {
            start: Instant::now(),
            start_unix: unix_now(),
        }
    }

    /// Seconds since the run started.
    pub fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// Seconds since 1970-01-01 UTC, by the wall clock.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `bytes` by category name, with `offload_host` taken from `host`.
pub fn by_category(bytes: &[(Category, usize)], host: usize) -> BTreeMap<String, usize> {
    Category::ALL
        .iter()
        .map(|&c| {
            let b = if c == Category::Offload {
                host
            } else {
                bytes.iter().find(|(x, _)| *x == c).map_or(0, |x| x.1)
            };
            (c.name().to_string(), b)
        })
        .collect()
}

impl StepMetrics {
    /// The line of training step `r`.
    pub fn of_step(r: &StepReport, facts: &RunFacts) -> Self {
        // only the attention the step's masks let the kernels compute
        let unmasked = facts.attention_flops_per_token * (1.0 - r.attn_flop_fraction / 0.5);
        let tflops = (facts.flops_per_token - unmasked) * r.tokens_per_s / 1e12;
        StepMetrics {
            step: r.step,
            time_unix_s: None,
            elapsed_s: None,
            loss: r.loss,
            lr: Some(r.lr as f64),
            skipped_steps: Some(r.skipped),
            grad_norm: Some(r.grad_norm),
            tokens: r.tokens,
            counted_tokens: Some(r.counted_tokens),
            attn_flop_fraction: Some(r.attn_flop_fraction),
            tokens_per_s: r.tokens_per_s,
            attention_kernel: facts.attention_kernel.clone(),
            optim_state: facts.optim_state.clone(),
            precision: facts.precision.clone(),
            tflops,
            tflops_per_rank: tflops / facts.ranks.max(1) as f64,
            ranks: facts.ranks,
            peak_bytes: r.peak_bytes,
            peak_by_category: by_category(&r.at_peak_by_category, r.host_peak_bytes),
            predicted_peak_bytes: facts.predicted.as_ref().map(|p| p.peak),
            predicted_by_category: facts
                .predicted
                .as_ref()
                .map(|p| by_category(&p.at_peak, p.host_peak)),
            profile: r.profile.map(|p| {
                let mut m = p.to_map();
                m.insert("wall_ms".into(), step_ms(r));
                m
            }),
            eval: r.eval.clone(),
            retrieval: r.retrieval.clone(),
            mixture: r.mixture.clone(),
            skipped_windows: (r.skipped_windows > 0).then_some(r.skipped_windows),
        }
    }

    /// The line stamped with the time on `clock`.
    pub fn at(mut self, clock: &RunClock) -> Self {
        let elapsed = clock.start.elapsed().as_secs_f64();
        self.time_unix_s = Some(clock.start_unix + elapsed);
        self.elapsed_s = Some(elapsed);
        self
    }

    /// One JSON line.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("metrics serialize")
    }
}

/// The wall time of step `r`, ms.
pub fn step_ms(r: &StepReport) -> f64 {
    1e3 * r.tokens as f64 / r.tokens_per_s
}

/// Model FLOP/s for people: TFLOP/s, or GFLOP/s below one TFLOP/s.
pub fn flops_text(tflops: f64) -> String {
    if tflops >= 1.0 {
        format!("{tflops:.1} TFLOP/s")
    } else {
        format!("{:.1} GFLOP/s", tflops * 1e3)
    }
}

/// A metrics file being written: one line per call, flushed, so a run that
/// stops leaves every finished step behind. Write errors are kept and
/// returned by [`MetricsFile::finish`] (steps report through a callback
/// that cannot fail).
pub struct MetricsFile {
    path: PathBuf,
    out: Mutex<(std::fs::File, Option<std::io::Error>)>,
}

impl MetricsFile {
    /// Creates (or truncates) `path`; a missing parent directory is created.
    pub fn create(path: &Path) -> Result<Self> {
        Self::open(path, false)
    }

    /// Opens `path` to add lines after those it holds (a resumed run keeps
    /// the steps before its restart), creating it when missing.
    pub fn append(path: &Path) -> Result<Self> {
        Self::open(path, true)
    }

    fn open(path: &Path, append: bool) -> Result<Self> {
        let what = || format!("creating --metrics {}", path.display());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(what(), e))?;
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| Error::io(what(), e))?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            out: Mutex::new((file, None)),
        })
    }

    /// Appends one line.
    pub fn write(&self, m: &StepMetrics) {
        let mut out = self.out.lock().expect("metrics file poisoned");
        if out.1.is_none() {
            let line = m.to_line() + "\n";
            if let Err(e) = out.0.write_all(line.as_bytes()) {
                out.1 = Some(e);
            }
        }
    }

    /// The first write error, if any.
    pub fn finish(self) -> Result<()> {
        let (_, err) = self.out.into_inner().expect("metrics file poisoned");
        match err {
            Some(e) => Err(Error::io(format!("writing {}", self.path.display()), e)),
            None => Ok(()),
        }
    }
}

/// Reads a metrics file; a malformed line is an error naming it.
pub fn read(path: &Path) -> Result<Vec<StepMetrics>> {
    crate::input_path::check_file(path, "metrics file")?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let m = serde_json::from_str(line).map_err(|e| {
            Error::Config(format!(
                "{} line {}: not a metrics line of `upipe train --metrics` ({e})",
                path.display(),
                i + 1
            ))
        })?;
        out.push(m);
    }
    if out.is_empty() {
        return crate::config_err!("{} holds no metrics lines", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u32) -> StepReport {
        StepReport {
            step,
            loss: 2.5,
            lr: 1e-3,
            grad_norm: 0.5,
            skipped: 0,
            tokens_per_s: 1000.0,
            peak_bytes: 300,
            at_peak_by_category: vec![(Category::Weights, 200), (Category::Activations, 100)],
            host_peak_bytes: 64,
            tokens: 512,
            counted_tokens: 500,
            attn_flop_fraction: 0.5,
            profile: None,
            eval: None,
            retrieval: None,
            mixture: None,
            skipped_windows: 0,
        }
    }

    /// A step whose masks compute a quarter of the scores instead of the
    /// causal half counts half the attention FLOPs.
    #[test]
    fn model_flops_count_only_the_attention_the_masks_compute() {
        let facts = RunFacts {
            flops_per_token: 3e9,
            attention_flops_per_token: 2e9,
            ranks: 1,
            predicted: None,
            attention_kernel: None,
            optim_state: None,
            precision: None,
        };
        let mut r = report(1);
        assert!((StepMetrics::of_step(&r, &facts).tflops - 3.0).abs() < 1e-9);
        r.attn_flop_fraction = 0.25;
        let m = StepMetrics::of_step(&r, &facts);
        assert!((m.tflops - 2.0).abs() < 1e-9, "{}", m.tflops);
        assert_eq!(m.counted_tokens, Some(500));
    }

    #[test]
    fn a_line_holds_the_step_its_flops_and_memory_and_reads_back() {
        let facts = RunFacts {
            flops_per_token: 3e9,
            attention_flops_per_token: 0.0,
            ranks: 4,
            predicted: None,
            attention_kernel: Some("cudnn 9.14.0".into()),
            optim_state: Some("moments 8bit, master none".into()),
            precision: None,
        };
        let m = StepMetrics::of_step(&report(7), &facts);
        // 3 GFLOP per token at 1000 tokens/s: 3 TFLOP/s, 0.75 per rank
        assert!((m.tflops - 3.0).abs() < 1e-12 && (m.tflops_per_rank - 0.75).abs() < 1e-12);
        assert_eq!(m.peak_by_category["weights"], 200);
        assert_eq!(m.peak_by_category["offload_host"], 64);
        assert_eq!(m.peak_by_category.len(), Category::ALL.len());
        assert!(m.to_line().contains(r#""attention_kernel":"cudnn 9.14.0""#));
        let back: StepMetrics = serde_json::from_str(&m.to_line()).unwrap();
        assert_eq!(back, m);
        let mut diverged = m.clone();
        diverged.loss = f64::NAN;
        let back: StepMetrics = serde_json::from_str(&diverged.to_line()).unwrap();
        assert!(back.loss.is_nan());
    }

    #[test]
    fn a_file_is_written_line_by_line_and_bad_lines_are_named() {
        let dir = std::env::temp_dir().join(format!("upipe-metrics-{}", std::process::id()));
        let path = dir.join("sub").join("m.jsonl");
        let f = MetricsFile::create(&path).unwrap();
        let facts = RunFacts {
            flops_per_token: 1.0,
            attention_flops_per_token: 0.0,
            ranks: 1,
            predicted: None,
            attention_kernel: None,
            optim_state: None,
            precision: None,
        };
        for s in 1..=3 {
            f.write(&StepMetrics::of_step(&report(s), &facts));
        }
        f.finish().unwrap();
        let lines = read(&path).unwrap();
        assert_eq!(lines.iter().map(|m| m.step).collect::<Vec<_>>(), [1, 2, 3]);
        std::fs::write(&path, "{\"step\": 1}\n").unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
