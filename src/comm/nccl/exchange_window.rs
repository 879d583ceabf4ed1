//! The Ulysses group's exchange window: all-to-all over copy engines.
//!
//! NCCL's all-to-all kernels need SMs; beside attention and GEMMs they slow
//! both (docs/strategies.md, "Overlap"). NCCL 2.28 can move an all-to-all
//! with the GPUs' copy engines instead, using no SMs, when the communicator's
//! CTA policy is `NCCL_CTA_POLICY_ZERO`, the GPUs of the group are NVLink
//! peers of one node, and both buffers lie in a window registered with
//! `NCCL_WIN_COLL_SYMMETRIC` (each rank's receive buffer at the same offset
//! of its window: each rank's copy engine writes straight into the peer's).
//!
//! With `UPIPE_CE_EXCHANGE_MB=<MiB>` each rank of a Ulysses group of more
//! than one GPU allocates that many bytes with `ncclMemAlloc`, registers them
//! once as a symmetric window of the group's communicator, and hands out its
//! exchange buffers from it ([`ArenaMap`]: the same offsets on every rank,
//! since every rank asks for the same buffers in the same order). A buffer
//! that does not fit is an error naming the fix, on every rank alike. The
//! ledger counts window buffers as `comm` like pool ones; the window itself
//! is device memory beside the pool (the pool's own counters do not see
//! them).

use super::comm::{Comm, drv_bind, lock};
use super::library::check;
use crate::backend::arena::ArenaMap;
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::pool::BlockOwner;
use crate::backend::{Backend, Category, DType, Tensor};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Environment variable that turns the window on: its size in MiB.
pub const SIZE_VAR: &str = "UPIPE_CE_EXCHANGE_MB";

/// Offset alignment of buffers in the window (cuBLASLt and cuDNN want 256).
const ALIGN: usize = 256;

/// `ncclMemAlloc`'s granularity on every GPU we run (sizes round up to it).
const GRANULE: usize = 2 << 20;

/// The window's size from [`SIZE_VAR`]: `None` when unset or 0.
pub fn size_from_env() -> Result<Option<usize>> {
    window_bytes(std::env::var(SIZE_VAR).ok().as_deref())
}

/// Bytes of a window of `mib` MiB (the variable's text), rounded up to
/// `ncclMemAlloc`'s granularity: `None` when unset or 0, an error naming the
/// variable when it is not a number.
fn window_bytes(mib: Option<&str>) -> Result<Option<usize>> {
    let Some(v) = mib else {
        return Ok(None);
    };
    let n: usize = v.trim().parse().map_err(|_| {
        Error::Config(format!(
            "{SIZE_VAR}={v:?} is not a size in MiB; set e.g. {SIZE_VAR}=2048, or 0 for NCCL's kernels"
        ))
    })?;
    let bytes = n.checked_mul(1 << 20).ok_or_else(|| {
        Error::Config(format!(
            "{SIZE_VAR}={n} MiB does not fit in memory addresses"
        ))
    })?;
    Ok((n > 0).then(|| bytes.div_ceil(GRANULE) * GRANULE))
}

/// Whether the global ranks `members` share one node of `per_node`
/// consecutive ranks (where NCCL's copy-engine all-to-all can serve them;
/// across nodes it would run its kernels on window buffers, the mix that hung).
pub fn one_node(members: &[usize], per_node: usize) -> bool {
    let node = |r: usize| r / per_node.max(1);
    members.iter().all(|&r| node(r) == node(members[0]))
}

/// One rank's registered window and the offsets handed out in it.
pub struct ExchangeWindow {
    comm: Arc<Comm>,
    backend: Arc<CudaBackend>,
    base: u64,
    bytes: usize,
    win: sys::ncclWindow_t,
    map: Mutex<ArenaMap>,
    /// Buffers handed out so far.
    handed_out: AtomicU64,
}

// SAFETY: the window handle is only passed to NCCL under the communicator's
// lock (registration and deregistration); the offsets are behind a mutex.
unsafe impl Send for ExchangeWindow {}
// SAFETY: as above.
unsafe impl Sync for ExchangeWindow {}

impl ExchangeWindow {
    /// Allocates `bytes` with `ncclMemAlloc` and registers them as a
    /// symmetric window of `comm` (collective over the group: every member
    /// must call it with the same size).
    pub(super) fn register(
        comm: Arc<Comm>,
        backend: Arc<CudaBackend>,
        bytes: usize,
    ) -> Result<Arc<ExchangeWindow>> {
        drv_bind(&backend)?;
        let mut base: *mut c_void = std::ptr::null_mut();
        // SAFETY: `base` is a valid out pointer; the backend's context is current.
        check(
            unsafe { sys::ncclMemAlloc(&mut base, bytes) },
            &format!("ncclMemAlloc({bytes}) for the exchange window ({SIZE_VAR})"),
            Some(comm.raw),
        )?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        // (a failure to lock, too, frees the allocation below)
        let registered = lock(&comm).and_then(|_g| {
            // SAFETY: `base` holds `bytes` bytes from ncclMemAlloc; every
            // member registers a window of the same size in the same order.
            check(
                unsafe {
                    sys::ncclCommWindowRegister(
                        comm.raw,
                        base,
                        bytes,
                        &mut win,
                        NCCL_WIN_COLL_SYMMETRIC,
                    )
                },
                "ncclCommWindowRegister (exchange window)",
                Some(comm.raw),
            )
        });
        if let Err(e) = registered {
            // SAFETY: `base` came from ncclMemAlloc and is not registered.
            let _ = unsafe { sys::ncclMemFree(base) };
            return Err(e);
        }
        tracing::info!(
            "exchange window of group {}: {} MiB registered (NCCL zero-CTA: all-to-all on copy engines)",
            comm.name,
            bytes >> 20
        );
        Ok(Arc::new(ExchangeWindow {
            comm,
            backend,
            base: base as u64,
            bytes,
            win,
            map: Mutex::new(ArenaMap::new(bytes, ALIGN)),
            handed_out: AtomicU64::new(0),
        }))
    }

