//! `upipe plan`: predicted per-rank memory of a training step by category,
//! or the longest context that fits for each strategy (see `crate::plan`).

use crate::attention::Strategy;
use crate::backend::cuda::cudnn::select::version_text;
use crate::backend::memory::default_pinned_budget;
use crate::backend::{Bytes, Category};
use crate::cli::config::{self, Given, RunArgs, RunFile, at_least, for_key, run_keys};
use crate::cli::lora::LoraArgs;
use crate::cli::memory::MemoryArgs;
use crate::cli::mesh::MeshArgs;
use crate::cli::schedule::{ChunkHeads, ScheduleArgs};
use crate::cli::svg::{Area, Bar, Svg, stacked_bars};
use crate::cli::train::{CPU_DEFAULT_MESH, host_available_bytes};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::decoder::attn_dims;
use crate::plan::mesh::{MeshChoice, MeshFlags, resolve_mesh};
use crate::plan::resolve::{Strategies, host_share};
use crate::plan::{
    Budget, CudnnVersion, Depth, DeviceKind, Fit, FsdpMode, MemoryChoices, Prediction, RankBudget,
    RunRequest, StageChoices, StepSpec, longest_context, resolve_plan, resolve_run, seq_unit,
};
use crate::plan::{CheckpointEvery, OffloadBlocks, OptimizerOffload};
use clap::ArgMatches;
use serde_json::json;
use std::path::{Path, PathBuf};

mod device;
mod limits;
mod output;

pub use device::PlannedCudnn;
use device::plan_device;
pub(crate) use limits::at_most_tokens;
use limits::{at_most_planned, check_ring};

use output::{
    POLICY_HEAD, POLICY_NOTE, TrainCommand, breakdown_line, by_category, category_bar, fmt_tokens,
    limit_text, mesh_json, mesh_text, policy_cells,
};

const GIB: f64 = (1u64 << 30) as f64;

