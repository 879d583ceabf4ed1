//! Launching the flash kernels on the operands of one call
//! ([`AttnFwd`], [`AttnBwd`]): the checks of its geometry, pointers and
//! strides (every call is checked before its first launch), the kernels'
//! parameter blocks, and the launches of [`flash_fwd`] and [`flash_bwd`].

use super::functions::{FlashFunctions, FlashKernel, drv};
use super::tiles::*;
use crate::backend::AttnMask;
use crate::backend::cuda::attn_operands::{AttnBwd, AttnFwd};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Scratch bytes [`flash_bwd`] needs (the f32 `delta = rowsum(dO * O)` per query row and head).
pub fn flash_bwd_workspace_bytes(sq: usize, hq: usize) -> usize {
    (sq * hq * 4).div_ceil(256) * 256
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct FwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    bounds: u64,
    q_stride: i64,
    k_stride: i64,
    v_stride: i64,
    o_stride: i64,
    lse_stride: i64,
    sq: i32,
    sk: i32,
    hq: i32,
    hkv: i32,
    group: i32,
    causal: i32,
    scale_log2: f32,
    pad0: i32,
}
// SAFETY: plain-old-data with the exact C layout of `FlashFwdParams` in flash_fwd.cu.
unsafe impl DeviceRepr for FwdParams {}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct BwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    d_o: u64,
    lse: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    delta: u64,
    bounds: u64,
    q_stride: i64,
    k_stride: i64,
    v_stride: i64,
    o_stride: i64,
    do_stride: i64,
    lse_stride: i64,
    dq_stride: i64,
    dk_stride: i64,
    dv_stride: i64,
    sq: i32,
    sk: i32,
    hq: i32,
    hkv: i32,
    group: i32,
    causal: i32,
    scale: f32,
    scale_log2: f32,
}
// SAFETY: plain-old-data with the exact C layout of `FlashBwdParams` in flash_bwd.cu.
unsafe impl DeviceRepr for BwdParams {}

/// Errors when the flash kernels do not take this geometry (head dim, GQA
/// ratio, the mask's shape, sizes of one launch).
pub fn check_supported(
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    mask: &AttnMask,
) -> Result<()> {
    if !HEAD_DIMS.contains(&d) {
        return Err(Error::Config(format!(
            "flash attention supports head_dim 64, 128 or 256, got {d}; use the cuDNN or CPU attention for other sizes"
        )));
    }
    if hq == 0 || hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(Error::Config(format!(
            "flash attention: query heads ({hq}) must be a non-zero multiple of kv heads ({hkv})"
        )));
    }
    if let Err(why) = mask.check_shape(sq, sk) {
        return Err(Error::Config(format!("flash attention: {why}")));
    }
    let lim = i32::MAX as usize / 64;
    let fwd_blocks = sq.div_ceil(FWD_BM).saturating_mul(hq);
    let bwd_blocks = sk.div_ceil(bwd_bn(d)).saturating_mul(hkv);
    if sq > lim || sk > lim || sq.saturating_mul(hq) > lim || fwd_blocks > lim || bwd_blocks > lim {
        return Err(Error::Config(format!(
            "flash attention: sizes too large for one launch (sq={sq}, sk={sk}, hq={hq}); split the call"
        )));
    }
    Ok(())
}

/// The kernels' `causal` parameter for `mask` (the naive kernels of
/// `kernels/attention.cu` take the same flag): 1 keeps keys `0..=i` of row
/// `i`, 0 keeps every key, or the rows' `bounds` when the call has them (a
/// documents mask: `BoundedMask::row_bounds`, uploaded by the caller).
pub fn causal_flag(mask: &AttnMask) -> i32 {
    match mask {
        AttnMask::Full | AttnMask::Bounded(_) => 0,
        AttnMask::Causal => 1,
    }
}

pub(super) fn check_ptr(name: &str, p: u64, align: u64) -> Result<()> {
    if p == 0 || !p.is_multiple_of(align) {
        return Err(Error::Backend(format!(
            "flash attention: {name} pointer {p:#x} must be non-null and {align}-byte aligned"
        )));
    }
    Ok(())
}

