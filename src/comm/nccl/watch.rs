//! NCCL's watchdog side: every issued collective followed by its end
//! event, communicators polled for asynchronous errors, and every
//! communicator aborted on a timeout or an error (policy in
//! `comm::watchdog`).

use super::comm::Comm;
use super::library::{check, is_ok, library, nccl_message};
use crate::comm::watchdog::{self, Failure, InFlight, Watchdog};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent};
use cudarc::nccl::sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError, Weak, mpsc};
use std::time::{Duration, Instant};

/// Capacity of the watchdog's queue (see [`Watchdog::push`] for a full one).
pub(super) const WATCH_CAPACITY: usize = 4096;

/// How long the watchdog waits for a communicator's enqueue lock before
/// aborting it anyway (a thread stuck inside NCCL holds it forever).
pub(super) const ABORT_LOCK_WAIT: Duration = Duration::from_secs(2);

/// End of an issued collective: an event recorded on the communication
/// stream after its transfers, once they are all enqueued.
pub(super) struct EndMark {
    pub(super) event: CudaEvent,
    pub(super) state: AtomicU8,
}

/// [`EndMark::state`]: being enqueued (not finished, whatever the event says).
pub(super) const ENQUEUEING: u8 = 0;
/// [`EndMark::state`]: the event is recorded; it tells.
pub(super) const RECORDED: u8 = 1;
/// [`EndMark::state`]: enqueueing failed, nothing to wait for.
pub(super) const ABANDONED: u8 = 2;

/// Marks an [`EndMark`] abandoned if it is dropped before being recorded.
pub(super) struct AbandonUnlessRecorded(pub(super) Arc<EndMark>);

