//! The one place the layers above make an optimizer and ask what state it
//! keeps: [`build`] from the run's [`OptimConfig`] over a store's slots,
//! and [`state_bytes_per_element`] for the planner. Only this file (and
//! the optimizer's own folder) knows which optimizer a run trains with.

use super::adamw::{AdamW, AdamWConfig, state_specs};
use super::optimizer::{Optimizer, StateSpec};
use super::slot::Slot;
use super::state_format::StateFormat;
use crate::backend::{Backend, Tensor};
use crate::error::Result;

/// The run's optimizer settings: hyper-parameters, schedule, where and how
/// its state is kept (AdamW's: the one optimizer today).
pub type OptimConfig = AdamWConfig;

/// What an optimizer is built over: a parameter store's slots.
pub struct BuildArgs<'a, B: Backend> {
    pub slots: Vec<Slot>,
    /// Each slot's current parameters (`[k]`: slot k's tensor).
    pub params: &'a [&'a Tensor<B>],
    /// The model's blocks (they order the updates).
    pub layers: usize,
    /// Whether a step with deferred host updates zeroes the device slots'
    /// gradients too (a store whose backward adds into gradients zeroed
    /// only when no host update is pending).
    pub zero_device_grads: bool,
}

/// The optimizer `cfg` names, its state made for `args.slots` (zero
/// moments, masters of the current parameters where it keeps them).
pub fn build<B: Backend>(
    b: &B,
    cfg: &OptimConfig,
    args: BuildArgs<'_, B>,
) -> Result<Box<dyn Optimizer<B>>> {
    let opt = AdamW::new(b, *cfg, args.slots, args.params, args.layers)?;
    Ok(if args.zero_device_grads {
        Box::new(opt.zeroing_device_grads())
    } else {
        Box::new(opt)
    })
}

/// The state the run's optimizer keeps per parameter element on the
/// device, kept as `format` says, for parameters in a lower precision than
/// F32 (`narrow`) or not.
pub fn state_per_element(format: StateFormat, narrow: bool) -> Vec<StateSpec> {
    state_specs(format, narrow)
}

/// [`state_per_element`]'s bytes (block scales aside).
pub fn state_bytes_per_element(format: StateFormat, narrow: bool) -> usize {
    (state_per_element(format, narrow).iter())
        .map(StateSpec::bytes)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{MasterWeights, MomentFormat};

    /// AdamW declares two moments in their format and, for narrow
    /// parameters, an F32 master: 12 bytes by default on a GPU, 8 on the
    /// CPU, 2 with 8-bit moments and no master.
    #[test]
    fn adamws_state_is_what_it_declares() {
        let plain = StateFormat::default();
        assert_eq!(state_bytes_per_element(plain, true), 12);
        assert_eq!(state_bytes_per_element(plain, false), 8);
        let compact = StateFormat {
            moments: MomentFormat::Q8,
            master: MasterWeights::None,
            ..plain
        };
        assert_eq!(state_bytes_per_element(compact, true), 2);
        let names: Vec<_> = (state_per_element(plain, true).iter())
            .map(|s| s.kind.name())
            .collect();
        assert_eq!(names, ["exp_avg", "exp_avg_sq", "master"]);
    }
}
