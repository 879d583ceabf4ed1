//! Launching the flash kernels: the arguments of one call, the checks of
//! its geometry, pointers and strides (every call is checked before its
//! first launch), and the launches of [`flash_fwd`] and [`flash_bwd`].

use super::functions::{FlashFunctions, FlashKernel, drv};
use super::tiles::*;
use crate::backend::AttnMask;
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Arguments of [`flash_fwd`]. Pointers are device addresses of the first row;
/// strides are in elements between consecutive rows.
#[derive(Debug, Clone)]
pub struct FlashFwdArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    /// `[2·sq]` int32 key-row bounds of a documents mask (see
    /// `BoundedMask::row_bounds`), or 0.
    pub bounds: u64,
    pub q_stride: usize,
    pub k_stride: usize,
    pub v_stride: usize,
    pub o_stride: usize,
    pub lse_stride: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// The softmax scale of the scores.
    pub scale: f32,
}

/// Arguments of [`flash_bwd`]. `dq`, `dk`, `dv` are f32 and accumulated into;
/// `workspace` holds at least [`flash_bwd_workspace_bytes`] bytes.
#[derive(Debug, Clone)]
pub struct FlashBwdArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub d_o: u64,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub workspace: u64,
    /// As in [`FlashFwdArgs`].
    pub bounds: u64,
    pub q_stride: usize,
    pub k_stride: usize,
    pub v_stride: usize,
    pub o_stride: usize,
    pub do_stride: usize,
    pub lse_stride: usize,
    pub dq_stride: usize,
    pub dk_stride: usize,
    pub dv_stride: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// The softmax scale of the scores.
    pub scale: f32,
}

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

pub(super) fn check_geometry(
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
    check_geometry(sq, sk, hq, hkv, d, mask)
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

/// Attention forward: writes `o` and `lse` (see the module docs).
pub fn flash_fwd(stream: &Arc<CudaStream>, f: &FlashFunctions, a: &FlashFwdArgs) -> Result<()> {
    check_geometry(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)?;
    if a.sq == 0 {
        return Ok(());
    }
    if a.sk == 0 {
        return Err(Error::Config(
            "flash attention forward: no keys (sk = 0); every query row needs at least one key"
                .into(),
        ));
    }
    for (n, p) in [("q", a.q), ("k", a.k), ("v", a.v), ("o", a.o)] {
        check_ptr(n, p, 16)?;
    }
    check_ptr("lse", a.lse, 4)?;
    check_stride("q", a.q_stride, a.hq * a.d, 8)?;
    check_stride("k", a.k_stride, a.hkv * a.d, 8)?;
    check_stride("v", a.v_stride, a.hkv * a.d, 8)?;
    check_stride("o", a.o_stride, a.hq * a.d, 8)?;
    check_stride("lse", a.lse_stride, a.hq, 1)?;
    let scale = a.scale;
    let p = FwdParams {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.o,
        lse: a.lse,
        bounds: a.bounds,
        q_stride: a.q_stride as i64,
        k_stride: a.k_stride as i64,
        v_stride: a.v_stride as i64,
        o_stride: a.o_stride as i64,
        lse_stride: a.lse_stride as i64,
        sq: a.sq as i32,
        sk: a.sk as i32,
        hq: a.hq as i32,
        hkv: a.hkv as i32,
        group: (a.hq / a.hkv) as i32,
        causal: causal_flag(&a.mask),
        scale_log2: scale * std::f32::consts::LOG2_E,
        pad0: 0,
    };
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

/// Checks every operand's alignment and stride before a backward launch.
fn check_bwd_operands(a: &FlashBwdArgs) -> Result<()> {
    for (n, p) in [
        ("q", a.q),
        ("k", a.k),
        ("v", a.v),
        ("o", a.o),
        ("d_o", a.d_o),
    ] {
        check_ptr(n, p, 16)?;
    }
    for (n, p) in [("dq", a.dq), ("dk", a.dk), ("dv", a.dv)] {
        check_ptr(n, p, 8)?;
    }
    check_ptr("lse", a.lse, 4)?;
    check_ptr("workspace", a.workspace, 4)?;
    check_stride("q", a.q_stride, a.hq * a.d, 8)?;
    check_stride("k", a.k_stride, a.hkv * a.d, 8)?;
    check_stride("v", a.v_stride, a.hkv * a.d, 8)?;
    check_stride("o", a.o_stride, a.hq * a.d, 8)?;
    check_stride("d_o", a.do_stride, a.hq * a.d, 8)?;
    check_stride("lse", a.lse_stride, a.hq, 1)?;
    check_stride("dq", a.dq_stride, a.hq * a.d, 2)?;
    check_stride("dk", a.dk_stride, a.hkv * a.d, 2)?;
    check_stride("dv", a.dv_stride, a.hkv * a.d, 2)
}

impl BwdParams {
    /// The parameter block both backward kernels (delta, main) take.
    fn of(a: &FlashBwdArgs) -> BwdParams {
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
            delta: a.workspace,
            bounds: a.bounds,
            q_stride: a.q_stride as i64,
            k_stride: a.k_stride as i64,
            v_stride: a.v_stride as i64,
            o_stride: a.o_stride as i64,
            do_stride: a.do_stride as i64,
            lse_stride: a.lse_stride as i64,
            dq_stride: a.dq_stride as i64,
            dk_stride: a.dk_stride as i64,
            dv_stride: a.dv_stride as i64,
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

/// Attention backward: adds into `dq`, `dk`, `dv` (see the module docs).
pub fn flash_bwd(stream: &Arc<CudaStream>, f: &FlashFunctions, a: &FlashBwdArgs) -> Result<()> {
    check_geometry(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)?;
    if a.sq == 0 || a.sk == 0 {
        return Ok(());
    }
    check_bwd_operands(a)?;
    let p = BwdParams::of(a);
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
