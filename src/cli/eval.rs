//! `upipe eval`: the mean next-token cross-entropy of an HF checkpoint on a
//! token file, forward only, under any strategy and mesh, overall and by
//! position within the window — for checking against other frameworks on
//! the same weights, and for long-context evaluation.
//!
//! Runs go where `upipe train`'s would ([`route_for`]): on the CPU (f32) as
//! thread ranks; on GPUs (bf16) as one process per GPU (started by itself,
//! or by `upipe launch`/torchrun/srun), or as thread ranks spread over the
//! GPUs when the mesh has more ranks than GPUs.

use crate::attention::Strategy;
use crate::backend::cuda::cudnn::AttnKernel;
use crate::cli::train::{Device, Launched, MeshChoice, Route, default_mesh, route_for};
use crate::comm::env::DistEnv;
use crate::error::Result;
use crate::model::ModelConfig;
use crate::train::checkpoint::load_hf_model;
use crate::train::data::Tokens;
use crate::train::eval::{EvalConfig, EvalReport, eval_cpu, eval_process_rank, eval_threads};
use std::path::PathBuf;

/// Flags of `upipe eval`.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// HF model directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Token ids: `.u32` (little-endian uint32) or `.u16`/`.bin` (uint16),
    /// memory-mapped and checked against the model's vocab_size.
    #[arg(long)]
    pub tokens: PathBuf,
    /// Inputs per window: the file is evaluated as consecutive windows of this
    /// many tokens (default: the whole file as one sequence).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Also report the loss over this many equal ranges of positions within
    /// the window (`by_position`).
    #[arg(long, default_value_t = 1)]
    pub buckets: usize,
    /// Attention strategy: local, ulysses, ring, usp, upipe.
    #[arg(long, default_value = "upipe")]
    pub attn: String,
    /// Ulysses degree Pu (default 1; with no mesh flag on 2+ GPUs or under a
    /// launch, the mesh fits the ranks as `upipe train`'s does).
    #[arg(long)]
    pub ulysses: Option<usize>,
    /// Ring degree Pr (default 1).
    #[arg(long)]
    pub ring: Option<usize>,
    /// Data replicas, each evaluating every N-th window (default 1).
    #[arg(long)]
    pub data_parallel: Option<usize>,
    /// UPipe heads per stage U (default Pu).
    #[arg(long)]
    pub chunk_heads: Option<usize>,
    /// UPipe heads per forward stage (default U).
    #[arg(long)]
    pub fwd_chunk_heads: Option<usize>,
    /// Rows of logits computed at once.
    #[arg(long, default_value_t = 256)]
    pub loss_chunk: usize,
    /// Device: auto (cuda when a GPU is visible, else cpu), cpu (f32), or cuda
    /// (bf16; one process per GPU as `upipe train`).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Attention kernel on GPUs: auto, cudnn, native (see `upipe train --help`).
    #[arg(long, default_value = "auto")]
    pub attn_kernel: String,
}

/// The mesh: the flags (left-out ones 1), or with none given and `ranks`
/// available, `upipe train`'s default mesh for them.
fn eval_mesh(
    a: &EvalArgs,
    strategy: Strategy,
    model: &ModelConfig,
    seq: usize,
    ranks: Option<usize>,
) -> MeshChoice {
    let given = a.data_parallel.is_some() || a.ulysses.is_some() || a.ring.is_some();
    // a length every mesh of n ranks divides, since eval pads the window
    let fitted = ranks.filter(|_| !given).and_then(|n| {
        default_mesh(
            strategy,
            model,
            seq.next_multiple_of(2 * n),
            a.chunk_heads,
            n,
        )
    });
    fitted.unwrap_or(MeshChoice {
        data: a.data_parallel.unwrap_or(1),
        ulysses: a.ulysses.unwrap_or(1),
        ring: a.ring.unwrap_or(1),
    })
}

pub fn run(a: EvalArgs) -> Result<i32> {
    let device: Device = a.device.parse()?;
    let kernel: AttnKernel = a.attn_kernel.parse()?;
    let gpus = match device {
        Device::Cpu => 0,
        _ => crate::cli::train::visible_gpus(),
    };
    let env = DistEnv::from_env()?;
    let launched = Launched::from_env(env.as_ref());
    let model = ModelConfig::resolve(&a.model_dir.to_string_lossy())?;
    let tokens = Tokens::open_checked(&a.tokens, model.vocab)?;
    let strategy: Strategy = a.attn.parse()?;
    let mut cfg = EvalConfig {
        strategy,
        chunk_heads: a.chunk_heads,
        fwd_chunk_heads: a.fwd_chunk_heads,
        seq: a.seq,
        buckets: a.buckets,
        loss_chunk: a.loss_chunk,
        ..EvalConfig::new(model.clone())
    };
    let seq = cfg.windows(&tokens)?.seq;
    let ranks = match launched {
        Some(l) => Some(l.world_size),
        None if device != Device::Cpu && gpus >= 2 => Some(gpus),
        None => None,
    };
    let mesh = eval_mesh(&a, strategy, &model, seq, ranks);
    (cfg.data_parallel, cfg.ulysses, cfg.ring) = (mesh.data, mesh.ulysses, mesh.ring);
    let shape = cfg.mesh_shape(&cfg.plan(seq)?);
    let nccl = || {
        crate::comm::nccl::library()
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let route = route_for("eval", device, launched, gpus, shape, &nccl)?;
    if let Route::SelfLaunch { nproc } = route {
        tracing::info!("{gpus} GPUs visible: starting {nproc} processes, one per GPU (NCCL)");
        let child = crate::cli::launch::own_command("eval")?;
        return crate::cli::launch::run_local(nproc, child);
    }
    let host = load_hf_model(&a.model_dir, &model)?;
    let report: EvalReport = match &route {
        Route::ProcessRank => {
            let env = env.as_ref().expect("a launched run has its environment");
            eval_process_rank(&cfg, &tokens, &host, env, kernel)?
        }
        Route::GpuThreads { gpus, why } => {
            tracing::info!("thread ranks on GPUs: {why}");
            eval_on_gpus(&cfg, &tokens, &host, *gpus, kernel)?
        }
        _ => eval_cpu(&cfg, &tokens, &host)?,
    };
    if route != Route::ProcessRank || env.as_ref().is_none_or(|e| e.rank == 0) {
        let text = serde_json::to_string(&report).expect("a report always serialises");
        println!("{text}");
    }
    Ok(0)
}

/// Thread ranks spread round-robin over `gpus` devices.
fn eval_on_gpus(
    cfg: &EvalConfig,
    tokens: &Tokens,
    host: &std::collections::BTreeMap<String, crate::train::checkpoint::HostTensor>,
    gpus: usize,
    kernel: AttnKernel,
) -> Result<EvalReport> {
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
        b
    };
    eval_threads(cfg, tokens, host, make)
}
