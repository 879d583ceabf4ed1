//! The LoRA adapters' transient buffers (`attention::lora_delta`), walked
//! where the engine applies an adapter: each forward application
//! (`lora_delta_fwd_mat`) holds `h` `[rows, r]` in the activations' dtype
//! for its second GEMM, each backward (`lora_delta_bwd_mat`) `h` then `g`,
//! both `[rows, r]`, one after the other. The adapters' weights, gradients
//! and optimizer state are the store's (`plan::walk_step_rank`,
//! `plan::offload_optim::unit_slots`).

use crate::backend::Category::Workspace;
use crate::model::lora::{LoraConfig, LoraTarget};
use crate::plan::sim::Sim;

/// The adapted projections of every block and their rank (none: no LoRA).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Adapters {
    /// The rank `r` (0: no adapters).
    pub rank: usize,
    /// Whether each target of [`LoraTarget::ALL`] is adapted.
    on: [bool; 7],
}

impl Adapters {
    /// The adapters of a run with `lora` (`None`: none).
    pub fn of(lora: Option<&LoraConfig>) -> Adapters {
        let Some(c) = lora else {
            return Adapters::default();
        };
        let mut on = [false; 7];
        for (i, t) in LoraTarget::ALL.iter().enumerate() {
            on[i] = c.targets.contains(t);
        }
        Adapters { rank: c.rank, on }
    }

    /// Whether `target` has an adapter.
    pub fn has(&self, target: LoraTarget) -> bool {
        let i = LoraTarget::ALL.iter().position(|&t| t == target);
        self.rank > 0 && i.is_some_and(|i| self.on[i])
    }

    /// `lora_delta_fwd_mat` of `target`'s adapter on `rows` rows (`ab`
    /// bytes per element): `h` `[rows, r]`, freed after the second GEMM.
    pub fn fwd(&self, sim: &mut Sim, target: LoraTarget, rows: usize, ab: usize) {
        if self.has(target) {
            let h = sim.alloc(Workspace, rows * self.rank * ab);
            sim.free(h);
        }
    }

    /// `lora_delta_bwd_mat` of `target`'s adapter on `rows` rows: `h`
    /// `[rows, r]`, freed, then `g` `[rows, r]`, freed.
    pub fn bwd(&self, sim: &mut Sim, target: LoraTarget, rows: usize, ab: usize) {
        if self.has(target) {
            for _ in 0..2 {
                let t = sim.alloc(Workspace, rows * self.rank * ab);
                sim.free(t);
            }
        }
    }
}
