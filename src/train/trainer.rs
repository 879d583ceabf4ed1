//! The training loop: every context-parallel rank runs the same step on its
//! token shard; gradients and loss are summed over ranks, clipped, and applied
//! by the run's optimizer identically everywhere. Ranks are threads of one process
//! ([`train_threads`]: CPU, or GPUs with host-copy exchanges) or one process
//! per GPU ([`train_process_rank`]: NCCL); both run the same per-rank loop.
//! A rehearsal (`TrainConfig::rehearse`) runs that loop on the rank's device
//! wrapped in a [`Rehearsal`] and on rehearsing process groups
//! (`comm::counting`): the real allocators, nothing computed or moved.

pub use super::config::TrainConfig;
use super::eval::{EvalConfig, EvalReport, eval_on_mesh};
use super::eval_during;
use super::fsdp::Sharded;
pub use super::host_weights::{weights_from_host, weights_to_host};
use super::replicated::{Replicated, ReplicatedStore, Resumed};
use super::state::{Micro, RankModel, Sequence};
use super::step_windows::{RankWindow, draw_step, step_counted};
use crate::attention::CpPlan;
use crate::backend::cpu::CpuBackend;
use crate::backend::profile::ClassTotals;
use crate::backend::rehearsal::{Rehearsable, Rehearsal};
use crate::backend::{Backend, Category, DType, MemoryStats, PoolReport};
use crate::checkpoint::HostTensor;
use crate::checkpoint::carried::carry_files;
use crate::checkpoint::hf_config::checkpoint_config;
use crate::comm::counting::counting_mesh;
use crate::comm::env::DistEnv;
use crate::comm::local::run_ranks;
use crate::comm::{Mesh, MeshShape};
use crate::data::mixture::MixShare;
use crate::data::{Dataset, Mixture, MixtureSampler, PackMode, PackedWindow, Tokens};
use crate::error::{Error, Result};
use crate::model::{Decoder, GradSpec, MemoryPolicy, ModelConfig, ModelWeights};
use crate::optim::Update;
use crate::optim::divergence::DivergenceGuard;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long process ranks wait for each other at the rendezvous.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// What one step did (rank 0's view; loss and gradients are global).
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub step: u32,
    pub loss: f64,
    pub lr: f32,
    pub grad_norm: f64,
    /// Steps of the run so far (this one included) whose loss or gradient
    /// norm was not finite, so not applied (`--skip-nonfinite`).
    pub skipped: u32,
    pub tokens_per_s: f64,
    /// Rank 0's ledger peak so far.
    pub peak_bytes: usize,
    /// Rank 0's bytes of each category at that peak.
    pub at_peak_by_category: Vec<(Category, usize)>,
    /// Rank 0's highest host (offload) bytes so far.
    pub host_peak_bytes: usize,
    /// Tokens the step trained on (every sequence of every replica).
    pub tokens: usize,
    /// Targets counted toward the loss (the loss's denominator): `tokens`
    /// less those masked (document ends, padding, SFT prompts).
    pub counted_tokens: usize,
    /// The share of the `seq × seq` attention scores the step's masks let
    /// the kernels compute (rank 0's replica's windows, mean over
    /// micro-steps): ½ for one causal document per window, less where
    /// packed documents remove attention across their boundaries.
    pub attn_flop_fraction: f64,
    /// Rank 0's time of the step by op class, when profiled.
    pub profile: Option<ClassTotals>,
    /// The held-out evaluation after this step, when one was due
    /// (`--eval-data`, `--eval-every`; `train::eval_during`).
    pub eval: Option<EvalReport>,
    /// The retrieval trials after this step, when due (`--eval-task`;
    /// `train::retrieval_during`).
    pub retrieval: Option<super::retrieval::RetrievalPoint>,
    /// A mixture's realised proportions so far (rank 0's data replica's
    /// windows, `--data a.u32:0.7,b.u32:0.3`); `None` for one corpus.
    pub mixture: Option<Vec<MixShare>>,
    /// Windows with no counted target the sampler passed over so far (rank
    /// 0's data replica's; `PackedSampler::next_packed`).
    pub skipped_windows: u64,
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub reports: Vec<StepReport>,
    /// Rank 0's memory at the end (a process rank's own memory on that rank).
    pub memory: MemoryStats,
    pub ranks: usize,
    /// What rank 0's device allocator held beside the ledger (the CUDA
    /// pool's reserved high-water, the memory outside it); `None` on the CPU.
    pub pool: Option<PoolReport>,
}

/// Checks that `world_size` launched processes fit the mesh of `shape` of
/// the subcommand `command` (`train`, `eval`); the error names both fixes
/// (launch another number of processes, or change the mesh flags).
pub fn check_world_size(command: &str, shape: MeshShape, world_size: usize) -> Result<()> {
    let want = shape.world_size();
    if want == world_size {
        return Ok(());
    }
    crate::config_err!(
        "the mesh --data-parallel {} x --ring {} x --ulysses {} needs {want} processes, but {world_size} were launched; \
         start `upipe launch --nproc-per-node {want} -- {command} ...` (one process per GPU), \
         or choose --data-parallel/--ulysses/--ring with a product of {world_size} \
         (leave all three out for a default mesh of {world_size} ranks)",
        shape.data,
        shape.ring,
        shape.ulysses
    )
}

/// Checks that this node's process `local_rank` has a GPU of its own.
pub fn check_local_rank(local_rank: usize, gpus: usize) -> Result<()> {
    if local_rank < gpus {
        return Ok(());
    }
    crate::config_err!(
        "LOCAL_RANK is {local_rank} but {gpus} GPU(s) are visible on this node: \
         start at most {gpus} process(es) per node (one per GPU), e.g. `upipe launch --nproc-per-node {gpus}`"
    )
}