/// Flags of `upipe plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// A run file (TOML, as `upipe train --config` reads): plans that run;
    /// flags given here win.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Preset name (tiny, llama3.1-8b, llama3.2-1b, qwen3-8b, ...: see docs/checkpoints.md), config.json, or HF model dir.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Number of GPUs (data x ulysses x ring; default: the product of the
    /// mesh flags given, or with none the mesh `upipe train` would fit here:
    /// to the visible GPUs, or on the CPU 2 Ulysses x 2 ring).
    #[arg(long)]
    pub gpus: Option<usize>,
    /// Memory of one GPU in GiB.
    #[arg(long, default_value_t = 80.0)]
    pub gpu_mem: f64,
    /// GiB per GPU kept outside the ledger (CUDA context, library handles,
    /// the device pool's fragmentation), as `upipe train` keeps it.
    #[arg(long, default_value_t = crate::plan::GPU_RESERVE_BYTES as f64 / (1u64 << 30) as f64)]
    pub reserve: f64,
    /// Pinned host memory of one node in GiB, for offloaded checkpoints and
    /// optimizer state (default: this machine's available memory less what
    /// the system keeps, as `upipe train` takes it; `inf`: unlimited).
    #[arg(long)]
    pub host_mem: Option<f64>,
    /// GPUs per node (ranks sharing one host's memory).
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Global sequence length: print the per-category breakdown at this length.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Sequences per optimizer step (`train --grad-accum`).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Strategies, comma-separated (ulysses, ring, usp, upipe, local), or `all`.
    #[arg(long, default_value = "all")]
    pub attn: String,
    #[command(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// FSDP as `train --fsdp`, whose default it shares: auto (on when
    /// there is more than one GPU and the whole model's states take more
    /// than half of a GPU's memory), on, off.
    #[arg(long, default_value = "auto")]
    pub fsdp: String,
    /// HSDP: with `fsdp`, shard inside groups of gpus/R ranks, replicated R times.
    #[arg(long, default_value_t = 1)]
    pub fsdp_replicate: usize,
    /// AdamW's moments as `train --optim-state` keeps them: f32, bf16, 8bit
    /// or auto (the most exact training state that fits at each length).
    #[arg(long, default_value = "f32")]
    pub optim_state: String,
    /// As `train --master-weights`: f32 or none.
    #[arg(long, default_value = "f32")]
    pub master_weights: String,
    /// As `train --grad-dtype`: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub grad_dtype: String,
    /// As `train --precision`: bf16, fp8 (the FP8 operand copies of each
    /// linear GEMM counted), fp8-attention (and each attention call's
    /// FP8 operands and scales) or fp8-attention-bwd (those of its
    /// backward).
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Memory policies, comma-separated: checkpoint, offload, offload-auto,
    /// offload-optimizer, tiled-mlp, fsdp (or `none`); added to
    /// --checkpoint, --offload, --offload-optimizer, --tiled-mlp and --fsdp.
    #[arg(long, default_value = "none")]
    pub policies: String,
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Dtypes to plan for: cuda (bf16 activations), cpu (f32), or auto (as
    /// `train --device auto` would run here: cuda when a GPU is visible).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Attention kernels on cuda: auto (cuDNN SDPA where it takes the call;
    /// its plan workspace as cuDNN 9.14 took it on H200) or native (our
    /// kernels, modelled exactly).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    /// The cuDNN version whose limits decide which attention calls run on
    /// cuDNN (`--attn-kernel auto` on cuda): 9.19, 9.19.0 or 91900. Default:
    /// the cuDNN this machine loads, else 9.14.
    #[arg(long)]
    pub cudnn_version: Option<CudnnVersion>,
    /// Longest length the search tries (tokens).
    #[arg(long, default_value_t = 1 << 28)]
    pub max_seq: usize,
    /// One JSON object per strategy instead of a table.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          default_value_t = false, action = clap::ArgAction::Set)]
    pub json: bool,
    /// With --seq: also draw each strategy's per-rank memory by category as
    /// stacked bars in this SVG file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

impl PlanArgs {
    run_keys! {
        model => model.model,
        gpus => hardware.gpus,
        gpu_mem => hardware.gpu_mem,
        reserve => hardware.reserve,
        host_mem => hardware.host_mem,
        gpus_per_node => hardware.gpus_per_node,
        seq => data.seq,
        grad_accum => data.grad_accum,
        attn => parallel.attn,
        fsdp => parallel.fsdp,
        fsdp_replicate => parallel.fsdp_replicate,
        optim_state => optim.optim_state,
        master_weights => optim.master_weights,
        grad_dtype => optim.grad_dtype,
        precision => run.precision,
        policies => memory.policies,
        device => run.device,
        attn_kernel => run.attn_kernel,
        cudnn_version => plan.cudnn_version,
        json => run.json,
        max_seq => plan.max_seq,
        svg => plan.svg;
        flatten mesh, schedule, memory, lora
    }
}

impl RunArgs for PlanArgs {
    fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }
    fn take_file(&mut self, file: &RunFile, given: &Given) {
        self.take_keys(file, given);
    }
    fn to_file(&self) -> RunFile {
        let mut f = RunFile::default();
        self.put_keys(&mut f);
        f
    }
}

/// The memory choices and the FSDP mode: `--policies` added to
/// `--checkpoint`, `--offload`, `--offload-optimizer`, `--tiled-mlp` and
/// `--fsdp` (an `auto` given stays `auto`: each is resolved at each length
/// as `train` resolves it).
fn memory_choices(a: &PlanArgs, layers: usize) -> Result<(MemoryChoices, FsdpMode)> {
    let mut m = a.memory.choices();
    let mut fsdp: FsdpMode = for_key(PlanArgs::KEYS, "fsdp", a.fsdp.parse())?;
    for item in a
        .policies
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
    {
        match item {
            "none" => {}
            "checkpoint" => m.checkpoint = true,
            "offload" if m.offload != OffloadBlocks::Auto => m.offload = OffloadBlocks::All,
            "offload" => {}
            "offload-auto" => m.offload = OffloadBlocks::Auto,
            "offload-optimizer" if m.offload_optimizer != OptimizerOffload::Auto => {
                m.offload_optimizer = OptimizerOffload::All
            }
            "offload-optimizer" => {}
            "tiled-mlp" | "tiled_mlp" => m.tiled_mlp = true,
            "fsdp" => fsdp = FsdpMode::On,
            other => {
                return Err(Error::Config(format!(
                    "unknown policy '{other}' in --policies ([memory] policies); use checkpoint, offload, offload-auto, offload-optimizer, tiled-mlp, fsdp (comma-separated) or none"
                )));
            }
        }
    }
    m.policy(layers, layers).validate_for(layers)?;
    Ok((m, fsdp))
}

