//! `--offload-optimizer` (`optim::host`): how many units keep their
//! optimizer state on the host, and `auto`, the fewest that make the step
//! fit (what the state costs where it lives is the engine's: `plan::engine`).

use super::{StepSpec, predict_step};
use crate::error::Result;
use crate::model::{HostUpdate, MemoryPolicy};
use crate::optim::{MomentFormat, StateFormat};

/// The `--host-update` choice: where the optimizer state on the host is
/// updated (`MemoryPolicy::host_update`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostUpdateChoice {
    /// The GPU for BF16 or 8-bit moments, the host's threads for F32 ones
    /// and wherever the device is the host ([`HostUpdateChoice::resolve`]).
    #[default]
    Auto,
    Is(HostUpdate),
}

impl std::fmt::Display for HostUpdateChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostUpdateChoice::Auto => f.write_str("auto"),
            HostUpdateChoice::Is(u) => u.fmt(f),
        }
    }
}

impl std::str::FromStr for HostUpdateChoice {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(HostUpdateChoice::Auto),
            "cpu" => Ok(HostUpdateChoice::Is(HostUpdate::Cpu)),
            "gpu" => Ok(HostUpdateChoice::Is(HostUpdate::Gpu)),
            other => Err(crate::Error::Config(format!(
                "--host-update {other}: use gpu (the host's optimizer state paged through the \
                 GPU for its update), cpu (updated by the host's threads) or auto"
            ))),
        }
    }
}

impl HostUpdateChoice {
    /// Where state kept as `state` says is updated on a GPU (`cuda`) or
    /// the CPU. `auto` on a GPU: compact moments on the GPU, whose update on
    /// the host's cores is arithmetic (decoding and encoding) the host does
    /// far slower than the copies paging costs (about 2 bytes per parameter
    /// each way with 8-bit moments); F32 moments on the host's threads,
    /// where the update runs at memory speed and only the gradient and the
    /// weights cross PCIe (paging would copy 8-12 bytes per parameter each
    /// way). On the CPU, whose device is the host, its threads.
    pub fn resolve(self, state: StateFormat, cuda: bool) -> HostUpdate {
        match self {
            HostUpdateChoice::Is(u) => u,
            HostUpdateChoice::Auto if !cuda || state.moments == MomentFormat::F32 => {
                HostUpdate::Cpu
            }
            HostUpdateChoice::Auto => HostUpdate::Gpu,
        }
    }
}

/// The `--offload-optimizer` choice: units (the embedding, each block, the
/// head) whose F32 master weights and moments live in host memory, the
/// last ones of update order (`MemoryPolicy::offload_optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerOffload {
    /// The fewest units that make the step fit the device budget beside
    /// everything else the run decided ([`optimizer_auto`]).
    Auto,
    /// Every unit.
    All,
    /// The last N units (`none`: 0).
    Units(usize),
}

impl std::fmt::Display for OptimizerOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptimizerOffload::Auto => f.write_str("auto"),
            OptimizerOffload::All => f.write_str("all"),
            OptimizerOffload::Units(0) => f.write_str("none"),
            OptimizerOffload::Units(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for OptimizerOffload {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(OptimizerOffload::Auto),
            "all" | "true" => Ok(OptimizerOffload::All),
            "none" | "false" => Ok(OptimizerOffload::Units(0)),
            n => n.parse().map(OptimizerOffload::Units).map_err(|_| {
                crate::Error::Config(format!(
                    "--offload-optimizer {n}: use all (the flag alone), a number of units \
                     (the last blocks first, then the embedding and the head), auto, or none"
                ))
            }),
        }
    }
}

impl OptimizerOffload {
    /// The units of a `layers`-block model on the host before any budget
    /// is known: `auto` starts from every unit (the most room for the
    /// choices resolved before it).
    pub fn units(self, layers: usize) -> usize {
        match self {
            OptimizerOffload::Auto | OptimizerOffload::All => MemoryPolicy::optimizer_units(layers),
            OptimizerOffload::Units(n) => n,
        }
    }

    /// The units on the host in a step of `spec` (its
    /// `policy.offload_optimizer` is ignored) with `budget` device bytes
    /// per rank (`None`: unknown; `auto` then keeps every unit's state on
    /// the host). A number above the model's units is an error naming the
    /// fix.
    pub fn resolve(self, spec: &StepSpec, budget: Option<usize>) -> Result<usize> {
        let layers = spec.model.layers;
        let n = match (self, budget) {
            (OptimizerOffload::Auto, Some(b)) if spec.optimizer => optimizer_auto(spec, b)?,
            (OptimizerOffload::Auto, _) if !spec.optimizer => 0,
            (choice, _) => choice.units(layers),
        };
        let mut policy = spec.policy;
        policy.offload_optimizer = n;
        policy.validate_for(layers)?;
        Ok(n)
    }
}

/// The fewest units whose optimizer state on the host brings the step's
/// predicted device peak within `budget`; every unit when even that does
/// not (the preflight then reports the closest run). Each unit moved to
/// the host takes its state off the device, so the peak falls with the
/// count: the search bisects.
pub fn optimizer_auto(spec: &StepSpec, budget: usize) -> Result<usize> {
    let all = MemoryPolicy::optimizer_units(spec.model.layers);
    let fits = |n: usize| -> Result<bool> {
        let mut s = spec.clone();
        s.policy.offload_optimizer = n;
        Ok(predict_step(&s)?.rank_bytes(s.device) <= budget)
    };
    if fits(0)? {
        return Ok(0);
    }
    if !fits(all)? {
        return Ok(all);
    }
    // fits(lo) is false, fits(hi) true
    let (mut lo, mut hi) = (0, all);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}
