//! The preflight of a training run: before anything is allocated, the
//! planner's prediction is held against the device's memory and the host's,
//! and a run that cannot fit is refused with its breakdown and the smallest
//! change that fits.

use super::{Prediction, StepSpec, predict_step_rank};
use crate::backend::{Bytes, Category};
use crate::error::{Error, Result};
use crate::model::HostUpdate;
use crate::optim::{GradDtype, MasterWeights, MomentFormat, StateFormat};

/// The memory one rank may use.
#[derive(Debug, Clone, Copy)]
pub struct RankMemory {
    /// Device bytes (a GPU's, less what lies outside the ledger; on the CPU
    /// the host's available memory shared by the thread ranks).
    pub device: usize,
    /// Host bytes for offloaded tensors (None: unchecked).
    pub host: Option<usize>,
}

/// A change to the run and the flags that make it.
struct Change {
    flags: &'static str,
    apply: fn(&mut StepSpec),
}

/// The changes tried, cheapest in speed first (`--offload auto` stands for
/// offloading every block here, `--offload-optimizer auto` for every
/// unit's optimizer state on the host: auto then picks the fewest that fit);
/// the exact arithmetic before the narrower training state.
const CHANGES: [Change; 13] = [
    Change {
        // what `auto` falls back to: if none fits, auto fits
        flags: "--save-attention auto",
        apply: |s| s.policy.save_attention = 0,
    },
    Change {
        flags: "--fsdp on",
        apply: |s| s.fsdp = true,
    },
    Change {
        flags: "--checkpoint",
        apply: |s| s.policy.checkpoint = true,
    },
    Change {
        flags: "--checkpoint --tiled-mlp",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.tiled_mlp = true;
        },
    },
    Change {
        flags: "--checkpoint --offload auto",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.offload = s.model.layers;
        },
    },
    Change {
        flags: "--checkpoint --tiled-mlp --offload auto",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.tiled_mlp = true;
            s.policy.offload = s.model.layers;
        },
    },
    Change {
        flags: "--offload-optimizer auto",
        apply: |s| s.policy.offload_optimizer = all_units(s),
    },
    Change {
        flags: "--checkpoint --offload auto --offload-optimizer auto",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.offload = s.model.layers;
            s.policy.offload_optimizer = all_units(s);
        },
    },
    Change {
        flags: "--checkpoint --tiled-mlp --offload auto --offload-optimizer auto",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.tiled_mlp = true;
            s.policy.offload = s.model.layers;
            s.policy.offload_optimizer = all_units(s);
        },
    },
    Change {
        flags: "--checkpoint --tiled-mlp --offload auto --offload-optimizer auto \
                --checkpoint-every auto",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.tiled_mlp = true;
            s.policy.offload = s.model.layers;
            s.policy.offload_optimizer = all_units(s);
            s.policy.checkpoint_every = sqrt_segments(s);
        },
    },
    Change {
        flags: "--checkpoint --tiled-mlp --offload auto --offload-optimizer auto \
                --checkpoint-every auto --grad-dtype bf16",
        apply: |s| {
            s.policy.checkpoint = true;
            s.policy.tiled_mlp = true;
            s.policy.offload = s.model.layers;
            s.policy.offload_optimizer = all_units(s);
            s.policy.checkpoint_every = sqrt_segments(s);
            s.state.grads = GradDtype::Bf16;
        },
    },
    Change {
        // compact state on the device
        flags: "--checkpoint --tiled-mlp --offload auto --checkpoint-every auto --grad-dtype \
                bf16 --optim-state 8bit --master-weights none --offload-optimizer 0",
        apply: |s| compact_state(s, 0),
    },
    Change {
        // compact state on the host, paged through the GPU for its update
        flags: "--checkpoint --tiled-mlp --offload auto --checkpoint-every auto --grad-dtype \
                bf16 --optim-state 8bit --master-weights none --offload-optimizer auto \
                --host-update gpu",
        apply: |s| compact_state(s, all_units(s)),
    },
];

/// Every memory policy and the most compact training state (8-bit
/// moments, no master, BF16 gradients), that state on the host for
/// `host_units` units, paged through the GPU for its update.
fn compact_state(s: &mut StepSpec, host_units: usize) {
    s.policy.host_update = HostUpdate::Gpu;
    s.policy.checkpoint = true;
    s.policy.tiled_mlp = true;
    s.policy.offload = s.model.layers;
    s.policy.offload_optimizer = host_units;
    s.policy.checkpoint_every = sqrt_segments(s);
    s.state = StateFormat {
        moments: MomentFormat::Q8,
        master: MasterWeights::None,
        grads: GradDtype::Bf16,
    };
}

/// Segments of about √L blocks, which keep about 2√L block inputs alive
/// at once (near the fewest of any length): one of the lengths
/// `--checkpoint-every auto` tries (it tries every length, the fewest
/// recomputes first), so wherever this fits, auto fits.
fn sqrt_segments(s: &StepSpec) -> usize {
    ((s.model.layers as f64).sqrt().round() as usize).max(2)
}

/// Whether `s` fits, with a change of segment checkpointing tried at each
/// segment length from 2 to the one it names (√L): which fits first
/// depends on what else is offloaded (rebuilt inputs stay on the device).
fn segments_fit(s: &mut StepSpec, fits: &impl Fn(&StepSpec) -> bool) -> bool {
    let most = s.policy.checkpoint_every;
    if most <= 1 {
        return fits(s);
    }
    (2..=most).any(|k| {
        s.policy.checkpoint_every = k;
        fits(s)
    })
}

