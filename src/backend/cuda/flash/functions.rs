//! The flash kernels loaded: which kernel a run asks for
//! ([`FlashKernel`], from the environment) and the functions of the loaded
//! modules ([`FlashFunctions`]).

use super::sources::*;
use super::tiles::*;
use crate::error::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaFunction, CudaModule};
use std::sync::Arc;

/// Which kernel [`flash_fwd`] or [`flash_bwd`] runs for head dim 128
/// (`UPIPE_FLASH_FWD`, `UPIPE_FLASH_BWD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    /// The wgmma kernel where it is loaded, the mma.sync kernel otherwise (the default).
    Auto,
    /// The FlashAttention-2 mma.sync kernel (every head dim, sm_90+).
    Mma,
    /// The wgmma kernel (sm_90a, head dim 128; head dims 64 and 256 run the mma.sync kernel).
    Wgmma,
}

impl std::str::FromStr for FlashKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(FlashKernel::Auto),
            "mma" => Ok(FlashKernel::Mma),
            "wgmma" => Ok(FlashKernel::Wgmma),
            other => Err(Error::Config(format!(
                "flash kernel '{other}': expected auto, mma or wgmma"
            ))),
        }
    }
}

impl FlashKernel {
    pub fn name(self) -> &'static str {
        match self {
            FlashKernel::Auto => "auto",
            FlashKernel::Mma => "mma",
            FlashKernel::Wgmma => "wgmma",
        }
    }

    /// The kernel that runs for head dim `d` when the wgmma one is `loaded`
    /// (never `Auto`); an error when wgmma was asked for (through `var`) but
    /// is not loaded.
    pub(super) fn resolve(self, d: usize, loaded: bool, var: &str) -> Result<FlashKernel> {
        match (self, d, loaded) {
            (FlashKernel::Mma, _, _) | (FlashKernel::Auto, _, false) => Ok(FlashKernel::Mma),
            (_, d, _) if d != 128 => Ok(FlashKernel::Mma),
            (_, _, true) => Ok(FlashKernel::Wgmma),
            (FlashKernel::Wgmma, _, false) => Err(Error::Config(format!(
                "flash attention: the wgmma kernel was asked for ({var}=wgmma) but is not loaded; it needs an sm_90a device (H100/H200)"
            ))),
        }
    }
}

fn kernel_from_env(var: &str) -> Result<FlashKernel> {
    match std::env::var(var) {
        Ok(v) => v.parse().map_err(|e| Error::Config(format!("{var}: {e}"))),
        Err(_) => Ok(FlashKernel::Auto),
    }
}

/// The forward kernel chosen by `UPIPE_FLASH_FWD` (`auto` when unset).
pub fn fwd_kernel_from_env() -> Result<FlashKernel> {
    kernel_from_env("UPIPE_FLASH_FWD")
}

/// The backward kernel chosen by `UPIPE_FLASH_BWD` (`auto` when unset).
pub fn bwd_kernel_from_env() -> Result<FlashKernel> {
    kernel_from_env("UPIPE_FLASH_BWD")
}

/// The mma.sync kernels of one head dim.
#[derive(Debug, Clone)]
pub(super) struct MmaKernels {
    pub(super) d: usize,
    pub(super) fwd: CudaFunction,
    /// The backward's preprocessing (`delta = rowsum(dO * O)`).
    pub(super) pre: CudaFunction,
    pub(super) bwd: CudaFunction,
}

/// The loaded flash kernels of one module (plus the wgmma forward, when loaded).
#[derive(Debug, Clone)]
pub struct FlashFunctions {
    /// One set per head dim of [`HEAD_DIMS`], in that order.
    pub(super) mma: Vec<MmaKernels>,
    /// The wgmma forward and its block size.
    pub(super) fwd128_wgmma: Option<(CudaFunction, u32)>,
    pub(super) fwd_kernel: FlashKernel,
    /// The wgmma backward.
    pub(super) bwd128_wgmma: Option<CudaFunction>,
    pub(super) bwd_kernel: FlashKernel,
}

pub(super) fn drv(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("flash attention: {what}: {e:?}"))
}