/// `--attn`: `(is_all, strategies)`; `all` is `local` and `upipe` (its head
/// stages shrink the attention's memory on one GPU too) on one GPU, else
/// every context-parallel strategy.
fn parse_attn(s: &str, gpus: usize) -> Result<(bool, Vec<Strategy>)> {
    match s.parse()? {
        Strategies::All if gpus == 1 => Ok((true, vec![Strategy::Local, Strategy::Upipe])),
        Strategies::All => {
            let parallel = [
                Strategy::Ulysses,
                Strategy::Ring,
                Strategy::Usp,
                Strategy::Upipe,
            ];
            Ok((true, parallel.to_vec()))
        }
        Strategies::Listed(v) if v.is_empty() => {
            Err(Error::Config("--attn needs at least one strategy".into()))
        }
        Strategies::Listed(v) => Ok((false, v)),
    }
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

/// `upipe plan`'s flags, parsed and checked.
struct Ctx {
    model: ModelConfig,
    /// The memory policy chosen (`--policies` added), `auto`s undecided.
    memory: MemoryChoices,
    /// `--freeze`: parameters without gradients or optimizer state.
    freeze: crate::model::Freeze,
    /// `--lora-rank` and the other LoRA flags: the adapters trained.
    lora: Option<crate::model::lora::LoraConfig>,
    fsdp_mode: FsdpMode,
    /// Whether the run shards (for the header; each request decides it too).
    fsdp: bool,
    /// What `--fsdp auto` decided, when that needs saying.
    fsdp_note: Option<String>,
    device: DeviceKind,
    /// The cuDNN version planned and where it came from (cuDNN devices).
    cudnn: Option<PlannedCudnn>,
    gpus: usize,
    /// With neither `--gpus` nor a mesh flag: each strategy's mesh as
    /// `upipe train` fits it ([`resolve_mesh`]) to these ranks.
    fitted: Option<Option<usize>>,
    /// `--attn all` (strategies that do not fit the mesh are skipped).
    all: bool,
    strategies: Vec<Strategy>,
    budget: Budget,
    /// The same budget as the resolver takes it.
    rank_budget: RankBudget,
    /// How AdamW keeps its state (`--optim-state`, `--master-weights`).
    state: crate::optim::StateFormat,
    /// `--precision`.
    precision: crate::backend::fp8::Precision,
    a: PlanArgs,
}

impl Ctx {
    /// The step of `strategy` at `seq` with every `auto` resolved as
    /// `upipe train` resolves it at that length.
    fn predict(&self, strategy: Strategy, seq: usize) -> Result<(Prediction, StepSpec)> {
        self.predict_resolved(strategy, seq, false)
    }

    /// [`Self::predict`], or with `searching` what the search for the
    /// longest context holds fixed ([`Depth::Search`]): wherever that
    /// fits, the resolved run fits too.
    fn predict_resolved(
        &self,
        strategy: Strategy,
        seq: usize,
        searching: bool,
    ) -> Result<(Prediction, StepSpec)> {
        let depth = if searching { Depth::Search } else { Depth::Run };
        let resolved = resolve_run(&self.request(strategy, seq)?, depth)?;
        Ok((resolved.prediction, resolved.spec))
    }

    /// The mesh of `strategy` at `seq`: as `train` fits it to the ranks
    /// here, or to `--gpus` (with no mesh flag the default mesh of them,
    /// with some the others fitted around them; where none fits, the
    /// context group of the degrees given takes the GPUs the replicas
    /// leave).
    fn mesh(&self, strategy: Strategy, seq: usize) -> Result<MeshChoice> {
        let chunk = ChunkHeads::start(self.a.mesh.chunk_heads);
        let (gpus, ulysses, ring, replicas) = match self.fitted {
            Some(ranks) => {
                let flags = MeshFlags::default();
                let m = resolve_mesh(flags, strategy, &self.model, seq, chunk, ranks);
                (m.world_size(), Some(m.ulysses), Some(m.ring), m.data)
            }
            None => match self.fitted_around_flags(strategy, seq) {
                // as `train` fits the rest around the flags given on these GPUs
                Some(m) => (m.world_size(), Some(m.ulysses), Some(m.ring), m.data),
                None => {
                    let replicas = self.a.mesh.data_parallel.unwrap_or(1);
                    (self.gpus, self.a.mesh.ulysses, self.a.mesh.ring, replicas)
                }
            },
        };
        let dims = attn_dims(&self.model);
        // with no mesh flag, the default mesh of the GPUs: the one `train`
        // fits to them (the strategy's own rule)
        let (plan, data) =
            resolve_plan(strategy, &dims, seq, gpus / replicas, ulysses, ring, chunk)?;
        check_ring(plan.layout.pr)?;
        Ok(MeshChoice {
            data: data * replicas,
            ulysses: plan.layout.pu,
            ring: plan.layout.pr,
        })
    }

    /// With some mesh flags given, the mesh of `--gpus` ranks `train`
    /// resolves from them there ([`resolve_mesh`]), when one has them.
    fn fitted_around_flags(&self, strategy: Strategy, seq: usize) -> Option<MeshChoice> {
        if !self.a.mesh.any_given() {
            return None;
        }
        let chunk = ChunkHeads::start(self.a.mesh.chunk_heads);
        let (flags, gpus) = (self.a.mesh.flags(), Some(self.gpus));
        let m = resolve_mesh(flags, strategy, &self.model, seq, chunk, gpus);
        (m.world_size() == self.gpus).then_some(m)
    }

    /// The resolver's request of `strategy` at `seq` tokens.
    fn request(&self, strategy: Strategy, seq: usize) -> Result<RunRequest> {
        let a = &self.a;
        Ok(RunRequest {
            model: self.model.clone(),
            strategy,
            mesh: self.mesh(strategy, seq)?,
            seq,
            stages: StageChoices {
                chunk_heads: a.mesh.chunk_heads,
                fwd: a.schedule.fwd.fwd_chunk_heads,
                overlap: a.schedule.overlap,
                settle: a.schedule.settle_every,
            },
            fsdp: self.fsdp_mode,
            fsdp_replicas: a.fsdp_replicate,
            sharded_resume: false,
            grad_accum: a.grad_accum,
            memory: self.memory,
            freeze: self.freeze.clone(),
            lora: self.lora.clone(),
            device: self.device,
            budget: self.rank_budget,
            state: self.state,
            state_auto: self.a.optim_state == "auto",
            precision: self.precision,
        })
    }
}

/// The resolver's request `upipe plan` with flags `a` makes for `strategy`
/// at `seq` tokens (what it predicts at that length is [`resolve_run`]'s).
pub fn plan_request(a: PlanArgs, strategy: Strategy, seq: usize) -> Result<RunRequest> {
    validate(a)?.request(strategy, seq)
}

pub fn run(a: PlanArgs, m: &ArgMatches) -> Result<i32> {
    let a = config::resolve(a, m)?;
    let ctx = validate(a)?;
    if let (Some(note), false) = (&ctx.fsdp_note, ctx.a.json) {
        println!("{note}");
    }
    if !ctx.a.json {
        println!(
            "{} ({:.2}B params) on {} GPUs of {} GiB ({} GiB outside the ledger), {}; training \
             state: {}; policies: {}; save-attention {}",
            ctx.model.name,
            ctx.model.param_count() as f64 / 1e9,
            ctx.gpus,
            ctx.a.gpu_mem,
            ctx.a.reserve,
            ctx.device.name(),
            match ctx.a.optim_state.as_str() {
                "auto" => "auto (at each length the most exact that fits: f32, then BF16 \
                           gradients, then 8-bit moments, no master and BF16 gradients; `run it:` \
                           names it)"
                    .to_string(),
                _ => ctx.state.to_string(),
            },
            policy_text(&ctx),
            ctx.a.memory.save_attention,
        );
        match ctx.a.memory.checkpoint_every {
            Some(CheckpointEvery::Auto) => println!(
                "checkpoint-every auto: at each length, the segments with the fewest recomputed \
                 blocks that fit (ckpt every)"
            ),
            Some(k) => {
                println!("checkpoint-every {k}: one checkpointed block input every {k} blocks")
            }
            None => {}
        }
        if let Some(c) = &ctx.cudnn {
            println!("{}", c.line());
        }
        println!("{}", host_line(&ctx));
        if !ctx.freeze.is_empty() && ctx.lora.is_none() {
            let (frozen, all) = ctx.freeze.frozen_elements(&ctx.model);
            println!(
                "--freeze {}: {:.2}B of {:.2}B parameters frozen (no gradients, no optimizer state)",
                ctx.freeze,
                frozen as f64 / 1e9,
                all as f64 / 1e9
            );
        }
        if let Some(lora) = &ctx.lora {
            println!("{}", crate::cli::lora::plan_line(lora, &ctx.model));
        }
    }
    match ctx.a.seq {
        Some(seq) => breakdown(&ctx, seq),
        None if ctx.a.svg.is_some() => crate::config_err!(
            "--svg draws the memory at one length: add --seq (or [data] seq in --config)"
        ),
        None => search(&ctx),
    }
}

/// Where the pinned host budget came from, and what it is per rank.
fn host_line(ctx: &Ctx) -> String {
    match (ctx.budget.host, ctx.a.host_mem) {
        (Some(h), Some(g)) => format!(
            "host memory for offload: {} per rank (--host-mem {g})",
            Bytes(h)
        ),
        (Some(h), None) => format!(
            "host memory for offload: {} per rank (this machine's available memory less what the \
             system keeps, shared by {} GPUs; --host-mem GIB plans another node, --host-mem inf none)",
            Bytes(h),
            ctx.gpus.min(ctx.a.gpus_per_node)
        ),
        (None, Some(_)) => "host memory for offload: unlimited (--host-mem inf)".into(),
        (None, None) => {
            "host memory for offload: unchecked (not known here; --host-mem GIB plans it)".into()
        }
    }
}

/// The policies in effect, as `--policies` lists them.
fn policy_text(ctx: &Ctx) -> String {
    let m = &ctx.memory;
    let offload_auto = m.offload == OffloadBlocks::Auto;
    let p = m.policy(ctx.model.layers, ctx.model.layers);
    let on = [
        (p.checkpoint, "checkpoint"),
        (p.offload > 0 && !offload_auto, "offload"),
        (offload_auto, "offload-auto"),
        (p.offload_optimizer > 0, "offload-optimizer"),
        (p.tiled_mlp, "tiled-mlp"),
        (ctx.fsdp, "fsdp"),
    ];
    let v: Vec<&str> = on.iter().filter(|x| x.0).map(|x| x.1).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(",")
    }
}

