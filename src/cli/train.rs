//! `upipe train`: with no arguments, the embedded default — tiny model,
//! bundled corpus, UPipe — on the CPU as 4 thread ranks (2 Ulysses x 2 ring),
//! or, where two or more GPUs are visible, as one process per GPU over NCCL
//! (`upipe train` launches them itself, as `upipe launch` would).
//!
//! Where a run goes ([`route`]):
//! - launched (`upipe launch`, torchrun, srun: `WORLD_SIZE` > 1): this
//!   process is one rank on GPU `LOCAL_RANK` with an NCCL mesh; the world
//!   size must equal the mesh size;
//! - not launched, `G >= 2` GPUs, a mesh of `W` ranks with `1 < W <= G`:
//!   starts `W` processes of itself, one per GPU (self-launch);
//! - otherwise ranks are threads: on the CPU, or spread round-robin over the
//!   visible GPUs with exchanges through host memory (`W > G`, one GPU, or
//!   one rank).
//!
//! With no mesh flag (`--data-parallel`, `--ulysses`, `--ring`) the mesh is
//! chosen for the ranks available ([`default_mesh`]): the launched world
//! size, or the visible GPUs; on the CPU it is 2 Ulysses x 2 ring.

use crate::attention::{CpPlan, Strategy};
use crate::backend::cuda::cudnn::AttnKernel;
use crate::backend::{Bytes, Category};
use crate::cli::schedule::FwdChunk;
use crate::comm::MeshShape;
use crate::comm::env::DistEnv;
use crate::error::{Error, Result};
use crate::model::decoder::attn_dims;
use crate::model::{MemoryPolicy, ModelConfig};
use crate::plan::{DeviceKind, SaveAttention};
use crate::train::data::{Tokens, load_tokens};
use crate::train::optim::AdamWConfig;
use crate::train::trainer::{
    StepReport, TrainConfig, TrainSummary, check_local_rank, check_world_size, train_cpu,
    train_process_rank,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// Flags of `upipe train`.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// Preset name (tiny, llama3.2-1b, llama3-8b, llama3-70b, qwen3-32b), config.json, or HF model dir.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Training data: a text file (tokenized with --tokenizer), or pre-tokenized
    /// ids: `.u32` (little-endian uint32) or `.u16`/`.bin` (uint16), memory-mapped
    /// and checked against the model's vocab_size. Default: the bundled corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Tokenizer for text data: `byte` (the default) or a path to an HF
    /// tokenizer.json; ignored, with a warning, for pre-tokenized data.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Start from the weights of an HF model directory (config.json + safetensors).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// Attention strategy: local, ulysses, ring, usp, upipe.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    /// Ulysses degree Pu (default 2; with no mesh flag at all, the default mesh, see below).
    #[arg(long)]
    pub ulysses: Option<usize>,
    /// Ring degree Pr (default 2; with no mesh flag at all, the default mesh).
    #[arg(long)]
    pub ring: Option<usize>,
    /// UPipe heads per stage U (default Pu).
    #[arg(long)]
    pub chunk_heads: Option<usize>,
    /// UPipe heads per forward stage: `auto` (the widest that keeps the
    /// planned peak of this run's step) or a number (see `bench attn --help`).
    #[arg(long, default_value_t = FwdChunk::Auto)]
    pub fwd_chunk_heads: FwdChunk,
    /// Data-parallel replicas, each its own context-parallel group (default 1;
    /// with no mesh flag at all the mesh fits the GPUs: one process per GPU).
    #[arg(long)]
    pub data_parallel: Option<usize>,
    /// Tokens per sequence (global, before context sharding).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    #[arg(long, default_value_t = 300)]
    pub steps: u32,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    #[arg(long, default_value_t = 3e-4)]
    pub min_lr: f32,
    #[arg(long, default_value_t = 20)]
    pub warmup: u32,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Full activation checkpointing per block.
    #[arg(long)]
    pub checkpoint: bool,
    /// Hold checkpointed block inputs in host memory (needs --checkpoint).
    #[arg(long)]
    pub offload: bool,
    /// Tiled MLP/RMSNorm (token tiles of about `hidden` rows).
    #[arg(long)]
    pub tiled_mlp: bool,
    /// Rows of logits per fused-loss chunk.
    #[arg(long, default_value_t = 256)]
    pub loss_chunk: usize,
    /// With --checkpoint: blocks (the last ones) that keep their attention
    /// output and LSEs, so their backward skips the attention recompute:
    /// none, all, N, or auto (as many as fit this GPU's memory, or this
    /// host's per rank, beside the rest of the planned step).
    #[arg(long, default_value_t = SaveAttention::Auto)]
    pub save_attention: SaveAttention,
    /// Directory for training checkpoints (safetensors + optimizer state).
    #[arg(long)]
    pub save_dir: Option<PathBuf>,
    /// Checkpoint every N steps (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub save_every: u32,
    /// Resume from --save-dir when it holds a checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Device: auto (cuda when a GPU is visible, else cpu), cpu, or cuda. On
    /// cuda with 2+ GPUs and a mesh of at most that many ranks, one process per
    /// GPU (NCCL; started by itself, or by `upipe launch`/torchrun/srun);
    /// otherwise ranks are threads (on GPUs: exchanges through host memory).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Attention kernel on GPUs: auto (cuDNN SDPA where it supports the call,
    /// else our kernels), cudnn (an error where it cannot), native (ours).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
    /// FSDP: shard parameters, gradients and optimizer state over every
    /// rank of the mesh. auto: on when the mesh has more than one rank and
    /// the whole model's states do not fit the device's memory; on; off.
    #[arg(long, default_value = "auto")]
    pub fsdp: String,
    /// HSDP (multi-node): shard inside groups of world/R consecutive ranks
    /// (one node each, typically) and replicate across the R groups;
    /// gradients are all-reduced across replicas after the reduce-scatter.
    #[arg(long, default_value_t = 1)]
    pub fsdp_replicate: usize,
    /// Host memory for offloaded tensors, GiB per node (default: the host's
    /// available memory, read at start); shared by the node's ranks.
    #[arg(long)]
    pub host_mem: Option<f64>,
    /// Sequences per optimizer step (per data replica): gradients
    /// accumulate over them, the loss is the mean over the step's tokens.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// One JSON object per step instead of a progress bar.
    #[arg(long)]
    pub json: bool,
}

