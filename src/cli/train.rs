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
//!
//! A run goes parse → validate → build → prepare → preflight → run →
//! report ([`run`]): the run file under the flags given ([`TrainArgs`],
//! `cli::config`), the flags parsed and checked ([`TrainArgs::validate`]),
//! mesh, [`TrainConfig`], plan and route ([`build`]), data, sharding and
//! forward stages resolved with the planner's prediction, the checks made
//! before anything is allocated ([`preflight`]), the training loop, and the
//! closing report (`summary.rs`).

mod args;
mod built;
mod execute;
pub(crate) mod kernel;
mod mesh;
mod preflight;
mod progress;
mod rehearse;
mod resolve;
mod route;
mod summary;
mod tokenizer;

pub use args::{Choices, Device, FsdpMode, TrainArgs, training_state};
pub use kernel::{decide as decide_kernel, may_hold_documents};
pub use mesh::{
    CPU_DEFAULT_MESH, MAX_THREAD_RANKS, MeshChoice, MeshFlags, check_thread_ranks, default_mesh,
    resolve_mesh,
};
pub use preflight::{memory_per_rank, outside_ledger};
pub use resolve::run_request;
pub use route::{
    Launched, Route, gpu_memory_per_rank, host_available_bytes, route, route_for, visible_gpus,
};

use crate::checkpoint::ExtraTensors;
use crate::cli::schedule::{ChunkHeads, FwdChunk};
use crate::cli::{config, print_config};
use crate::comm::env::DistEnv;
use crate::data::Mixture;
use crate::data::dataset::load_dataset;
use crate::data::mixture::load_mixture;
use crate::data::sampler::PackedSampler;
use crate::error::Result;
use crate::model::flops::{
    frozen_and_adapter_flops, skipped_attention_share, train_attention_flops_per_token,
    train_flops_per_token,
};
use crate::plan::{
    CheckpointEvery, HostUpdateChoice, OffloadBlocks, OptimizerOffload, SaveAttention,
};
use crate::train::eval::EvalDuring;
use crate::train::trainer::TrainConfig;
use built::Built;
use clap::ArgMatches;
use execute::execute;

/// `upipe train` with flags `a`, parsed from the command line `m`.
pub fn run(a: TrainArgs, m: &ArgMatches) -> Result<i32> {
    let a = config::resolve(a, m)?;
    // what --print-config prints is a run file `train` accepts
    let choices = a.validate()?;
    if a.print_config {
        print!("{}", print_config::annotated(&a, &TrainArgs::all_keys())?);
        return Ok(0);
    }
    a.refuse_replacing()?;
    let mut run = build(&a, choices)?;
    if let Route::SelfLaunch { nproc } = run.route {
        return self_launch(&run, nproc);
    }
    if a.rehearse {
        return rehearse::run(&a, m, &mut run);
    }
    // the model's own tokenizer unless --tokenizer names one; the run file records it
    let tokenizer = tokenizer::decide(&a, run.cfg.model.vocab)?;
    if run.lead && a.tokenizer.is_none() && tokenizer.arg.is_some() {
        tracing::info!("tokenizer: {}", tokenizer.said);
    }
    let mut a = TrainArgs {
        tokenizer: tokenizer.arg.clone(),
        ..a
    };
    let data = load_mixture(
        a.data.as_deref(),
        a.tokenizer.as_deref(),
        run.cfg.model.vocab,
    )?;
    let per_epoch = windows_per_epoch(&data, &run.cfg)?;
    let steps = a.steps_for(per_epoch, run.cfg.data_parallel)?;
    set_steps(&mut a, &mut run.cfg, steps)?;
    run.cfg.eval = eval_during(&a, run.cfg.model.vocab)?;
    run.cfg.eval_task = eval_task_during(&a, &run.cfg)?;
    if let Some(rd) = &run.cfg.eval_task {
        rd.check(run.cfg.seq)?;
    }
    let predicted = run.resolve(&a)?;
    crate::train::eval_during::check(&run.cfg)?;
    if let Some(done) = finished_checkpoint(&run.cfg)? {
        if run.lead {
            println!("{done}");
        }
        return Ok(0);
    }
    if run.lead {
        let decided = run.cfg.decided_flags();
        tracing::info!("decided from this machine's memory: {decided}");
    }
    run.cfg.run_file = Some(run_file(&a, &run)?);
    let progress = preflight::preflight(&a, &mut run, &predicted)?;
    if run.lead && !a.json {
        announce(&run, data.len(), &tokenizer.said, per_epoch);
    }
    let summary = execute(&run, data, &|r| progress.on_step(r))?;
    progress.finish()?;
    if run.lead && !a.json {
        let lora = run.cfg.lora.as_ref().map(|l| &l.config);
        let (model, freeze, seq) = (&run.cfg.model, &run.cfg.freeze, run.cfg.seq);
        let skipped = train_attention_flops_per_token(model, seq)
            * skipped_attention_share(model, freeze, lora);
        let flops = train_flops_per_token(model, seq) - skipped
            + frozen_and_adapter_flops(model, freeze, lora);
        summary::print(&summary, &predicted, flops);
    }
    if run.lead {
        summary::print_profile(&summary, a.json);
    }
    if let (Some(out), Some(dir), true) = (&a.merge_lora, &run.cfg.save_dir, run.lead) {
        use crate::checkpoint::lora_merge::{MergeJob, merge_adapter_dir};
        // the final checkpoint: in the save directory, or its latest folder
        let ckpt = crate::checkpoint::save_dir::latest(dir).unwrap_or_else(|| dir.clone());
        // the base the final save names (the run's own, resumed or not)
        let state = crate::checkpoint::sharded::read_state(&ckpt)?;
        let extra = state.get("extra").cloned().unwrap_or_default();
        let base = crate::train::lora_base::resumed_base(&run.cfg, &ckpt, &extra)?;
        merge_adapter_dir(&MergeJob {
            base: &base,
            adapter: &ckpt,
            out,
            cfg: &run.cfg.model,
            dtype: run.cfg.save_dtype,
        })?;
        tracing::info!("the model with its adapters merged is in {}", out.display());
    }
    Ok(0)
}

