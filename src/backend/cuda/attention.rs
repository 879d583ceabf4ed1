//! Attention on raw device operands: the interim kernels from
//! `kernels/attention.cu` (one block per (query row, head); correctness only).
//!
//! **Swap point for FlashAttention-2.** [`AttnFwd`] and [`AttnBwd`] carry
//! exactly what the flash module takes (device pointers as `u64`, row strides
//! in elements, `sq, sk, hq, hkv, d, causal`, bf16 q/k/v/o/dO, f32 lse
//! `[s, h]`, f32 dq/dk/dv accumulated). To use it, in [`fwd`] and [`bwd`]
//! replace the body with a call to `flash::flash_fwd(stream, &fns, &args)` /
//! `flash::flash_bwd(...)` built from these fields (keep the naive path for
//! non-bf16 inputs or `d` the flash kernels do not support), and load the
//! flash functions next to [`Kernels`] in `CudaBackend::new`. The backend side
//! (checks, row offsets, f32 scratch for bf16 gradients) stays as it is.

use super::kernels::{ATT_THREADS, Args, Kernels, launch};
use crate::backend::DType;
use crate::error::Result;
use cudarc::driver::CudaStream;

/// `0` for f32, `1` for bf16 (the `dt` flags of the kernels).
pub fn dt_flag(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
    }
}

/// Operands of one attention forward. Pointers already point at the first row
/// of each view; strides are elements between consecutive token rows.
#[derive(Debug, Clone, Copy)]
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
    pub causal: bool,
}

/// Operands of one attention backward; `dq`, `dk`, `dv` are f32 and accumulated.
#[derive(Debug, Clone, Copy)]
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
    pub causal: bool,
}

fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// Attention forward (writes o and lse).
pub fn fwd(k: &Kernels, stream: &CudaStream, a: &AttnFwd) -> Result<()> {
    if a.sq == 0 || a.hq == 0 {
        return Ok(());
    }
    // SWAP: `return flash::flash_fwd(stream, &flash_fns, &a.into())` when a.dt is BF16.
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
        .i32(a.causal as i32)
        .f32(scale(a.d));
    launch(
        stream,
        k.attn_fwd_naive,
        (a.sq as u32, a.hq as u32, 1),
        ATT_THREADS,
        smem,
        args,
    )
}

/// Attention backward (accumulates f32 dq, dk, dv).
pub fn bwd(k: &Kernels, stream: &CudaStream, a: &AttnBwd) -> Result<()> {
    if a.sq == 0 || a.hq == 0 {
        return Ok(());
    }
    // SWAP: `return flash::flash_bwd(stream, &flash_fns, &a.into())` when a.dt is BF16.
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
        .i32(a.causal as i32)
        .f32(scale(a.d));
    launch(
        stream,
        k.attn_bwd_naive,
        (a.sq as u32, a.hq as u32, 1),
        ATT_THREADS,
        smem,
        args,
    )
}
