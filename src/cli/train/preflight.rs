//! The checks a training run makes once it is built and before anything is
//! allocated: the planner's prediction against the memory each rank has (a
//! run that cannot fit is refused with its breakdown and the smallest
//! change that fits, `plan::preflight`), the pinned-host budget of GPU
//! runs, and the outputs it opens (checkpoint directory, metrics file,
//! TensorBoard directory, trace file).

use super::TrainArgs;
use super::built::Built;
use super::progress::Progress;
use crate::backend::memory::{default_pinned_budget, host_reserve};
use crate::checkpoint::save_dir;
use crate::cli::metrics::{MetricsFile, RunFacts, unix_now};
use crate::cli::tensorboard::EventWriter;
use crate::error::Result;
use crate::model::flops::{
    causal_train_flops_per_token, frozen_and_adapter_flops, skipped_attention_share,
};
use crate::plan::preflight::{RankMemory, planned_host};
use crate::plan::{GPU_RESERVE_BYTES, Prediction};

/// Every check, in order; the run's per-step output on success.
pub(super) fn preflight(
    a: &TrainArgs,
    run: &mut Built,
    predicted: &Prediction,
) -> Result<Progress> {
    memory(run, predicted, a.host_mem)?;
    outputs(a, run, predicted)
}

/// Refuses a run the planner says cannot fit the memory each rank has (GPU
/// less what lies outside the ledger, or the host's share on the CPU), and
/// sets the pinned-host budget of GPU runs (`--host-mem`, GiB per node).
fn memory(run: &mut Built, predicted: &Prediction, host_mem_gib: Option<f64>) -> Result<()> {
    match rank_memory(run, host_mem_gib)? {
        Some(mem) => {
            crate::plan::preflight::check(&run.spec(&run.plan), &held(run, predicted), mem)
        }
        None => Ok(()),
    }
}

/// The memory each rank may use (`None`: unknown), as the preflight holds
/// the prediction against it; sets the pinned-host budget of GPU runs.
pub(super) fn rank_memory(
    run: &mut Built,
    host_mem_gib: Option<f64>,
) -> Result<Option<RankMemory>> {
    let (world, gpus) = (run.shape.world_size(), run.gpus.max(1));
    let host = host_per_rank(run, host_mem_gib)?;
    let Some(device) = run.budget else {
        return Ok(None);
    };
    if !run.on_gpu() {
        return Ok(Some(RankMemory { device, host: None }));
    }
    run.cfg.host_budget = host;
    if run.lead {
        log_host_budget(host, host_mem_gib, run.host_available);
    }
    // the pinned pool's slack lies outside the host's tensors
    Ok(Some(RankMemory {
        device: device.saturating_sub(outside_ledger(world, gpus)),
        host: host.map(planned_host),
    }))
}

/// The memory each of `world` ranks has (`None`: unknown): on GPUs a GPU's
/// shared by the ranks on it, on the CPU the host's available memory
/// (`host_available`) shared by the thread ranks.
pub fn memory_per_rank(
    on_gpu: bool,
    world: usize,
    gpus: usize,
    host_available: Option<usize>,
) -> Option<usize> {
    match on_gpu {
        true => super::gpu_memory_per_rank(world, gpus),
        false => host_available.map(|b| b / world.max(1)),
    }
}

/// A GPU rank's device bytes outside the ledger ([`GPU_RESERVE_BYTES`]:
/// the CUDA context, the libraries' handles, the pool's fragmentation),
/// shared by the ranks on one GPU.
pub fn outside_ledger(world: usize, gpus: usize) -> usize {
    GPU_RESERVE_BYTES / world.div_ceil(gpus.max(1))
}

/// `predicted` as it is held against [`rank_memory`]: on the CPU the
/// offloaded tensors share the same memory.
pub(super) fn held(run: &Built, predicted: &Prediction) -> Prediction {
    let mut whole = predicted.clone();
    if !run.on_gpu() {
        whole.peak += predicted.host_peak;
    }
    whole
}

/// Host memory each rank of a GPU run may pin: `--host-mem` (GiB per node)
/// or the host's available memory less what the system keeps
/// ([`default_pinned_budget`]), shared by the node's ranks.
pub(super) fn host_per_rank(run: &Built, host_mem_gib: Option<f64>) -> Result<Option<usize>> {
    let per_node = run.shape.world_size().min(run.gpus.max(1));
    match host_mem_gib {
        Some(g) if g.is_finite() && g > 0.0 => {
            Ok(Some((g * (1u64 << 30) as f64) as usize / per_node))
        }
        Some(g) => crate::config_err!("--host-mem {g}: give GiB per node, more than 0"),
        None => Ok(run
            .host_available
            .map(|b| default_pinned_budget(b) / per_node)),
    }
}

