//! The loaded libnccl: where it came from, what its version supports
//! (`ncclCommSplit`, `ncclAlltoAll`), its results as our errors and its
//! element types.

use crate::backend::DType;
use crate::backend::cuda::libs::{self, Lib, LoadedLib};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::CStr;

/// Loads libnccl (once per process) and returns where it came from.
pub fn library() -> Result<&'static LoadedLib> {
    libs::load(Lib::Nccl)
}

/// Converts an NCCL result into ours: the call, NCCL's string for the code,
/// and (when a communicator is known) its last error message.
pub(super) fn check(r: sys::ncclResult_t, what: &str, comm: Option<sys::ncclComm_t>) -> Result<()> {
    if is_ok(r) {
        return Ok(());
    }
    Err(Error::Comm(nccl_message(r, what, comm)))
}

pub(super) fn is_ok(r: sys::ncclResult_t) -> bool {
    matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    )
}

/// The text of [`check`]'s error.
pub(super) fn nccl_message(
    r: sys::ncclResult_t,
    what: &str,
    comm: Option<sys::ncclComm_t>,
) -> String {
    // SAFETY: both functions return pointers to static or communicator-owned
    // NUL-terminated strings (or null), read immediately.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let code = text(unsafe { sys::ncclGetErrorString(r) });
    let last = comm.map(|c| text(unsafe { sys::ncclGetLastError(c) }));
    let mut msg = format!("NCCL {what}: {code} ({r:?})");
    if let Some(l) = last.filter(|l| !l.is_empty()) {
        msg.push_str(&format!(": {l}"));
    }
    msg.push_str("; set NCCL_DEBUG=WARN for NCCL's own log");
    msg
}

/// The NCCL element type of a tensor dtype.
pub(super) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        // FP8 codes move as bytes (never reduced)
        DType::U8 | DType::F8E4M3 | DType::F8E5M2 => sys::ncclDataType_t::ncclUint8,
    }
}

/// Whether an NCCL version string (`2.28.3`) has `ncclCommSplit` (2.18+).
pub(super) fn supports_split(version: &str) -> bool {
    at_least(version, (2, 18))
}

/// Whether an NCCL version string (`2.28.3`) has `ncclAlltoAll` (2.28+).
pub(super) fn supports_alltoall(version: &str) -> bool {
    at_least(version, (2, 28))
}

fn at_least(version: &str, want: (u32, u32)) -> bool {
    let mut it = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    (major, minor) >= want
}

/// Whether all-to-all uses NCCL's own `ncclAlltoAll` (NCCL 2.28+, unless
/// `UPIPE_NCCL_ALLTOALL=0`) rather than grouped sends and receives. Decided
/// once per process from the loaded library's version: cudarc panics on a
/// missing symbol, so the call is only made where the version has it.
pub(super) fn native_alltoall() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        let off = std::env::var("UPIPE_NCCL_ALLTOALL").is_ok_and(|v| v == "0");
        let version = library().ok().and_then(|l| l.api_version.clone());
        !off && version.is_some_and(|v| supports_alltoall(&v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_needs_nccl_2_18() {
        assert!(supports_split("2.28.3"));
        assert!(supports_split("2.18.1"));
        assert!(supports_split("3.0.0"));
        assert!(!supports_split("2.17.9"));
        assert!(!supports_split("garbage"));
        assert!(supports_alltoall("2.28.3") && supports_alltoall("3.1"));
        assert!(!supports_alltoall("2.27.7") && !supports_alltoall(""));
    }
}
