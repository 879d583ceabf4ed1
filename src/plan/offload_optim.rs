//! The allocations of `--offload-optimizer` (`train::offload_optim`): the
//! host-resident state as it is built, and a step's gradient downloads
//! (one slot ahead) and parameter uploads.

use super::sim::Sim;
use crate::backend::Category::{Offload, Workspace};
use crate::model::ModelConfig;
use crate::train::fsdp::model_layouts;

const F32: usize = 4;

/// Elements of every parameter tensor, in `ModelWeights::named` order.
pub fn tensor_numels(cfg: &ModelConfig) -> Vec<usize> {
    model_layouts(cfg, 1)
        .iter()
        .flat_map(|u| u.params.iter().map(|p| p.numel()))
        .collect()
}

/// Each slot's F32 master (through a device F32 copy when the compute
/// dtype of `ab` bytes is narrower), then its two moments, in host memory.
pub fn host_state(sim: &mut Sim, slots: &[usize], ab: usize) {
    for &n in slots {
        sim.alloc(Offload, n * F32);
        if ab != F32 {
            let wide = sim.alloc(Workspace, n * F32);
            sim.free(wide);
        }
        sim.alloc(Offload, n * F32);
        sim.alloc(Offload, n * F32);
    }
}

/// One optimizer step: slot k+1's gradient downloaded while slot k is
/// updated; each updated master goes back through a device F32 buffer when
/// the compute dtype is narrower.
pub fn host_step(sim: &mut Sim, slots: &[usize], ab: usize) {
    let mut next = slots.first().map(|&n| sim.alloc(Offload, n * F32));
    for (k, &n) in slots.iter().enumerate() {
        let Some(grad) = next.take() else {
            break;
        };
        next = slots.get(k + 1).map(|&m| sim.alloc(Offload, m * F32));
        sim.free(grad);
        if ab != F32 {
            let wide = sim.alloc(Workspace, n * F32);
            sim.free(wide);
        }
    }
}
