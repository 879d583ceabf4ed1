//! The FP8 ops on CUDA. This build has no FP8 kernels yet: a run that
//! chooses `--precision fp8` on a GPU is refused where it starts
//! ([`Backend::supports_fp8`](crate::backend::Backend::supports_fp8)), and
//! the ops refuse alike should anything call them.

use super::backend::CudaBackend;
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use crate::error::{Error, Result};

fn refusal() -> Error {
    Error::Config(
        "--precision fp8 runs on the CPU reference only in this build (the CUDA FP8 kernels \
         are not built yet); use --precision bf16 on a GPU"
            .into(),
    )
}

impl CudaBackend {
    pub(super) fn supports_fp8_impl(&self) -> Result<()> {
        Err(refusal())
    }
    pub(super) fn fp8_quantize_impl(&self, _f: Fp8Format, _a: Fp8Quantize<'_, Self>) -> Result<()> {
        Err(refusal())
    }
    pub(super) fn fp8_gemm_impl(&self, _g: &Fp8GemmShape, _a: Fp8Gemm<'_, Self>) -> Result<()> {
        Err(refusal())
    }
}
