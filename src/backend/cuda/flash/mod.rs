//! Native FlashAttention-2-style forward and backward kernels for Hopper
//! (sm_90), written in CUDA C and compiled at run time by NVRTC.
//!
//! Semantics are those of [`Backend::attention_fwd`](crate::backend::Backend::attention_fwd)
//! and [`Backend::attention_bwd`](crate::backend::Backend::attention_bwd): q `[sq, hq, d]`,
//! k, v `[sk, hkv, d]` in bf16 (row-major, each row `stride` elements apart, the
//! pointer already at the first row), GQA (query head `h` uses kv head
//! `h / (hq / hkv)`), an [`AttnMask`]: causal (row `i` sees keys `0..=i`, needs `sq == sk`) or full,
//! the call's softmax scale (`1/sqrt(d)` by default); o bf16 `[sq, hq, d]`, lse f32 `[sq, hq]` natural log.
//! The backward takes the lse of the full row and *adds* into f32 dq, dk, dv.
//!
//! Use: compile the one entry of [`FLASH_SOURCES`] with NVRTC for
//! [`NVRTC_ARCH`] and [`NVRTC_OPTIONS`], load it as a module, build
//! [`FlashFunctions::load`] once, then call [`flash_fwd`] / [`flash_bwd`]
//! (the backward needs [`flash_bwd_workspace_bytes`] of scratch). Both only
//! enqueue work on the given stream.
//!
//! Design (FlashAttention-2 schedule on `mma.sync.m16n8k16` bf16 with
//! `ldmatrix` and `cp.async`, XOR-swizzled shared-memory tiles; head dims 64,
//! 128 and 256):
//! - forward: a block is 128 query rows of one head (4 warps x 32 rows; 8
//!   warps x 16 rows at head dim 256, where a warp's O accumulator would not
//!   fit its registers at 32 rows), K/V tiles of 64 keys double-buffered,
//!   online softmax in base 2, grid ordered heads-fastest and longest causal
//!   rows first;
//! - backward: a preprocessing kernel writes `delta = rowsum(dO * O)`; the main
//!   kernel owns 128 keys of one kv head (64 at head dim 256, whose tiles
//!   would not fit the shared memory at 128; 8 warps), loops over the group's query
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
//! forward+backward 405-414 (`RESULTS.md`). Head dim 256 on one H100
//! (2026-12-07, H=8, Hkv=4, causal, S = 16K / 64K): forward 269-276,
//! backward 193-195, forward+backward 210-213.
//! `examples/flash_check.rs` reproduces the table and checks against the CPU oracle.

mod functions;
mod launch;
mod sources;
mod tiles;

pub use functions::*;
pub use launch::*;
pub use sources::*;

#[cfg(test)]
mod tests {
    use super::launch::{BwdParams, FwdParams, check_ptr, check_stride};
    use super::tiles::*;
    use super::*;
    use crate::backend::AttnMask;
    use crate::backend::cuda::attention::{AttnBwd, AttnFwd};
    use crate::error::Error;

    #[test]
    fn smem_fits_hopper() {
        // H100/H200: 228 KiB per SM, 227 KiB per block, 1 KiB reserved per block.
        // Forward: two blocks per SM (one at head dim 256: 256 threads of up
        // to 255 registers); backward (255 registers x 256 threads): one.
        for d in HEAD_DIMS {
            let fwd_blocks = if d == 256 { 1 } else { 2 };
            assert!(fwd_blocks * (fwd_smem_bytes(d) + 1024) <= 228 * 1024, "{d}");
            assert!(bwd_smem_bytes(d) + 1024 <= 227 * 1024, "{d}");
        }
        assert_eq!(
            bwd_smem_bytes(256),
            (2 * 64 * 256 + 4 * 64 * 256 + 2 * 64 * 64) * 2 + 1024
        );
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
            for d in [64, 256] {
                assert_eq!(auto.resolve(d, loaded, "V").unwrap(), mma);
                assert_eq!(wgmma.resolve(d, loaded, "V").unwrap(), mma);
            }
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
        assert!(check_supported(10, 10, 8, 2, 96, &AttnMask::Full).is_err());
        assert!(check_supported(10, 10, 8, 3, 64, &AttnMask::Full).is_err());
        assert!(check_supported(10, 12, 8, 2, 64, &AttnMask::Causal).is_err());
        assert!(check_supported(10, 12, 8, 2, 64, &AttnMask::Full).is_ok());
        assert!(check_supported(12, 12, 8, 8, 128, &AttnMask::Causal).is_ok());
        assert!(check_supported(12, 12, 8, 4, 256, &AttnMask::Causal).is_ok());
        assert!(check_supported(12, 12, 8, 4, 512, &AttnMask::Causal).is_err());
        assert!(check_stride("q", 100, 128, 8).is_err());
        assert!(check_ptr("q", 8, 16).is_err());
    }

