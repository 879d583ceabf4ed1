//! Our CUDA C kernels: the source (from `kernels/*.cu`), the loaded module,
//! the function table and a small launch helper.

use super::device::drv;
use super::nvrtc::{self, CubinSource};
use crate::backend::fused_update::DeviceProgram;
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, result, sys};
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Mutex;

/// Every kernel file, in the order they are concatenated (common helpers first).
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cu", include_str!("kernels/common.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("norm_rope.cu", include_str!("kernels/norm_rope.cu")),
    ("loss.cu", include_str!("kernels/loss.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("fp8.cu", include_str!("kernels/fp8.cu")),
];

/// The single translation unit NVRTC compiles.
pub fn full_source() -> String {
    let mut s = String::new();
    for (name, src) in SOURCES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// The translation unit of an update program (`Backend::fused_update`):
/// the common helpers, then its sources in order.
pub fn program_source(p: DeviceProgram) -> String {
    let common = SOURCES.iter().filter(|(name, _)| *name == "common.cu");
    let mut s = String::new();
    for (name, src) in common.chain(p.sources) {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// Threads per block used by the attention kernels (`ATT_T` in attention.cu).
pub const ATT_THREADS: u32 = 128;
/// Largest head dim the interim attention kernels take (`ATT_T * ATT_DPT`).
pub const ATT_MAX_D: usize = 512;

macro_rules! kernel_table {
    ($($name:ident),* $(,)?) => {
        /// Function handles of every kernel.
        #[allow(non_snake_case)]
        pub struct Kernels {
            module: sys::CUmodule,
            /// Whether the cubin came from the disk cache.
            pub source: CubinSource,
            $(pub $name: Func,)*
        }

        impl Kernels {
            fn resolve(module: sys::CUmodule, source: CubinSource) -> Result<Self> {
                Ok(Kernels {
                    module,
                    source,
                    $($name: get_function(module, stringify!($name))?,)*
                })
            }
        }
    };
}

kernel_table!(
    copy2d,
    copy_rows16,
    cast_rows8,
    scale2d,
    fill,
    axpy,
    add_bias_rows,
    bias_grad,
    sum_squares,
    gated_act_fwd,
    gated_act_bwd,
    embedding_fwd,
    embedding_bwd,
    rmsnorm_fwd,
    add_rmsnorm_fwd,
    rmsnorm_bwd,
    rope,
    rope_bf16x8,
    cross_entropy,
    attn_fwd_naive,
    attn_bwd_naive,
    lse_merge,
    fp8_amax,
    fp8_cast,
    fp8_scale_inv,
    fp8_attn_scales,
    fp8_dequant,
);

// SAFETY: module and function handles are immutable driver objects, valid on
// any thread that has the owning context bound.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// A kernel handle of a loaded module.
#[derive(Debug, Clone, Copy)]
pub struct Func(sys::CUfunction);

fn get_function(module: sys::CUmodule, name: &str) -> Result<Func> {
    let c = CString::new(name).expect("kernel names have no NUL");
    // SAFETY: `module` is loaded and outlives the handle (unloaded only on drop of Kernels).
    drv(
        unsafe { result::module::get_function(module, c) },
        &format!("cuModuleGetFunction({name})"),
    )
    .map(Func)
}

impl Kernels {
    /// Compiles (or reads from the disk cache) and loads the kernels for `arch`.
    /// The context must be bound to this thread.
    pub fn load(arch: &str) -> Result<Kernels> {
        let (module, source) = load_module(&full_source(), arch)?;
        Kernels::resolve(module, source)
    }
}

/// Compiles `src` for `arch` (or reads its cubin from the disk cache) and
/// loads it. The context must be bound to this thread.
fn load_module(src: &str, arch: &str) -> Result<(sys::CUmodule, CubinSource)> {
    let (cubin, source) = nvrtc::compile_cached(src, arch)?;
    // SAFETY: `cubin` is a complete cubin image, alive for the call.
    let module = drv(
        unsafe { result::module::load_data(cubin.as_ptr().cast()) },
        "cuModuleLoadData",
    )
    .map_err(|e| {
        Error::Backend(format!(
            "{e}; delete the kernel cache ({:?}) if it is stale",
            nvrtc::cache_dir()
        ))
    })?;
    Ok((module, source))
}

/// A module compiled at run time from a program the layers above supply
/// (an optimizer's update program: `fused_update.rs`), its functions
/// looked up by name on first use.
pub struct ProgramModule {
    module: sys::CUmodule,
    functions: Mutex<HashMap<&'static str, Func>>,
}

// SAFETY: as for `Kernels`: immutable driver handles.
unsafe impl Send for ProgramModule {}
// SAFETY: as above; the function table is behind a lock.
unsafe impl Sync for ProgramModule {}

impl ProgramModule {
    /// Compiles `src` (or reads it from the disk cache) for `arch` and
    /// loads it. The context must be bound to this thread.
    pub fn load(src: &str, arch: &str) -> Result<Self> {
        let (module, _) = load_module(src, arch)?;
        Ok(ProgramModule {
            module,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The module's function `name`.
    pub fn function(&self, name: &'static str) -> Result<Func> {
        let mut functions = self
            .functions
            .lock()
            .map_err(|_| Error::Backend("a program's function table was poisoned".into()))?;
        if let Some(f) = functions.get(name) {
            return Ok(*f);
        }
        let f = get_function(self.module, name)?;
        functions.insert(name, f);
        Ok(f)
    }
}

impl Drop for ProgramModule {
    fn drop(&mut self) {
        // SAFETY: as for `Kernels`: no launch of it is still in flight.
        unsafe {
            let _ = result::module::unload(self.module);
        }
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: no launch can be in flight that the caller has not synchronised.
        unsafe {
            let _ = result::module::unload(self.module);
        }
    }
}

/// Kernel arguments, each in its own 8-byte slot (the driver reads only the
/// parameter's size from each slot; x86-64 is little-endian), or a struct
/// passed by value in several consecutive slots ([`Args::words`]).
#[derive(Default)]
pub struct Args {
    /// Every argument's bytes.
    slots: Vec<u64>,
    /// Where each argument starts in `slots`.
    starts: Vec<usize>,
}

impl Args {
    pub fn new() -> Self {
        Args {
            slots: Vec::with_capacity(32),
            starts: Vec::with_capacity(32),
        }
    }
    pub fn ptr(self, p: u64) -> Self {
        self.words(&[p])
    }
    pub fn i64(self, v: i64) -> Self {
        self.words(&[v as u64])
    }
    pub fn usize(self, v: usize) -> Self {
        self.i64(v as i64)
    }
    pub fn i32(self, v: i32) -> Self {
        self.words(&[v as u32 as u64])
    }
    pub fn f32(self, v: f32) -> Self {
        self.words(&[v.to_bits() as u64])
    }
    /// One argument of `words.len() * 8` bytes: a struct passed by value,
    /// laid out as the kernel declares it (8-byte aligned).
    pub fn words(mut self, words: &[u64]) -> Self {
        self.starts.push(self.slots.len());
        self.slots.extend_from_slice(words);
        self
    }
}

/// Launches `f` on `stream`.
pub fn launch(
    stream: &CudaStream,
    f: Func,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    mut args: Args,
) -> Result<()> {
    let base = args.slots.as_mut_ptr();
    // SAFETY: every start indexes `slots`, which is not resized from here on.
    let mut ptrs: Vec<*mut c_void> = args
        .starts
        .iter()
        .map(|&i| unsafe { base.add(i) }.cast())
        .collect();
    // SAFETY: `f` is a loaded kernel whose parameter list matches `args` (each
    // call site mirrors the kernel's signature in kernels/*.cu); all device
    // pointers are live allocations ordered on `stream`.
    drv(
        unsafe {
            result::launch_kernel(
                f.0,
                grid,
                (block, 1, 1),
                smem,
                stream.cu_stream(),
                &mut ptrs,
            )
        },
        "cuLaunchKernel",
    )
}

/// A 1-D grid for `n` elements with grid-stride loops (capped).
pub fn grid_for(n: usize, block: u32) -> (u32, u32, u32) {
    let blocks = n.div_ceil(block as usize).clamp(1, 65_535 * 8);
    (blocks as u32, 1, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles the kernels whenever NVRTC can be found (no GPU needed), so a
    /// syntax error shows up on any machine with the CUDA toolkit or the
    /// `nvidia-cuda-nvrtc` wheel (`UPIPE_NVRTC_LIB=.../libnvrtc.so.13`).
    #[test]
    fn kernels_compile_with_nvrtc_when_available() {
        match nvrtc::version() {
            Err(Error::LibraryMissing(m)) => {
                eprintln!("SKIP: NVRTC not available ({m})");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => {
                // Compile straight through NVRTC (not the cache) to catch errors now.
                let src = full_source();
                let (cubin, _) =
                    nvrtc::compile_uncached_for_test(&src, "sm_90", nvrtc::OPTIONS).unwrap();
                assert!(cubin.len() > 1000);
                for name in [
                    "attn_fwd_naive",
                    "attn_bwd_naive",
                    "cross_entropy",
                    "copy2d",
                    "add_rmsnorm_fwd",
                ] {
                    assert!(
                        cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                        "{name} missing from the cubin"
                    );
                }
            }
        }
    }
}
