//! Attention on raw device operands, with two implementations:
//!
//! - the native FlashAttention-2 kernels of `super::flash` (bf16
//!   q/k/v/o/dO, head dim 64, 128 or 256, sm_90+), used whenever they apply;
//! - the naive kernels of `kernels/attention.cu` (one block per (query row,
//!   head)): every other case (f32 inputs, other head dims, an f32 `o`,
//!   misaligned views, older GPUs), and the GPU oracle the flash path is tested
//!   against ([`AttentionKernels::Naive`]).
//!
//! [`AttnFwd`] and [`AttnBwd`] (defined in `attn_operands.rs`, beneath both
//! implementations) carry what both take (device pointers as `u64`,
//! row strides in elements, `sq, sk, hq, hkv, d, mask`, f32 lse `[s, h]`, f32
//! dq/dk/dv accumulated into). The backend side (checks, row offsets, f32
//! scratch for bf16 gradients, the flash backward's workspace) lives in
//! `CudaBackend::attention_fwd` / `attention_bwd` (in `attention_ops.rs`),
//! which pick the path with [`flash_fwd_unsupported`] /
//! [`flash_bwd_unsupported`] and log it at debug level.

pub use super::attn_operands::{AttnBwd, AttnFwd};
use super::flash;
use super::kernels::{ATT_THREADS, Args, Kernels, launch};
use crate::backend::DType;
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;

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
    flash::check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)
        .and_then(|()| flash::check_fwd_operands(a))
        .err()
        .map(|e| e.to_string())
}

/// Why the flash kernels cannot run this backward (`None`: they can).
pub fn flash_bwd_unsupported(a: &AttnBwd) -> Option<String> {
    if a.dt != DType::BF16 || a.o_dt != DType::BF16 || a.d_o_dt != DType::BF16 {
        return Some(format!(
            "q/k/v {:?}, o {:?}, dO {:?}; flash needs bf16",
            a.dt, a.o_dt, a.d_o_dt
        ));
    }
    flash::check_supported(a.sq, a.sk, a.hq, a.hkv, a.d, &a.mask)
        .and_then(|()| flash::check_bwd_operands(a))
        .err()
        .map(|e| e.to_string())
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