    /// A backward on aligned views of `[8, hq, 64]` rows, `hq = 4`, `hkv = 2`.
    fn aligned_bwd() -> AttnBwd {
        use crate::backend::DType;
        let (hq, hkv, d) = (4, 2, 64);
        AttnBwd {
            q: 0x1000,
            k: 0x2000,
            v: 0x3000,
            dt: DType::BF16,
            o: 0x4000,
            o_dt: DType::BF16,
            d_o: 0x5000,
            d_o_dt: DType::BF16,
            lse: 0x6004,
            dq: 0x7008,
            dk: 0x8008,
            dv: 0x9008,
            q_rs: hq * d,
            k_rs: hkv * d,
            v_rs: hkv * d,
            o_rs: hq * d,
            d_o_rs: hq * d,
            lse_rs: hq,
            dq_rs: hq * d,
            dk_rs: hkv * d,
            dv_rs: hkv * d,
            sq: 8,
            sk: 8,
            hq,
            hkv,
            d,
            mask: AttnMask::Causal,
            bounds: 0,
            scale: 0.125,
        }
    }

    #[test]
    fn forward_operands_are_validated() {
        let fwd = aligned_bwd().forward();
        assert!(check_fwd_operands(&fwd).is_ok());
        // A head chunk's view: wider rows than its own heads are fine.
        assert!(
            check_fwd_operands(&AttnFwd {
                q_rs: 8 * 64,
                ..fwd.clone()
            })
            .is_ok()
        );
        let bad_fwd = [
            AttnFwd {
                k: 0x2008,
                ..fwd.clone()
            },
            AttnFwd {
                lse: 0x6002,
                ..fwd.clone()
            },
            AttnFwd {
                v_rs: 2 * 64 + 4,
                ..fwd.clone()
            },
            AttnFwd {
                o_rs: 3 * 64,
                ..fwd.clone()
            },
            AttnFwd {
                lse_rs: 3,
                ..fwd.clone()
            },
        ];
        for f in &bad_fwd {
            assert!(check_fwd_operands(f).is_err(), "{f:?}");
        }
    }

    #[test]
    fn backward_operands_are_validated() {
        let a = aligned_bwd();
        assert!(check_bwd_operands(&a).is_ok());
        let bad_bwd = [
            AttnBwd {
                d_o: 0x5008,
                ..a.clone()
            },
            AttnBwd {
                d_o_rs: 4 * 64 - 8,
                ..a.clone()
            },
            AttnBwd {
                dq: 0x7004,
                ..a.clone()
            },
            AttnBwd {
                dk_rs: 2 * 64 + 1,
                ..a.clone()
            },
            AttnBwd { dv: 0, ..a.clone() },
            AttnBwd {
                q: 0x1008,
                ..a.clone()
            },
        ];
        for b in &bad_bwd {
            let e = check_bwd_operands(b).unwrap_err();
            assert!(
                e.to_string().starts_with("backend error: flash attention:"),
                "{e}"
            );
        }
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
            (mma, "FWD_NT_D256", FWD_THREADS_D256 as usize),
            (mma, "BWD_BM", BWD_BM),
            (mma, "BWD_BN", BWD_BN),
            (mma, "BWD_BN_D256", BWD_BN_D256),
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
                    || FLASH_SOURCE
                        .contains(&format!("void __launch_bounds__(FWD_NT_D256, 1) {name}("))
                    || FLASH_SOURCE.contains(&format!("void __launch_bounds__(BWD_NT, 1) {name}("))
                    || FLASH_SOURCE.contains(&format!("void {name}(")),
                "{name}"
            );
        }
    }
}