/// `--fsdp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsdpMode {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for FsdpMode {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(FsdpMode::Auto),
            "on" => Ok(FsdpMode::On),
            "off" => Ok(FsdpMode::Off),
            other => crate::config_err!("--fsdp {other}: use auto, on or off"),
        }
    }
}

impl FsdpMode {
    /// Whether a run of `world` ranks shards, given the bytes of the whole
    /// model's states per rank and the memory each rank has (`None`:
    /// unknown); with a note to log when the choice needs saying.
    pub fn resolve(
        self,
        world: usize,
        states: usize,
        budget: Option<usize>,
    ) -> (bool, Option<String>) {
        match (self, world) {
            (FsdpMode::Off, _) => (false, None),
            (FsdpMode::On, 1) => (
                false,
                Some(
                    "--fsdp on with one rank: there is nothing to shard, training unsharded".into(),
                ),
            ),
            (FsdpMode::On, _) => (true, None),
            (FsdpMode::Auto, 1) => (false, None),
            (FsdpMode::Auto, _) => match budget {
                Some(b) if states <= b / 2 => (false, None),
                _ => (
                    true,
                    Some(format!(
                        "--fsdp auto: sharding over {world} ranks (the whole model's states are {} per rank)",
                        Bytes(states)
                    )),
                ),
            },
        }
    }
}

/// Refuses, before anything is allocated, a run the planner says cannot fit
/// the memory each rank has (GPU less what lies outside the ledger, or the
/// host's share on the CPU), and sets the pinned-host budget of GPU runs.
#[allow(clippy::too_many_arguments)]
fn preflight(
    spec: &crate::plan::StepSpec,
    predicted: &crate::plan::Prediction,
    budget: Option<usize>,
    host_mem_gib: Option<f64>,
    cfg: &mut TrainConfig,
    on_gpu: bool,
    shape: MeshShape,
    gpus: usize,
) -> Result<()> {
    use crate::plan::preflight::{RankMemory, check};
    let per_node = shape.world_size().min(gpus.max(1));
    let host = match host_mem_gib {
        Some(g) if g.is_finite() && g > 0.0 => Some((g * (1u64 << 30) as f64) as usize / per_node),
        Some(g) => return crate::config_err!("--host-mem {g}: give GiB per node, more than 0"),
        None => host_available_bytes().map(|b| b / per_node),
    };
    let Some(device) = budget else {
        return Ok(());
    };
    if on_gpu {
        cfg.host_budget = host;
        // the CUDA context, cuBLAS and cuDNN handles lie outside the ledger
        let mem = RankMemory {
            device: device.saturating_sub((1 << 30) / shape.world_size().div_ceil(gpus.max(1))),
            host,
        };
        return check(spec, predicted, mem);
    }
    // on the CPU the offloaded tensors share the same memory
    let mut whole = predicted.clone();
    whole.peak += predicted.host_peak;
    check(spec, &whole, RankMemory { device, host: None })
}