/// GPUs: `--gpus`, or the product of the mesh flags given; with neither,
/// the ranks `upipe train` fits its mesh to here (the second value: the
/// visible GPUs, else `None`, the CPU default mesh).
fn plan_gpus(a: &PlanArgs) -> Result<(usize, Option<Option<usize>>)> {
    a.mesh.validate()?;
    let mesh = [a.mesh.data_parallel, a.mesh.ulysses, a.mesh.ring];
    for (id, degree) in ["data_parallel", "ulysses", "ring"].into_iter().zip(mesh) {
        if let Some(d) = degree {
            at_most_planned(&format!("--{}", id.replace('_', "-")), d)?;
        }
    }
    let (gpus, fitted) = match a.gpus {
        Some(g) => (g, None),
        None if mesh.iter().any(Option::is_some) => {
            let product = mesh
                .iter()
                .try_fold(1usize, |p, d| p.checked_mul(d.unwrap_or(1)));
            (product.unwrap_or(usize::MAX), None)
        }
        None => match crate::cli::train::visible_gpus() {
            g if g >= 1 => (g, Some(Some(g))),
            _ => (CPU_DEFAULT_MESH.world_size(), Some(None)),
        },
    };
    at_least(PlanArgs::KEYS, "gpus", gpus, 1)?;
    at_most_planned("the GPUs (--gpus, or the product of the mesh flags)", gpus)?;
    if let Some(d) = a.mesh.data_parallel
        && !gpus.is_multiple_of(d)
    {
        return crate::config_err!("--gpus {gpus} is not a multiple of --data-parallel {d}");
    }
    Ok((gpus, fitted))
}

