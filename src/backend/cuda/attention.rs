//! Attention on raw device operands, with two implementations:
//!
//! - the native FlashAttention-2 kernels of `super::flash` (bf16
//!   q/k/v/o/dO, head dim 64, 128 or 256, sm_90+), used whenever they apply;
//! - the naive kernels of `kernels/attention.cu` (one block per (query row,
//!   head)): every other case (f32 inputs, other head dims, an f32 `o`,
//!   misaligned views, older GPUs), and the GPU oracle the flash path is tested
//!   against ([`AttentionKernels::Naive`]).
//!
//! [`AttnFwd`] and [`AttnBwd`] carry what both take (device pointers as `u64`,
//! row strides in elements, `sq, sk, hq, hkv, d, mask`, f32 lse `[s, h]`, f32
//! dq/dk/dv accumulated into). The backend side (checks, row offsets, f32
//! scratch for bf16 gradients, the flash backward's workspace) lives in
//! `CudaBackend::attention_fwd` / `attention_bwd` (in `attention_ops.rs`),
//! which pick the path with [`flash_fwd_unsupported`] /
//! [`flash_bwd_unsupported`] and log it at debug level.

use super::flash::{self, FlashBwdArgs, FlashFunctions, FlashFwdArgs};
use super::kernels::{ATT_THREADS, Args, Kernels, launch};
use crate::backend::{AttnMask, DType};
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Which attention kernels a [`CudaBackend`](super::CudaBackend) uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKernels {
    /// The flash kernels wherever they apply, the naive ones otherwise.
    #[default]
    Auto,
    /// Always the naive kernels (slow; the GPU oracle of the flash path).
    Naive,
}

impl AttentionKernels {
    /// From `UPIPE_ATTENTION` (`auto`, the default, or `naive`).
    pub fn from_env() -> Result<Self> {
        match std::env::var("UPIPE_ATTENTION") {
            Err(_) => Ok(AttentionKernels::Auto),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" | "flash" => Ok(AttentionKernels::Auto),
                "naive" => Ok(AttentionKernels::Naive),
                other => Err(Error::Config(format!(
                    "UPIPE_ATTENTION={other}: expected `auto` (flash kernels where they apply) or `naive`"
                ))),
            },
        }
    }
}

/// The kernels one attention call ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnPath {
    Flash,
    Naive,
    Cudnn,
}

fn aligned(p: u64, a: u64) -> bool {
    p != 0 && p.is_multiple_of(a)
}

/// Why the flash kernels cannot run this forward (`None`: they can).
pub fn flash_fwd_unsupported(a: &AttnFwd) -> Option<String> {
    if a.dt != DType::BF16 || a.o_dt != DType::BF16 {
        return Some(format!(
            "inputs {:?} / output {:?}, flash needs bf16",
            a.dt, a.o_dt
        ));
    }
    if a.sk == 0 {
        return Some("no keys".into());
    }
    if let Err(e) = flash::check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask) {
        return Some(e.to_string());
    }
    let ptrs_ok = [a.q, a.k, a.v, a.o].iter().all(|&p| aligned(p, 16)) && aligned(a.lse, 4);
    let strides_ok = [a.q_rs, a.k_rs, a.v_rs, a.o_rs].iter().all(|s| s % 8 == 0);
    if !ptrs_ok || !strides_ok {
        return Some("views not 16-byte aligned".into());
    }
    None
}

/// Why the flash kernels cannot run this backward (`None`: they can).
pub fn flash_bwd_unsupported(a: &AttnBwd) -> Option<String> {
    if a.dt != DType::BF16 || a.o_dt != DType::BF16 || a.d_o_dt != DType::BF16 {
        return Some(format!(
            "q/k/v {:?}, o {:?}, dO {:?}; flash needs bf16",
            a.dt, a.o_dt, a.d_o_dt
        ));
    }
    if let Err(e) = flash::check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask) {
        return Some(e.to_string());
    }
    let ptrs_ok = [a.q, a.k, a.v, a.o, a.d_o].iter().all(|&p| aligned(p, 16))
        && [a.dq, a.dk, a.dv].iter().all(|&p| aligned(p, 8))
        && aligned(a.lse, 4);
    let strides_ok = [a.q_rs, a.k_rs, a.v_rs, a.o_rs, a.d_o_rs]
        .iter()
        .all(|s| s % 8 == 0)
        && [a.dq_rs, a.dk_rs, a.dv_rs].iter().all(|s| s % 2 == 0);
    if !ptrs_ok || !strides_ok {
        return Some("views not aligned for vector loads".into());
    }
    None
}

/// Forward on the flash kernels (the caller checked [`flash_fwd_unsupported`]).
pub fn fwd_flash(stream: &Arc<CudaStream>, f: &FlashFunctions, a: &AttnFwd) -> Result<()> {
    let args = FlashFwdArgs {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.o,
        lse: a.lse,
        bounds: a.bounds,
        q_stride: a.q_rs,
        k_stride: a.k_rs,
        v_stride: a.v_rs,
        o_stride: a.o_rs,
        lse_stride: a.lse_rs,
        sq: a.sq,
        sk: a.sk,
        hq: a.hq,
        hkv: a.hkv,
        d: a.d,
        mask: a.mask.clone(),
        scale: a.scale,
    };
    flash::flash_fwd(stream, f, &args)
}

