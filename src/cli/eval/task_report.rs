//! What `upipe eval --task` reports: a table of accuracy by depth ×
//! length (or, with `--json`, the summary as one JSON object), and under
//! `--out DIR` the trials (`trials.jsonl`), the summary (`summary.json`)
//! and the heatmap (`heatmap.svg`).

use super::args::EvalArgs;
use crate::backend::Bytes;
use crate::cli::svg::heatmap::{Heatmap, heatmap};
use crate::cli::svg::{Area, Svg};
use crate::data::Tokenizer;
use crate::data::retrieval::{Grid, TaskSpec, Templates};
use crate::error::{Error, Result};
use crate::plan::Prediction;
use crate::train::retrieval::{RetrievalSummary, Scored, TrialResult, summarize};
use serde::Serialize;
use std::path::Path;

/// One line of `trials.jsonl`.
#[derive(Serialize)]
struct TrialLine<'a> {
    task: &'a str,
    #[serde(flatten)]
    result: &'a TrialResult,
    /// The argmax at the answer positions, as text.
    predicted: String,
}

/// What a retrieval evaluation scored, and what the planner predicted of
/// each length (in the grid's order).
pub struct Scores<'a> {
    pub scored: &'a Scored,
    pub predicted: &'a [Prediction],
    /// The chat template's file the trials were framed by (`None`: plain text).
    pub chat_template: Option<&'a str>,
}

/// One length's memory and time (`summary.json`'s `by_length`).
#[derive(Serialize)]
struct LengthLine {
    length: usize,
    /// The planner's prediction of the highest rank's peak.
    predicted_peak_bytes: usize,
    /// The highest rank's ledger peak over the length's trials.
    measured_peak_bytes: usize,
    seconds_per_trial: f64,
}

/// `summary.json`: what ran and how it scored.
#[derive(Serialize)]
struct SummaryFile<'a> {
    task: &'a str,
    model_dir: Option<String>,
    lora_from: Option<String>,
    haystack: String,
    templates: &'a Templates,
    /// The chat template's file (`null`: plain text).
    chat_template: Option<&'a str>,
    needles: usize,
    digits: usize,
    lengths: &'a [usize],
    depths: &'a [f64],
    trials_per_cell: usize,
    seed: u64,
    #[serde(flatten)]
    summary: &'a RetrievalSummary,
    by_length: Vec<LengthLine>,
}