/// The flags parsed and checked.
fn validate(a: PlanArgs) -> Result<Ctx> {
    let k = PlanArgs::KEYS;
    let model = for_key(k, "model", ModelConfig::resolve(&a.model))?;
    let (gpus, fitted) = plan_gpus(&a)?;
    at_least(k, "gpus_per_node", a.gpus_per_node, 1)?;
    at_least(k, "grad_accum", a.grad_accum, 1)?;
    if let Some(seq) = a.seq {
        at_least(k, "seq", seq, 1)?;
        at_most_tokens("--seq", seq)?;
    }
    at_least(k, "max_seq", a.max_seq, 1)?;
    at_most_tokens("--max-seq", a.max_seq)?;
    a.memory.validate()?;
    let kernel = for_key(k, "attn_kernel", a.attn_kernel.parse())?;
    let (device, cudnn) = plan_device(&a.device, kernel, a.cudnn_version)?;
    let (budget, rank_budget) = plan_budget(&a, gpus)?;
    let (memory, fsdp_mode) = memory_choices(&a, model.layers)?;
    let lora_run = a.lora.run(&model)?;
    let freeze = LoraArgs::freeze(lora_run.as_ref(), a.memory.freeze(&model)?);
    let policy = memory.policy(model.layers, model.layers);
    a.memory.save_attention.check(policy, model.layers)?;
    memory.checkpoint_every.check(policy)?;
    let state = super::train::training_state(k, &a.optim_state, &a.master_weights, &a.grad_dtype)?;
    let precision: crate::backend::fp8::Precision = for_key(k, "precision", a.precision.parse())?;
    if precision.fp8_attention().any() {
        let documents = device.documents();
        crate::cli::train::kernel::fp8_attention_fits(
            precision,
            device.cudnn(),
            device.is_cuda(),
            &model,
            documents,
        )?;
    }
    // as every request decides it (the same GPUs, the same budget)
    let states = crate::plan::trained_state_bytes(&model, device.is_cuda(), &freeze, state);
    let (mut fsdp, mut fsdp_note) = fsdp_mode.resolve(gpus, states, rank_budget.memory);
    let replicated = freeze.split_unit(&model).is_some() || lora_run.is_some();
    if fsdp && fsdp_mode == FsdpMode::Auto && replicated {
        (fsdp, fsdp_note) = (false, None);
    }
    if let Some(run) = &lora_run {
        run.check(&model, &freeze)?;
    }
    let lora = lora_run.map(|l| l.config);
    if a.fsdp_replicate == 0
        || !gpus.is_multiple_of(a.fsdp_replicate)
        || (a.fsdp_replicate > 1 && !fsdp)
    {
        return Err(Error::Config(format!(
            "--fsdp-replicate {} needs the fsdp policy and must divide --gpus {gpus}",
            a.fsdp_replicate
        )));
    }
    let (all, strategies) = for_key(k, "attn", parse_attn(&a.attn, gpus))?;
    check_mesh(&a, gpus)?;
    Ok(Ctx {
        model,
        memory,
        freeze,
        lora,
        fsdp_mode,
        fsdp,
        fsdp_note,
        device,
        cudnn,
        gpus,
        fitted,
        all,
        strategies,
        budget,
        rank_budget,
        state,
        precision,
        a,
    })
}

