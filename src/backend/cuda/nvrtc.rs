//! Run-time compilation of our CUDA C kernels to cubin with NVRTC, cached on
//! disk under `$UPIPE_KERNEL_CACHE` (default `~/.cache/upipe/kernels`), keyed
//! by a hash of the source, the target arch, the options and NVRTC's version.

use super::libs::{self, Lib};
use crate::error::{Error, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::path::PathBuf;

/// Options passed to NVRTC besides the arch.
pub const OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// 64-bit FNV-1a: a stable hash (std's `DefaultHasher` may change between releases).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // Separator so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The folder for cached cubins.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UPIPE_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("upipe/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/upipe/kernels"))
}

/// The cache key of one compilation with the default [`OPTIONS`].
pub fn cache_key(src: &str, arch: &str, nvrtc_version: (i32, i32)) -> String {
    cache_key_with(src, arch, OPTIONS, nvrtc_version)
}

/// The cache key of one compilation with `options`.
pub fn cache_key_with(
    src: &str,
    arch: &str,
    options: &[&str],
    nvrtc_version: (i32, i32),
) -> String {
    let v = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
    let opts = options.join(" ");
    format!(
        "{:016x}",
        fnv1a(&[
            src.as_bytes(),
            arch.as_bytes(),
            opts.as_bytes(),
            v.as_bytes()
        ])
    )
}

/// NVRTC's version.
pub fn version() -> Result<(i32, i32)> {
    libs::load(Lib::Nvrtc)?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC is loaded; both are valid out pointers.
    unsafe { sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map_err(|e| Error::Backend(format!("nvrtcVersion: {e:?}")))?;
    Ok((a, b))
}

/// Where a cubin came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CubinSource {
    DiskCache,
    Compiled,
}

/// Compiles `src` for `arch` (e.g. `sm_90`) with the default [`OPTIONS`] or
/// reads the cached cubin.
pub fn compile_cached(src: &str, arch: &str) -> Result<(Vec<u8>, CubinSource)> {
    compile_cached_with(src, arch, OPTIONS)
}

/// As [`compile_cached`] with explicit NVRTC `options` (besides `-arch`).
pub fn compile_cached_with(
    src: &str,
    arch: &str,
    options: &[&str],
) -> Result<(Vec<u8>, CubinSource)> {
    let ver = version()?;
    let key = cache_key_with(src, arch, options, ver);
    let path = cache_dir().map(|d| d.join(format!("{key}.{arch}.cubin")));
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
        && !bytes.is_empty()
    {
        return Ok((bytes, CubinSource::DiskCache));
    }
    let cubin = compile(src, arch, options)?;
    if let Some(p) = &path
        && let Err(e) = write_atomic(p, &cubin)
    {
        tracing::warn!("could not cache kernels at {}: {e}", p.display());
    }
    Ok((cubin, CubinSource::Compiled))
}

/// Compiles without touching the disk cache (tests).
#[cfg(test)]
pub(crate) fn compile_uncached_for_test(
    src: &str,
    arch: &str,
    options: &[&str],
) -> Result<(Vec<u8>, CubinSource)> {
    compile(src, arch, options).map(|c| (c, CubinSource::Compiled))
}

fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn compile(src: &str, arch: &str, options: &[&str]) -> Result<Vec<u8>> {
    let csrc =
        CString::new(src).map_err(|_| Error::Backend("kernel source contains NUL".into()))?;
    let name = CString::new("upipe_kernels.cu").expect("static name");
    let prog = result::create_program(&csrc, Some(&name))
        .map_err(|e| Error::Backend(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts: Vec<String> = options.iter().map(|s| s.to_string()).collect();
    opts.push(format!("-arch={arch}"));
    // SAFETY: `prog` is a live program; it is destroyed on every path below.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let res = match compiled {
            Err(e) => Err(Error::Backend(format!(
                "NVRTC failed to compile our kernels ({e:?}):\n{log}"
            ))),
            Ok(()) => {
                let mut size = 0usize;
                let r = sys::nvrtcGetCUBINSize(prog, &mut size).result();
                match r {
                    Err(e) => Err(Error::Backend(format!("nvrtcGetCUBINSize: {e:?}"))),
                    Ok(()) => {
                        let mut buf = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                            .result()
                            .map(|_| buf)
                            .map_err(|e| Error::Backend(format!("nvrtcGetCUBIN: {e:?}")))
                    }
                }
            }
        };
        let _ = result::destroy_program(prog);
        res
    };
    if out.as_ref().is_ok_and(|b| b.is_empty()) {
        return Err(Error::Backend(format!(
            "NVRTC produced no cubin for {arch}; is the arch a real sm_XY?"
        )));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_every_input() {
        let k = cache_key("src", "sm_90", (13, 0));
        assert_eq!(k, cache_key("src", "sm_90", (13, 0)));
        assert_ne!(k, cache_key("src2", "sm_90", (13, 0)));
        assert_ne!(k, cache_key("src", "sm_89", (13, 0)));
        assert_ne!(k, cache_key("src", "sm_90", (13, 1)));
        assert_eq!(k, cache_key_with("src", "sm_90", OPTIONS, (13, 0)));
        assert_ne!(k, cache_key_with("src", "sm_90", &["--std=c++17"], (13, 0)));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(k.len(), 16);
    }
}