/// Loads kernel `name`, raises its dynamic shared memory to `smem` bytes and
/// checks that its block size (set by `__launch_bounds__` / `setmaxnreg`
/// in the source) is one of `threads`; returns it with that block size.
fn load_sized(
    module: &Arc<CudaModule>,
    name: &str,
    smem: usize,
    threads: &[u32],
) -> Result<(CudaFunction, u32)> {
    let func = module
        .load_function(name)
        .map_err(|e| drv(&format!("load {name}"), e))?;
    func.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| drv(&format!("raise shared memory to {smem} bytes"), e))?;
    let got = func
        .get_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        .map_err(|e| drv(&format!("block size of {name}"), e))?;
    match u32::try_from(got) {
        Ok(t) if threads.contains(&t) => Ok((func, t)),
        _ => Err(Error::Backend(format!(
            "flash attention: {name} allows {got} threads per block; expected one of {threads:?}"
        ))),
    }
}

impl FlashFunctions {
    /// Loads every kernel of [`KERNEL_NAMES`] from a module compiled from
    /// [`FLASH_SOURCES`] and raises their dynamic shared-memory limits.
    pub fn load(module: &Arc<CudaModule>) -> Result<Self> {
        let mut mma = Vec::with_capacity(MMA_KERNELS.len());
        for (d, fwd, pre, bwd) in MMA_KERNELS {
            let (fwd, _) = load_sized(module, fwd, fwd_smem_bytes(d), &[fwd_threads(d)])?;
            let pre = module
                .load_function(pre)
                .map_err(|e| drv(&format!("load {pre}"), e))?;
            let (bwd, _) = load_sized(module, bwd, bwd_smem_bytes(d), &[BWD_THREADS])?;
            mma.push(MmaKernels { d, fwd, pre, bwd });
        }
        Ok(FlashFunctions {
            mma,
            fwd128_wgmma: None,
            fwd_kernel: FlashKernel::Auto,
            bwd128_wgmma: None,
            bwd_kernel: FlashKernel::Auto,
        })
    }

    /// The mma.sync kernels of head dim `d` (one of [`HEAD_DIMS`]).
    pub(super) fn mma(&self, d: usize) -> Result<&MmaKernels> {
        self.mma.iter().find(|k| k.d == d).ok_or_else(|| {
            Error::Config(format!(
                "flash attention has no kernels for head dim {d} (it has {HEAD_DIMS:?})"
            ))
        })
    }

    /// Adds the wgmma forward from a module compiled from
    /// [`FLASH_WGMMA_SOURCE`] for [`WGMMA_NVRTC_ARCH`].
    pub fn with_wgmma(mut self, module: &Arc<CudaModule>) -> Result<Self> {
        let expected = [WG_THREADS, WG_THREADS + 128];
        let (func, threads) = load_sized(module, FWD_WGMMA_D128, wgmma_smem_bytes(), &expected)?;
        self.fwd128_wgmma = Some((func, threads));
        Ok(self)
    }

    /// Adds the wgmma backward from a module compiled from
    /// [`FLASH_WGMMA_BWD_SOURCE`] for [`WGMMA_NVRTC_ARCH`].
    pub fn with_wgmma_bwd(mut self, module: &Arc<CudaModule>) -> Result<Self> {
        let expected = [WB_NT + 128];
        let (func, _) = load_sized(module, BWD_WGMMA_D128, wgmma_bwd_smem_bytes(), &expected)?;
        self.bwd128_wgmma = Some(func);
        Ok(self)
    }

    /// Whether the wgmma backward is loaded.
    pub fn has_wgmma_bwd(&self) -> bool {
        self.bwd128_wgmma.is_some()
    }

    /// Chooses the backward kernel (default [`FlashKernel::Auto`]).
    pub fn set_bwd_kernel(&mut self, k: FlashKernel) {
        self.bwd_kernel = k;
    }

    /// The backward kernel [`flash_bwd`] runs for head dim `d` (never `Auto`);
    /// errors when the wgmma kernel is asked for but not loaded.
    pub fn bwd_kernel_for(&self, d: usize) -> Result<FlashKernel> {
        self.bwd_kernel
            .resolve(d, self.has_wgmma_bwd(), "UPIPE_FLASH_BWD")
    }

    /// Whether the wgmma forward is loaded.
    pub fn has_wgmma(&self) -> bool {
        self.fwd128_wgmma.is_some()
    }

    /// Chooses the forward kernel (default [`FlashKernel::Auto`]).
    pub fn set_fwd_kernel(&mut self, k: FlashKernel) {
        self.fwd_kernel = k;
    }

    /// The forward kernel [`flash_fwd`] runs for head dim `d` (never `Auto`);
    /// errors when the wgmma kernel is asked for but not loaded.
    pub fn fwd_kernel_for(&self, d: usize) -> Result<FlashKernel> {
        self.fwd_kernel
            .resolve(d, self.has_wgmma(), "UPIPE_FLASH_FWD")
    }
}