/// Device memory per rank: a GPU's memory, shared by the thread ranks on it.
fn gpu_memory_per_rank(world: usize, gpus: usize) -> Option<usize> {
    let mem = crate::backend::cuda::device::gpus()
        .ok()?
        .first()?
        .total_mem;
    Some(mem / world.div_ceil(gpus.max(1)))
}

/// `MemAvailable` of `/proc/meminfo` (Linux), in bytes.
pub fn host_available_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// cuda when a GPU is visible, else cpu.
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => crate::config_err!("--device {other}: use auto, cpu or cuda"),
        }
    }
}

/// The mesh flags as given (`None`: left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MeshFlags {
    pub data: Option<usize>,
    pub ulysses: Option<usize>,
    pub ring: Option<usize>,
}

/// Mesh degrees for a [`TrainConfig`]: data replicas, Ulysses and ring degree
/// (as `--data-parallel`, `--ulysses`, `--ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshChoice {
    pub data: usize,
    pub ulysses: usize,
    pub ring: usize,
}

impl MeshChoice {
    /// Ranks of the mesh.
    pub fn world_size(&self) -> usize {
        self.data * self.ulysses * self.ring
    }
}

/// The mesh of a run on the CPU, and the defaults of flags left out when
/// some mesh flag is given: one replica, 2 Ulysses x 2 ring.
pub const CPU_DEFAULT_MESH: MeshChoice = MeshChoice {
    data: 1,
    ulysses: 2,
    ring: 2,
};

/// Divisors of `n`, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The default mesh of exactly `n` ranks for `strategy` on `model` at `seq`
/// tokens, or `None` when no such mesh is valid.
///
/// Context parallelism first: the fewest data replicas, then, within one
/// context group of `C` ranks, the largest Ulysses degree that divides the
/// kv heads (no K/V replication), the ring taking the rest; larger Ulysses
/// degrees (replicating K/V) and data replicas only when nothing else fits.
/// `local` attention has no context group: `n` data replicas. For the tiny
/// model (4 heads, 2 kv heads, seq 256) this gives 2 GPUs: Pu 2; 4 GPUs:
/// Pu 2 x Pr 2 (the CPU default); 8 GPUs: Pu 2 x Pr 4; 3 GPUs: 3 replicas.
pub fn default_mesh(
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    n: usize,
) -> Option<MeshChoice> {
    if n == 0 {
        return None;
    }
    if strategy == Strategy::Local {
        return Some(MeshChoice {
            data: n,
            ulysses: 1,
            ring: 1,
        });
    }
    let dims = attn_dims(model);
    for data in divisors(n) {
        let c = n / data;
        let mut pus = divisors(c);
        // no K/V replication first, then the largest Ulysses degree
        pus.sort_by_key(|&pu| (pu > model.kv_heads, std::cmp::Reverse(pu)));
        for pu in pus {
            let (ulysses, ring) = match strategy {
                Strategy::Ulysses => (c, 1),
                Strategy::Ring => (1, c),
                _ => (pu, c / pu),
            };
            if CpPlan::new(strategy, &dims, seq, ulysses, ring, chunk_heads).is_ok() {
                return Some(MeshChoice {
                    data,
                    ulysses,
                    ring,
                });
            }
        }
    }
    None
}

/// The mesh of a run. With any mesh flag given, the flags (left-out ones at
/// [`CPU_DEFAULT_MESH`]); with none and `ranks` available (the launched
/// world size, or the visible GPUs), [`default_mesh`] for them; otherwise
/// the CPU default. `local` attention always has Ulysses and ring degree 1.
pub fn resolve_mesh(
    flags: MeshFlags,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    chunk_heads: Option<usize>,
    ranks: Option<usize>,
) -> MeshChoice {
    let given = flags.data.is_some() || flags.ulysses.is_some() || flags.ring.is_some();
    let fitted = ranks
        .filter(|_| !given)
        .and_then(|n| default_mesh(strategy, model, seq, chunk_heads, n));
    if let Some(m) = fitted {
        return m;
    }
    let d = CPU_DEFAULT_MESH;
    let mut m = MeshChoice {
        data: flags.data.unwrap_or(d.data),
        ulysses: flags.ulysses.unwrap_or(d.ulysses),
        ring: flags.ring.unwrap_or(d.ring),
    };
    if strategy == Strategy::Local {
        m.ulysses = 1;
        m.ring = 1;
    }
    m
}

