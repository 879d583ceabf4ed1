//! How `upipe plan` prints a step: table cells, JSON objects, SVG bars.

use crate::attention::Strategy;
use crate::backend::{Bytes, Category};
use crate::cli::svg::Bar;
use crate::plan::{Limit, Prediction, StepSpec};
use serde_json::{Value, json};

/// The policy columns' heads, as [`policy_cells`] fills them.
pub(super) const POLICY_HEAD: &str = "heads/stage  attn kept  offloaded  optim host  ckpt every";

/// What the policy columns mean, printed under a table.
pub(super) const POLICY_NOTE: &str = "heads/stage: query heads per attention stage, backward \
    (fwd: forward); attn kept: blocks keeping attention outputs\n\
    offloaded: blocks whose checkpoints are on the host; optim host: units whose optimizer \
    state is on the host\n\
    ckpt every: blocks per kept checkpoint (--checkpoint-every; 1: every block's input is kept)";

/// A step's policy columns under [`POLICY_HEAD`]: heads per stage (`8`,
/// or `8 fwd 32` with wider forward stages), blocks keeping attention
/// (`3/16`), blocks offloaded and units with host optimizer state (`-`
/// for none), and blocks per kept checkpoint (`-` without checkpointing).
pub(super) fn policy_cells(spec: &StepSpec) -> String {
    let (u, uf) = (spec.plan.schedule.chunk, spec.plan.fwd_schedule.chunk);
    let stages = match u == uf {
        true => u.to_string(),
        false => format!("{u} fwd {uf}"),
    };
    let (p, layers) = (&spec.policy, spec.model.layers);
    let count = |n: usize| if n == 0 { "-".into() } else { n.to_string() };
    let every = match p.checkpoint {
        true => p.checkpoint_every.to_string(),
        false => "-".into(),
    };
    format!(
        "{stages:>11}  {:>9}  {:>9}  {:>10}  {every:>10}",
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

/// The `upipe train` command that runs `spec` at `seq` tokens: the model as
/// given, the strategy and its resolved mesh and stages, every memory
/// choice as the plan resolved it, and the flags the plan took as given.
pub(super) struct TrainCommand<'a> {
    pub model: &'a str,
    pub spec: &'a StepSpec,
    pub seq: usize,
    pub host_mem: Option<f64>,
}

impl std::fmt::Display for TrainCommand<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (spec, p) = (self.spec, &self.spec.policy);
        let plan = &spec.plan;
        write!(
            f,
            "upipe train --model {} --attn {}",
            self.model,
            plan.strategy.name()
        )?;
        write!(
            f,
            " --data-parallel {} --ulysses {} --ring {}",
            spec.data, plan.layout.pu, plan.layout.pr
        )?;
        if plan.strategy.has_head_stages() {
            let (u, uf) = (plan.schedule.chunk, plan.fwd_schedule.chunk);
            write!(f, " --chunk-heads {u} --fwd-chunk-heads {uf}")?;
        }
        write!(f, " --seq {}", self.seq)?;
        for (on, flag) in [
            (p.checkpoint, " --checkpoint"),
            (p.tiled_mlp, " --tiled-mlp"),
        ] {
            if on {
                f.write_str(flag)?;
            }
        }
        write!(
            f,
            " --offload {} --save-attention {}",
            p.offload, p.save_attention
        )?;
        if p.checkpoint_every != 1 {
            write!(f, " --checkpoint-every {}", p.checkpoint_every)?;
        }
        write!(f, " --offload-optimizer {}", p.offload_optimizer)?;
        if p.offload_optimizer > 0 {
            write!(f, " --host-update {}", p.host_update)?;
        }
        write!(f, " --fsdp {}", if spec.fsdp { "on" } else { "off" })?;
        if spec.grad_accum > 1 {
            write!(f, " --grad-accum {}", spec.grad_accum)?;
        }
        if !spec.state.is_plain() {
            let s = spec.state;
            let (m, w) = (s.moments.name(), s.master.name());
            write!(f, " --optim-state {m} --master-weights {w}")?;
            write!(f, " --grad-dtype {}", s.grads.name())?;
        }
        if spec.precision != Default::default() {
            write!(f, " --precision {}", spec.precision)?;
        }
        if !spec.freeze.is_empty() && spec.lora.is_none() {
            write!(f, " --freeze {}", spec.freeze)?;
        }
        if let Some(l) = &spec.lora {
            let targets: Vec<&str> = l.targets.iter().map(|t| t.peft_name()).collect();
            write!(
                f,
                " --lora-rank {} --lora-alpha {} --lora-targets {}",
                l.rank,
                l.alpha,
                targets.join(",")
            )?;
            if l.use_rslora {
                f.write_str(" --lora-rslora")?;
            }
        }
        if let Some(h) = self.host_mem.filter(|h| h.is_finite()) {
            write!(f, " --host-mem {h}")?;
        }
        Ok(())
    }
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