    /// A `comm` tensor in the window; an error naming the fix when it does
    /// not fit now.
    pub(super) fn buffer(
        self: &Arc<Self>,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor<CudaBackend>> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let (offset, used) = {
            let mut map = self
                .map
                .lock()
                .map_err(|_| Error::Comm("the exchange window's map was poisoned".into()))?;
            (map.take(bytes), map.used())
        };
        let Some(offset) = offset else {
            return Err(Error::Comm(format!(
                "the exchange window of group {} ({} MiB) is full: a {shape:?} {dtype:?} buffer needs \
                 {bytes} bytes with {used} in use; raise {SIZE_VAR} (every Ulysses exchange buffer \
                 in flight lives there)",
                self.comm.name,
                self.bytes >> 20
            )));
        };
        self.handed_out.fetch_add(1, Ordering::Relaxed);
        let owner: Arc<dyn BlockOwner> = self.clone();
        self.backend.adopt(
            self.base + offset as u64,
            bytes,
            owner,
            shape,
            dtype,
            Category::Comm,
        )
    }

    /// Whether `bytes` at `ptr` lie inside the window.
    pub(super) fn contains(&self, ptr: u64, bytes: usize) -> bool {
        ptr >= self.base && ptr + bytes as u64 <= self.base + self.bytes as u64
    }
}

impl BlockOwner for ExchangeWindow {
    fn release(&self, ptr: u64, bytes: usize) {
        if let Ok(mut m) = self.map.lock() {
            m.give((ptr - self.base) as usize, bytes);
        }
    }
}

impl Drop for ExchangeWindow {
    fn drop(&mut self) {
        let high = self.map.lock().map(|m| m.high()).unwrap_or(0);
        tracing::info!(
            "exchange window of group {} ({} MiB): {} buffers handed out, at most {:.1} MiB at once",
            self.comm.name,
            self.bytes >> 20,
            self.handed_out.load(Ordering::Relaxed),
            high as f64 / (1 << 20) as f64
        );
        if self.comm.aborted.load(Ordering::Acquire) {
            return; // the communicator is gone; the process is failing anyway
        }
        let _ = self.backend.synchronize();
        let _ = self.comm.stream.synchronize();
        if let Ok(_g) = lock(&self.comm) {
            // SAFETY: `win` was registered on this communicator; nothing
            // queued uses the window any more (both streams are drained).
            let r = unsafe { sys::ncclCommWindowDeregister(self.comm.raw, self.win) };
            if let Err(e) = check(r, "ncclCommWindowDeregister", Some(self.comm.raw)) {
                tracing::warn!("{e}");
                return;
            }
        }
        // SAFETY: `base` came from ncclMemAlloc and is no longer registered.
        let r = unsafe { sys::ncclMemFree(self.base as *mut c_void) };
        if let Err(e) = check(r, "ncclMemFree", None) {
            tracing::warn!("{e}");
        }
    }
}

/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h, 2.27+).
const NCCL_WIN_COLL_SYMMETRIC: i32 = 0x01;

/// `NCCL_CTA_POLICY_ZERO` (nccl.h, 2.28+).
pub(super) const NCCL_CTA_POLICY_ZERO: i32 = 0x02;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_means_the_same_block_of_consecutive_ranks() {
        assert!(one_node(&[0, 1], 8));
        assert!(one_node(&[8, 9, 10, 11, 12, 13, 14, 15], 8));
        assert!(!one_node(&[6, 7, 8, 9], 8));
        assert!(!one_node(&[0, 1], 1));
        assert!(one_node(&[3], 1));
    }

    #[test]
    fn window_size_parses_mib_and_names_the_variable_when_bad() {
        assert_eq!(window_bytes(None).unwrap(), None);
        assert_eq!(window_bytes(Some("0")).unwrap(), None);
        assert_eq!(window_bytes(Some(" 4096 ")).unwrap(), Some(4096 << 20));
        // 1 MiB rounds up to ncclMemAlloc's 2 MiB
        assert_eq!(window_bytes(Some("1")).unwrap(), Some(2 << 20));
        for bad in ["2G", "-1", "", "1e3"] {
            let e = window_bytes(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(SIZE_VAR), "{bad:?}: {e}");
        }
    }
}