/// Where this process sits when a launcher started it with more than one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launched {
    pub world_size: usize,
    pub local_rank: usize,
}

impl Launched {
    /// A launch of more than one process (a world of one trains like an
    /// unlaunched process, e.g. `upipe train` inside a one-task `srun`).
    pub fn from_env(env: Option<&DistEnv>) -> Option<Launched> {
        env.filter(|e| e.world_size > 1).map(|e| Launched {
            world_size: e.world_size,
            local_rank: e.local_rank,
        })
    }
}

/// How a run executes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Ranks as threads on the CPU.
    CpuThreads,
    /// Ranks as threads spread round-robin over `gpus` GPUs, exchanging
    /// through host memory; `why` says why not one process per GPU.
    GpuThreads { gpus: usize, why: String },
    /// This process is one NCCL rank of a launched run.
    ProcessRank,
    /// Start `nproc` processes of this command, one per GPU.
    SelfLaunch { nproc: usize },
}

/// Decides where a run of mesh `shape` goes (see the module docs), given the
/// launch (if any), the visible GPUs and whether NCCL loads (asked only
/// before a self-launch). Errors name the fix.
pub fn route(
    device: Device,
    launched: Option<Launched>,
    gpus: usize,
    shape: MeshShape,
    nccl: &dyn Fn() -> std::result::Result<(), String>,
) -> Result<Route> {
    route_for("train", device, launched, gpus, shape, nccl)
}

/// [`route`] for the subcommand `command` (`train`, `eval`), named in its errors.
pub fn route_for(
    command: &str,
    device: Device,
    launched: Option<Launched>,
    gpus: usize,
    shape: MeshShape,
    nccl: &dyn Fn() -> std::result::Result<(), String>,
) -> Result<Route> {
    if device == Device::Cuda && gpus == 0 {
        return crate::config_err!(
            "--device cuda: no GPU is visible (see `upipe info`); use --device cpu"
        );
    }
    if let Some(l) = launched {
        let how = format!(
            "this process was launched as one of {} ranks (RANK/WORLD_SIZE or SLURM_PROCID set), \
             and a multi-process `upipe {command}` runs one NCCL rank per GPU",
            l.world_size
        );
        if device == Device::Cpu {
            return crate::config_err!(
                "--device cpu: {how}; on the CPU the ranks are threads of one process: \
                 run `upipe {command} --device cpu` without upipe launch/torchrun/srun"
            );
        }
        if gpus == 0 {
            return crate::config_err!(
                "no GPU is visible (see `upipe info`), but {how}; run `upipe {command}` without \
                 upipe launch/torchrun/srun to run with CPU thread ranks"
            );
        }
        check_world_size(shape, l.world_size)?;
        check_local_rank(l.local_rank, gpus)?;
        return Ok(Route::ProcessRank);
    }
    let w = shape.world_size();
    if device == Device::Cpu || gpus == 0 {
        return Ok(Route::CpuThreads);
    }
    let threads = |why: String| Ok(Route::GpuThreads { gpus, why });
    if w == 1 {
        return threads("the mesh has one rank".into());
    }
    if gpus == 1 {
        return threads(format!(
            "one GPU is visible: the {w} thread ranks share it and exchange through host memory"
        ));
    }
    if w > gpus {
        return threads(format!(
            "the mesh has {w} ranks but {gpus} GPUs are visible: thread ranks share the GPUs \
             and exchange through host memory; a mesh of at most {gpus} ranks (or no mesh flag) \
             runs one NCCL process per GPU"
        ));
    }
    if let Err(e) = nccl() {
        return threads(format!(
            "NCCL is not available ({e}): thread ranks exchange through host memory"
        ));
    }
    Ok(Route::SelfLaunch { nproc: w })
}

/// Thread ranks spread round-robin over `gpus` devices.
fn train_on_gpus(
    cfg: &TrainConfig,
    tokens: Tokens,
    gpus: usize,
    kernel: AttnKernel,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    use crate::backend::cuda::CudaBackend;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // open every device once here, so a failure is an error rather than a
    // failure inside a rank thread
    for g in 0..gpus {
        CudaBackend::new(g)?;
    }
    let next = AtomicUsize::new(0);
    let make = || {
        let g = next.fetch_add(1, Ordering::Relaxed) % gpus;
        let mut b = CudaBackend::new(g).expect("the device opened a moment ago");
        b.set_attn_kernel(kernel);
        b.set_host_budget(cfg.host_budget);
        b
    };
    crate::train::trainer::train_threads(cfg, tokens, make, on_step)
}

