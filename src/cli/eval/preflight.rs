//! `upipe eval`'s preflight: before any weight is loaded, the planner
//! predicts the peak of every length the evaluation runs (its own forward
//! on the counting backend, `plan::predict_eval`) and holds each against
//! the memory a rank has, as `upipe train`'s preflight does; a length that
//! cannot fit is refused naming what fits.

use crate::attention::Strategy;
use crate::backend::Bytes;
use crate::backend::cuda::cudnn::AttnKernel;
use crate::cli::train::{
    Device, Route, decide_kernel, host_available_bytes, memory_per_rank, outside_ledger,
};
use crate::error::{Error, Result};
use crate::plan::{DeviceKind, EvalForward, EvalSpec, Prediction, predict_eval};
use crate::train::eval::EvalConfig;

/// Where an evaluation runs, as the preflight needs it.
pub(super) struct Placement<'a> {
    pub route: &'a Route,
    pub device: Device,
    /// `--attn-kernel`.
    pub kernel: AttnKernel,
    pub gpus: usize,
    /// Whether its windows may hold several documents (documents masks).
    pub documents: bool,
}

/// What the preflight planned: each length's prediction.
pub(super) struct Planned {
    /// One per length, in the order given.
    pub predictions: Vec<Prediction>,
}

/// Predicts every one of `lengths` of `cfg` (`forward`: the loss or a
/// trial) and refuses the first that cannot fit a rank's memory.
pub(super) fn preflight(
    cfg: &EvalConfig,
    lengths: &[usize],
    forward: EvalForward,
    at: &Placement,
) -> Result<Planned> {
    let head_dim = cfg.model.head_dim;
    let kernel = decide_kernel(
        at.route,
        at.device,
        at.kernel,
        head_dim,
        at.documents,
        false,
    )?;
    let device = DeviceKind::of_kernel(kernel, at.documents);
    let predict = |cfg: &EvalConfig, length: usize| {
        let spec = EvalSpec {
            cfg,
            length,
            device,
            forward,
        };
        predict_eval(&spec)
    };
    let predictions = (lengths.iter())
        .map(|&l| predict(cfg, l))
        .collect::<Result<Vec<_>>>()?;
    let world = cfg.mesh_shape(&cfg.plan(lengths.iter().copied().max().unwrap_or(1))?);
    let world = world.world_size();
    let on_gpu = *at.route != Route::CpuThreads;
    let usable = memory_per_rank(on_gpu, world, at.gpus, host_available_bytes()).map(|m| {
        m.saturating_sub(if on_gpu {
            outside_ledger(world, at.gpus)
        } else {
            0
        })
    });
    let Some(usable) = usable else {
        return Ok(Planned { predictions });
    };
    let needs = |p: &Prediction| p.rank_bytes(device);
    for (&length, p) in lengths.iter().zip(&predictions) {
        if needs(p) > usable {
            let fits = |c: &EvalConfig, l: usize| predict(c, l).is_ok_and(|p| needs(&p) <= usable);
            let fix = suggest(cfg, length, forward, &fits);
            return Err(refusal(length, p, usable, forward, &fix));
        }
    }
    Ok(Planned { predictions })
}

/// The error of a length that cannot fit, with the breakdown and `fix`.
fn refusal(length: usize, p: &Prediction, usable: usize, forward: EvalForward, fix: &str) -> Error {
    let by: Vec<String> = (p.at_peak.iter())
        .filter(|(c, b)| *b > 0 && c.on_device())
        .map(|(c, b)| format!("{} {}", c.name(), Bytes(*b)))
        .collect();
    let flag = match forward {
        EvalForward::Loss => "--seq",
        EvalForward::Trial => "--lengths",
    };
    let at = match p.peak_at {
        "" => String::new(),
        part => format!("; at {part}"),
    };
    Error::Config(format!(
        "{flag} {length} cannot fit, so no weight was loaded: the planner predicts a peak of {} \
         per rank ({}{at}), but {} is usable. {fix}",
        Bytes(p.peak),
        by.join(", "),
        Bytes(usable)
    ))
}

/// A sentence naming what fits: UPipe, narrower UPipe stages, a shorter
/// length (the longest of the halvings of `length` that fits), and more
/// GPUs; `fits` asks the planner.
fn suggest(
    cfg: &EvalConfig,
    length: usize,
    forward: EvalForward,
    fits: &dyn Fn(&EvalConfig, usize) -> bool,
) -> String {
    let flag = match forward {
        EvalForward::Loss => "--seq",
        EvalForward::Trial => "--lengths",
    };
    let upipe = EvalConfig {
        strategy: Strategy::Upipe,
        ulysses: cfg.ulysses.max(1),
        ..cfg.clone()
    };
    if cfg.strategy != Strategy::Upipe && fits(&upipe, length) {
        return "Adding --attn upipe fits (UPipe attends a few heads at a time).".into();
    }
    let narrow = EvalConfig {
        chunk_heads: Some(upipe.ulysses),
        fwd_chunk_heads: Some(upipe.ulysses),
        ..upipe
    };
    let narrower = cfg.chunk_heads.is_none_or(|c| c > narrow.ulysses);
    if narrower && fits(&narrow, length) {
        return format!(
            "Adding --attn upipe --chunk-heads {} --fwd-chunk-heads {} fits (the narrowest \
             UPipe stages).",
            narrow.ulysses, narrow.ulysses
        );
    }
    let shorter = std::iter::successors(Some(length / 2), |&l| Some(l / 2))
        .take_while(|&l| l >= 64)
        .find(|&l| fits(cfg, l));
    let shorter = match shorter {
        Some(l) => format!("give a shorter {flag} ({l} fits), or "),
        None => String::new(),
    };
    format!(
        "To fit: {shorter}spread it over more GPUs (a larger --ulysses or --ring mesh); \
         `upipe plan` shows what fits."
    )
}