/// Prints the table (or the JSON) and writes `--out`'s files.
pub fn report(
    a: &EvalArgs,
    (spec, grid, tok): (&TaskSpec, &Grid, &Tokenizer),
    scores: &Scores,
) -> Result<()> {
    let results = &scores.scored.trials;
    let summary = summarize(grid, results);
    let by_length: Vec<LengthLine> = (scores.scored.lengths.iter())
        .zip(scores.predicted)
        .map(|(m, p)| LengthLine {
            length: m.length,
            predicted_peak_bytes: p.peak,
            measured_peak_bytes: m.peak_bytes,
            seconds_per_trial: m.seconds_per_trial,
        })
        .collect();
    let task = spec.task.name();
    let file = SummaryFile {
        task,
        model_dir: a.model_dir.as_ref().map(|p| p.display().to_string()),
        lora_from: a.lora_from.as_ref().map(|p| p.display().to_string()),
        haystack: match (&a.task.haystack, spec.task.uses_haystack()) {
            (Some(p), _) => p.display().to_string(),
            (None, true) => "the built-in filler".into(),
            (None, false) => "its own key-value list".into(),
        },
        templates: &spec.templates,
        chat_template: scores.chat_template,
        needles: spec.needles,
        digits: spec.digits,
        lengths: &grid.lengths,
        depths: &grid.depths,
        trials_per_cell: grid.trials,
        seed: grid.seed,
        summary: &summary,
        by_length,
    };
    let json = serde_json::to_string_pretty(&file).expect("a summary always serialises");
    match a.json {
        true => println!("{}", serde_json::to_string(&file).expect("serialises")),
        false => print!(
            "{}{}",
            table(task, grid, &summary),
            cost_table(&file.by_length)
        ),
    }
    if let Some(dir) = &a.task.out {
        write_out(dir, task, tok, results, &json, &summary, grid)?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}

/// `passkey: 40/44 passed (90.9 %), ...` then accuracy (%) by depth × length.
pub fn table(task: &str, grid: &Grid, s: &RetrievalSummary) -> String {
    let mut out = format!(
        "{task}: {}/{} trials passed ({:.1} %), mean answer log-likelihood {:.4} nats/token\n",
        s.passed,
        s.trials,
        100.0 * s.accuracy,
        s.mean_logprob
    );
    out.push_str("accuracy (%) by needle depth (rows) and context length (columns):\n");
    out.push_str(&format!("{:>7}", "depth"));
    for &l in &grid.lengths {
        out.push_str(&format!("{:>8}", length_label(l)));
    }
    out.push('\n');
    for (di, &d) in grid.depths.iter().enumerate() {
        out.push_str(&format!("{:>5.0} %", 100.0 * d));
        for li in 0..grid.lengths.len() {
            let c = &s.cells[li * grid.depths.len() + di];
            out.push_str(&format!("{:>8.0}", 100.0 * c.accuracy));
        }
        out.push('\n');
    }
    out
}

/// Memory (predicted and measured peak per rank) and seconds per trial by
/// length.
fn cost_table(lines: &[LengthLine]) -> String {
    let mut out = format!(
        "{:>8} {:>16} {:>16} {:>12}\n",
        "length", "predicted peak", "measured peak", "s/trial"
    );
    for l in lines {
        out.push_str(&format!(
            "{:>8} {:>16} {:>16} {:>12.3}\n",
            length_label(l.length),
            Bytes(l.predicted_peak_bytes).to_string(),
            Bytes(l.measured_peak_bytes).to_string(),
            l.seconds_per_trial
        ));
    }
    out
}

/// `4K` for 4096, `1M` for 1048576, else the number.
pub fn length_label(l: usize) -> String {
    match l {
        l if l >= 1 << 20 && l.is_multiple_of(1 << 20) => format!("{}M", l >> 20),
        l if l >= 1 << 10 && l.is_multiple_of(1 << 10) => format!("{}K", l >> 10),
        l => l.to_string(),
    }
}

/// Writes `trials.jsonl`, `summary.json` and `heatmap.svg` into `dir`.
fn write_out(
    dir: &Path,
    task: &str,
    tok: &Tokenizer,
    results: &[TrialResult],
    summary_json: &str,
    summary: &RetrievalSummary,
    grid: &Grid,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let [trials, summary_path, svg] = out_files(dir);
    let mut lines = String::new();
    for r in results {
        let line = TrialLine {
            task,
            result: r,
            predicted: tok.decode(&r.predicted_ids).unwrap_or_default(),
        };
        lines.push_str(&serde_json::to_string(&line).expect("a trial always serialises"));
        lines.push('\n');
    }
    let write = |path: &Path, text: &str| {
        std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
    };
    write(&trials, &lines)?;
    write(&summary_path, &format!("{summary_json}\n"))?;
    write(&svg, &heatmap_svg(task, grid, summary))
}

/// The heatmap of accuracy by depth (rows, 0 % on top) × length.
pub fn heatmap_svg(task: &str, grid: &Grid, s: &RetrievalSummary) -> String {
    let (nl, nd) = (grid.lengths.len(), grid.depths.len());
    let cell = |li: usize, di: usize| &s.cells[li * nd + di];
    let title = format!("{task}: accuracy (%), {} of {} passed", s.passed, s.trials);
    let h = Heatmap {
        title: &title,
        column_name: "context length (tokens)",
        row_name: "needle depth",
        columns: grid.lengths.iter().map(|&l| length_label(l)).collect(),
        rows: grid
            .depths
            .iter()
            .map(|d| format!("{:.0} %", 100.0 * d))
            .collect(),
        values: (0..nd)
            .map(|di| (0..nl).map(|li| Some(cell(li, di).accuracy)).collect())
            .collect(),
        tips: (0..nd)
            .map(|di| {
                (0..nl)
                    .map(|li| {
                        let c = cell(li, di);
                        format!(
                            "length {}, depth {:.0} %: {}/{} passed, mean log-likelihood {:.3}",
                            c.length,
                            100.0 * c.depth,
                            c.passed,
                            c.trials,
                            c.mean_logprob
                        )
                    })
                    .collect()
            })
            .collect(),
    };
    let width = (120.0 + 64.0 * nl as f64).max(520.0);
    let height = 110.0 + 26.0 * nd as f64;
    let mut svg = Svg::new(width, height);
    let area = Area {
        x: 10.0,
        y: 40.0,
        w: width - 20.0,
        h: height - 60.0,
    };
    heatmap(&mut svg, area, &h);
    svg.finish()
}

/// Paths `--out DIR` writes.
pub fn out_files(dir: &Path) -> [std::path::PathBuf; 3] {
    ["trials.jsonl", "summary.json", "heatmap.svg"].map(|f| dir.join(f))
}
