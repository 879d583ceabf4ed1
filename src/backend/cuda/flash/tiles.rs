//! The kernels' tile shapes and shared-memory sizes (they must match the
//! `.cu` files).

// Tile shapes; must match the .cu files.
pub(super) const FWD_BM: usize = 128;
pub(super) const FWD_BN: usize = 64;
pub(super) const FWD_THREADS: u32 = 128;
/// The forward at head dim 256: 8 warps of 16 rows (same 128-row block).
pub(super) const FWD_THREADS_D256: u32 = 256;
pub(super) const BWD_BM: usize = 64;
pub(super) const BWD_BN: usize = 128;
/// Keys per block of the backward at head dim 256 (its 128-key tiles would
/// not fit the shared memory).
pub(super) const BWD_BN_D256: usize = 64;
pub(super) const BWD_THREADS: u32 = 256;
/// The head dims the mma.sync kernels are compiled for.
pub(super) const HEAD_DIMS: [usize; 3] = [64, 128, 256];
pub(super) const PRE_THREADS: u32 = 256;
pub(super) const WG_BM: usize = 128;
pub(super) const WG_BN: usize = 128;
/// Consumer threads of the wgmma forward (2 warpgroups); the kernel's block
/// also has a copy warpgroup unless compiled with `WG_WS=0`, so the block size
/// is read from the loaded function (its `__launch_bounds__`).
pub(super) const WG_THREADS: u32 = 256;
/// Deepest K/V pipeline the wgmma forward may be compiled with (`WG_STAGES`
/// <= `WG_MAX_STAGES` in the .cu file); its shared memory is sized for it (the
/// kernel's registers allow one block per SM anyway).
pub(super) const WG_MAX_STAGES: usize = 3;
/// wgmma backward: query rows per step, keys per block, consumer threads
/// (the block adds a copy warpgroup), deepest Q/dO ring it may be compiled with.
pub(super) const WB_BM: usize = 64;
pub(super) const WB_BN: usize = 128;
pub(super) const WB_NT: u32 = 256;
pub(super) const WB_MAX_STAGES: usize = 3;

/// Threads of the forward kernel for head dim `d`.
pub(super) fn fwd_threads(d: usize) -> u32 {
    if d == 256 {
        FWD_THREADS_D256
    } else {
        FWD_THREADS
    }
}
/// Keys per block of the backward kernel for head dim `d`.
pub(super) fn bwd_bn(d: usize) -> usize {
    if d == 256 { BWD_BN_D256 } else { BWD_BN }
}
/// Dynamic shared memory of the forward kernel for head dim `d`.
pub(super) fn fwd_smem_bytes(d: usize) -> usize {
    (FWD_BM * d + 4 * FWD_BN * d) * 2
}
/// Dynamic shared memory of the wgmma forward (head dim 128): Q, `WG_MAX_STAGES`
/// K and V tiles, 1 KiB to align the tiles to the 1024-byte swizzle period and
/// 128 bytes of mbarriers.
pub(super) fn wgmma_smem_bytes() -> usize {
    (WG_BM * 128 + 2 * WG_MAX_STAGES * WG_BN * 128) * 2 + 1024 + 128
}
/// Dynamic shared memory of the wgmma backward (head dim 128): K and V, the
/// Q/dO ring, two dS^T buffers, lse/delta rows, mbarriers, 1 KiB of alignment.
pub(super) fn wgmma_bwd_smem_bytes() -> usize {
    (2 * WB_BN * 128 + 2 * WB_MAX_STAGES * WB_BM * 128 + 2 * WB_BN * WB_BM) * 2
        + WB_MAX_STAGES * 2 * WB_BM * 4
        + 16 * WB_MAX_STAGES
        + 1024
}
/// Dynamic shared memory of the backward kernel for head dim `d`.
pub(super) fn bwd_smem_bytes(d: usize) -> usize {
    let bn = bwd_bn(d);
    (2 * bn * d + 4 * BWD_BM * d + 2 * bn * BWD_BM) * 2 + 4 * BWD_BM * 4
}
