//! Native FlashAttention-2-style forward and backward kernels for Hopper
//! (sm_90), written in CUDA C and compiled at run time by NVRTC.
//!
//! Semantics are those of [`Backend::attention_fwd`](crate::backend::Backend::attention_fwd)
//! and [`Backend::attention_bwd`](crate::backend::Backend::attention_bwd): q `[sq, hq, d]`,
//! k, v `[sk, hkv, d]` in bf16 (row-major, each row `stride` elements apart, the
//! pointer already at the first row), GQA (query head `h` uses kv head
//! `h / (hq / hkv)`), an [`AttnMask`]: causal (row `i` sees keys `0..=i`, needs `sq == sk`) or full,
//! softmax scale `1/sqrt(d)`; o bf16 `[sq, hq, d]`, lse f32 `[sq, hq]` natural log.
//! The backward takes the lse of the full row and *adds* into f32 dq, dk, dv.
//!
//! Use: compile the one entry of [`FLASH_SOURCES`] with NVRTC for
//! [`NVRTC_ARCH`] and [`NVRTC_OPTIONS`], load it as a module, build
//! [`FlashFunctions::load`] once, then call [`flash_fwd`] / [`flash_bwd`]
//! (the backward needs [`flash_bwd_workspace_bytes`] of scratch). Both only
//! enqueue work on the given stream.
//!
//! Design (FlashAttention-2 schedule on `mma.sync.m16n8k16` bf16 with
//! `ldmatrix` and `cp.async`, XOR-swizzled shared-memory tiles):
//! - forward: a block is 128 query rows of one head (4 warps x 32 rows), K/V
//!   tiles of 64 keys double-buffered, online softmax in base 2, grid ordered
//!   heads-fastest and longest causal rows first;
//! - backward: a preprocessing kernel writes `delta = rowsum(dO * O)`; the main
//!   kernel owns 128 keys of one kv head (8 warps), loops over the group's query
//!   heads and 64-row query blocks, keeps dK/dV in registers and adds dQ with
//!   vector `red.global.add` straight into the f32 output.
//!
//! - forward on Hopper proper (`sm_90a`, head dim 128): a second module,
//!   [`FLASH_WGMMA_SOURCE`], holds a warpgroup-MMA (wgmma) forward in the
//!   FlashAttention-3 style (2 consumer warpgroups x 64 query rows taking turns
//!   on the tensor cores, a copy warpgroup feeding 128-key K/V tiles through
//!   mbarriers, S and P V on `wgmma.mma_async` with shared-memory descriptors,
//!   the softmax of a block overlapping the P V product of the previous one). Load it with
//!   [`FlashFunctions::with_wgmma`]; [`flash_fwd`] then runs it for head dim
//!   128 unless [`FlashKernel::Mma`] is chosen (`UPIPE_FLASH_FWD=mma`, see
//!   [`fwd_kernel_from_env`]).
//!
//! - backward on Hopper proper (`sm_90a`, head dim 128): a third module,
//!   [`FLASH_WGMMA_BWD_SOURCE`], holds a wgmma backward (`flash_bwd_wgmma.cu`:
//!   128 keys per block = 2 consumer warpgroups x 64 keys, a copy warpgroup
//!   feeding 64-row Q/dO/lse/delta tiles through mbarriers; S^T, dP^T, dV, dK
//!   and dQ on `wgmma.mma_async`). Loaded with
//!   [`FlashFunctions::with_wgmma_bwd`]; [`flash_bwd`] runs it for head dim
//!   128 unless [`FlashKernel::Mma`] is chosen (`UPIPE_FLASH_BWD=mma`, see
//!   [`bwd_kernel_from_env`]).
//!
//! Measured on one H200 (2026-11-30, d=128, H=16, causal, S = 16K / 64K):
//! mma.sync forward 295-304 TFLOP/s, backward 251-265, forward+backward
//! 262-275; wgmma forward 465-473, wgmma backward 383-397, both wgmma
//! forward+backward 405-414 (`RESULTS.md`).
//! `examples/flash_check.rs` reproduces the table and checks against the CPU oracle.

use crate::backend::AttnMask;
use crate::error::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

mod launch;