/// Backward on the flash kernels (the caller checked [`flash_bwd_unsupported`]);
/// `workspace` holds [`flash::flash_bwd_workspace_bytes`]`(a.sq, a.hq)` bytes.
pub fn bwd_flash(
    stream: &Arc<CudaStream>,
    f: &FlashFunctions,
    a: &AttnBwd,
    workspace: u64,
) -> Result<()> {
    let args = FlashBwdArgs {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.o,
        d_o: a.d_o,
        lse: a.lse,
        dq: a.dq,
        dk: a.dk,
        dv: a.dv,
        workspace,
        bounds: a.bounds,
        q_stride: a.q_rs,
        k_stride: a.k_rs,
        v_stride: a.v_rs,
        o_stride: a.o_rs,
        do_stride: a.d_o_rs,
        lse_stride: a.lse_rs,
        dq_stride: a.dq_rs,
        dk_stride: a.dk_rs,
        dv_stride: a.dv_rs,
        sq: a.sq,
        sk: a.sk,
        hq: a.hq,
        hkv: a.hkv,
        d: a.d,
        mask: a.mask.clone(),
        scale: a.scale,
    };
    flash::flash_bwd(stream, f, &args)
}

/// `0` for f32, `1` for bf16, `2` for 8-bit codes, `3` and `4` for FP8
/// E4M3 and E5M2 (the `dt` flags of the kernels; only the FP8 kernels
/// read the last two).
pub fn dt_flag(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::U8 => 2,
        DType::F8E4M3 => 3,
        DType::F8E5M2 => 4,
    }
}

/// Operands of one attention forward. Pointers already point at the first row
/// of each view; strides are elements between consecutive token rows.
#[derive(Debug, Clone)]
pub struct AttnFwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    /// Dtype of q, k and v.
    pub dt: DType,
    pub o: u64,
    pub o_dt: DType,
    /// f32 `[sq, hq]` (natural log).
    pub lse: u64,
    pub q_rs: usize,
    pub k_rs: usize,
    pub v_rs: usize,
    pub o_rs: usize,
    pub lse_rs: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// The rows' key bounds of a documents mask on the device (`[2·sq]`
    /// int32, `BoundedMask::row_bounds`), or 0.
    pub bounds: u64,
    /// The softmax scale of the scores.
    pub scale: f32,
}

/// Operands of one attention backward; `dq`, `dk`, `dv` are f32 and accumulated.
#[derive(Debug, Clone)]
pub struct AttnBwd {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub dt: DType,
    pub o: u64,
    pub o_dt: DType,
    pub d_o: u64,
    pub d_o_dt: DType,
    pub lse: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub q_rs: usize,
    pub k_rs: usize,
    pub v_rs: usize,
    pub o_rs: usize,
    pub d_o_rs: usize,
    pub lse_rs: usize,
    pub dq_rs: usize,
    pub dk_rs: usize,
    pub dv_rs: usize,
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// As in [`AttnFwd`].
    pub bounds: u64,
    /// As in [`AttnFwd`].
    pub scale: f32,
}

/// Attention forward on the naive kernel (writes o and lse).
pub fn fwd_naive(k: &Kernels, stream: &CudaStream, a: &AttnFwd) -> Result<()> {
    if a.sq == 0 || a.hq == 0 {
        return Ok(());
    }
    let smem = ((a.d + ATT_THREADS as usize + 32) * 4) as u32;
    let args = Args::new()
        .ptr(a.q)
        .ptr(a.k)
        .ptr(a.v)
        .i32(dt_flag(a.dt))
        .ptr(a.o)
        .i32(dt_flag(a.o_dt))
        .ptr(a.lse)
        .usize(a.q_rs)
        .usize(a.k_rs)
        .usize(a.v_rs)
        .usize(a.o_rs)
        .usize(a.lse_rs)
        .usize(a.sq)
        .usize(a.sk)
        .usize(a.hq)
        .usize(a.hkv)
        .usize(a.d)
        .i32(flash::causal_flag(&a.mask))
        .ptr(a.bounds)
        .f32(a.scale);
    launch(
        stream,
        k.attn_fwd_naive,
        (a.sq as u32, a.hq as u32, 1),
        ATT_THREADS,
        smem,
        args,
    )
}

/// Attention backward on the naive kernel (accumulates f32 dq, dk, dv).
pub fn bwd_naive(k: &Kernels, stream: &CudaStream, a: &AttnBwd) -> Result<()> {
    if a.sq == 0 || a.hq == 0 {
        return Ok(());
    }
    let smem = ((2 * a.d + 2 * ATT_THREADS as usize + 32) * 4) as u32;
    let args = Args::new()
        .ptr(a.q)
        .ptr(a.k)
        .ptr(a.v)
        .i32(dt_flag(a.dt))
        .ptr(a.o)
        .i32(dt_flag(a.o_dt))
        .ptr(a.d_o)
        .i32(dt_flag(a.d_o_dt))
        .ptr(a.lse)
        .ptr(a.dq)
        .ptr(a.dk)
        .ptr(a.dv)
        .usize(a.q_rs)
        .usize(a.k_rs)
        .usize(a.v_rs)
        .usize(a.o_rs)
        .usize(a.d_o_rs)
        .usize(a.lse_rs)
        .usize(a.dq_rs)
        .usize(a.dk_rs)
        .usize(a.dv_rs)
        .usize(a.sq)
        .usize(a.sk)
        .usize(a.hq)
        .usize(a.hkv)
        .usize(a.d)
        .i32(flash::causal_flag(&a.mask))
        .ptr(a.bounds)
        .f32(a.scale);
    launch(
        stream,
        k.attn_bwd_naive,
        (a.sq as u32, a.hq as u32, 1),
        ATT_THREADS,
        smem,
        args,
    )
}
