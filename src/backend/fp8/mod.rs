//! FP8: the two 8-bit float formats (`format`), tensor-wise scales
//! (`scale`), the FP8 ops' descriptors and their checks (`args`), and the
//! precision a run's linear layers compute in with the one GEMM they call
//! (`linear`).

pub mod args;
pub mod attention;
pub mod format;
pub mod linear;
pub mod scale;

pub use args::{Fp8Gemm, Fp8GemmShape, Fp8Quantize};
pub use attention::Fp8Passes;
pub use format::Fp8Format;
pub use linear::{
    Fp8Operand, Fp8Ref, LinearGemm, LinearRole, OutputGrad, Precision, Quantized, linear_gemm,
    linear_gemm_quantized,
};
pub use scale::{amax, quantized, scale_for};