/// Trains on `data` with ranks as threads on the CPU backend, calling
/// `on_step` after every step.
pub fn train_cpu(
    cfg: &TrainConfig,
    data: impl Into<Mixture>,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    train_threads(cfg, data, CpuBackend::new, on_step)
}

/// Trains with ranks as threads, each on a backend from `make_backend`
/// (a rehearsal: each rank's backend in a [`Rehearsal`], its groups
/// rehearsing ones).
pub fn train_threads<B: Backend + Rehearsable>(
    cfg: &TrainConfig,
    data: impl Into<Mixture>,
    make_backend: impl Fn() -> B + Sync,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    let data = data.into();
    let plan = cfg.plan()?;
    let _held = cfg.take_save_dir()?;
    data.check_vocab(cfg.model.vocab)?;
    let shape = cfg.mesh_shape(&plan);
    let out = run_ranks(shape, make_backend, |rank, b, mesh| match cfg.rehearse {
        true => {
            let (b, mesh) = (Rehearsal::on(b), counting_mesh(shape, rank));
            run_rank(cfg, &plan, data.clone(), &b, &mesh, rank, on_step)
        }
        false => run_rank(cfg, &plan, data.clone(), b.as_ref(), &mesh, rank, on_step),
    })?;
    let (reports, memory, pool) = out.into_iter().next().expect("at least one rank");
    Ok(TrainSummary {
        reports,
        memory,
        ranks: shape.world_size(),
        pool,
    })
}

/// Trains as rank `mesh.rank` of a run whose process groups are `mesh` (one
/// process per rank). Collective: every rank of the mesh calls it with the
/// same `cfg` and `data`. Loss and gradient norm are global, so every rank
/// returns the same reports (those [`train_threads`] returns); `on_step` runs
/// on rank 0 only, and only rank 0 writes checkpoints. The caller has taken
/// the save directory ([`TrainConfig::take_save_dir`]) before any rank runs.
/// A rehearsal runs on a rehearsing `b` and `mesh` ([`Rehearsal`],
/// `comm::counting`).
pub fn train_on_mesh<B: Backend>(
    cfg: &TrainConfig,
    data: impl Into<Mixture>,
    b: &B,
    mesh: &Mesh<B>,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    let data = data.into();
    let plan = cfg.plan()?;
    data.check_vocab(cfg.model.vocab)?;
    let shape = cfg.mesh_shape(&plan);
    if mesh.shape != shape {
        return crate::config_err!(
            "the training mesh is {shape:?} but the process groups were built for {:?}",
            mesh.shape
        );
    }
    let (reports, memory, pool) = run_rank(cfg, &plan, data, b, mesh, mesh.rank, on_step)?;
    Ok(TrainSummary {
        reports,
        memory,
        ranks: shape.world_size(),
        pool,
    })
}