/// Every unit's optimizer state on the host (what `--offload-optimizer
/// auto` falls back to: wherever it fits, auto fits).
fn all_units(s: &StepSpec) -> usize {
    crate::model::MemoryPolicy::optimizer_units(s.model.layers)
}

/// Of a rank's pinned host budget, the bytes its planned host tensors may
/// fill: the pinned pool's slack (`backend::memory::PINNED_SLACK`) is left
/// out, as the GPU's reserve is left out of its memory.
pub fn planned_host(pinned_budget: usize) -> usize {
    pinned_budget.saturating_sub(crate::backend::memory::PINNED_SLACK)
}

/// `Err` naming the breakdown and a fix when `pred` (of `spec`) does not fit `mem`.
pub fn check(spec: &StepSpec, pred: &Prediction, mem: RankMemory) -> Result<()> {
    let over_device = pred.peak > mem.device;
    let over_host = mem.host.is_some_and(|h| pred.host_peak > h);
    if !over_device && !over_host {
        return Ok(());
    }
    let by: Vec<String> = pred
        .at_peak
        .iter()
        .filter(|(c, b)| *b > 0 && c.on_device())
        .map(|(c, b)| format!("{} {}", c.name(), Bytes(*b)))
        .collect();
    let what = if over_device {
        format!(
            "the planner predicts a peak of {} per rank ({}; at {}), but {} is usable",
            Bytes(pred.peak),
            by.join(", "),
            pred.peak_at,
            Bytes(mem.device)
        )
    } else {
        format!(
            "the planner predicts {} of host memory per rank ({} {}), but {} is usable (--host-mem)",
            Bytes(pred.host_peak),
            Category::Offload.name(),
            Bytes(pred.host_peak),
            Bytes(mem.host.unwrap_or(0))
        )
    };
    Err(Error::Config(format!(
        "this run cannot fit, so nothing was allocated: {what}. {}",
        suggest(spec, mem)
    )))
}

/// The first change of [`CHANGES`] that fits `mem` (the smallest in
/// speed), or a shorter `--seq`: a sentence naming the flags.
pub fn suggest(spec: &StepSpec, mem: RankMemory) -> String {
    let world = spec.data * spec.plan.mesh_shape().world_size();
    let fits = |s: &StepSpec| {
        predict_step_rank(s, 0)
            .is_ok_and(|p| p.peak <= mem.device && mem.host.is_none_or(|h| p.host_peak <= h))
    };
    for c in &CHANGES {
        let mut s = spec.clone();
        (c.apply)(&mut s);
        if c.flags.contains("fsdp") && world == 1 {
            continue;
        }
        let changed = s.policy != spec.policy || s.fsdp != spec.fsdp || s.state != spec.state;
        if changed && segments_fit(&mut s, &fits) {
            return format!(
                "Adding {} fits (`upipe plan` shows the breakdown).",
                c.flags
            );
        }
    }
    "No memory policy alone makes it fit: shorten --seq, add GPUs (a larger mesh), \
     or lower --chunk-heads (UPipe); `upipe plan --seq ...` shows what fits."
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{CpPlan, Strategy};
    use crate::model::decoder::attn_dims;
    use crate::model::{MemoryPolicy, ModelConfig};
    use crate::plan::DeviceKind;

    fn spec(seq: usize, policy: MemoryPolicy) -> StepSpec {
        spec_of("llama3.2-1b", seq, policy)
    }

    fn spec_of(model: &str, seq: usize, policy: MemoryPolicy) -> StepSpec {
        let model = ModelConfig::resolve(model).unwrap();
        let plan = CpPlan::new(Strategy::Upipe, &attn_dims(&model), seq, 1, 1, None).unwrap();
        StepSpec {
            model,
            plan,
            data: 1,
            policy,
            fsdp: false,
            fsdp_replicas: 1,
            grad_accum: 1,
            device: DeviceKind::CUDA,
            optimizer: true,
            state: Default::default(),
            precision: Default::default(),
            freeze: Default::default(),
            lora: None,
        }
    }

    #[test]
    fn a_run_that_cannot_fit_is_refused_naming_the_change_that_fits() {
        let mem = RankMemory {
            device: 80 << 30,
            host: None,
        };
        let plain = spec(65536, MemoryPolicy::default());
        let pred = predict_step_rank(&plain, 0).unwrap();
        assert!(pred.peak > mem.device, "the test needs a run over 80 GiB");
        let e = check(&plain, &pred, mem).unwrap_err().to_string();
        assert!(
            e.contains("cannot fit") && e.contains("Adding --checkpoint fits"),
            "{e}"
        );
        let ckpt = spec(
            65536,
            MemoryPolicy {
                checkpoint: true,
                ..MemoryPolicy::default()
            },
        );
        check(&ckpt, &predict_step_rank(&ckpt, 0).unwrap(), mem).unwrap();
        let huge = spec(1 << 22, MemoryPolicy::default());
        let e = check(&huge, &predict_step_rank(&huge, 0).unwrap(), mem)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shorten --seq"), "{e}");
    }

    /// Llama3-8B at 512K on one 80 GiB GPU with 108 GiB of host: no
    /// policy with F32 state fits, the compact training state does.
    #[test]
    fn the_compact_training_state_is_named_where_only_it_fits() {
        let mem = RankMemory {
            device: (79.18 * (1u64 << 30) as f64) as usize - (1 << 30),
            host: Some(planned_host(108 << 30)),
        };
        let plain = spec_of("llama3-8b", 1 << 19, MemoryPolicy::default());
        let e = check(&plain, &predict_step_rank(&plain, 0).unwrap(), mem)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--grad-dtype bf16 --optim-state 8bit --master-weights none"),
            "{e}"
        );
    }
}