impl Drop for AbandonUnlessRecorded {
    fn drop(&mut self) {
        let _ = self.0.state.compare_exchange(
            ENQUEUEING,
            ABANDONED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// A collective the watchdog follows.
pub(super) struct Issued {
    pub(super) kind: &'static str,
    pub(super) bytes: usize,
    pub(super) group: Arc<str>,
    pub(super) end: Arc<EndMark>,
}

impl InFlight for Issued {
    fn finished(&self) -> std::result::Result<bool, String> {
        match self.end.state.load(Ordering::Acquire) {
            ENQUEUEING => Ok(false),
            RECORDED => self
                .end
                .event
                .try_is_complete()
                .map_err(|e| format!("cuEventQuery: {e:?}")),
            _ => Ok(true),
        }
    }
    fn describe(&self) -> String {
        format!("{} {} B on group {}", self.kind, self.bytes, self.group)
    }
}

/// What the collectives and the watchdog thread of one world share.
pub(super) struct Watch {
    pub(super) dog: Mutex<Watchdog<Issued>>,
    /// Every communicator of the world, in creation order (world first).
    pub(super) comms: Mutex<Vec<Weak<Comm>>>,
    pub(super) rank: usize,
}

impl Watch {
    pub(super) fn follow(&self, work: Issued) {
        // a poisoned queue (a panic while polling) only loses the watchdog
        if let Ok(mut d) = self.dog.lock() {
            d.push(work, Instant::now());
        }
    }

    pub(super) fn register(&self, c: &Arc<Comm>) {
        if let Ok(mut v) = self.comms.lock() {
            v.retain(|w| w.strong_count() > 0);
            v.push(Arc::downgrade(c));
        }
    }

    /// The communicators still alive.
    pub(super) fn live(&self) -> Vec<Arc<Comm>> {
        match self.comms.lock() {
            Ok(v) => v.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// One watchdog step: the failure to act on, if any.
    pub(super) fn poll(&self) -> Option<Failure> {
        // `live` may hold the last reference to a communicator being dropped
        // meanwhile: it is then destroyed here, after the queue is released
        let comms = self.live();
        let mut dog = self.dog.lock().ok()?;
        dog.poll(Instant::now(), || async_error(&comms))
    }

    /// Acts on `f`: logs it, records it as the backend's fault (before
    /// anything returns early because of the abort) and aborts every
    /// communicator ([`abort_all`]).
    pub(super) fn fail(&self, f: &Failure, fault: &OnceLock<String>, timeout: Duration) {
        let msg = f.to_string();
        tracing::error!(
            rank = self.rank,
            timeout_s = timeout.as_secs_f64(),
            "{msg}; aborting this rank's NCCL communicators"
        );
        let _ = fault.set(msg);
        abort_all(&self.live());
    }
}

/// NCCL's own error state of each communicator, first error first.
pub(super) fn async_error(comms: &[Arc<Comm>]) -> Option<String> {
    for c in comms {
        if c.aborted.load(Ordering::Acquire) {
            continue;
        }
        // the owner is enqueueing: ask next step
        let Ok(_g) = c.lock.try_lock() else {
            continue;
        };
        let mut state = sys::ncclResult_t::ncclSuccess;
        tracing::trace!("NCCL watchdog: ncclCommGetAsyncError on group {}", c.name);
        // SAFETY: `raw` is alive (not aborted, and `c` holds it) and `state`
        // is a valid out pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(c.raw, &mut state) };
        if !is_ok(r) {
            return Some(nccl_message(
                r,
                &format!("ncclCommGetAsyncError (group {})", c.name),
                Some(c.raw),
            ));
        }
        if !is_ok(state) {
            return Some(nccl_message(
                state,
                &format!("communicator of group {}", c.name),
                Some(c.raw),
            ));
        }
    }
    None
}

/// `c`'s enqueue lock if its owner lets go within [`ABORT_LOCK_WAIT`]
/// (it then finds the fault and enqueues nothing more); `None` otherwise, as
/// a thread blocked inside NCCL on a dead peer is what the abort is there to
/// release.
pub(super) fn lock_for_abort(c: &Comm) -> Option<MutexGuard<'_, ()>> {
    let until = Instant::now() + ABORT_LOCK_WAIT;
    loop {
        match c.lock.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(TryLockError::WouldBlock) => {
                tracing::warn!(
                    "NCCL watchdog: group {} is busy in NCCL; aborting it anyway",
                    c.name
                );
                return None;
            }
        }
    }
}

/// Aborts every communicator in `comms` with `ncclCommAbort`, all in one
/// NCCL group. The group matters: each abort first raises its
/// communicator's abort flag (which makes its kernels exit) and then frees
/// its resources, which waits for the device; every communicator queues its
/// kernels on the one communication stream, so freeing one while another's
/// kernel still spins (its flag not yet raised) would wait forever. Inside a
/// group NCCL raises every flag at the call and frees at `ncclGroupEnd`.
///
/// The enqueue locks are held while the communicators are marked aborted and
/// the flags raised, and released before `ncclGroupEnd`: freeing waits for
/// the peers to close their connections to this rank's proxy (NCCL's proxy
/// thread outlives its communicator until they do), which a hung peer never
/// does, and the owner must meanwhile find the fault, not wait on a lock.
pub(super) fn abort_all(comms: &[Arc<Comm>]) {
    let guards: Vec<_> = comms.iter().map(|c| lock_for_abort(c)).collect();
    let todo: Vec<&Arc<Comm>> = comms
        .iter()
        .filter(|c| !c.aborted.swap(true, Ordering::AcqRel))
        .collect();
    if todo.is_empty() {
        return;
    }
    // SAFETY: no arguments; closed by the ncclGroupEnd below.
    if let Err(e) = check(unsafe { sys::ncclGroupStart() }, "ncclGroupStart", None) {
        tracing::warn!("{e}; aborting the communicators one by one");
    }
    for c in &todo {
        // SAFETY: `raw` is alive (`comms` holds it, it was not aborted
        // before) and never used again (every use checks `aborted` or the
        // fault, both set before this).
        let r = unsafe { sys::ncclCommAbort(c.raw) };
        if let Err(e) = check(r, &format!("ncclCommAbort (group {})", c.name), None) {
            tracing::warn!("{e}");
        }
    }
    drop(guards);
    tracing::info!(
        "NCCL watchdog: abort flags raised on {} communicators; freeing them \
         (waits for the peers to close their connections)",
        todo.len()
    );
    // SAFETY: closes the group opened above (a failed start leaves depth 0,
    // where ncclGroupEnd reports an error and does nothing).
    match check(unsafe { sys::ncclGroupEnd() }, "ncclGroupEnd (abort)", None) {
        Ok(()) => tracing::info!("NCCL watchdog: communicators aborted and freed"),
        Err(e) => tracing::warn!("{e}"),
    }
}

/// How long dropping a world waits for a watchdog thread that is still
/// freeing aborted communicators ([`abort_all`]: it waits for the peers)
/// before leaving it to finish alone (or to end with the process).
pub(super) const WATCH_JOIN_WAIT: Duration = Duration::from_secs(10);

/// The watchdog thread of a world: stopped and joined on drop.
pub(super) struct WatchThread {
    pub(super) stop: Option<mpsc::Sender<()>>,
    /// Disconnected when the thread's closure returns.
    pub(super) ended: mpsc::Receiver<()>,
    pub(super) handle: Option<std::thread::JoinHandle<()>>,
}

impl WatchThread {
    pub(super) fn spawn(
        watch: Arc<Watch>,
        ctx: Arc<CudaContext>,
        fault: Arc<OnceLock<String>>,
        timeout: Duration,
    ) -> Result<WatchThread> {
        let (stop, stopped) = mpsc::channel::<()>();
        let (ending, ended) = mpsc::channel::<()>();
        let every = watchdog::poll_interval(timeout);
        let handle = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", watch.rank))
            .spawn(move || {
                let _ending = ending;
                // cuEventQuery and NCCL need the GPU's context on this thread
                if let Err(e) = ctx.bind_to_thread() {
                    tracing::error!(
                        "NCCL watchdog: bind the CUDA context: {e:?}; collectives are not watched"
                    );
                    return;
                }
                let mut reported = Instant::now();
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    if reported.elapsed() >= Duration::from_secs(1) {
                        reported = Instant::now();
                        let n = watch.dog.lock().map(|d| d.len()).unwrap_or(0);
                        tracing::debug!(
                            rank = watch.rank,
                            "NCCL watchdog: {n} collectives in flight"
                        );
                    }
                    if let Some(f) = watch.poll() {
                        watch.fail(&f, &fault, timeout);
                        return;
                    }
                }
            })
            .map_err(|e| Error::io("start the NCCL watchdog thread", e))?;
        Ok(WatchThread {
            stop: Some(stop),
            ended,
            handle: Some(handle),
        })
    }
}

impl Drop for WatchThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        let Some(h) = self.handle.take() else {
            return;
        };
        // a poll ends within its interval; freeing aborted communicators
        // can take until the peers are gone
        if let Err(mpsc::RecvTimeoutError::Timeout) = self.ended.recv_timeout(WATCH_JOIN_WAIT) {
            tracing::warn!(
                "the NCCL watchdog is still freeing the aborted communicators after {} s \
                 (NCCL waits for the peer ranks to close their connections); leaving it",
                WATCH_JOIN_WAIT.as_secs()
            );
            return;
        }
        if h.join().is_err() {
            tracing::warn!("the NCCL watchdog thread panicked");
        }
    }
}

/// `ncclCommGetAsyncError` and `ncclCommAbort` are in the loaded libnccl
/// (cudarc panics on a missing symbol at its first call, so look first).
pub(super) fn require_watchdog_symbols() -> Result<()> {
    let lib = library()?;
    // SAFETY: `library()` succeeded, so cudarc's loader resolves libnccl and
    // `culib` returns it without reaching its panic; the symbols are only looked up.
    let h = unsafe { sys::culib() };
    for name in ["ncclCommGetAsyncError", "ncclCommAbort"] {
        let sym = format!("{name}\0");
        if let Err(e) = unsafe { h.get::<*const c_void>(sym.as_bytes()) } {
            return Err(Error::LibraryMissing(format!(
                "{} lacks {name} ({e}), which the NCCL watchdog needs; set UPIPE_NCCL_LIB to NCCL 2.18 or newer, \
                 or {}=0 to run without the watchdog",
                lib.path.display(),
                watchdog::TIMEOUT_VAR
            )));
        }
    }
    Ok(())
}