/// Trains as one process rank of a multi-GPU run started by `upipe launch`,
/// torchrun or srun (`env`): opens `CudaBackend::new(LOCAL_RANK)`, meets the
/// other ranks at the rendezvous, joins the NCCL world and splits the
/// `data x ring x ulysses` mesh of `cfg` from it, then runs the per-rank loop
/// of [`train_on_mesh`]. The world size must equal the mesh size. `kernel`
/// picks the attention kernels (`--attn-kernel`).
pub fn train_process_rank(
    cfg: &TrainConfig,
    data: impl Into<Mixture>,
    env: &DistEnv,
    kernel: crate::backend::cuda::cudnn::AttnKernel,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary> {
    let data = data.into();
    let plan = cfg.plan()?;
    // rank 0 takes it before the rendezvous, so before any rank reads it
    let _held = match env.rank {
        0 => cfg.take_save_dir()?,
        _ => None,
    };
    data.check_vocab(cfg.model.vocab)?;
    let shape = cfg.mesh_shape(&plan);
    let decided = cfg.decided_flags();
    let attention = RankAttention {
        select: kernel,
        decided: cfg.attention_kernel,
        fp8: cfg.precision.fp8_attention(),
    };
    let rank = ProcessRank::join("train", env, shape, attention, cfg.host_budget, &decided)?;
    match cfg.rehearse {
        true => {
            let b = Rehearsal::on(rank.backend.clone());
            let mesh = counting_mesh(shape, rank.mesh.rank);
            train_on_mesh(cfg, data, &b, &mesh, on_step)
        }
        false => train_on_mesh(cfg, data, rank.backend.as_ref(), &rank.mesh, on_step),
    }
}

/// Evaluates ([`eval_on_mesh`]) as one process rank of a multi-GPU run started by `upipe
/// launch`, torchrun or srun (`env`), joined as `train_process_rank` joins
/// ([`ProcessRank::join`]). The world size must equal the mesh size.
pub fn eval_process_rank(
    cfg: &EvalConfig,
    data: impl Into<Dataset>,
    host: &BTreeMap<String, HostTensor>,
    env: &DistEnv,
    kernel: crate::backend::cuda::cudnn::AttnKernel,
) -> Result<EvalReport> {
    let data = data.into();
    data.tokens.check_vocab(cfg.model.vocab)?;
    let shape = cfg.mesh_shape(&cfg.plan(cfg.windows(&data)?.seq)?);
    // eval takes every choice from its flags: nothing of its own to agree on
    let rank = ProcessRank::join("eval", env, shape, RankAttention::of(kernel), None, "")?;
    eval_on_mesh(cfg, &data, host, rank.backend.as_ref(), &rank.mesh)
}

/// [`eval_process_rank`] for retrieval trials
/// ([`super::retrieval::retrieval_on_mesh`]): rank 0's results are
/// every rank's.
pub fn retrieval_process_rank(
    run: &super::retrieval::RetrievalRun,
    host: &BTreeMap<String, HostTensor>,
    env: &DistEnv,
    kernel: crate::backend::cuda::cudnn::AttnKernel,
) -> Result<super::retrieval::Scored> {
    let longest = run.grid.lengths.iter().copied().max().unwrap_or(1);
    let shape = run.cfg.mesh_shape(&run.cfg.plan(longest)?);
    let rank = ProcessRank::join("eval", env, shape, RankAttention::of(kernel), None, "")?;
    super::retrieval::retrieval_on_mesh(run, host, rank.backend.as_ref(), &rank.mesh)
}

/// How a process rank's GPU runs attention: the kernel selection
/// (`--attn-kernel`), the kernel the run decided on
/// (`TrainConfig::attention_kernel`) and which passes run on cuDNN's FP8
/// graphs (`--precision fp8-attention`, `fp8-attention-bwd`).
#[derive(Debug, Clone, Copy)]
pub struct RankAttention {
    pub select: crate::backend::cuda::cudnn::AttnKernel,
    pub decided: Option<crate::backend::cuda::cudnn::AttentionKernel>,
    pub fp8: crate::backend::fp8::Fp8Passes,
}

impl RankAttention {
    /// The selection alone (evaluation: BF16 attention, decided per call).
    pub fn of(select: crate::backend::cuda::cudnn::AttnKernel) -> RankAttention {
        RankAttention {
            select,
            decided: None,
            fp8: crate::backend::fp8::Fp8Passes::default(),
        }
    }
}

/// One process rank of a multi-GPU run (`upipe train`, `upipe eval`): its
/// mesh, the NCCL world and GPU it runs on, and the rendezvous it met the
/// other ranks at, all held for the run (dropped in this order).
pub struct ProcessRank {
    pub mesh: Mesh<crate::backend::cuda::CudaBackend>,
    _world: crate::comm::nccl::NcclWorld,
    pub backend: Arc<crate::backend::cuda::CudaBackend>,
    _rv: crate::comm::rendezvous::Rendezvous,
}

impl ProcessRank {
    /// Joins the run of the subcommand `command` (named in errors) that
    /// `env` describes: checks that the world size is the size of `shape`
    /// and that `LOCAL_RANK` has a GPU of its own, opens that GPU with the
    /// `attention` settings and the pinned-host budget `host_budget`, meets
    /// the other ranks at the rendezvous, joins the NCCL world and splits
    /// the `data x ring x ulysses` mesh from it. `decided` is what this
    /// rank chose on its own, as flags: every rank must have chosen alike,
    /// or all of them fail before the first GPU allocation.
    pub fn join(
        command: &str,
        env: &DistEnv,
        shape: MeshShape,
        attention: RankAttention,
        host_budget: Option<usize>,
        decided: &str,
    ) -> Result<ProcessRank> {
        use crate::backend::cuda::CudaBackend;
        use crate::comm::nccl::NcclWorld;
        use crate::comm::rendezvous::Rendezvous;
        check_world_size(command, shape, env.world_size)?;
        let gpus = crate::backend::cuda::device::gpus()?.len();
        check_local_rank(env.local_rank, gpus)?;
        let mut rv = Rendezvous::connect(env, RENDEZVOUS_TIMEOUT)?;
        rv.agree(
            &format!("`{command}`'s memory choices"),
            decided,
            "pass rank 0's flags to every rank, or the same --host-mem on every node",
        )?;
        let mut b = CudaBackend::new(env.local_rank)?;
        b.set_attn_kernel(attention.select);
        if let Some(k) = attention.decided {
            b.set_attention_kernel(k);
        }
        b.set_attention_fp8(attention.fp8);
        b.set_host_budget(host_budget);
        let backend = Arc::new(b);
        let world = NcclWorld::connect(env, &mut rv, backend.clone())?;
        let mesh = world.mesh(shape)?;
        Ok(ProcessRank {
            mesh,
            _world: world,
            backend,
            _rv: rv,
        })
    }
}

/// Rehearses `cfg` under `plan` (two steps, nothing computed: the
/// `--rehearse` loop) as rank `mesh.rank` on `b`, a rehearsing backend
/// ([`Rehearsal`]), alone when `mesh`'s groups wait for no one
/// (`comm::counting`), and returns the rank's ledger. The memory planner's
/// engine path (`plan::engine`) runs it on a counting backend.
pub fn rehearse_rank<B: Backend>(
    cfg: &TrainConfig,
    plan: &CpPlan,
    b: &B,
    mesh: &Mesh<B>,
) -> Result<MemoryStats> {
    let cfg = TrainConfig {
        rehearse: true,
        profile: false,
        save_dir: None,
        resume: false,
        eval: None,
        eval_task: None,
        // the same windows whatever the packing: a rehearsal reads no data
        pack: PackMode::Stream,
        ..cfg.clone()
    };
    // a rehearsal reads no token: one window of zeros, whose pages are
    // never touched, stands for every replica's (`run_rank`)
    let zeros = Arc::<[u32]>::new_zeroed_slice(cfg.seq + 1);
    // SAFETY: zero bits are a valid u32.
    let tokens = Tokens::from(unsafe { zeros.assume_init() });
    let (_, memory, _) = run_rank(&cfg, plan, tokens.into(), b, mesh, mesh.rank, &|_| {})?;
    Ok(memory)
}

/// A rehearsal runs on a rehearsing backend and nothing else does.
fn check_rehearsal<B: Backend>(cfg: &TrainConfig, b: &B) -> Result<()> {
    if cfg.rehearse != b.rehearsing() {
        return Err(Error::Backend(format!(
            "a rehearsal runs on a rehearsing backend (`Rehearsal`) and nothing else does: \
             rehearse={} on {}",
            cfg.rehearse,
            b.name()
        )));
    }
    Ok(())
}

/// One rank's training loop, in the order a step runs: windows, the
/// micro-steps' forward and backward, the optimizer step and its guard,
/// the evaluations due, the report, the save due.
fn run_rank<B: Backend>(
    cfg: &TrainConfig,
    plan: &CpPlan,
    data: Mixture,
    b: &B,
    mesh: &Mesh<B>,
    rank: usize,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<RankOutcome> {
    eval_during::check(cfg)?;
    check_rehearsal(cfg, b)?;
    b.ledger().enter("resident");
    let mut decoder = Decoder::new(b, cfg.model.clone(), plan.clone(), mesh, cfg.policy)?;
    decoder.set_precision(b, cfg.precision)?;
    decoder.backward_floor = cfg.freeze.backward_floor(&cfg.model, cfg.lora.is_some());
    let (mut model, resumed) = open_model(b, cfg, mesh)?;
    let mut sampler = rank_sampler(cfg, data, mesh)?;
    let first = match resumed {
        Some(r) => resume(cfg, &mut sampler, r, rank)?,
        None => 1,
    };
    let positions = match cfg.rehearse {
        true => Vec::new(),
        false => plan
            .layout
            .rank_positions(mesh.ring.rank(), mesh.ulysses.rank()),
    };
    // tokens the step trains on (every sequence of every replica)
    let targets_per_step = (cfg.seq * cfg.data_parallel * cfg.grad_accum) as f64;
    let mut reports = Vec::new();
    if cfg.profile {
        b.enable_profile();
    }
    // a rehearsal's second step starts with what the first kept (cuDNN's
    // grown workspace), as every later step of a run does
    let last = if cfg.rehearse { first + 1 } else { cfg.steps };
    let resumed_from = (first > 1).then_some(first - 1);
    let mut guard = DivergenceGuard::new(cfg.skip_nonfinite, cfg.save_dir.clone(), resumed_from)
        .quiet(rank != 0);
    for step in first..=last {
        let at = (plan, b, mesh);
        let drawing = (&mut sampler, positions.as_slice());
        let done = train_step(cfg, at, (&mut decoder, model.as_mut()), drawing, step)?;
        let (loss, update) = (done.loss, done.update);
        let profile = step_profile(cfg, b, step, rank)?;
        let memory = b.ledger().stats();
        let (eval, retrieval) = evaluations_due(cfg, at, &mut decoder, model.as_mut(), step)?;
        let report = StepReport {
            step,
            loss,
            lr: update.lr,
            grad_norm: done.grad_norm,
            skipped: guard.skipped() + u32::from(!update.applied),
            tokens_per_s: targets_per_step / done.seconds,
            peak_bytes: memory.peak,
            at_peak_by_category: memory.at_peak_by_category,
            host_peak_bytes: memory.host_peak,
            tokens: targets_per_step as usize,
            counted_tokens: done.counted,
            attn_flop_fraction: done.attn_flop_fraction,
            profile,
            eval,
            retrieval,
            mixture: sampler.shares(),
            skipped_windows: sampler.skipped_windows(),
        };
        if rank == 0 {
            on_step(&report);
        }
        reports.push(report);
        // every rank stops alike: the loss and the gradient norm are global
        guard.after_step(step, loss, &update)?;
        let eval = reports.last().and_then(|r| r.eval.as_ref());
        if save_due(
            cfg,
            b,
            model.as_mut(),
            (&sampler, eval),
            (step, first, rank),
        )? {
            guard.saved(step);
        }
    }
    model.settle(b)?;
    Ok((reports, b.ledger().stats(), b.pool_report()?))
}

/// What one training step computed: the global loss and gradient norm (NaN
/// in a rehearsal, which computes neither), the optimizer's update, the
/// targets counted, attention's share of the FLOPs and the step's seconds.
struct StepDone {
    loss: f64,
    grad_norm: f64,
    update: Update,
    counted: usize,
    attn_flop_fraction: f64,
    seconds: f64,
}

/// One training step on this rank: its windows drawn, every sequence's
/// forward and backward, the loss reduced over the world, then the
/// optimizer's update (which changes nothing where the loss or the gradient
/// norm is not finite).
fn train_step<B: Backend>(
    cfg: &TrainConfig,
    (plan, b, mesh): (&CpPlan, &B, &Mesh<B>),
    (decoder, model): (&mut Decoder<B>, &mut (dyn RankModel<B> + '_)),
    (sampler, positions): (&mut MixtureSampler, &[usize]),
    step: u32,
) -> Result<StepDone> {
    // what ran before the step (setup, the last step's checkpoint) is not its own
    b.take_profile()?;
    let start = Instant::now();
    // the loss is the mean over the counted targets of the whole step
    // (every micro-step of every replica), known before any backward
    let rehearsal = (cfg.rehearse, cfg.documents);
    let windows = draw_step(sampler, plan, positions, cfg.grad_accum, rehearsal)?;
    let counted = step_counted(b, mesh, &windows)?;
    let (local_loss, attn_flop_fraction) =
        run_sequences(cfg, (b, mesh), decoder, model, &windows, counted)?;
    b.ledger().enter("optimizer");
    let mut loss = b.from_host(&[local_loss as f32], &[1], DType::F32, Category::Workspace)?;
    mesh.world.all_reduce(&mut loss)?;
    let loss = b.to_host(&loss)?[0] as f64 / counted as f64;
    let update = model.optimizer_step(b, step, cfg.rehearse || loss.is_finite())?;
    let (loss, grad_norm) = match cfg.rehearse {
        true => (f64::NAN, f64::NAN),
        false => (loss, update.grad_norm),
    };
    b.synchronize()?;
    Ok(StepDone {
        loss,
        grad_norm,
        update,
        counted,
        attn_flop_fraction,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The rank's model state: sharded (`--fsdp`) or replicated, fresh or
/// from the checkpoint the run resumes (then with what it saved).
fn open_model<'a, B: Backend>(
    b: &B,
    cfg: &TrainConfig,
    mesh: &'a Mesh<B>,
) -> Result<(Box<dyn RankModel<B> + 'a>, Option<Resumed>)> {
    Ok(if cfg.fsdp {
        let (m, r) = Sharded::open(b, cfg, mesh)?;
        (Box::new(m), r)
    } else {
        let (m, r) = Replicated::open(b, cfg, mesh.world.as_ref())?;
        (Box::new(m), r)
    })
}

/// The forward and backward of a step's sequences (`windows`, this rank's
/// share of each), the loss the mean over the step's `counted` targets:
/// this rank's summed loss and the step's attention share of the FLOPs.
fn run_sequences<B: Backend>(
    cfg: &TrainConfig,
    (b, mesh): (&B, &Mesh<B>),
    decoder: &mut Decoder<B>,
    model: &mut (dyn RankModel<B> + '_),
    windows: &[RankWindow],
    counted: usize,
) -> Result<(f64, f64)> {
    let grad_scale = (1.0 / counted as f64) as f32;
    let (mut local_loss, mut attn_flop_fraction) = (0.0, 0.0);
    for (i, w) in windows.iter().enumerate() {
        decoder.set_window(b, &w.doc_starts)?;
        attn_flop_fraction += decoder.attn_flop_fraction(cfg.seq) / windows.len() as f64;
        let seq = Sequence {
            ids: &w.ids,
            targets: &w.targets,
            grad_scale,
            micro: Micro::of(i, cfg.grad_accum),
        };
        local_loss += model.forward_backward(b, decoder, mesh, seq)?;
    }
    Ok((local_loss, attn_flop_fraction))
}

/// The rank's sampler: replicas draw disjoint windows, the context ranks
/// of one replica share one. A rehearsal draws no data (`draw_step`): one
/// window of zeros stands for every replica's, whatever the data-parallel
/// degree.
fn rank_sampler<B: Backend>(
    cfg: &TrainConfig,
    data: Mixture,
    mesh: &Mesh<B>,
) -> Result<MixtureSampler> {
    let (sampler_rank, replicas) = match cfg.rehearse {
        true => (0, 1),
        false => (mesh.shape.coords(mesh.rank).data, cfg.data_parallel),
    };
    MixtureSampler::sharded(data, cfg.pack, cfg.seq, cfg.seed, sampler_rank, replicas)
}

/// The held-out evaluation and the retrieval trials after `step`, each
/// where one is due (`train::eval_during`, `train::retrieval_during`).
fn evaluations_due<B: Backend>(
    cfg: &TrainConfig,
    (plan, b, mesh): (&CpPlan, &B, &Mesh<B>),
    decoder: &mut Decoder<B>,
    model: &mut (dyn RankModel<B> + '_),
    step: u32,
) -> Result<(Option<EvalReport>, Option<super::retrieval::RetrievalPoint>)> {
    let eval = eval_during::after_step(cfg, plan, b, mesh, decoder, model, step)?;
    let retrieval = super::retrieval_during::after_step(cfg, plan, b, mesh, decoder, model, step)?;
    Ok((eval, retrieval))
}

/// Saves the checkpoint of `step` where one is due (the last step, every
/// `--save-every`, with a save directory); whether it saved. `first` is
/// the first step this run trained, `eval` the step's evaluation.
fn save_due<B: Backend>(
    cfg: &TrainConfig,
    b: &B,
    model: &mut (dyn RankModel<B> + '_),
    (sampler, eval): (&MixtureSampler, Option<&EvalReport>),
    (step, first, rank): (u32, u32, usize),
) -> Result<bool> {
    let due = step == cfg.steps || (cfg.save_every > 0 && step % cfg.save_every == 0);
    let Some(dir) = cfg.save_dir.as_ref().filter(|_| due) else {
        return Ok(false);
    };
    let extra = saved_extra(cfg, sampler, eval);
    let at = SaveAt {
        dir,
        step,
        first,
        extra: &extra,
        rank,
    };
    save(cfg, b, model, &at)?;
    Ok(true)
}

/// What a checkpoint's `state.json` keeps of the run beside the model: the
/// sampler's place, the seed, the packing, the frozen parts, the optimizer
/// state's format, and the step's evaluation loss (what `--keep-best`
/// ranks checkpoints by).
fn saved_extra(
    cfg: &TrainConfig,
    sampler: &MixtureSampler,
    eval: Option<&EvalReport>,
) -> serde_json::Value {
    let mut extra = serde_json::json!({
        "sampler": sampler.state(), "seed": cfg.seed, "pack": cfg.pack,
        "freeze": cfg.freeze_key(), "optim_state": cfg.optim.state.saved().to_string(),
    });
    if let Some(eval) = eval {
        extra["eval_loss"] = eval.loss.into();
    }
    extra
}

/// Restores the sampler of a resumed run; the first step to run.
fn resume(cfg: &TrainConfig, sampler: &mut MixtureSampler, r: Resumed, rank: usize) -> Result<u32> {
    let dir = cfg.resume_dir().expect("resumed from a directory");
    let dir = dir.as_path();
    cfg.check_resume_step(dir, r.step)?;
    // checkpoints from before `--pack` have no key: their windows were `stream`'s
    if let Some(saved) = r.extra.get("pack") {
        let saved: PackMode = serde_json::from_value(saved.clone())
            .map_err(|e| Error::Checkpoint(format!("{}: bad pack mode: {e}", dir.display())))?;
        if saved != cfg.pack {
            return crate::config_err!(
                "{} was trained with --pack {saved}, this run asks for --pack {}: its saved \
                 position counts other windows; resume with --pack {saved}",
                dir.display(),
                cfg.pack
            );
        }
    }
    sampler.restore(&r.extra["sampler"])?;
    if rank == 0 {
        tracing::info!("resumed from {} at step {}", dir.display(), r.step);
    }
    Ok(r.step as u32 + 1)
}

/// A save of the training loop: the run's save directory, the step, the
/// first step this run trained (1 unless resumed), the caller state for
/// `state.json`, and the rank saving.
struct SaveAt<'a> {
    dir: &'a std::path::Path,
    step: u32,
    first: u32,
    extra: &'a serde_json::Value,
    rank: usize,
}

/// Writes the checkpoint of `at.step` into the save directory, or into its
/// `checkpoint-STEP` folder when the run keeps folders (rank 0 adds
/// `config.json`, the source's updated, which makes it an HF model
/// directory (not a LoRA run's adapter directory), the tokenizer files of the source, and the run file), logs
/// it, and applies `--keep-last`/`--keep-best`.
fn save<B: Backend>(
    cfg: &TrainConfig,
    b: &B,
    model: &mut (dyn RankModel<B> + '_),
    at: &SaveAt,
) -> Result<()> {
    use crate::checkpoint::save_dir;
    let start = Instant::now();
    let dir = match cfg.keep.folders() {
        true => save_dir::folder_of(at.dir, u64::from(at.step)),
        false => at.dir.to_path_buf(),
    };
    let dir = dir.as_path();
    // written into the directory's staging, then moved in (`checkpoint::save_dir`)
    let staged = save_dir::staging(dir);
    model.save(b, &staged, at.step as u64, at.extra, at.rank == 0)?;
    if at.rank != 0 {
        return Ok(());
    }
    // a LoRA checkpoint is PEFT's adapter directory: its base has the config
    if cfg.lora.is_none() {
        let path = staged.join("config.json");
        let config = checkpoint_config(cfg.source_config.as_ref(), &cfg.model, cfg.save_dtype);
        std::fs::write(&path, config).map_err(|e| Error::io(path.display().to_string(), e))?;
    }
    if let Some(from) = cfg.carry_from() {
        carry_files(&from, dir, &staged)?;
    }
    if let Some(text) = &cfg.run_file {
        let path = staged.join("run.toml");
        std::fs::write(&path, text).map_err(|e| Error::io(path.display().to_string(), e))?;
    }
    let bytes = save_dir::staged_bytes(dir);
    save_dir::publish(dir)?;
    tracing::info!(
        "saved the checkpoint of step {} to {} ({}, {:.1} s)",
        at.step,
        dir.display(),
        crate::backend::Bytes(bytes as usize),
        start.elapsed().as_secs_f64()
    );
    keep_checkpoints(cfg, at)
}

/// After a save: removes checkpoint folders of an older run (one this run
/// replaces under `--overwrite`) and, when the run keeps folders, those
/// past `--keep-last` that are not the best (`--keep-best`); a fresh run
/// that keeps folders also retires the checkpoint an older run left in
/// the save directory itself.
fn keep_checkpoints(cfg: &TrainConfig, at: &SaveAt) -> Result<()> {
    use crate::checkpoint::save_dir::{self, Kept, Retention};
    let saved_here = |s: u64| {
        let every = u64::from(cfg.save_every);
        s <= u64::from(at.step)
            && (s == u64::from(cfg.steps) || (every > 0 && s.is_multiple_of(every)))
    };
    let first = u64::from(at.first);
    let lineage = |s: u64| s < first || (cfg.keep.folders() && saved_here(s));
    let keep = match cfg.keep.folders() {
        true => cfg.keep,
        false => Retention::default(),
    };
    let kept = Kept {
        keep,
        lineage: &lineage,
    };
    for gone in save_dir::retain(at.dir, &kept)? {
        tracing::info!("removed the checkpoint {}", gone.display());
    }
    if cfg.keep.folders() && at.first == 1 {
        save_dir::retire_own(at.dir)?;
    }
    if let (true, Some((step, loss))) = (cfg.keep.keep_best, save_dir::best(at.dir)?) {
        let best = save_dir::folder_of(at.dir, step);
        tracing::info!(
            "the best checkpoint by held-out loss is {} ({loss:.4})",
            best.display()
        );
    }
    Ok(())
}

/// The step's op profile by class (when profiled); rank 0 writes the last
/// step's trace (`cfg.trace`).
fn step_profile<B: Backend>(
    cfg: &TrainConfig,
    b: &B,
    step: u32,
    rank: usize,
) -> Result<Option<ClassTotals>> {
    let Some(p) = b.take_profile()? else {
        return Ok(None);
    };
    if let (Some(path), true, 0) = (&cfg.trace, step == cfg.steps, rank) {
        p.write_trace(path, rank)?;
    }
    Ok(Some(p.totals()))
}
/// What one rank's loop returns: its reports, its memory at the end, and
/// what its allocator held beside the ledger (`Backend::pool_report`).
type RankOutcome = (Vec<StepReport>, MemoryStats, Option<PoolReport>);

/// Loss (mean over `targets`) and reduced parameter gradients of one sequence
/// under `plan`, on CPU thread ranks, from weights built by `weights` on each
/// rank. The engine of the equivalence tests and of `upipe eval`.
pub fn loss_and_grads_cpu(
    model: &ModelConfig,
    plan: &CpPlan,
    policy: MemoryPolicy,
    ids: &[u32],
    targets: &[u32],
    weights: &(dyn Fn(&CpuBackend) -> Result<ModelWeights<CpuBackend>> + Sync),
) -> Result<(f64, BTreeMap<String, Vec<f32>>)> {
    let window = PackedWindow::stream(ids.to_vec(), targets.to_vec());
    loss_and_grads_cpu_packed(model, plan, policy, &window, weights)
}

/// [`loss_and_grads_cpu`] of a packed window: attention block-diagonal over
/// its documents, positions restarting at each, the loss the mean over its
/// counted (non-[`IGNORE`](crate::backend::IGNORE)) targets.
pub fn loss_and_grads_cpu_packed(
    model: &ModelConfig,
    plan: &CpPlan,
    policy: MemoryPolicy,
    window: &PackedWindow,
    weights: &(dyn Fn(&CpuBackend) -> Result<ModelWeights<CpuBackend>> + Sync),
) -> Result<(f64, BTreeMap<String, Vec<f32>>)> {
    let none = crate::model::Freeze::none();
    loss_and_grads_cpu_frozen(model, plan, policy, window, weights, &none)
}

/// [`loss_and_grads_cpu_packed`] with the parameters `frozen` freezes
/// taking no gradient (none of theirs is returned).
pub fn loss_and_grads_cpu_frozen(
    model: &ModelConfig,
    plan: &CpPlan,
    policy: MemoryPolicy,
    window: &PackedWindow,
    weights: &(dyn Fn(&CpuBackend) -> Result<ModelWeights<CpuBackend>> + Sync),
    frozen: &crate::model::Freeze,
) -> Result<(f64, BTreeMap<String, Vec<f32>>)> {
    let run = CpuRun::default();
    loss_and_grads_cpu_norms(model, plan, policy, window, weights, frozen, run)
}

/// [`loss_and_grads_cpu`] with the linear layers computing in `precision`
/// (`Decoder::set_precision`).
pub fn loss_and_grads_cpu_precision(
    model: &ModelConfig,
    plan: &CpPlan,
    policy: MemoryPolicy,
    window: &PackedWindow,
    weights: &(dyn Fn(&CpuBackend) -> Result<ModelWeights<CpuBackend>> + Sync),
    precision: crate::backend::fp8::Precision,
) -> Result<(f64, BTreeMap<String, Vec<f32>>)> {
    let none = crate::model::Freeze::none();
    let run = CpuRun {
        unfused_norms: false,
        precision,
    };
    loss_and_grads_cpu_norms(model, plan, policy, window, weights, &none, run)
}

/// How [`loss_and_grads_cpu_norms`] runs the decoder.
#[derive(Debug, Clone, Copy, Default)]
struct CpuRun {
    /// Each norm backward and its residual add as two ops
    /// (`Decoder::unfused_norms`) rather than fused, as training runs them.
    unfused_norms: bool,
    /// What the linear layers compute in.
    precision: crate::backend::fp8::Precision,
}

/// [`loss_and_grads_cpu_frozen`], the decoder run as `run` says.
fn loss_and_grads_cpu_norms(
    model: &ModelConfig,
    plan: &CpPlan,
    policy: MemoryPolicy,
    window: &PackedWindow,
    weights: &(dyn Fn(&CpuBackend) -> Result<ModelWeights<CpuBackend>> + Sync),
    frozen: &crate::model::Freeze,
    run: CpuRun,
) -> Result<(f64, BTreeMap<String, Vec<f32>>)> {
    if window.len() != plan.layout.seq {
        return crate::config_err!(
            "a window of {} tokens for a plan of {} tokens",
            window.len(),
            plan.layout.seq
        );
    }
    window.validate()?;
    let counted = window.counted().max(1);
    let out = run_ranks(plan.mesh_shape(), CpuBackend::new, |_rank, b, mesh| {
        let b = b.as_ref();
        let mut decoder = Decoder::new(b, model.clone(), plan.clone(), &mesh, policy)?;
        decoder.unfused_norms = run.unfused_norms;
        decoder.set_precision(b, run.precision)?;
        decoder.set_window(b, &window.doc_starts)?;
        let w = weights(b)?;
        // adapters beside the weights train every block they adapt
        let adapters = w.blocks.iter().any(|blk| !blk.adapters().is_empty());
        decoder.backward_floor = frozen.backward_floor(model, adapters);
        let mut store =
            ReplicatedStore::with_grads(b, model, w, mesh.world.as_ref(), GradSpec::f32(frozen))?;
        let pos = plan
            .layout
            .rank_positions(mesh.ring.rank(), mesh.ulysses.rank());
        let rows = RankWindow::of(window, &pos)?;
        let scale = 1.0 / counted as f32;
        let loss =
            decoder.forward_backward(b, &mesh, &mut store, &rows.ids, &rows.targets, scale)?;
        let mut loss = b.from_host(&[loss as f32], &[1], DType::F32, Category::Workspace)?;
        mesh.world.all_reduce(&mut loss)?;
        let mut grads = BTreeMap::new();
        for (name, t) in store.g.named() {
            grads.insert(name, b.to_host(t)?);
        }
        Ok((b.to_host(&loss)?[0] as f64 / counted as f64, grads))
    })?;
    Ok(out.into_iter().next().expect("at least one rank"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::Strategy;
    use crate::optim::OptimConfig;

    fn cfg(data: usize, ulysses: usize, ring: usize) -> TrainConfig {
        TrainConfig {
            data_parallel: data,
            strategy: Strategy::Upipe,
            ulysses,
            ring,
            seed: 3,
            ..TrainConfig::new(
                ModelConfig::resolve("tiny").unwrap(),
                64,
                3,
                OptimConfig::schedule(3e-3, 3e-4, 1, 3),
            )
        }
    }

    fn tokens() -> Arc<[u32]> {
        crate::data::ByteTokenizer
            .encode(crate::data::CORPUS)
            .into()
    }

    /// The process-rank entry on meshes built by hand (thread-backed here)
    /// runs the loop `train_threads` runs: the same reports on every rank.
    #[test]
    fn train_on_mesh_reproduces_the_thread_path() {
        for c in [cfg(1, 2, 1), cfg(2, 1, 1)] {
            let want = train_threads(&c, tokens(), CpuBackend::new, &|_| {}).unwrap();
            let shape = c.mesh_shape(&c.plan().unwrap());
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let on_step = |_: &StepReport| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            };
            let got = run_ranks(shape, CpuBackend::new, |_, b, mesh| {
                train_on_mesh(&c, tokens(), b.as_ref(), &mesh, &on_step)
            })
            .unwrap();
            assert_eq!(calls.into_inner(), 3, "on_step on rank 0 only");
            for g in &got {
                assert_eq!(g.ranks, 2);
                for (x, y) in g.reports.iter().zip(&want.reports) {
                    assert_eq!((x.step, x.loss, x.grad_norm), (y.step, y.loss, y.grad_norm));
                }
                assert_eq!(g.reports.len(), 3);
            }
        }
    }

    /// A step whose norm backwards run fused with their residual adds
    /// (`Backend::rms_norm_bwd_add`) equals, bit for bit, the step of the
    /// unfused ops (`rms_norm_bwd` into a temporary, then `axpy`): untiled,
    /// and checkpointed with a tiled MLP (the add through a copy of the
    /// tile's rows), with a frozen norm weight.
    #[test]
    fn fused_norm_backward_step_equals_the_unfused_ops() {
        let model = ModelConfig::resolve("tiny").unwrap();
        let seq = 4 * model.hidden;
        let plan = CpPlan::new(
            Strategy::Local,
            &crate::model::decoder::attn_dims(&model),
            seq,
            1,
            1,
            None,
        )
        .unwrap();
        let ids: Vec<u32> = (0..=seq).map(|i| (i * 7 % model.vocab) as u32).collect();
        let window = PackedWindow::stream(ids[..seq].to_vec(), ids[1..].to_vec());
        let init = |b: &CpuBackend| ModelWeights::random(b, &model, 5);
        let tiled = MemoryPolicy {
            checkpoint: true,
            tiled_mlp: true,
            ..Default::default()
        };
        let frozen = crate::model::Freeze::parse("norms").unwrap();
        for (policy, freeze) in [
            (MemoryPolicy::default(), crate::model::Freeze::none()),
            (tiled, frozen),
        ] {
            let run = |unfused| {
                let run = CpuRun {
                    unfused_norms: unfused,
                    ..CpuRun::default()
                };
                loss_and_grads_cpu_norms(&model, &plan, policy, &window, &init, &freeze, run)
                    .unwrap()
            };
            let (fused, unfused) = (run(false), run(true));
            assert_eq!(fused.0.to_bits(), unfused.0.to_bits(), "{policy:?}: loss");
            assert_eq!(fused.1.len(), unfused.1.len());
            for (name, g) in &fused.1 {
                let same = g
                    .iter()
                    .zip(&unfused.1[name])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{policy:?}: the gradient of {name} differs");
            }
        }
    }

    #[test]
    fn world_and_mesh_mismatches_are_errors_naming_the_fix() {
        let c = cfg(1, 2, 1);
        let wrong = MeshShape::new(2, 1, 1).unwrap();
        let err = run_ranks(wrong, CpuBackend::new, |_, b, mesh| {
            train_on_mesh(&c, tokens(), b.as_ref(), &mesh, &|_| {})
        })
        .unwrap_err();
        assert!(err.to_string().contains("process groups"), "{err}");
        let shape = c.mesh_shape(&c.plan().unwrap());
        check_world_size("train", shape, 2).unwrap();
        let e = check_world_size("train", shape, 3).unwrap_err().to_string();
        assert!(
            e.contains("needs 2 processes, but 3 were launched")
                && e.contains("--nproc-per-node 2 -- train ...")
                && e.contains("product of 3"),
            "{e}"
        );
        // `upipe eval` under a launch names itself in the fix
        let e = check_world_size("eval", shape, 3).unwrap_err().to_string();
        assert!(e.contains("--nproc-per-node 2 -- eval ..."), "{e}");
        check_local_rank(1, 2).unwrap();
        let e = check_local_rank(2, 2).unwrap_err().to_string();
        assert!(e.contains("LOCAL_RANK is 2"), "{e}");
    }
}
