//! `upipe plan`: predicted per-rank memory of a training step by category,
//! or the longest context that fits for each strategy (see `crate::plan`).

use crate::attention::Strategy;
use crate::backend::{Bytes, Category};
use crate::cli::schedule::ScheduleArgs;
use crate::error::{Error, Result};
use crate::model::decoder::attn_dims;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::plan::{
    Budget, DeviceKind, Fit, Limit, Prediction, StepSpec, longest_context, predict_step,
    resolve_plan, seq_unit,
};
use serde_json::{Value, json};

const GIB: f64 = (1u64 << 30) as f64;

/// Flags of `upipe plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// Preset name (tiny, llama3.2-1b, llama3-8b, llama3-70b, qwen3-32b), config.json, or HF model dir.
    #[arg(long)]
    pub model: String,
    /// Number of GPUs (data x ulysses x ring).
    #[arg(long)]
    pub gpus: usize,
    /// Memory of one GPU in GiB.
    #[arg(long, default_value_t = 80.0)]
    pub gpu_mem: f64,
    /// GiB per GPU kept outside the ledger (CUDA context, library workspaces, pool slack).
    #[arg(long, default_value_t = 1.0)]
    pub reserve: f64,
    /// Host memory of one node in GiB, for offloaded activations (unchecked when absent).
    #[arg(long)]
    pub host_mem: Option<f64>,
    /// GPUs per node (ranks sharing one host's memory).
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Global sequence length: print the per-category breakdown at this length.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Strategies, comma-separated (ulysses, ring, usp, upipe, local), or `all`.
    #[arg(long, default_value = "all")]
    pub attn: String,
    /// Ulysses degree Pu (default: all GPUs; usp: up to 8).
    #[arg(long)]
    pub ulysses: Option<usize>,
    /// Ring degree Pr (default: 1; ring: all GPUs).
    #[arg(long)]
    pub ring: Option<usize>,
    /// UPipe heads per stage U (default: Pu).
    #[arg(long)]
    pub chunk_heads: Option<usize>,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// HSDP: with `fsdp`, shard inside groups of gpus/R ranks, replicated R times.
    #[arg(long, default_value_t = 1)]
    pub fsdp_replicate: usize,
    /// Memory policies, comma-separated: checkpoint, offload, tiled-mlp, fsdp (or `none`).
    #[arg(long, default_value = "none")]
    pub policies: String,
    /// Rows of logits per fused-loss chunk.
    #[arg(long, default_value_t = 256)]
    pub loss_chunk: usize,
    /// Dtypes to plan for: cuda (bf16 activations) or cpu (f32).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Attention kernels on cuda: auto (cuDNN SDPA where it takes the call;
    /// its plan workspace as cuDNN 9.14 took it on H200) or native (our
    /// kernels, modelled exactly).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    /// Longest length the search tries (tokens).
    #[arg(long, default_value_t = 1 << 28)]
    pub max_seq: usize,
    /// One JSON object per strategy instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Parsed `--policies`: (memory policy, fsdp).
fn parse_policies(s: &str, loss_chunk: usize) -> Result<(MemoryPolicy, bool)> {
    let mut p = MemoryPolicy {
        loss_chunk,
        ..Default::default()
    };
    let mut fsdp = false;
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        match item {
            "none" => {}
            "checkpoint" => p.checkpoint = true,
            "offload" => p.offload = true,
            "tiled-mlp" | "tiled_mlp" => p.tiled_mlp = true,
            "fsdp" => fsdp = true,
            other => {
                return Err(Error::Config(format!(
                    "unknown policy '{other}' in --policies; use checkpoint, offload, tiled-mlp, fsdp (comma-separated) or none"
                )));
            }
        }
    }
    p.validate()?;
    Ok((p, fsdp))
}

fn parse_attn(s: &str, gpus: usize) -> Result<(bool, Vec<Strategy>)> {
    if s == "all" {
        let v = if gpus == 1 {
            vec![Strategy::Local]
        } else {
            vec![
                Strategy::Ulysses,
                Strategy::Ring,
                Strategy::Usp,
                Strategy::Upipe,
            ]
        };
        return Ok((true, v));
    }
    let v: Vec<Strategy> = s
        .split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_>>()?;
    if v.is_empty() {
        return Err(Error::Config("--attn needs at least one strategy".into()));
    }
    Ok((false, v))
}