pub use launch::*;

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
/// Backward preprocessing (delta = rowsum(dO * O)), head dim 64.
pub const BWD_PRE_D64: &str = "upipe_flash_bwd_pre_d64";
/// Backward preprocessing, head dim 128.
pub const BWD_PRE_D128: &str = "upipe_flash_bwd_pre_d128";
/// Backward kernel, head dim 64.
pub const BWD_D64: &str = "upipe_flash_bwd_d64";
/// Backward kernel, head dim 128.
pub const BWD_D128: &str = "upipe_flash_bwd_d128";
/// Every kernel name in the module.
pub const KERNEL_NAMES: &[&str] = &[
    FWD_D64,
    FWD_D128,
    BWD_PRE_D64,
    BWD_PRE_D128,
    BWD_D64,
    BWD_D128,
];

// Tile shapes; must match the .cu files.
const FWD_BM: usize = 128;
const FWD_BN: usize = 64;
const FWD_THREADS: u32 = 128;
const BWD_BM: usize = 64;
const BWD_BN: usize = 128;
const BWD_THREADS: u32 = 256;
const PRE_THREADS: u32 = 256;
const WG_BM: usize = 128;
const WG_BN: usize = 128;
/// Consumer threads of the wgmma forward (2 warpgroups); the kernel's block
/// also has a copy warpgroup unless compiled with `WG_WS=0`, so the block size
/// is read from the loaded function (its `__launch_bounds__`).
const WG_THREADS: u32 = 256;
/// Deepest K/V pipeline the wgmma forward may be compiled with (`WG_STAGES`
/// <= `WG_MAX_STAGES` in the .cu file); its shared memory is sized for it (the
/// kernel's registers allow one block per SM anyway).
const WG_MAX_STAGES: usize = 3;
/// wgmma backward: query rows per step, keys per block, consumer threads
/// (the block adds a copy warpgroup), deepest Q/dO ring it may be compiled with.
const WB_BM: usize = 64;
const WB_BN: usize = 128;
const WB_NT: u32 = 256;
const WB_MAX_STAGES: usize = 3;

/// Dynamic shared memory of the forward kernel for head dim `d`.
fn fwd_smem_bytes(d: usize) -> usize {
    (FWD_BM * d + 4 * FWD_BN * d) * 2
}
/// Dynamic shared memory of the wgmma forward (head dim 128): Q, `WG_MAX_STAGES`
/// K and V tiles, 1 KiB to align the tiles to the 1024-byte swizzle period and
/// 128 bytes of mbarriers.
fn wgmma_smem_bytes() -> usize {
    (WG_BM * 128 + 2 * WG_MAX_STAGES * WG_BN * 128) * 2 + 1024 + 128
}
/// Dynamic shared memory of the wgmma backward (head dim 128): K and V, the
/// Q/dO ring, two dS^T buffers, lse/delta rows, mbarriers, 1 KiB of alignment.
fn wgmma_bwd_smem_bytes() -> usize {
    (2 * WB_BN * 128 + 2 * WB_MAX_STAGES * WB_BM * 128 + 2 * WB_BN * WB_BM) * 2
        + WB_MAX_STAGES * 2 * WB_BM * 4
        + 16 * WB_MAX_STAGES
        + 1024
}
/// Dynamic shared memory of the backward kernel for head dim `d`.
fn bwd_smem_bytes(d: usize) -> usize {
    (2 * BWD_BN * d + 4 * BWD_BM * d + 2 * BWD_BN * BWD_BM) * 2 + 4 * BWD_BM * 4
}

