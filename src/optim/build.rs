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