fn gib(x: f64, what: &str) -> Result<usize> {
    if !(x.is_finite() && x >= 0.0) {
        return Err(Error::Config(format!(
            "{what} must be a non-negative number of GiB, not {x}"
        )));
    }
    Ok((x * GIB) as usize)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

struct Ctx {
    model: ModelConfig,
    policy: MemoryPolicy,
    fsdp: bool,
    device: DeviceKind,
    a: PlanArgs,
}

impl Ctx {
    fn predict(&self, strategy: Strategy, seq: usize) -> Result<(Prediction, StepSpec)> {
        let (plan, data) = resolve_plan(
            strategy,
            &attn_dims(&self.model),
            seq,
            self.a.gpus,
            self.a.ulysses,
            self.a.ring,
            self.a.chunk_heads,
        )?;
        let spec = |plan: &crate::attention::CpPlan| StepSpec {
            model: self.model.clone(),
            plan: plan.clone(),
            data,
            policy: self.policy,
            fsdp: self.fsdp,
            fsdp_replicas: self.a.fsdp_replicate,
            grad_accum: 1,
            device: self.device,
            optimizer: true,
        };
        let plan = self
            .a
            .schedule
            .apply(plan, |p| Ok(predict_step(&spec(p))?.peak))?;
        let spec = spec(&plan);
        Ok((predict_step(&spec)?, spec))
    }
}

fn by_category(p: &Prediction) -> Value {
    let mut m = serde_json::Map::new();
    for c in Category::ALL {
        m.insert(c.name().to_string(), json!(p.at(c)));
    }
    Value::Object(m)
}

fn mesh_json(spec: &StepSpec) -> Value {
    json!({
        "data": spec.data, "ulysses": spec.plan.layout.pu, "ring": spec.plan.layout.pr,
        "chunk_heads": spec.plan.schedule.chunk, "fwd_chunk_heads": spec.plan.fwd_schedule.chunk, "stages": spec.plan.schedule.n_stages(),
        "overlap": spec.plan.overlap, "settle_every": spec.plan.settle_every.to_string(),
    })
}

fn mesh_text(spec: &StepSpec) -> String {
    format!(
        "{}x{}x{}",
        spec.data, spec.plan.layout.pu, spec.plan.layout.pr
    )
}

fn limit_text(l: &Limit) -> String {
    match l {
        Limit::Device(c, at) => format!("gpu: {} ({at})", c.name()),
        Limit::Host => "host: offload_host".to_string(),
    }
}

fn fmt_tokens(n: usize) -> String {
    let m = n as f64 / (1u64 << 20) as f64;
    if m >= 1.0 {
        format!("{m:.2}M")
    } else {
        format!("{:.0}K", n as f64 / 1024.0)
    }
}

pub fn run(a: PlanArgs) -> Result<i32> {
    let model = ModelConfig::resolve(&a.model)?;
    if a.gpus == 0 {
        return Err(Error::Config("--gpus must be at least 1".into()));
    }
    if a.gpus_per_node == 0 {
        return Err(Error::Config("--gpus-per-node must be at least 1".into()));
    }
    let device = match a.device.as_str() {
        "cuda" => DeviceKind::cuda_with(a.attn_kernel.parse()?),
        "cpu" => DeviceKind::Cpu,
        other => {
            return Err(Error::Config(format!(
                "--device {other}: plan for cuda (bf16) or cpu (f32)"
            )));
        }
    };
    let (policy, fsdp) = parse_policies(&a.policies, a.loss_chunk)?;
    if a.fsdp_replicate == 0
        || !a.gpus.is_multiple_of(a.fsdp_replicate)
        || (a.fsdp_replicate > 1 && !fsdp)
    {
        return Err(Error::Config(format!(
            "--fsdp-replicate {} needs the fsdp policy and must divide --gpus {}",
            a.fsdp_replicate, a.gpus
        )));
    }
    let (all, strategies) = parse_attn(&a.attn, a.gpus)?;
    if a.ulysses.is_some() || a.ring.is_some() {
        let c = a.ulysses.unwrap_or(1) * a.ring.unwrap_or(1);
        if c == 0 || !a.gpus.is_multiple_of(c) {
            return Err(Error::Config(format!(
                "--gpus {} is not a product of the mesh: data x {} (ulysses) x {} (ring) needs a multiple of {c} GPUs",
                a.gpus,
                a.ulysses.unwrap_or(1),
                a.ring.unwrap_or(1)
            )));
        }
    }
    let usable = gib(a.gpu_mem, "--gpu-mem")?.saturating_sub(gib(a.reserve, "--reserve")?);
    let host = match a.host_mem {
        Some(h) => Some(gib(h, "--host-mem")? / a.gpus.min(a.gpus_per_node)),
        None => None,
    };
    let budget = Budget {
        device: usable,
        host,
    };
    let ctx = Ctx {
        model,
        policy,
        fsdp,
        device,
        a: a.clone(),
    };
    if !a.json {
        println!(
            "{} ({:.2}B params) on {} GPUs of {} GiB ({} GiB outside the ledger), {}; policies: {}",
            ctx.model.name,
            ctx.model.param_count() as f64 / 1e9,
            a.gpus,
            a.gpu_mem,
            a.reserve,
            device.name(),
            a.policies,
        );
        if let Some(h) = host {
            println!("host memory for offload: {} per rank", Bytes(h));
        }
    }
    match a.seq {
        Some(seq) => breakdown(&ctx, all, &strategies, seq, budget),
        None => search(&ctx, all, &strategies, budget),
    }
}

/// `Err` of a strategy: skipped (with `all`) or fatal.
fn skip_or_fail(all: bool, s: Strategy, e: Error, json: bool) -> Result<()> {
    if !all {
        return Err(e);
    }
    if json {
        println!(
            "{}",
            json!({"strategy": s.name(), "skipped": e.to_string()})
        );
    } else {
        println!("{:<8} skipped: {e}", s.name());
    }
    Ok(())
}

fn breakdown(
    ctx: &Ctx,
    all: bool,
    strategies: &[Strategy],
    seq: usize,
    budget: Budget,
) -> Result<i32> {
    let json = ctx.a.json;
    if !json {
        let mut head = format!("{:<8} {:>9} {:>4}", "method", "mesh", "U");
        for c in Category::ALL {
            head += &format!(" {:>12}", c.name());
        }
        head += &format!(" {:>12} {:>5}  peak at", "gpu peak", "");
        println!(
            "seq {seq} ({}), per rank; mesh = data x ulysses x ring",
            fmt_tokens(seq)
        );
        println!("{head}");
    }
    for &s in strategies {
        let (p, spec) = match ctx.predict(s, seq) {
            Ok(x) => x,
            Err(e) => {
                skip_or_fail(all, s, e, json)?;
                continue;
            }
        };
        let base = ctx
            .predict(s, seq_unit(spec.plan.layout.pu, spec.plan.layout.pr))?
            .0;
        let fits = budget.check(&p, Some(&base));
        if json {
            println!(
                "{}",
                json!({
                    "strategy": s.name(), "seq": seq, "mesh": mesh_json(&spec),
                    "peak_bytes": p.peak, "host_bytes": p.host_peak,
                    "by_category": by_category(&p), "peak_at": p.peak_at,
                    "fits": fits.is_none(), "limit": fits.as_ref().map(limit_text),
                })
            );
        } else {
            let mut line = format!(
                "{:<8} {:>9} {:>4}",
                s.name(),
                mesh_text(&spec),
                spec.plan.chunk_text()
            );
            for c in Category::ALL {
                line += &format!(" {:>12}", Bytes(p.at(c)).to_string());
            }
            line += &format!(
                " {:>12} {:>5}  {}",
                Bytes(p.peak).to_string(),
                if fits.is_none() { "fits" } else { "OOM" },
                p.peak_at
            );
            println!("{line}");
        }
    }
    Ok(0)
}

fn search(ctx: &Ctx, all: bool, strategies: &[Strategy], budget: Budget) -> Result<i32> {
    let json = ctx.a.json;
    if !json {
        println!(
            "{:<8} {:>9} {:>4} {:>19} {:>12}  limit at the next length",
            "method", "mesh", "U", "longest", "gpu peak"
        );
    }
    for &s in strategies {
        // any length that is a multiple of 2 x gpus x 1024 resolves the mesh
        let probe = 2 * ctx.a.gpus * 1024;
        let spec = match ctx.predict(s, probe) {
            Ok((_, spec)) => spec,
            Err(e) => {
                skip_or_fail(all, s, e, json)?;
                continue;
            }
        };
        let unit = seq_unit(spec.plan.layout.pu, spec.plan.layout.pr);
        let step = unit / gcd(unit, 1024) * 1024;
        let fit: Fit = longest_context(step, ctx.a.max_seq, budget, |seq| {
            ctx.predict(s, seq).map(|x| x.0)
        })?;
        let limit = fit.limit.as_ref();
        if json {
            println!(
                "{}",
                json!({
                    "strategy": s.name(), "mesh": mesh_json(&spec), "longest_seq": fit.seq,
                    "peak_bytes": fit.at_fit.as_ref().map(|p| p.peak),
                    "by_category": fit.at_fit.as_ref().map(by_category),
                    "limit": limit.map(|(seq, l, p)| json!({
                        "seq": seq, "reason": limit_text(l), "peak_bytes": p.peak,
                        "by_category": by_category(p),
                    })),
                })
            );
        } else {
            println!(
                "{:<8} {:>9} {:>4} {:>19} {:>12}  {}",
                s.name(),
                mesh_text(&spec),
                spec.plan.chunk_text(),
                format!("{} ({})", fit.seq, fmt_tokens(fit.seq)),
                fit.at_fit
                    .as_ref()
                    .map_or("-".into(), |p| Bytes(p.peak).to_string()),
                limit.map_or(
                    format!("none up to --max-seq {}", ctx.a.max_seq),
                    |(seq, l, p)| { format!("{seq} needs {}: {}", Bytes(p.peak), limit_text(l)) }
                )
            );
        }
    }
    Ok(0)
}