/// Each rank's memory: `--gpu-mem` less `--reserve` for the ledger, and
/// its share of `--host-mem` for offloaded tensors, as the checks and as
/// the resolver take it.
fn plan_budget(a: &PlanArgs, gpus: usize) -> Result<(Budget, RankBudget)> {
    let memory = gib(a.gpu_mem, "--gpu-mem")?;
    let reserve = gib(a.reserve, "--reserve")?;
    let node = gpus.min(a.gpus_per_node);
    let host = match a.host_mem {
        Some(h) if h == f64::INFINITY => None,
        Some(h) => Some(host_share(gib(h, "--host-mem")?, node)),
        None if a.device == "cpu" => None,
        None => host_available_bytes().map(|b| host_share(default_pinned_budget(b), node)),
    };
    let rank = RankBudget::with_reserve(memory, reserve, host);
    let budget = Budget {
        device: memory.saturating_sub(reserve),
        host,
    };
    Ok((budget, rank))
}

/// The mesh flags divide the GPUs.
fn check_mesh(a: &PlanArgs, gpus: usize) -> Result<()> {
    if a.mesh.ulysses.is_none() && a.mesh.ring.is_none() {
        return Ok(());
    }
    let c = a
        .mesh
        .ulysses
        .unwrap_or(1)
        .saturating_mul(a.mesh.ring.unwrap_or(1))
        .saturating_mul(a.mesh.data_parallel.unwrap_or(1));
    if c == 0 || !gpus.is_multiple_of(c) {
        return crate::config_err!(
            "--gpus {gpus} is not a product of the mesh: {} (data) x {} (ulysses) x {} (ring) needs a multiple of {c} GPUs",
            a.mesh.data_parallel.unwrap_or(1),
            a.mesh.ulysses.unwrap_or(1),
            a.mesh.ring.unwrap_or(1)
        );
    }
    Ok(())
}

