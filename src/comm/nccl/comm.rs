//! An owned NCCL communicator ([`Comm`]): destroyed on drop unless the
//! watchdog aborted it, enqueued on under its lock once no fault is
//! recorded.

use super::library::check;
use crate::backend::cuda::CudaBackend;
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// An owned communicator; destroyed on drop (unless the watchdog aborted it).
pub(super) struct Comm {
    pub(super) raw: sys::ncclComm_t,
    /// Its group, for messages: `world`, `ulysses [0, 1]`, ...
    pub(super) name: Arc<str>,
    /// The stream its collectives run on: drained before the communicator
    /// is destroyed, so no transfer is in flight then.
    pub(super) stream: Arc<CudaStream>,
    /// Serialises enqueueing (NCCL communicators are not thread-safe); the
    /// watchdog takes it too before aborting, when it can ([`abort`]).
    pub(super) lock: Mutex<()>,
    /// The backend's communication fault: once set, nothing is enqueued.
    pub(super) fault: Arc<OnceLock<String>>,
    /// `ncclCommAbort` ran: `raw` is freed, never to be used again.
    pub(super) aborted: AtomicBool,
}

// SAFETY: the handle is only used under `lock`, and NCCL allows a
// communicator to be used from any thread as long as calls do not overlap.
// The exceptions are the watchdog's `ncclCommGetAsyncError` (an atomic read
// of the communicator's error state, made to be polled from another thread;
// the watchdog still takes `lock` with `try_lock` around it) and
// `ncclCommAbort`, which NCCL provides to release a thread blocked in NCCL.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    pub(super) fn new(
        raw: sys::ncclComm_t,
        name: &str,
        stream: Arc<CudaStream>,
        fault: Arc<OnceLock<String>>,
    ) -> Comm {
        Comm {
            raw,
            name: name.into(),
            stream,
            lock: Mutex::new(()),
            fault,
            aborted: AtomicBool::new(false),
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            // ncclCommAbort freed it; its stream may hold transfers that
            // never finish correctly, so neither drain nor destroy
            tracing::debug!(
                "NCCL communicator of group {} was aborted; not destroyed",
                self.name
            );
            return;
        }
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!("NCCL communicator: draining its stream: {e:?}");
        }
        // SAFETY: `raw` came from a successful init/split and is destroyed once.
        let r = unsafe { sys::ncclCommDestroy(self.raw) };
        if let Err(e) = check(r, "ncclCommDestroy", None) {
            tracing::warn!("{e}");
        }
    }
}

/// `Err` with the recorded communication fault, if there is one.
pub(super) fn fault_check(fault: &OnceLock<String>) -> Result<()> {
    match fault.get() {
        Some(m) => Err(Error::Comm(m.clone())),
        None => Ok(()),
    }
}

pub(super) fn drv_bind(b: &CudaBackend) -> Result<()> {
    b.context()
        .bind_to_thread()
        .map_err(|e| Error::Backend(format!("CUDA driver: bind context: {e:?}")))
}

/// The enqueue lock of a communicator that may still be used: `Err` once the
/// watchdog has failed (checked under the lock, so that no enqueue overlaps
/// or follows the abort).
pub(super) fn lock(c: &Comm) -> Result<MutexGuard<'_, ()>> {
    let g = c
        .lock
        .lock()
        .map_err(|_| Error::Comm("an NCCL communicator was poisoned by a panic".into()))?;
    fault_check(&c.fault)?;
    if c.aborted.load(Ordering::Acquire) {
        return Err(Error::Comm(format!(
            "the NCCL communicator of group {} was aborted",
            c.name
        )));
    }
    Ok(g)
}

pub(super) fn drv<T>(
    r: std::result::Result<T, cudarc::driver::DriverError>,
    what: &str,
) -> Result<T> {
    r.map_err(|e| Error::Backend(format!("CUDA driver: {what}: {e:?}")))
}