/// Which kernel [`flash_fwd`] or [`flash_bwd`] runs for head dim 128
/// (`UPIPE_FLASH_FWD`, `UPIPE_FLASH_BWD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    /// The wgmma kernel where it is loaded, the mma.sync kernel otherwise (the default).
    Auto,
    /// The FlashAttention-2 mma.sync kernel (every head dim, sm_90+).
    Mma,
    /// The wgmma kernel (sm_90a, head dim 128; head dim 64 runs the mma.sync kernel).
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
    fn resolve(self, d: usize, loaded: bool, var: &str) -> Result<FlashKernel> {
        match (self, d, loaded) {
            (FlashKernel::Mma, _, _) | (_, 64, _) | (FlashKernel::Auto, _, false) => {
                Ok(FlashKernel::Mma)
            }
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

/// The loaded flash kernels of one module (plus the wgmma forward, when loaded).
#[derive(Debug, Clone)]
pub struct FlashFunctions {
    fwd64: CudaFunction,
    fwd128: CudaFunction,
    pre64: CudaFunction,
    pre128: CudaFunction,
    bwd64: CudaFunction,
    bwd128: CudaFunction,
    /// The wgmma forward and its block size.
    fwd128_wgmma: Option<(CudaFunction, u32)>,
    fwd_kernel: FlashKernel,
    /// The wgmma backward.
    bwd128_wgmma: Option<CudaFunction>,
    bwd_kernel: FlashKernel,
}

fn drv(what: &str, e: impl std::fmt::Debug) -> Error {
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
        let get = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| drv(&format!("load {name}"), e))
        };
        let f = FlashFunctions {
            fwd64: get(FWD_D64)?,
            fwd128: get(FWD_D128)?,
            pre64: get(BWD_PRE_D64)?,
            pre128: get(BWD_PRE_D128)?,
            bwd64: get(BWD_D64)?,
            bwd128: get(BWD_D128)?,
            fwd128_wgmma: None,
            fwd_kernel: FlashKernel::Auto,
            bwd128_wgmma: None,
            bwd_kernel: FlashKernel::Auto,
        };
        let attr = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        for (func, bytes) in [
            (&f.fwd64, fwd_smem_bytes(64)),
            (&f.fwd128, fwd_smem_bytes(128)),
            (&f.bwd64, bwd_smem_bytes(64)),
            (&f.bwd128, bwd_smem_bytes(128)),
        ] {
            func.set_attribute(attr, bytes as i32)
                .map_err(|e| drv(&format!("raise shared memory to {bytes} bytes"), e))?;
        }
        Ok(f)
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

#[cfg(test)]
mod tests {
    use super::launch::{BwdParams, FwdParams, check_geometry, check_ptr, check_stride};
    use super::*;

    #[test]
    fn smem_fits_hopper() {
        // H100/H200: 228 KiB per SM, 227 KiB per block, 1 KiB reserved per block.
        // Forward: two blocks per SM; backward (255 registers x 256 threads): one.
        for d in [64, 128] {
            assert!(2 * (fwd_smem_bytes(d) + 1024) <= 228 * 1024);
            assert!(bwd_smem_bytes(d) + 1024 <= 227 * 1024);
        }
        // wgmma forward and backward: one block per SM.
        assert!(wgmma_smem_bytes() <= 227 * 1024);
        assert!(wgmma_bwd_smem_bytes() <= 227 * 1024);
    }

    #[test]
    fn kernel_choice() {
        assert_eq!("mma".parse::<FlashKernel>().unwrap(), FlashKernel::Mma);
        assert_eq!(
            " WGMMA ".parse::<FlashKernel>().unwrap(),
            FlashKernel::Wgmma
        );
        assert_eq!("".parse::<FlashKernel>().unwrap(), FlashKernel::Auto);
        assert_eq!("Auto".parse::<FlashKernel>().unwrap(), FlashKernel::Auto);
        assert!("fa3".parse::<FlashKernel>().is_err());
        let (auto, mma, wgmma) = (FlashKernel::Auto, FlashKernel::Mma, FlashKernel::Wgmma);
        for loaded in [false, true] {
            assert_eq!(auto.resolve(64, loaded, "V").unwrap(), mma);
            assert_eq!(wgmma.resolve(64, loaded, "V").unwrap(), mma);
            assert_eq!(mma.resolve(128, loaded, "V").unwrap(), mma);
        }
        assert_eq!(auto.resolve(128, true, "V").unwrap(), wgmma);
        assert_eq!(auto.resolve(128, false, "V").unwrap(), mma);
        assert_eq!(wgmma.resolve(128, true, "V").unwrap(), wgmma);
        let e = wgmma.resolve(128, false, "UPIPE_FLASH_BWD").unwrap_err();
        assert!(e.to_string().contains("UPIPE_FLASH_BWD=wgmma"), "{e}");
    }

    #[test]
    fn param_structs_have_c_layout() {
        assert_eq!(std::mem::size_of::<FwdParams>(), 6 * 8 + 5 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<BwdParams>(), 11 * 8 + 9 * 8 + 8 * 4);
    }

    #[test]
    fn geometry_is_validated() {
        assert!(check_geometry(10, 10, 8, 2, 96, &AttnMask::Full).is_err());
        assert!(check_geometry(10, 10, 8, 3, 64, &AttnMask::Full).is_err());
        assert!(check_geometry(10, 12, 8, 2, 64, &AttnMask::Causal).is_err());
        assert!(check_geometry(10, 12, 8, 2, 64, &AttnMask::Full).is_ok());
        assert!(check_geometry(12, 12, 8, 8, 128, &AttnMask::Causal).is_ok());
        assert!(check_stride("q", 100, 128, 8).is_err());
        assert!(check_ptr("q", 8, 16).is_err());
    }

    #[test]
    fn tile_constants_match_the_cuda_source() {
        let mma = ("the mma.sync .cu files", FLASH_SOURCE);
        let fwd = ("flash_fwd_wgmma.cu", FLASH_WGMMA_SOURCE);
        let bwd = ("flash_bwd_wgmma.cu", FLASH_WGMMA_BWD_SOURCE);
        for ((file, source), name, value) in [
            (mma, "FWD_BM", FWD_BM),
            (mma, "FWD_BN", FWD_BN),
            (mma, "FWD_NT", FWD_THREADS as usize),
            (mma, "BWD_BM", BWD_BM),
            (mma, "BWD_BN", BWD_BN),
            (mma, "BWD_NT", BWD_THREADS as usize),
            (fwd, "WG_BM", WG_BM),
            (fwd, "WG_BN", WG_BN),
            (fwd, "WG_NT", WG_THREADS as usize),
            (fwd, "WG_MAX_STAGES", WG_MAX_STAGES),
            (bwd, "WB_BM", WB_BM),
            (bwd, "WB_BN", WB_BN),
            (bwd, "WB_NT", WB_NT as usize),
            (bwd, "WB_MAX_STAGES", WB_MAX_STAGES),
        ] {
            assert!(
                source.contains(&format!("#define {name} {value}\n")),
                "{name} != {value} in {file}"
            );
        }
        for ((file, source), threads, entry) in [
            (fwd, "WG_THREADS", FWD_WGMMA_D128),
            (bwd, "WB_THREADS", BWD_WGMMA_D128),
        ] {
            assert!(
                source.contains(&format!("void __launch_bounds__({threads}, 1) {entry}(")),
                "{file} has no kernel {entry}"
            );
        }
    }

    /// Compiles the flash module the way the backend does whenever NVRTC can
    /// be found (no GPU needed; `UPIPE_NVRTC_LIB=.../libnvrtc.so.13`).
    #[test]
    fn flash_source_compiles_with_nvrtc_when_available() {
        use crate::backend::cuda::nvrtc;
        match nvrtc::version() {
            Err(Error::LibraryMissing(m)) => eprintln!("SKIP: NVRTC not available ({m})"),
            Err(e) => panic!("{e}"),
            Ok(_) => {
                let (name, src) = FLASH_SOURCES[0];
                assert_eq!(name, "upipe_flash");
                let (cubin, _) =
                    nvrtc::compile_uncached_for_test(src, NVRTC_ARCH, NVRTC_OPTIONS).unwrap();
                for k in KERNEL_NAMES {
                    assert!(
                        cubin.windows(k.len()).any(|w| w == k.as_bytes()),
                        "{k} missing from the cubin"
                    );
                }
                let (cubin, _) = nvrtc::compile_uncached_for_test(
                    FLASH_WGMMA_SOURCE,
                    WGMMA_NVRTC_ARCH,
                    NVRTC_OPTIONS,
                )
                .unwrap();
                let k = FWD_WGMMA_D128.as_bytes();
                assert!(cubin.windows(k.len()).any(|w| w == k));
                let (cubin, _) = nvrtc::compile_uncached_for_test(
                    FLASH_WGMMA_BWD_SOURCE,
                    WGMMA_NVRTC_ARCH,
                    NVRTC_OPTIONS,
                )
                .unwrap();
                let k = BWD_WGMMA_D128.as_bytes();
                assert!(cubin.windows(k.len()).any(|w| w == k));
            }
        }
    }

    #[test]
    fn source_names_every_kernel() {
        assert_eq!(FLASH_SOURCES.len(), 1);
        for name in KERNEL_NAMES {
            assert!(
                FLASH_SOURCE.contains(&format!("void __launch_bounds__(FWD_NT, 2) {name}("))
                    || FLASH_SOURCE.contains(&format!("void __launch_bounds__(BWD_NT, 1) {name}("))
                    || FLASH_SOURCE.contains(&format!("void {name}(")),
                "{name}"
            );
        }
    }
}