/// The end of a plan in which every strategy was skipped (their reasons
/// printed above): an error, since nothing was planned.
fn nothing_planned(ctx: &Ctx) -> Result<i32> {
    crate::config_err!(
        "nothing to plan: every strategy was skipped on {} GPUs (the reasons are above); \
         choose a number of GPUs or mesh flags (--ulysses, --ring, --data-parallel) that a \
         strategy of --attn accepts",
        ctx.gpus
    )
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

fn breakdown(ctx: &Ctx, seq: usize) -> Result<i32> {
    let json = ctx.a.json;
    if !json {
        let mut head = format!("{:<8} {:>9}  {POLICY_HEAD}", "method", "mesh");
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
    let mut bars = Vec::new();
    for &s in &ctx.strategies {
        let (p, spec) = match ctx.predict(s, seq) {
            Ok(x) => x,
            Err(e) => {
                skip_or_fail(ctx.all, s, e, json)?;
                continue;
            }
        };
        // the short length the search starts from (one every attention
        // kernel takes: cuDNN's FP8 graphs refuse a single token)
        let unit = seq_unit(spec.plan.layout.pu, spec.plan.layout.pr);
        let short = (unit / gcd(unit, 1024) * 1024).min(seq);
        let base = ctx.predict_resolved(s, short, true)?.0;
        let fits = ctx.budget.check(&p, Some(&base));
        let command = TrainCommand {
            model: &ctx.a.model,
            spec: &spec,
            seq,
            host_mem: ctx.a.host_mem,
        };
        if json {
            println!(
                "{}",
                json!({
                    "strategy": s.name(), "seq": seq, "mesh": mesh_json(&spec),
                    "peak_bytes": p.peak, "host_bytes": p.host_peak,
                    "by_category": by_category(&p), "peak_at": p.peak_at,
                    "fits": fits.is_none(), "limit": fits.as_ref().map(limit_text),
                    "save_attention": spec.policy.save_attention,
                    "checkpoint_every": spec.policy.checkpoint_every,
                    "offload_blocks": spec.policy.offload,
                    "optimizer_host_units": spec.policy.offload_optimizer,
                    "host_update": spec.policy.host_update.to_string(),
                    "cudnn_version": spec.device.cudnn().map(version_text),
                    "train_command": command.to_string(),
                })
            );
        } else {
            println!("{}", breakdown_line(s, &spec, &p, fits.is_none()));
            println!("  run it: {command}");
        }
        bars.push(category_bar(s, &spec, &p));
    }
    if bars.is_empty() {
        return nothing_planned(ctx);
    }
    if !json {
        println!("{POLICY_NOTE}");
    }
    if let Some(path) = &ctx.a.svg {
        write_svg(path, ctx, seq, &bars)?;
    }
    Ok(0)
}

/// `upipe plan --svg`: the breakdown's bars against the usable memory.
fn write_svg(path: &Path, ctx: &Ctx, seq: usize, bars: &[Bar]) -> Result<()> {
    let height = 120.0 + 40.0 * bars.len() as f64;
    let mut svg = Svg::new(900.0, height);
    let area = Area {
        x: 20.0,
        y: 50.0,
        w: 840.0,
        h: height - 90.0,
    };
    let title = format!(
        "{} on {} GPUs at seq {} ({}): device memory per rank at the peak by category, {{unit}}",
        ctx.model.name,
        ctx.gpus,
        seq,
        fmt_tokens(seq)
    );
    let usable = ctx.budget.device as f64;
    stacked_bars(&mut svg, area, &title, bars, Some((usable, "usable")));
    std::fs::write(path, svg.finish())
        .map_err(|e| Error::io(format!("writing --svg {}", path.display()), e))
}

fn search(ctx: &Ctx) -> Result<i32> {
    let json = ctx.a.json;
    if !json {
        println!(
            "{:<8} {:>9} {:>19} {:>12}  {POLICY_HEAD}  limit at the next length",
            "method", "mesh", "longest", "gpu peak"
        );
    }
    let mut planned = 0;
    for &s in &ctx.strategies {
        // any length that is a multiple of 2 x gpus x 1024 resolves the mesh
        let probe = 2 * ctx.gpus * 1024;
        let spec = match ctx.predict_resolved(s, probe, true) {
            Ok((_, spec)) => spec,
            Err(e) => {
                skip_or_fail(ctx.all, s, e, json)?;
                continue;
            }
        };
        let unit = seq_unit(spec.plan.layout.pu, spec.plan.layout.pr);
        let step = unit / gcd(unit, 1024) * 1024;
        let fit: Fit = longest_context(step, ctx.a.max_seq, ctx.budget, |seq| {
            ctx.predict_resolved(s, seq, true).map(|x| x.0)
        })?;
        // what the given --save-attention keeps at the longest length
        let saved = match fit.seq {
            0 => None,
            seq => Some(ctx.predict(s, seq)?.1),
        };
        print_longest(ctx, s, &spec, &fit, saved.as_ref());
        planned += 1;
    }
    if planned == 0 {
        return nothing_planned(ctx);
    }
    if !json {
        println!("{POLICY_NOTE}");
        if policy_text(ctx) == "none" {
            println!(
                "no memory policy given: --policies checkpoint,tiled-mlp,offload (with \
                 --offload-optimizer auto where the optimizer state binds) lengthens every row"
            );
        }
    }
    Ok(0)
}

/// One strategy's result of the search: a JSON line or a row of the table;
/// `saved` is the step at the longest length (none when nothing fits).
fn print_longest(ctx: &Ctx, s: Strategy, spec: &StepSpec, fit: &Fit, saved: Option<&StepSpec>) {
    let limit = fit.limit.as_ref();
    let command = saved.map(|spec| TrainCommand {
        model: &ctx.a.model,
        spec,
        seq: fit.seq,
        host_mem: ctx.a.host_mem,
    });
    if ctx.a.json {
        println!(
            "{}",
            json!({
                "strategy": s.name(), "mesh": mesh_json(spec), "longest_seq": fit.seq,
                "save_attention": saved.map(|s| s.policy.save_attention),
                "checkpoint_every": saved.map(|s| s.policy.checkpoint_every),
                "offload_blocks": saved.map(|s| s.policy.offload),
                "optimizer_host_units": saved.map(|s| s.policy.offload_optimizer),
                "host_update": saved.map(|s| s.policy.host_update.to_string()),
                "cudnn_version": spec.device.cudnn().map(version_text),
                "train_command": command.as_ref().map(ToString::to_string),
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
            "{:<8} {:>9} {:>19} {:>12}  {}  {}",
            s.name(),
            mesh_text(spec),
            format!("{} ({})", fit.seq, fmt_tokens(fit.seq)),
            fit.at_fit
                .as_ref()
                .map_or("-".into(), |p| Bytes(p.peak).to_string()),
            policy_cells(saved.unwrap_or(spec)),
            limit.map_or(
                format!("none up to --max-seq {}", ctx.a.max_seq),
                |(seq, l, p)| { format!("{seq} needs {}: {}", Bytes(p.peak), limit_text(l)) }
            )
        );
        if let Some(c) = &command {
            println!("  run it: {c}");
        }
    }
}