/// Says where the pinned-host budget of a GPU run came from.
fn log_host_budget(per_rank: Option<usize>, host_mem_gib: Option<f64>, available: Option<usize>) {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    match (per_rank, host_mem_gib) {
        (Some(b), Some(g)) => {
            tracing::info!(
                "pinned host budget: {:.2} GiB per rank (--host-mem {g})",
                gib(b)
            )
        }
        (Some(b), None) => {
            let avail = available.unwrap_or(0);
            tracing::info!(
                "pinned host budget: {:.2} GiB per rank (MemAvailable {:.2} GiB at start, less {:.2} GiB \
                 kept for the system and unpinned memory; --host-mem sets it)",
                gib(b),
                gib(avail),
                gib(host_reserve(avail))
            )
        }
        (None, _) => tracing::info!(
            "pinned host budget: unknown (no /proc/meminfo); give --host-mem to plan host memory"
        ),
    }
}

/// `--trace PATH` names a file that can be written (created now, empty;
/// the run's last step fills it); a missing parent directory is created.
fn trace_file(path: &std::path::Path) -> Result<()> {
    let bad = |why: String| {
        crate::config_err!(
            "--trace {}: {why}; give a file to write, e.g. --trace step.json",
            path.display()
        )
    };
    if path.is_dir() {
        return bad("is a directory".into());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        return bad(format!("cannot create its directory ({e})"));
    }
    match std::fs::File::create(path) {
        Ok(_) => Ok(()),
        Err(e) => bad(format!("cannot write it ({e})")),
    }
}

/// The checkpoint directory can take the run's checkpoints
/// (`checkpoint::save_dir::check`) and the metrics and trace files can be
/// created; the per-step output (bar, lines or JSON, and the metrics and
/// TensorBoard files).
fn outputs(a: &TrainArgs, run: &Built, predicted: &Prediction) -> Result<Progress> {
    if let (Some(dir), true) = (&run.cfg.save_dir, run.lead) {
        // F32 masters are saved on GPUs, and wherever the weight files are
        // narrower than F32 (then the F32 size counted for the weights bounds theirs)
        let masters = run.on_gpu() || run.cfg.save_dtype != crate::checkpoint::SaveDtype::F32;
        let bytes = crate::plan::checkpoint_bytes(&run.cfg.model, masters);
        save_dir::check(dir, run.cfg.save_rules(), bytes)?;
    }
    if let (Some(path), true) = (&run.cfg.trace, run.lead) {
        trace_file(path)?;
    }
    // the causal counts, which each step's masks (documents, a sliding
    // window) scale down to what they let the kernels compute
    let (flops_per_token, attention_flops_per_token) =
        causal_train_flops_per_token(&run.cfg.model, run.cfg.seq);
    // what is computed: no weight gradient of a frozen matrix, adapters' GEMMs
    let lora = run.cfg.lora.as_ref().map(|l| &l.config);
    // and no attention backward below the backward's floor
    let (model, freeze) = (&run.cfg.model, &run.cfg.freeze);
    let skipped = attention_flops_per_token * skipped_attention_share(model, freeze, lora);
    let attention_flops_per_token = attention_flops_per_token - skipped;
    let flops_per_token = flops_per_token - skipped + frozen_and_adapter_flops(model, freeze, lora);
    let facts = RunFacts {
        flops_per_token,
        attention_flops_per_token,
        ranks: run.shape.world_size(),
        predicted: Some(predicted.clone()),
        attention_kernel: run.cfg.attention_kernel.map(|k| k.to_string()),
        optim_state: (!run.cfg.optim.state.is_plain()).then(|| run.cfg.optim.state.to_string()),
        precision: (run.cfg.precision != Default::default()).then(|| run.cfg.precision.to_string()),
    };
    let mut progress = Progress::new(a.json, run.lead, run.cfg.steps, facts);
    if !run.lead {
        return Ok(progress);
    }
    if let Some(path) = &a.metrics {
        // a resumed run adds its steps after those the file holds
        let metrics = match run.cfg.resume_dir().is_some() {
            true => MetricsFile::append(path)?,
            false => MetricsFile::create(path)?,
        };
        progress = progress.with_metrics(metrics);
    }
    if let Some(dir) = &a.tensorboard {
        progress = progress.with_tensorboard(EventWriter::create(dir, unix_now())?);
    }
    Ok(progress)
}