pub(super) fn check_stride(name: &str, stride: usize, min: usize, multiple: usize) -> Result<()> {
    if stride < min || !stride.is_multiple_of(multiple) {
        return Err(Error::Backend(format!(
            "flash attention: {name} row stride {stride} must be >= {min} and a multiple of {multiple} elements"
        )));
    }
    Ok(())
}

fn launch_err(e: impl std::fmt::Debug) -> Error {
    drv("kernel launch", e)
}

/// Errors when a forward's operands are not aligned for the kernels'
/// vector loads: q, k, v and o 16-byte aligned with rows of `hq·d` or
/// `hkv·d` elements in multiples of 8, the f32 lse (`[s, hq]`) 4-byte aligned.
pub fn check_fwd_operands(a: &AttnFwd) -> Result<()> {
    let (hq, hkv, d) = (a.hq, a.hkv, a.d);
    for (n, p, stride, row) in [
        ("q", a.q, a.q_rs, hq * d),
        ("k", a.k, a.k_rs, hkv * d),
        ("v", a.v, a.v_rs, hkv * d),
        ("o", a.o, a.o_rs, hq * d),
    ] {
        check_ptr(n, p, 16)?;
        check_stride(n, stride, row, 8)?;
    }
    check_ptr("lse", a.lse, 4)?;
    check_stride("lse", a.lse_rs, hq, 1)
}

/// Errors when a backward's operands are not aligned for the kernels'
/// vector loads: those of its forward, dO as o, and the f32 dq, dk, dv
/// (8-byte aligned, rows in multiples of 2).
pub fn check_bwd_operands(a: &AttnBwd) -> Result<()> {
    check_fwd_operands(&a.forward())?;
    check_ptr("d_o", a.d_o, 16)?;
    check_stride("d_o", a.d_o_rs, a.hq * a.d, 8)?;
    for (n, p, stride, row) in [
        ("dq", a.dq, a.dq_rs, a.hq * a.d),
        ("dk", a.dk, a.dk_rs, a.hkv * a.d),
        ("dv", a.dv, a.dv_rs, a.hkv * a.d),
    ] {
        check_ptr(n, p, 8)?;
        check_stride(n, stride, row, 2)?;
    }
    Ok(())
}

impl FwdParams {
    /// The forward kernels' parameter block.
    pub(super) fn of(a: &AttnFwd) -> FwdParams {
        FwdParams {
            q: a.q,
            k: a.k,
            v: a.v,
            o: a.o,
            lse: a.lse,
            bounds: a.bounds,
            q_stride: a.q_rs as i64,
            k_stride: a.k_rs as i64,
            v_stride: a.v_rs as i64,
            o_stride: a.o_rs as i64,
            lse_stride: a.lse_rs as i64,
            sq: a.sq as i32,
            sk: a.sk as i32,
            hq: a.hq as i32,
            hkv: a.hkv as i32,
            group: (a.hq / a.hkv) as i32,
            causal: causal_flag(&a.mask),
            scale_log2: a.scale * std::f32::consts::LOG2_E,
            pad0: 0,
        }
    }
}

impl BwdParams {
    /// The parameter block both backward kernels (delta, main) take;
    /// `delta` is the workspace of [`flash_bwd_workspace_bytes`].
    pub(super) fn of(a: &AttnBwd, delta: u64) -> BwdParams {
        BwdParams {
            q: a.q,
            k: a.k,
            v: a.v,
            o: a.o,
            d_o: a.d_o,
            lse: a.lse,
            dq: a.dq,
            dk: a.dk,
            dv: a.dv,
            delta,
            bounds: a.bounds,
            q_stride: a.q_rs as i64,
            k_stride: a.k_rs as i64,
            v_stride: a.v_rs as i64,
            o_stride: a.o_rs as i64,
            do_stride: a.d_o_rs as i64,
            lse_stride: a.lse_rs as i64,
            dq_stride: a.dq_rs as i64,
            dk_stride: a.dk_rs as i64,
            dv_stride: a.dv_rs as i64,
            sq: a.sq as i32,
            sk: a.sk as i32,
            hq: a.hq as i32,
            hkv: a.hkv as i32,
            group: (a.hq / a.hkv) as i32,
            causal: causal_flag(&a.mask),
            scale: a.scale,
            scale_log2: a.scale * std::f32::consts::LOG2_E,
        }
    }
}

