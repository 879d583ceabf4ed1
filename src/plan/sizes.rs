//! Sizes given without running the engine: about the bytes of a rank's
//! model states (`--fsdp auto`'s rule of thumb) and of one checkpoint on
//! disk.

use crate::model::ModelConfig;

/// About the bytes of the whole model's states on one rank without FSDP, for
/// `--fsdp auto`'s rule of thumb (the plan itself counts every byte):
/// parameters in the compute dtype, and for the parameters `frozen` leaves
/// trained their gradients and the optimizer's state (moments and, on
/// GPUs, master weights) as `state` keeps them.
pub fn trained_state_bytes(
    cfg: &ModelConfig,
    gpu: bool,
    frozen: &crate::model::Freeze,
    state: crate::optim::StateFormat,
) -> usize {
    let (frozen_elems, _) = frozen.frozen_elements(cfg);
    let params = cfg.param_count();
    let weight = if gpu { 2 } else { 4 };
    // the optimizer's state as it declares it (masters only of narrow,
    // GPU, parameters)
    let trained = state.grads.dtype().size() + crate::optim::state_bytes_per_element(state, gpu);
    params * weight + (params - frozen_elems) * trained
}

/// Bytes of one training checkpoint of `cfg` on disk: F32 weights and both
/// AdamW moments (and the F32 masters, which a sharded run in a lower
/// precision keeps beside them: `masters`), and a MiB for the JSON and TOML
/// files.
pub fn checkpoint_bytes(cfg: &ModelConfig, masters: bool) -> u64 {
    let per_param = if masters { 16 } else { 12 };
    cfg.param_count() as u64 * per_param + (1 << 20)
}