/// Resolves the mesh, builds the [`TrainConfig`] and its plan, and decides
/// where the ranks run.
fn build(a: &TrainArgs, c: Choices) -> Result<Built> {
    let gpus = if c.device == Device::Cpu {
        0
    } else {
        visible_gpus()
    };
    let env = DistEnv::from_env()?;
    let launched = Launched::from_env(env.as_ref());
    // ranks the default mesh should fill: the launched processes, or the GPUs
    let ranks = match launched {
        Some(l) => Some(l.world_size),
        None if c.device != Device::Cpu && gpus >= 1 => Some(gpus),
        None => None,
    };
    let flags = a.mesh.flags();
    let chunk = ChunkHeads::start(a.mesh.chunk_heads);
    let mesh = resolve_mesh(flags, c.strategy, &c.model, a.seq, chunk, ranks);
    mesh.check_countable()?;
    let cfg = train_config(a, &c, mesh);
    let plan = cfg.plan()?;
    if a.mesh.chunk_heads == Some(ChunkHeads::Auto) && !c.strategy.has_head_stages() {
        return crate::config_err!("--chunk-heads applies to upipe only, not {}", c.strategy);
    }
    // a number or `all` without --checkpoint fails here, before any launch
    a.memory
        .save_attention
        .check(cfg.policy, cfg.model.layers)?;
    // `auto`, 0, or more than 1 without --checkpoint fails here too
    a.memory
        .checkpoint_every
        .unwrap_or_default()
        .check(cfg.policy)?;
    if a.memory.offload == OffloadBlocks::Auto && !cfg.policy.checkpoint {
        return crate::config_err!(
            "--offload auto moves checkpointed block inputs to the host: add --checkpoint"
        );
    }
    cfg.policy.validate_for(cfg.model.layers)?;
    let shape = cfg.mesh_shape(&plan);
    let nccl = || {
        crate::comm::nccl::library()
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let route = route(c.device, launched, gpus, shape, &nccl)?;
    if let Route::GpuThreads { why, .. } = &route {
        tracing::info!("thread ranks on GPUs: {why}");
    }
    let lead = route != Route::ProcessRank || env.as_ref().is_none_or(|e| e.rank == 0);
    // masks cuDNN does not take: several documents in a window (a sliding
    // window alone is a causal band, which it does)
    let bounded = cfg.documents;
    // the kernel is decided before anything is planned or allocated; a
    // parent that launches its ranks leaves the warning to rank 0
    let say = lead && !matches!(route, Route::SelfLaunch { .. });
    let head_dim = c.model.head_dim;
    let mut cfg = cfg;
    cfg.attention_kernel = kernel::decide(&route, c.device, c.kernel, head_dim, bounded, say)?;
    kernel::check_fp8_attention(cfg.precision, cfg.attention_kernel, &c.model, bounded)?;
    Ok(Built {
        cfg,
        plan,
        shape,
        route,
        kernel: c.kernel,
        fsdp: c.fsdp,
        env,
        gpus,
        budget: None,
        host_available: host_available_bytes(),
        lead,
    })
}

/// The [`TrainConfig`] of the flags on `mesh` (unsharded, its `auto`
/// choices undecided until [`resolve_run`] decides them).
pub fn train_config(a: &TrainArgs, c: &Choices, mesh: MeshChoice) -> TrainConfig {
    let layers = c.model.layers;
    TrainConfig {
        model: c.model.clone(),
        data_parallel: mesh.data,
        strategy: c.strategy,
        ulysses: mesh.ulysses,
        ring: mesh.ring,
        chunk_heads: ChunkHeads::start(a.mesh.chunk_heads),
        fwd_chunk_heads: match a.fwd.fwd_chunk_heads {
            FwdChunk::Heads(n) => Some(n),
            FwdChunk::Auto => None,
        },
        seq: a.seq,
        pack: a.pack,
        // decided in `build` once the route is known
        attention_kernel: None,
        documents: kernel::may_hold_documents(a.pack, a.data.as_deref()),
        steps: a.steps,
        optim: c.optim,
        precision: c.precision,
        seed: a.seed,
        // a number or `all` now (checked before any launch), `auto` once the budget is known
        policy: a.memory.policy(layers, 0),
        init_from: a.init_from.clone(),
        extra_tensors: if a.allow_extra_tensors {
            ExtraTensors::Ignore
        } else {
            ExtraTensors::Refuse
        },
        save_dir: a.save_dir.clone(),
        save_every: a.save_every,
        keep: a.retention(),
        resume: a.resume,
        overwrite: a.overwrite,
        skip_nonfinite: a.skip_nonfinite,
        grad_accum: a.grad_accum,
        fsdp: false,
        fsdp_replicas: 1,
        max_file_bytes: c.max_file_bytes,
        save_dtype: c.save_dtype,
        source_config: c.source_config.clone(),
        run_file: None,
        host_budget: None,
        profile: a.profile || a.trace.is_some() || profile_env(),
        trace: a.trace.clone(),
        rehearse: a.rehearse,
        freeze: c.freeze.clone(),
        lora: c.lora.clone(),
        // loaded once the run's data is (`eval_during`)
        eval: None,
        eval_task: None,
    }
}

/// Whether `UPIPE_PROFILE` asks for the op profile (as `--profile` does).
fn profile_env() -> bool {
    use crate::backend::cuda::profile::ProfileLevel;
    let v = std::env::var("UPIPE_PROFILE").ok();
    ProfileLevel::parse(v.as_deref()) != ProfileLevel::Off
}

/// The run file that repeats this run exactly: the flags as resolved, with
/// what the run decided for itself (mesh, sharding, backward and forward
/// stages, offloaded blocks, kept attention, host optimizer units).
fn run_file(a: &TrainArgs, run: &Built) -> Result<String> {
    let mut r = a.clone();
    r.mesh.data_parallel = Some(run.cfg.data_parallel);
    r.mesh.ulysses = Some(run.cfg.ulysses);
    r.mesh.ring = Some(run.cfg.ring);
    r.fsdp = if run.cfg.fsdp { "on" } else { "off" }.into();
    if let Some(u) = run.cfg.chunk_heads {
        r.mesh.chunk_heads = Some(ChunkHeads::Heads(u));
    }
    if let Some(n) = run.cfg.fwd_chunk_heads {
        r.fwd.fwd_chunk_heads = FwdChunk::Heads(n);
    }
    let p = run.cfg.policy;
    // what `auto` decided here, so the file repeats the memory layout
    // exactly on any machine
    if p.checkpoint {
        r.memory.offload = OffloadBlocks::Blocks(p.offload);
        r.memory.save_attention = SaveAttention::Blocks(p.save_attention);
        if r.memory.checkpoint_every.is_some() || p.checkpoint_every != 1 {
            r.memory.checkpoint_every = Some(CheckpointEvery::Blocks(p.checkpoint_every));
        }
    }
    r.memory.offload_optimizer = OptimizerOffload::Units(p.offload_optimizer);
    r.memory.host_update = HostUpdateChoice::Is(p.host_update);
    // `--optim-state auto`'s choice, so the file trains in the same state
    let state = run.cfg.optim.state;
    r.optim_state = state.moments.name().into();
    r.master_weights = state.master.name().into();
    r.grad_dtype = state.grads.name().into();
    if let Some(k) = run.cfg.attention_kernel {
        r.attn_kernel = kernel::flag_of(k).into();
    }
    print_config::annotated(&r, &TrainArgs::all_keys())
}

/// What to say when the checkpoint `--resume` continues from has already
/// reached `--steps`; a checkpoint past `--steps` is an error (its
/// learning-rate schedule ran past the end of this one).
fn finished_checkpoint(cfg: &TrainConfig) -> Result<Option<String>> {
    let Some(dir) = cfg.resume_dir() else {
        return Ok(None);
    };
    let dir = dir.as_path();
    let state = crate::checkpoint::sharded::read_state(dir)?;
    let Some(step) = state.get("step").and_then(serde_json::Value::as_u64) else {
        return Ok(None); // the loader names what is missing
    };
    cfg.check_resume_step(dir, step)?;
    let steps = u64::from(cfg.steps);
    Ok((step == steps).then(|| {
        format!(
            "the checkpoint in {} is at step {step} of --steps {steps}: nothing is left to \
             train (give a larger --steps to continue it)",
            dir.display()
        )
    }))
}

/// The held-out evaluation `--eval-data` asks for, its tokens (with the
/// document index and loss mask beside them) loaded as `--data`'s are
/// (errors name `--eval-data`); its windows are packed as `--pack` says.
fn eval_during(a: &TrainArgs, vocab: usize) -> Result<Option<EvalDuring>> {
    let Some(path) = &a.eval_data else {
        return Ok(None);
    };
    let data = load_dataset(Some(path), a.tokenizer.as_deref(), vocab).map_err(|e| match e {
        crate::Error::Config(m) => crate::Error::Config(format!(
            "--eval-data {}: {m}; give held-out data of the model's vocabulary (text with the \
             run's --tokenizer, or ids `upipe tokenize` wrote with it)",
            path.display()
        )),
        other => other,
    })?;
    Ok(Some(EvalDuring {
        data,
        every: a.eval_every.unwrap_or(a.steps),
        buckets: a.eval_buckets,
    }))
}

/// `--eval-task`: the retrieval trials scored during the run, with the
/// run's tokenizer (`--tokenizer`, else the `--init-from` directory's
/// `tokenizer.json`, else bytes for a model of 256 ids).
fn eval_task_during(
    a: &TrainArgs,
    cfg: &crate::train::config::TrainConfig,
) -> Result<Option<crate::train::retrieval::RetrievalDuring>> {
    use crate::data::Tokenizer;
    use crate::data::retrieval::{ChatFrame, Grid, Haystack, TaskSpec, parse_lengths};
    let Some(task) = &a.eval_task else {
        return Ok(None);
    };
    let mut spec = TaskSpec::new(task.parse()?);
    let own = a.init_from.as_ref().map(|d| d.join("tokenizer.json"));
    let tok = match (&a.tokenizer, own.filter(|f| f.is_file())) {
        (Some(t), _) => Tokenizer::resolve(t)?,
        (None, Some(file)) => Tokenizer::from_hf_file(&file)?,
        (None, None) if cfg.model.vocab == 256 => Tokenizer::byte(),
        _ => {
            return crate::config_err!(
                "--eval-task needs the run's tokenizer to write its trials: give --tokenizer"
            );
        }
    };
    let lengths = match &a.eval_task_lengths {
        Some(l) => parse_lengths(l)?,
        None => vec![cfg.seq],
    };
    let haystack = match spec.task.uses_haystack() {
        true => Some(Haystack::filler(&tok)?),
        false => None,
    };
    if a.eval_task_trials == 0 {
        return crate::config_err!("--eval-task-trials 0: give at least 1");
    }
    let grid = Grid {
        lengths,
        depths: Grid::even_depths(a.eval_task_depths)?,
        trials: a.eval_task_trials,
        seed: a.seed,
    };
    let dir = match a.tokenizer.as_deref() {
        Some("byte") => None,
        Some(t) => Some(std::path::PathBuf::from(t)),
        None => a.init_from.clone(),
    };
    let choice = (
        "--eval-task-chat-template",
        a.eval_task_chat_template.as_str(),
    );
    let chat = ChatFrame::choose(choice, dir.as_deref(), &tok)?.map(|c| c.0);
    if chat.is_some() {
        // the answer starts the assistant's turn, as `eval --task` frames it
        spec.templates.answer = "{value}".into();
    }
    Ok(Some(crate::train::retrieval::RetrievalDuring {
        spec,
        grid,
        tok,
        haystack,
        every: a.eval_every.unwrap_or(a.steps),
        chat,
    }))
}

/// Starts one process per GPU, each running this command.
fn self_launch(run: &Built, nproc: usize) -> Result<i32> {
    // each child resolves the same mesh: the same flags, or with no mesh
    // flag `default_mesh` for its world size, the parent's mesh size
    let child = crate::cli::launch::own_command("train")?;
    tracing::info!(
        "{} GPUs visible: starting {nproc} processes, one per GPU (NCCL), \
         mesh data {} x Pu {} x Pr {}",
        run.gpus,
        run.shape.data,
        run.shape.ulysses,
        run.shape.ring
    );
    crate::cli::launch::run_local(nproc, child)
}

/// The line a run starts with (on GPUs naming the attention kernel the
/// run decided on).
fn announce(run: &Built, tokens: usize, tokenizer: &str, per_epoch: usize) {
    let kernel = match run.cfg.attention_kernel {
        Some(k) => format!(", attention on {k}"),
        None => String::new(),
    };
    println!(
        "training {} on {tokens} tokens (tokenizer: {tokenizer}): {}, {} steps{kernel}",
        run.model_text(),
        run.layout_text(),
        run.cfg.steps
    );
    println!("{}", crate::train::lora_base::trainable_line(&run.cfg));
    let cfg = &run.cfg;
    if !cfg.optim.state.is_plain() {
        println!(
            "training state: {} (--optim-state, --master-weights, --grad-dtype; f32 throughout \
             is exact AdamW)",
            cfg.optim.state
        );
    }
    if cfg.precision.fp8_linear() {
        println!(
            "precision: fp8 linear layers (--precision; E4M3 weights and activations, E5M2 \
             gradients, tensor-wise scales; master weights, optimizer, loss, embedding, LM head \
             and norms as before)"
        );
    }
    let attention = cfg.precision.fp8_attention();
    if attention.any() {
        let passes = match attention.forward {
            true => "forward and backward",
            false => "backward only, after a BF16 forward",
        };
        println!(
            "precision: fp8 attention on cuDNN, {passes} (--precision {}; Q, K, V, O in E4M3, \
             dO and the gradients in E5M2, scales from bounds: docs/fp8.md)",
            cfg.precision
        );
    }
    let per_step = cfg.grad_accum * cfg.data_parallel;
    let epochs = (u64::from(cfg.steps) * per_step as u64) as f64 / per_epoch.max(1) as f64;
    println!(
        "{per_epoch} windows per epoch (--seq {}, --pack {}); {} steps of {per_step} windows \
         are {epochs:.2} epochs",
        cfg.seq, cfg.pack, cfg.steps
    );
}

/// Windows of `--seq` inputs one pass over the data gives, packed as
/// `--pack` packs them (every corpus of a mixture together).
fn windows_per_epoch(data: &Mixture, cfg: &TrainConfig) -> Result<usize> {
    data.corpora.iter().try_fold(0, |sum, d| {
        let s = PackedSampler::sharded(d.clone(), cfg.pack, cfg.seq, cfg.seed, 0, 1)?;
        Ok(sum + s.windows_per_epoch())
    })
}

/// The run's length: `steps` (`--steps`, or derived from `--epochs`) in
/// the flags, the run and its learning-rate schedule (checked again: the
/// warm-up and decay must fit it).
fn set_steps(a: &mut TrainArgs, cfg: &mut TrainConfig, steps: u32) -> Result<()> {
    if steps == cfg.steps {
        return Ok(());
    }
    (a.steps, cfg.steps, cfg.optim.total_steps) = (steps, steps, steps);
    let fits = cfg.optim.lr_schedule().validate();
    config::for_key(TrainArgs::KEYS, "epochs", fits)
}