/// Attention forward: writes `o` and `lse` (see the module docs).
pub fn flash_fwd(stream: &Arc<CudaStream>, f: &FlashFunctions, a: &AttnFwd) -> Result<()> {
    check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)?;
    if a.sq == 0 {
        return Ok(());
    }
    if a.sk == 0 {
        return Err(Error::Config(
            "flash attention forward: no keys (sk = 0); every query row needs at least one key"
                .into(),
        ));
    }
    check_fwd_operands(a)?;
    let p = FwdParams::of(a);
    let (func, cfg) = match (f.fwd_kernel_for(a.d)?, &f.fwd128_wgmma) {
        (FlashKernel::Wgmma, Some((func, threads))) => (
            func,
            LaunchConfig {
                grid_dim: ((a.sq.div_ceil(WG_BM) * a.hq) as u32, 1, 1),
                block_dim: (*threads, 1, 1),
                shared_mem_bytes: wgmma_smem_bytes() as u32,
            },
        ),
        _ => (
            &f.mma(a.d)?.fwd,
            LaunchConfig {
                grid_dim: ((a.sq.div_ceil(FWD_BM) * a.hq) as u32, 1, 1),
                block_dim: (fwd_threads(a.d), 1, 1),
                shared_mem_bytes: fwd_smem_bytes(a.d) as u32,
            },
        ),
    };
    // SAFETY: the parameters were validated above; the caller guarantees the
    // pointers address device buffers of the sizes the strides and lengths imply.
    unsafe { stream.launch_builder(func).arg(&p).launch(cfg) }.map_err(launch_err)?;
    Ok(())
}

/// Attention backward: adds into `dq`, `dk`, `dv` (see the module docs);
/// `workspace` holds at least [`flash_bwd_workspace_bytes`] bytes.
pub fn flash_bwd(
    stream: &Arc<CudaStream>,
    f: &FlashFunctions,
    a: &AttnBwd,
    workspace: u64,
) -> Result<()> {
    check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)?;
    if a.sq == 0 || a.sk == 0 {
        return Ok(());
    }
    check_bwd_operands(a)?;
    check_ptr("workspace", workspace, 4)?;
    let p = BwdParams::of(a, workspace);
    let mma = f.mma(a.d)?;
    let (pre, main, cfg) = match (f.bwd_kernel_for(a.d)?, &f.bwd128_wgmma) {
        (FlashKernel::Wgmma, Some(func)) => (
            &mma.pre,
            func,
            LaunchConfig {
                grid_dim: ((a.sk.div_ceil(WB_BN) * a.hkv) as u32, 1, 1),
                block_dim: (WB_NT + 128, 1, 1),
                shared_mem_bytes: wgmma_bwd_smem_bytes() as u32,
            },
        ),
        _ => (
            &mma.pre,
            &mma.bwd,
            LaunchConfig {
                grid_dim: ((a.sk.div_ceil(bwd_bn(a.d)) * a.hkv) as u32, 1, 1),
                block_dim: (BWD_THREADS, 1, 1),
                shared_mem_bytes: bwd_smem_bytes(a.d) as u32,
            },
        ),
    };
    let warps = a.sq * a.hq;
    let pre_cfg = LaunchConfig {
        grid_dim: ((warps * 32).div_ceil(PRE_THREADS as usize) as u32, 1, 1),
        block_dim: (PRE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as in `flash_fwd`; the workspace holds `sq * hq` f32 (checked by the caller
    // through `flash_bwd_workspace_bytes`).
    unsafe {
        stream
            .launch_builder(pre)
            .arg(&p)
            .launch(pre_cfg)
            .map_err(launch_err)?;
        stream
            .launch_builder(main)
            .arg(&p)
            .launch(cfg)
            .map_err(launch_err)?;
    }
    Ok(())
}
