//! How `upipe plan` prints a step: table cells, JSON objects, SVG bars.

use crate::attention::Strategy;
use crate::backend::{Bytes, Category};
use crate::cli::svg::Bar;
use crate::plan::{Limit, Prediction, StepSpec};
use serde_json::{Value, json};

/// The policy columns' heads, as [`policy_cells`] fills them.
pub(super) const POLICY_HEAD: &str = "heads/stage  attn kept  offloaded  optim host";

/// What the policy columns mean, printed under a table.
pub(super) const POLICY_NOTE: &str = "heads/stage: query heads per attention stage, backward \
    (fwd: forward); attn kept: blocks keeping attention outputs\n\
    offloaded: blocks whose checkpoints are on the host; optim host: units whose optimizer \
    state is on the host";

/// A step's policy columns under [`POLICY_HEAD`]: heads per stage (`8`,
/// or `8 fwd 32` with wider forward stages), blocks keeping attention
/// (`3/16`), blocks offloaded and units with host optimizer state (`-`
/// for none).
pub(super) fn policy_cells(spec: &StepSpec) -> String {
    let (u, uf) = (spec.plan.schedule.chunk, spec.plan.fwd_schedule.chunk);
    let stages = match u == uf {
        true => u.to_string(),
        false => format!("{u} fwd {uf}"),
    };
    let (p, layers) = (&spec.policy, spec.model.layers);
    let count = |n: usize| if n == 0 { "-".into() } else { n.to_string() };
    format!(
        "{stages:>11}  {:>9}  {:>9}  {:>10}",
        format!("{}/{layers}", p.save_attention),
        count(p.offload),
        count(p.offload_optimizer)
    )
}

/// The bytes of every category at the peak, as JSON.
pub(super) fn by_category(p: &Prediction) -> Value {
    let mut m = serde_json::Map::new();
    for c in Category::ALL {
        m.insert(c.name().to_string(), json!(p.at(c)));
    }
    Value::Object(m)
}

/// A step's mesh and stages, as JSON.
pub(super) fn mesh_json(spec: &StepSpec) -> Value {
    json!({
        "data": spec.data, "ulysses": spec.plan.layout.pu, "ring": spec.plan.layout.pr,
        "chunk_heads": spec.plan.schedule.chunk, "fwd_chunk_heads": spec.plan.fwd_schedule.chunk, "stages": spec.plan.schedule.n_stages(),
        "overlap": spec.plan.overlap, "settle_every": spec.plan.settle_every.to_string(),
    })
}

/// A step's mesh as tables print it: `data x ulysses x ring`.
pub(super) fn mesh_text(spec: &StepSpec) -> String {
    format!(
        "{}x{}x{}",
        spec.data, spec.plan.layout.pu, spec.plan.layout.pr
    )
}

/// Why a length does not fit, in words.
pub(super) fn limit_text(l: &Limit) -> String {
    match l {
        Limit::Device(c, at) => format!("gpu: {} ({at})", c.name()),
        Limit::Host => "host: offload_host".to_string(),
    }
}

/// A count of tokens in M (2^20) or K (2^10).
pub(super) fn fmt_tokens(n: usize) -> String {
    let m = n as f64 / (1u64 << 20) as f64;
    if m >= 1.0 {
        format!("{m:.2}M")
    } else {
        format!("{:.0}K", n as f64 / 1024.0)
    }
}

/// One strategy's row of the breakdown table.
pub(super) fn breakdown_line(s: Strategy, spec: &StepSpec, p: &Prediction, fits: bool) -> String {
    let mut line = format!(
        "{:<8} {:>9}  {}",
        s.name(),
        mesh_text(spec),
        policy_cells(spec)
    );
    for c in Category::ALL {
        line += &format!(" {:>12}", Bytes(p.at(c)).to_string());
    }
    line += &format!(
        " {:>12} {:>5}  {}",
        Bytes(p.peak).to_string(),
        if fits { "fits" } else { "OOM" },
        p.peak_at
    );
    line
}

/// A strategy's device bytes at its peak by category, as a bar.
pub(super) fn category_bar(s: Strategy, spec: &StepSpec, p: &Prediction) -> Bar {
    let segments = Category::ALL
        .iter()
        .filter(|&&c| c != Category::Offload)
        .map(|&c| (c.name().to_string(), p.at(c) as f64))
        .collect();
    Bar {
        label: format!("{} {}", s.name(), mesh_text(spec)),
        segments,
    }
}
