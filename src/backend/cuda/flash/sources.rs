//! The flash kernels' CUDA sources, their NVRTC modules and options, and
//! the names of their entry points.

/// The whole kernel source: shared helpers, forward, backward.
pub const FLASH_SOURCE: &str = concat!(
    include_str!("flash_common.cuh"),
    "\n",
    include_str!("flash_fwd.cu"),
    "\n",
    include_str!("flash_bwd.cu"),
);

/// `(module name, source)`: one module holding every flash kernel.
pub const FLASH_SOURCES: &[(&str, &str)] = &[("upipe_flash", FLASH_SOURCE)];

/// The wgmma forward (shared helpers + kernel), compiled separately for
/// [`WGMMA_NVRTC_ARCH`]: wgmma exists only on the arch-specific `sm_90a` target.
pub const FLASH_WGMMA_SOURCE: &str = concat!(
    include_str!("flash_common.cuh"),
    "\n",
    include_str!("flash_fwd_wgmma.cu"),
);
/// The wgmma backward (shared helpers, the wgmma forward whose wgmma/mbarrier
/// helpers it uses, the backward kernel), its own module for [`WGMMA_NVRTC_ARCH`]
/// so that a failure to build it never costs the forward.
pub const FLASH_WGMMA_BWD_SOURCE: &str = concat!(
    include_str!("flash_common.cuh"),
    "\n",
    include_str!("flash_fwd_wgmma.cu"),
    "\n",
    include_str!("flash_bwd_wgmma.cu"),
);
/// Module name of [`FLASH_WGMMA_BWD_SOURCE`].
pub const FLASH_WGMMA_BWD_MODULE: &str = "upipe_flash_wgmma_bwd";
/// The wgmma backward kernel, head dim 128 (its preprocessing is [`BWD_PRE_D128`]).
pub const BWD_WGMMA_D128: &str = "upipe_flash_bwd_wgmma_d128";
/// Module name of [`FLASH_WGMMA_SOURCE`].
pub const FLASH_WGMMA_MODULE: &str = "upipe_flash_wgmma";
/// NVRTC target of [`FLASH_WGMMA_SOURCE`] (runs on compute capability 9.0 only).
pub const WGMMA_NVRTC_ARCH: &str = "sm_90a";
/// The wgmma forward kernel, head dim 128.
pub const FWD_WGMMA_D128: &str = "upipe_flash_fwd_wgmma_d128";

/// NVRTC target architecture of the kernels (mma.sync, ldmatrix, cp.async,
/// vector `red` need sm_90).
pub const NVRTC_ARCH: &str = "sm_90";
/// Extra NVRTC options the source expects.
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17"];

/// Forward kernel, head dim 64.
pub const FWD_D64: &str = "upipe_flash_fwd_d64";
/// Forward kernel, head dim 128.
pub const FWD_D128: &str = "upipe_flash_fwd_d128";
/// Forward kernel, head dim 256.
pub const FWD_D256: &str = "upipe_flash_fwd_d256";
/// Backward preprocessing (delta = rowsum(dO * O)), head dim 64.
pub const BWD_PRE_D64: &str = "upipe_flash_bwd_pre_d64";
/// Backward preprocessing, head dim 128.
pub const BWD_PRE_D128: &str = "upipe_flash_bwd_pre_d128";
/// Backward preprocessing, head dim 256.
pub const BWD_PRE_D256: &str = "upipe_flash_bwd_pre_d256";
/// Backward kernel, head dim 64.
pub const BWD_D64: &str = "upipe_flash_bwd_d64";
/// Backward kernel, head dim 128.
pub const BWD_D128: &str = "upipe_flash_bwd_d128";
/// Backward kernel, head dim 256.
pub const BWD_D256: &str = "upipe_flash_bwd_d256";
/// Every kernel name in the module.
pub const KERNEL_NAMES: &[&str] = &[
    FWD_D64,
    FWD_D128,
    FWD_D256,
    BWD_PRE_D64,
    BWD_PRE_D128,
    BWD_PRE_D256,
    BWD_D64,
    BWD_D128,
    BWD_D256,
];
/// `(head dim, forward, backward preprocessing, backward)` of the mma.sync kernels.
pub(super) const MMA_KERNELS: [(usize, &str, &str, &str); 3] = [
    (64, FWD_D64, BWD_PRE_D64, BWD_D64),
    (128, FWD_D128, BWD_PRE_D128, BWD_D128),
    (256, FWD_D256, BWD_PRE_D256, BWD_D256),
];