/// GPUs visible to the driver (none when CUDA is unavailable).
pub fn visible_gpus() -> usize {
    crate::backend::cuda::device::gpus().map_or(0, |g| g.len())
}

pub fn run(a: TrainArgs) -> Result<i32> {
    let device: Device = a.device.parse()?;
    let kernel: AttnKernel = a.attn_kernel.parse()?;
    let gpus = if device == Device::Cpu {
        0
    } else {
        visible_gpus()
    };
    let env = DistEnv::from_env()?;
    let launched = Launched::from_env(env.as_ref());
    let model = ModelConfig::resolve(&a.model)?;
    let strategy: Strategy = a.attn.parse()?;
    // ranks the default mesh should fill: the launched processes, or the GPUs
    let ranks = match launched {
        Some(l) => Some(l.world_size),
        None if device != Device::Cpu && gpus >= 1 => Some(gpus),
        None => None,
    };
    let flags = MeshFlags {
        data: a.data_parallel,
        ulysses: a.ulysses,
        ring: a.ring,
    };
    let mesh = resolve_mesh(flags, strategy, &model, a.seq, a.chunk_heads, ranks);
    let mut cfg = TrainConfig {
        model,
        data_parallel: mesh.data,
        strategy,
        ulysses: mesh.ulysses,
        ring: mesh.ring,
        chunk_heads: a.chunk_heads,
        fwd_chunk_heads: match a.fwd_chunk_heads {
            FwdChunk::Heads(n) => Some(n),
            FwdChunk::Auto => None,
        },
        seq: a.seq,
        steps: a.steps,
        optim: AdamWConfig {
            weight_decay: a.weight_decay,
            clip: a.clip,
            ..AdamWConfig::schedule(a.lr, a.min_lr, a.warmup, a.steps)
        },
        seed: a.seed,
        policy: MemoryPolicy {
            checkpoint: a.checkpoint,
            offload: a.offload,
            tiled_mlp: a.tiled_mlp,
            loss_chunk: a.loss_chunk,
            save_attention: 0,
        },
        init_from: a.init_from.clone(),
        save_dir: a.save_dir.clone(),
        save_every: a.save_every,
        resume: a.resume,
        fsdp: false,
        fsdp_replicas: 1,
        max_file_bytes: crate::train::fsdp::checkpoint::FILE_BYTES,
        grad_accum: a.grad_accum,
        host_budget: None,
    };
    let mut plan = cfg.plan()?;
    a.save_attention.check(cfg.policy, cfg.model.layers)?;
    let shape = cfg.mesh_shape(&plan);
    let fsdp_mode: FsdpMode = a.fsdp.parse()?;
    let nccl = || {
        crate::comm::nccl::library()
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let route = route(device, launched, gpus, shape, &nccl)?;
    match &route {
        Route::SelfLaunch { nproc } => {
            // each child resolves the same mesh: the same flags, or with no
            // mesh flag `default_mesh` for its world size, the parent's mesh size
            let child = crate::cli::launch::own_command("train")?;
            tracing::info!(
                "{gpus} GPUs visible: starting {nproc} processes, one per GPU (NCCL), \
                 mesh data {} x Pu {} x Pr {}",
                shape.data,
                shape.ulysses,
                shape.ring
            );
            return crate::cli::launch::run_local(*nproc, child);
        }
        Route::GpuThreads { why, .. } => tracing::info!("thread ranks on GPUs: {why}"),
        Route::CpuThreads | Route::ProcessRank => {}
    }
    // under a launch only rank 0 reports
    let lead = route != Route::ProcessRank || env.as_ref().is_none_or(|e| e.rank == 0);
    let tokens = load_tokens(a.data.as_deref(), a.tokenizer.as_deref(), cfg.model.vocab)?;
    let on_gpu = route != Route::CpuThreads;
    let budget = if on_gpu {
        gpu_memory_per_rank(shape.world_size(), gpus)
    } else {
        host_available_bytes().map(|b| b / shape.world_size())
    };
    let states = crate::plan::model_state_bytes(&cfg.model, on_gpu);
    let (fsdp, note) = fsdp_mode.resolve(shape.world_size(), states, budget);
    cfg.fsdp = fsdp;
    if a.fsdp_replicate != 1 {
        if !fsdp {
            return crate::config_err!(
                "--fsdp-replicate {} needs sharding: add --fsdp on (this run resolved to unsharded)",
                a.fsdp_replicate
            );
        }
        cfg.fsdp_replicas = a.fsdp_replicate;
        cfg.plan()?;
    }
    if let (Some(note), true) = (note, lead) {
        tracing::warn!("{note}");
    }
    let kind = DeviceKind::of_run(on_gpu, kernel);
    let room = budget.map(|b| kind.ledger_budget(b));
    cfg.policy.save_attention = a
        .save_attention
        .resolve(&cfg.step_spec(&plan, kind), room)?;
    if cfg.policy.checkpoint && lead {
        tracing::info!(
            "--save-attention {}: the last {} of {} blocks keep their attention output",
            a.save_attention,
            cfg.policy.save_attention,
            cfg.model.layers
        );
    }
    // what `upipe plan` predicts for a step of `plan` here (rank 0's ledger peak)
    let spec_of = |plan: &CpPlan| crate::plan::StepSpec {
        model: cfg.model.clone(),
        plan: plan.clone(),
        data: cfg.data_parallel,
        policy: cfg.policy,
        fsdp: cfg.fsdp,
        fsdp_replicas: cfg.fsdp_replicas,
        grad_accum: cfg.grad_accum,
        device: if on_gpu {
            crate::plan::DeviceKind::cuda_with(kernel)
        } else {
            crate::plan::DeviceKind::Cpu
        },
        optimizer: true,
    };
    let predict = |plan: &CpPlan| crate::plan::predict_step_rank(&spec_of(plan), 0);
    if a.fwd_chunk_heads == FwdChunk::Auto {
        let wide = a
            .fwd_chunk_heads
            .apply(plan.clone(), |p| Ok(predict(p)?.peak))?;
        if wide.strategy == Strategy::Upipe {
            cfg.fwd_chunk_heads = Some(wide.fwd_schedule.chunk);
        }
        plan = wide;
    }
    if !a.json && lead {
        println!(
            "training {} ({:.2}M params) on {} tokens: {} on {} {} (data {} x Pu {} x Pr {}, U {}), seq {}, {} steps",
            cfg.model.name,
            cfg.model.param_count() as f64 / 1e6,
            tokens.len(),
            strategy,
            shape.world_size(),
            match route {
                Route::ProcessRank => "GPU process ranks (NCCL)",
                Route::GpuThreads { .. } => "GPU thread ranks",
                _ => "CPU thread ranks",
            },
            cfg.data_parallel,
            plan.layout.pu,
            plan.layout.pr,
            plan.chunk_text(),
            cfg.seq,
            cfg.steps
        );
    }
    let predicted = predict(&plan)?;
    preflight(
        &spec_of(&plan),
        &predicted,
        budget,
        a.host_mem,
        &mut cfg,
        on_gpu,
        shape,
        gpus,
    )?;
    let predicted_peak = predicted.peak;
    let bar = if a.json || !lead {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(cfg.steps as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
        );
        b
    };
    // without a terminal (e.g. under a launcher) progress goes out as lines
    let lines = !a.json && lead && bar.is_hidden();
    let every = (cfg.steps / 20).max(1);
    let json = a.json;
    let on_step = |r: &StepReport| {
        let msg = format!(
            "loss {:.4}  {:.0} tok/s  peak {}",
            r.loss,
            r.tokens_per_s,
            Bytes(r.peak_bytes)
        );
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "step": r.step, "loss": r.loss, "tokens_per_s": r.tokens_per_s,
                    "peak_bytes": r.peak_bytes, "lr": r.lr, "grad_norm": r.grad_norm,
                    "tokens": r.tokens,
                    "predicted_peak_bytes": predicted_peak,
                })
            );
        } else if lines {
            if r.step.is_multiple_of(every) || r.step == cfg.steps {
                println!("step {}/{}  {msg}", r.step, cfg.steps);
            }
        } else {
            bar.set_position(r.step as u64);
            bar.set_message(msg);
        }
    };
    let summary = match route {
        Route::ProcessRank => {
            let env = env.as_ref().expect("a launched run has its environment");
            train_process_rank(&cfg, tokens, env, kernel, &on_step)?
        }
        Route::GpuThreads { gpus, .. } => train_on_gpus(&cfg, tokens, gpus, kernel, &on_step)?,
        _ => train_cpu(&cfg, tokens, &on_step)?,
    };
    bar.finish();
    if json || !lead {
        return Ok(0);
    }
    let measured = summary.memory.peak;
    let diff = 100.0 * (predicted.peak as f64 - measured as f64) / measured.max(1) as f64;
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
        println!(
            "throughput: median {:.0} tok/s over steps 2..{} ({} ranks)",
            rates[rates.len() / 2],
            cfg.steps,
            summary.ranks
        );
    }
    println!(
        "peak of rank 0: predicted {} (upipe plan), measured {} ({diff:+.2}%)",
        Bytes(predicted.peak),
        Bytes(measured)
    );
    println!("memory of rank 0 (peak {}):", Bytes(summary.memory.peak));
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
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::launch::rank_command;

    fn tiny() -> ModelConfig {
        ModelConfig::resolve("tiny").unwrap()
    }

    fn mesh(data: usize, ulysses: usize, ring: usize) -> MeshChoice {
        MeshChoice {
            data,
            ulysses,
            ring,
        }
    }

    fn shape(data: usize, ring: usize, ulysses: usize) -> MeshShape {
        MeshShape::new(data, ring, ulysses).unwrap()
    }

    fn no_nccl() -> std::result::Result<(), String> {
        Err("libnccl.so.2 not found".into())
    }

    fn nccl_ok() -> std::result::Result<(), String> {
        Ok(())
    }

    fn config_error(r: Result<Route>) -> String {
        match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn default_mesh_fills_the_gpus_within_the_tiny_models_heads() {
        let m = tiny(); // 4 heads, 2 kv heads
        let up = |n| default_mesh(Strategy::Upipe, &m, 256, None, n).unwrap();
        assert_eq!(up(1), mesh(1, 1, 1));
        assert_eq!(up(2), mesh(1, 2, 1));
        assert_eq!(up(4), mesh(1, 2, 2), "the CPU default");
        assert_eq!(up(8), mesh(1, 2, 4));
        // 3 ranks: Pu 3 does not divide 4 heads, a ring of 3 not 256 tokens
        // (2 x 3 zigzag chunks): three replicas
        assert_eq!(up(3), mesh(3, 1, 1));
        // the ring of 8 ranks needs 16 | seq; at seq 8 it is Pu 2 x Pr 2 x 2 replicas
        assert_eq!(
            default_mesh(Strategy::Upipe, &m, 8, None, 8),
            Some(mesh(2, 2, 2))
        );
        // K/V replication (Pu 4 > 2 kv heads) when nothing else fits
        assert_eq!(
            default_mesh(Strategy::Ulysses, &m, 256, None, 4),
            Some(mesh(1, 4, 1))
        );
        assert_eq!(
            default_mesh(Strategy::Ring, &m, 256, None, 2),
            Some(mesh(1, 1, 2))
        );
        assert_eq!(
            default_mesh(Strategy::Local, &m, 256, None, 2),
            Some(mesh(2, 1, 1))
        );
        // every default is a valid plan of exactly n ranks
        for s in [
            Strategy::Upipe,
            Strategy::Usp,
            Strategy::Ulysses,
            Strategy::Ring,
        ] {
            for n in 1..=8 {
                let c = default_mesh(s, &m, 256, None, n).unwrap();
                assert_eq!(c.world_size(), n, "{s} {n}");
                let plan = CpPlan::new(s, &attn_dims(&m), 256, c.ulysses, c.ring, None).unwrap();
                assert_eq!(plan.mesh_shape().world_size() * c.data, n);
            }
        }
        assert_eq!(default_mesh(Strategy::Upipe, &m, 256, None, 0), None);
    }

    #[test]
    fn mesh_flags_win_over_the_default_mesh() {
        let m = tiny();
        let none = MeshFlags::default();
        let r = |flags, ranks| resolve_mesh(flags, Strategy::Upipe, &m, 256, None, ranks);
        assert_eq!(r(none, None), CPU_DEFAULT_MESH);
        assert_eq!(r(none, Some(2)), mesh(1, 2, 1));
        assert_eq!(r(none, Some(8)), mesh(1, 2, 4));
        // any flag given: the flags, the rest at 1 x 2 x 2
        let ring1 = MeshFlags {
            ring: Some(1),
            ..none
        };
        assert_eq!(r(ring1, Some(8)), mesh(1, 2, 1));
        let data2 = MeshFlags {
            data: Some(2),
            ..none
        };
        assert_eq!(r(data2, Some(2)), mesh(2, 2, 2));
        let local = resolve_mesh(data2, Strategy::Local, &m, 256, None, None);
        assert_eq!(local, mesh(2, 1, 1));
    }

    #[test]
    fn routes() {
        let w2 = shape(1, 1, 2);
        let w4 = shape(1, 2, 2);
        let auto = |gpus, s| route(Device::Auto, None, gpus, s, &nccl_ok).unwrap();
        assert_eq!(auto(0, w4), Route::CpuThreads);
        assert_eq!(auto(2, w2), Route::SelfLaunch { nproc: 2 });
        assert_eq!(auto(8, w4), Route::SelfLaunch { nproc: 4 });
        assert_eq!(
            route(Device::Cuda, None, 2, w2, &nccl_ok).unwrap(),
            Route::SelfLaunch { nproc: 2 }
        );
        // --device cpu never launches
        assert_eq!(
            route(Device::Cpu, None, 0, w2, &nccl_ok).unwrap(),
            Route::CpuThreads
        );
        let why = |r: Route| match r {
            Route::GpuThreads { why, .. } => why,
            other => panic!("expected thread ranks on GPUs, got {other:?}"),
        };
        let w = why(auto(2, w4));
        assert!(w.contains("4 ranks but 2 GPUs"), "{w}");
        assert!(why(auto(1, w2)).contains("one GPU"));
        assert!(why(auto(2, shape(1, 1, 1))).contains("one rank"));
        let w = why(route(Device::Auto, None, 2, w2, &no_nccl).unwrap());
        assert!(w.contains("libnccl.so.2 not found"), "{w}");
        let e = config_error(route(Device::Cuda, None, 0, w2, &nccl_ok));
        assert!(e.contains("--device cpu"), "{e}");
    }

    #[test]
    fn launched_ranks_and_their_errors() {
        let l = |world_size, local_rank| {
            Some(Launched {
                world_size,
                local_rank,
            })
        };
        let w2 = shape(1, 1, 2);
        let never = || -> std::result::Result<(), String> {
            panic!("NCCL is not asked about under a launch")
        };
        assert_eq!(
            route(Device::Auto, l(2, 1), 2, w2, &never).unwrap(),
            Route::ProcessRank
        );
        let e = config_error(route(Device::Auto, l(2, 0), 2, shape(1, 2, 2), &never));
        assert!(
            e.contains("needs 4 processes, but 2 were launched")
                && e.contains("--nproc-per-node 4"),
            "{e}"
        );
        let e = config_error(route(Device::Auto, l(4, 3), 2, shape(1, 2, 2), &never));
        assert!(
            e.contains("LOCAL_RANK is 3") && e.contains("--nproc-per-node 2"),
            "{e}"
        );
        let e = config_error(route(Device::Cpu, l(2, 0), 0, w2, &never));
        assert!(
            e.contains("--device cpu") && e.contains("without upipe launch"),
            "{e}"
        );
        let e = config_error(route(Device::Auto, l(2, 0), 0, w2, &never));
        assert!(e.contains("no GPU is visible"), "{e}");
        // a world of one is no launch (one-task srun on a CPU node)
        let env = DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        };
        assert_eq!(Launched::from_env(Some(&env)), None);
        let env2 = DistEnv {
            world_size: 2,
            rank: 1,
            local_rank: 1,
            ..env
        };
        assert_eq!(Launched::from_env(Some(&env2)), l(2, 1));
    }

    #[test]
    fn self_launched_children_resolve_the_parents_mesh() {
        let argv: Vec<String> = ["train", "--steps", "3"].map(String::from).to_vec();
        assert_eq!(rank_command(&argv, "train").unwrap(), argv);
        let e = rank_command(&["eval".to_string()], "train").unwrap_err();
        assert!(e.to_string().contains("upipe launch"), "{e}");
        let m = tiny();
        for s in [Strategy::Upipe, Strategy::Ulysses, Strategy::Local] {
            for flags in [
                MeshFlags::default(),
                MeshFlags {
                    ring: Some(1),
                    ..MeshFlags::default()
                },
            ] {
                for gpus in 2..=8 {
                    let parent = resolve_mesh(flags, s, &m, 256, None, Some(gpus));
                    let w = parent.world_size();
                    if w > 1 && w <= gpus {
                        let child = resolve_mesh(flags, s, &m, 256, None, Some(w));
                        assert_eq!(child, parent, "{s} {flags:?} on {gpus} GPUs");
                    }
                }
            }
        }
    }

    #[test]
    fn device_parses() {
        assert_eq!("auto".parse::<Device>().unwrap(), Device::Auto);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda);
        let e = "tpu".parse::<Device>().unwrap_err();
        assert!(e.to_string().contains("auto, cpu or cuda"), "{e}");
    }
}
