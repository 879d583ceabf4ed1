//! NCCL process groups: one process per GPU.
//!
//! The library is found and opened by [`crate::backend::cuda::libs`] (the
//! same discovery as every other CUDA library; `UPIPE_NCCL_LIB` overrides).
//! Rank 0 creates the 128-byte NCCL unique id and hands it to every rank
//! through the TCP [`Rendezvous`]; every rank then joins the world
//! communicator on its own GPU. The groups of a [`Mesh`] (Ulysses, ring,
//! context, data) are split from the world communicator with
//! `ncclCommSplit` (colour = the group's lowest global rank, key = the rank's
//! position in [`MeshShape::members`]), so their membership and group-rank
//! order are exactly those of the thread-rank meshes.
//!
//! Every collective is queued on the [`CudaBackend`]'s stream, in stream
//! order with the kernels around it; nothing waits on the host. An error
//! returned by NCCL names the call, NCCL's error string and the
//! communicator's last error message.
//!
//! A watchdog thread per [`NcclWorld`] (`UPIPE_NCCL_TIMEOUT_S`, default
//! 600 s, 0 = off; policy in [`super::watchdog`]) follows every issued
//! collective by its end event (`cuEventQuery`) and every communicator by
//! `ncclCommGetAsyncError`. When a collective outlives the timeout or NCCL
//! reports an error it logs which collective of which group, records the
//! failure in the backend's [`CudaBackend::comm_fault`], and aborts every
//! communicator (`ncclCommAbort`), so NCCL kernels waiting for a dead peer
//! exit and the stream syncs blocked behind them return; from then on every
//! collective, every [`Pending`] wait and every backend sync returns
//! [`Error::Comm`] with the watchdog's message.

use super::env::DistEnv;
use super::exchange_window::{self, ExchangeWindow};
use super::rendezvous::Rendezvous;
use super::watchdog::{self, Failure, InFlight, Watchdog};
use super::{GroupKind, Mesh, MeshShape, Pending, ProcessGroup};
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::libs::{self, Lib, LoadedLib};
use crate::backend::{Backend, DType, Tensor};
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError, Weak, mpsc};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

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

fn is_ok(r: sys::ncclResult_t) -> bool {
    matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    )
}

/// The text of [`check`]'s error.
fn nccl_message(r: sys::ncclResult_t, what: &str, comm: Option<sys::ncclComm_t>) -> String {
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
fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

/// The split of one group out of the world: which colour and key each rank passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSpec {
    pub kind: GroupKind,
    /// Global ranks of the group, in group-rank order.
    pub members: Vec<usize>,
    /// `ncclCommSplit` colour: the group's lowest global rank (unique per group of a kind).
    pub color: i32,
    /// `ncclCommSplit` key: this rank's position in `members`.
    pub key: i32,
}

/// The splits `rank` performs, in the order every rank performs them.
pub fn split_specs(shape: MeshShape, rank: usize) -> Result<Vec<SplitSpec>> {
    if rank >= shape.world_size() {
        return Err(Error::Config(format!(
            "rank {rank} is outside a mesh of {} ranks",
            shape.world_size()
        )));
    }
    [
        GroupKind::Ulysses,
        GroupKind::Ring,
        GroupKind::Context,
        GroupKind::Data,
        GroupKind::Shard,
        GroupKind::Replica,
    ]
    .into_iter()
    .map(|kind| {
        let members = shape.members(kind, rank);
        let pos = members
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| Error::Comm(format!("rank {rank} missing from its {kind:?} group")))?;
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| Error::Config(format!("rank {x} exceeds NCCL's int")))
        };
        Ok(SplitSpec {
            kind,
            color: int(members[0])?,
            key: int(pos)?,
            members,
        })
    })
    .collect()
}

/// Hands rank 0's NCCL unique id to every rank. `make_id` runs on rank 0 only.
pub fn exchange_unique_id(
    rv: &mut Rendezvous,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES]>,
) -> Result<[u8; UNIQUE_ID_BYTES]> {
    let mine = if rv.rank() == 0 {
        Some(make_id()?)
    } else {
        None
    };
    let got = rv.broadcast_bytes(mine.as_ref().map(|m| &m[..]))?;
    got.as_slice().try_into().map_err(|_| {
        Error::Comm(format!(
            "rank {}: received a {}-byte NCCL id from rank 0, expected {UNIQUE_ID_BYTES}",
            rv.rank(),
            got.len()
        ))
    })
}

/// A new NCCL unique id (rank 0 only).
fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    library()?;
    let mut id = sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a valid out pointer; the library is loaded.
    check(
        unsafe { sys::ncclGetUniqueId(&mut id) },
        "ncclGetUniqueId",
        None,
    )?;
    Ok(id.internal.map(|c| c as u8))
}

/// Whether an NCCL version string (`2.28.3`) has `ncclCommSplit` (2.18+).
fn supports_split(version: &str) -> bool {
    at_least(version, (2, 18))
}

/// Whether an NCCL version string (`2.28.3`) has `ncclAlltoAll` (2.28+).
fn supports_alltoall(version: &str) -> bool {
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
fn native_alltoall() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        let off = std::env::var("UPIPE_NCCL_ALLTOALL").is_ok_and(|v| v == "0");
        let version = library().ok().and_then(|l| l.api_version.clone());
        !off && version.is_some_and(|v| supports_alltoall(&v))
    })
}

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
    lock: Mutex<()>,
    /// The backend's communication fault: once set, nothing is enqueued.
    fault: Arc<OnceLock<String>>,
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
    fn new(
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

/// Capacity of the watchdog's queue (see [`Watchdog::push`] for a full one).
const WATCH_CAPACITY: usize = 4096;

/// How long the watchdog waits for a communicator's enqueue lock before
/// aborting it anyway (a thread stuck inside NCCL holds it forever).
const ABORT_LOCK_WAIT: Duration = Duration::from_secs(2);

/// End of an issued collective: an event recorded on the communication
/// stream after its transfers, once they are all enqueued.
struct EndMark {
    event: CudaEvent,
    state: AtomicU8,
}

/// [`EndMark::state`]: being enqueued (not finished, whatever the event says).
const ENQUEUEING: u8 = 0;
/// [`EndMark::state`]: the event is recorded; it tells.
const RECORDED: u8 = 1;
/// [`EndMark::state`]: enqueueing failed, nothing to wait for.
const ABANDONED: u8 = 2;

/// Marks an [`EndMark`] abandoned if it is dropped before being recorded.
struct AbandonUnlessRecorded(Arc<EndMark>);

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
struct Issued {
    kind: &'static str,
    bytes: usize,
    group: Arc<str>,
    end: Arc<EndMark>,
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
struct Watch {
    dog: Mutex<Watchdog<Issued>>,
    /// Every communicator of the world, in creation order (world first).
    comms: Mutex<Vec<Weak<Comm>>>,
    rank: usize,
}

impl Watch {
    fn follow(&self, work: Issued) {
        // a poisoned queue (a panic while polling) only loses the watchdog
        if let Ok(mut d) = self.dog.lock() {
            d.push(work, Instant::now());
        }
    }

    fn register(&self, c: &Arc<Comm>) {
        if let Ok(mut v) = self.comms.lock() {
            v.retain(|w| w.strong_count() > 0);
            v.push(Arc::downgrade(c));
        }
    }

    /// The communicators still alive.
    fn live(&self) -> Vec<Arc<Comm>> {
        match self.comms.lock() {
            Ok(v) => v.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// One watchdog step: the failure to act on, if any.
    fn poll(&self) -> Option<Failure> {
        // `live` may hold the last reference to a communicator being dropped
        // meanwhile: it is then destroyed here, after the queue is released
        let comms = self.live();
        let mut dog = self.dog.lock().ok()?;
        dog.poll(Instant::now(), || async_error(&comms))
    }

    /// Acts on `f`: logs it, records it as the backend's fault (before
    /// anything returns early because of the abort) and aborts every
    /// communicator ([`abort_all`]).
    fn fail(&self, f: &Failure, fault: &OnceLock<String>, timeout: Duration) {
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
fn async_error(comms: &[Arc<Comm>]) -> Option<String> {
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
fn lock_for_abort(c: &Comm) -> Option<MutexGuard<'_, ()>> {
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
fn abort_all(comms: &[Arc<Comm>]) {
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
const WATCH_JOIN_WAIT: Duration = Duration::from_secs(10);

/// The watchdog thread of a world: stopped and joined on drop.
struct WatchThread {
    stop: Option<mpsc::Sender<()>>,
    /// Disconnected when the thread's closure returns.
    ended: mpsc::Receiver<()>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl WatchThread {
    fn spawn(
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
fn require_watchdog_symbols() -> Result<()> {
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

/// This process's world communicator on its GPU; builds meshes.
pub struct NcclWorld {
    backend: Arc<CudaBackend>,
    /// The world communicator; its stream is the one every collective of
    /// this process runs on, ordered against the compute stream by events.
    comm: Arc<Comm>,
    rank: usize,
    size: usize,
    /// Ranks per node (consecutive global ranks share a node).
    local_world_size: usize,
    /// The collectives and communicators the watchdog follows (`None`: off).
    watch: Option<Arc<Watch>>,
    /// Its thread, stopped and joined first on drop.
    watch_thread: Option<WatchThread>,
    timeout: Option<Duration>,
}

impl NcclWorld {
    /// Joins the world of `env` on `backend`'s GPU: loads libnccl (logging the
    /// file), exchanges the unique id through `rv` and initialises the
    /// communicator. Collective over all ranks. Starts the watchdog unless
    /// `UPIPE_NCCL_TIMEOUT_S=0` (a bad value is an error here).
    pub fn connect(
        env: &DistEnv,
        rv: &mut Rendezvous,
        backend: Arc<CudaBackend>,
    ) -> Result<NcclWorld> {
        let lib = library()?;
        tracing::info!(rank = env.rank, "NCCL: {}", lib.describe());
        let timeout = watchdog::timeout_from_env()?;
        if timeout.is_some() {
            require_watchdog_symbols()?;
        }
        if let Some(v) = &lib.api_version
            && !supports_split(v)
        {
            return Err(Error::LibraryMissing(format!(
                "NCCL {v} at {} lacks ncclCommSplit (needs 2.18 or newer); set UPIPE_NCCL_LIB to a newer libnccl.so.2",
                lib.path.display()
            )));
        }
        if rv.world_size() != env.world_size || rv.rank() != env.rank {
            return Err(Error::Comm(format!(
                "rendezvous is rank {}/{} but the environment says {}/{}",
                rv.rank(),
                rv.world_size(),
                env.rank,
                env.world_size
            )));
        }
        let id = exchange_unique_id(rv, new_unique_id)?;
        let nranks = i32::try_from(env.world_size)
            .map_err(|_| Error::Config("world size exceeds NCCL's int".into()))?;
        drv_bind(&backend)?;
        // the highest priority the device has, so that beside compute
        // (`--overlap`) the block scheduler prefers NCCL's blocks to the
        // compute kernels' pending ones (on 2×H200 this did not make overlap
        // pay: docs/results-log.md); collectives not beside compute are unaffected
        let (_, greatest) = drv(
            cudarc::driver::result::stream::get_priority_range(),
            "stream priority range",
        )?;
        let comm_stream = drv(
            backend.context().new_stream_with_priority(greatest),
            "create the communication stream",
        )?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `raw` is a valid out pointer, the context of the backend's
        // GPU is current, and every rank passes the same id and world size.
        check(
            unsafe { sys::ncclCommInitRank(&mut raw, nranks, uid, env.rank as i32) },
            "ncclCommInitRank (world)",
            None,
        )?;
        let fault = backend.comm_fault().clone();
        let comm = Arc::new(Comm::new(raw, "world", comm_stream, fault.clone()));
        let (watch, thread) = match timeout {
            None => {
                tracing::info!(
                    rank = env.rank,
                    "NCCL watchdog off ({}=0)",
                    watchdog::TIMEOUT_VAR
                );
                (None, None)
            }
            Some(t) => {
                let watch = Arc::new(Watch {
                    dog: Mutex::new(Watchdog::new(t, WATCH_CAPACITY)),
                    comms: Mutex::new(Vec::new()),
                    rank: env.rank,
                });
                watch.register(&comm);
                let thread =
                    WatchThread::spawn(watch.clone(), backend.context().clone(), fault, t)?;
                (Some(watch), Some(thread))
            }
        };
        Ok(NcclWorld {
            backend,
            comm,
            rank: env.rank,
            size: env.world_size,
            local_world_size: env.local_world_size,
            watch,
            watch_thread: thread,
            timeout,
        })
    }

    /// The watchdog's timeout (`None`: off).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// `Err` with the watchdog's message once it has failed a collective
    /// (the same error every later collective and sync returns).
    pub fn health(&self) -> Result<()> {
        fault_check(self.backend.comm_fault())
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend the communicators run on.
    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.backend
    }

    /// The process groups of `shape` for this rank, split from the world
    /// communicator. Collective over all ranks (all must pass the same shape).
    pub fn mesh(&self, shape: MeshShape) -> Result<Mesh<CudaBackend>> {
        if shape.world_size() != self.size {
            return Err(Error::Config(format!(
                "a {}x{}x{} mesh needs {} ranks but {} were launched (data x ring x ulysses)",
                shape.data,
                shape.ring,
                shape.ulysses,
                shape.world_size(),
                self.size
            )));
        }
        let window_bytes = exchange_window::size_from_env()?;
        if window_bytes.is_some() && !native_alltoall() {
            let version = library()?.api_version.clone().unwrap_or_default();
            return Err(Error::Config(format!(
                "{} needs ncclAlltoAll (copy engines): NCCL 2.28 or newer (this is {version:?}; \
                 UPIPE_NCCL_LIB picks another libnccl.so.2) and UPIPE_NCCL_ALLTOALL not 0; \
                 or unset {}",
                exchange_window::SIZE_VAR,
                exchange_window::SIZE_VAR
            )));
        }
        drv_bind(&self.backend)?;
        let mut groups = Vec::new();
        for spec in split_specs(shape, self.rank)? {
            let mut raw: sys::ncclComm_t = std::ptr::null_mut();
            // the Ulysses group moves its all-to-alls on copy engines when
            // it has an exchange window (zero-CTA policy)
            let window =
                window_bytes.filter(|_| spec.kind == GroupKind::Ulysses && spec.members.len() > 1);
            if window.is_some() && !exchange_window::one_node(&spec.members, self.local_world_size)
            {
                return Err(Error::Config(format!(
                    "{} needs each Ulysses group on one node (copy engines reach NVLink peers only), \
                     but group {:?} spans nodes of {} ranks; unset it or keep --ulysses within a node",
                    exchange_window::SIZE_VAR,
                    spec.members,
                    self.local_world_size
                )));
            }
            let mut config = window.map(|_| zero_cta_config());
            let config_ptr = config
                .as_mut()
                .map_or(std::ptr::null_mut(), |c| c as *mut sys::ncclConfig_t);
            let world_lock = lock(&self.comm)?;
            // SAFETY: the world communicator is valid; a null config inherits
            // the parent's; every rank makes the same sequence of splits
            // with the same configs.
            check(
                unsafe {
                    sys::ncclCommSplit(self.comm.raw, spec.color, spec.key, &mut raw, config_ptr)
                },
                &format!("ncclCommSplit ({:?} group {:?})", spec.kind, spec.members),
                Some(self.comm.raw),
            )?;
            drop(world_lock);
            if raw.is_null() {
                return Err(Error::Comm(format!(
                    "NCCL returned no communicator for the {:?} group {:?}",
                    spec.kind, spec.members
                )));
            }
            let name = format!(
                "{} {:?}",
                format!("{:?}", spec.kind).to_lowercase(),
                spec.members
            );
            let comm = Arc::new(Comm::new(
                raw,
                &name,
                self.comm.stream.clone(),
                self.backend.comm_fault().clone(),
            ));
            // A communicator of one rank has no peer to fail, and on the
            // 2xH200 run (NCCL 2.28.3) the watchdog's first
            // ncclCommGetAsyncError on a fresh one-rank split never returned:
            // its collectives are still timed by their end events.
            if let Some(w) = self.watch.as_ref().filter(|_| spec.members.len() > 1) {
                w.register(&comm);
            }
            let window = match window {
                Some(bytes) => Some(ExchangeWindow::register(
                    comm.clone(),
                    self.backend.clone(),
                    bytes,
                )?),
                None => None,
            };
            groups.push(self.group_with_window(comm, spec.members, window));
        }
        let mut it = groups.into_iter();
        let mut next = || it.next().expect("six splits");
        let (ulysses, ring, context, data) = (next(), next(), next(), next());
        let (shard, replica) = (next(), next());
        Ok(Mesh {
            shape,
            rank: self.rank,
            world: self.group(self.comm.clone(), (0..self.size).collect()),
            ulysses,
            ring,
            context,
            data,
            shard,
            replica,
        })
    }

    fn group(&self, comm: Arc<Comm>, members: Vec<usize>) -> Box<dyn ProcessGroup<CudaBackend>> {
        self.group_with_window(comm, members, None)
    }

    fn group_with_window(
        &self,
        comm: Arc<Comm>,
        members: Vec<usize>,
        window: Option<Arc<ExchangeWindow>>,
    ) -> Box<dyn ProcessGroup<CudaBackend>> {
        let me = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("split_specs puts the rank in its groups");
        Box::new(NcclGroup {
            backend: self.backend.clone(),
            comm,
            me,
            size: members.len(),
            watch: self.watch.clone(),
            window,
        })
    }
}

impl Drop for NcclWorld {
    fn drop(&mut self) {
        // stop watching before the communicators go
        drop(self.watch_thread.take());
    }
}

/// `Err` with the recorded communication fault, if there is one.
fn fault_check(fault: &OnceLock<String>) -> Result<()> {
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

/// One group of an [`NcclWorld`] mesh.
struct NcclGroup {
    backend: Arc<CudaBackend>,
    comm: Arc<Comm>,
    me: usize,
    size: usize,
    watch: Option<Arc<Watch>>,
    /// Where its all-to-all buffers come from when they move on copy
    /// engines (`UPIPE_CE_EXCHANGE_MB`, Ulysses groups only).
    window: Option<Arc<ExchangeWindow>>,
}

/// A communicator config of NCCL 2.28's layout with every field unset but
/// the CTA policy: zero-CTA, so that collectives NCCL can run on copy
/// engines do (the rest keep their kernels).
fn zero_cta_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: exchange_window::NCCL_CTA_POLICY_ZERO,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// A grouped NCCL call in flight: `ncclGroupEnd` runs even on early error.
struct GroupCall(bool);

impl GroupCall {
    fn start() -> Result<GroupCall> {
        // SAFETY: no arguments; pairs with ncclGroupEnd in `end`/drop.
        check(unsafe { sys::ncclGroupStart() }, "ncclGroupStart", None)?;
        Ok(GroupCall(true))
    }
    fn end(mut self, comm: sys::ncclComm_t) -> Result<()> {
        self.0 = false;
        // SAFETY: closes the group opened in `start`.
        check(unsafe { sys::ncclGroupEnd() }, "ncclGroupEnd", Some(comm))
    }
}

impl Drop for GroupCall {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: closes the group opened in `start` on an error path.
            let _ = unsafe { sys::ncclGroupEnd() };
        }
    }
}

impl NcclGroup {
    /// The communication stream, as NCCL takes it.
    fn stream(&self) -> sys::cudaStream_t {
        self.comm.stream.cu_stream() as sys::cudaStream_t
    }

    /// Queues `f`'s transfers on the communication stream after everything
    /// queued so far on the compute stream; returns the event that marks
    /// their end. No host synchronisation: the watchdog follows the
    /// collective from here (pushed before `f`, so a hang inside NCCL's
    /// enqueue is timed too) by that event, queried on its own thread.
    fn issue(
        &self,
        kind: &'static str,
        bytes: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<Arc<EndMark>> {
        fault_check(&self.comm.fault)?;
        drv_bind(&self.backend)?;
        tracing::trace!("issue {kind} {bytes} B on group {}", self.comm.name);
        let end = Arc::new(EndMark {
            event: drv(self.backend.context().new_event(None), "create event")?,
            state: AtomicU8::new(ENQUEUEING),
        });
        let _abandon = AbandonUnlessRecorded(end.clone());
        if let Some(w) = &self.watch {
            w.follow(Issued {
                kind,
                bytes,
                group: self.comm.name.clone(),
                end: end.clone(),
            });
        }
        let ready = drv(self.backend.stream().record_event(None), "record event")?;
        drv(self.comm.stream.wait(&ready), "stream wait")?;
        {
            let _span = self
                .backend
                .profile()
                .span_shaped(kind, &self.comm.stream, || format!("{bytes} B"))?;
            f()?;
        }
        drv(end.event.record(&self.comm.stream), "record event")?;
        end.state.store(RECORDED, Ordering::Release);
        Ok(end)
    }

    /// What makes the compute stream wait for transfers ending at `done`
    /// (for a [`Pending`]; no host synchronisation). `Err` once the
    /// watchdog has failed: what was received is not to be trusted.
    fn join(&self, done: Arc<EndMark>) -> super::Join {
        let compute = self.backend.stream().clone();
        let fault = self.comm.fault.clone();
        Box::new(move || {
            drv(compute.wait(&done.event), "stream wait")?;
            fault_check(&fault)
        })
    }

    /// `issue`, then orders the compute stream after the transfers.
    fn ordered(
        &self,
        kind: &'static str,
        bytes: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let done = self.issue(kind, bytes, f)?;
        drv(self.backend.stream().wait(&done.event), "stream wait")
    }

    fn ptr(&self, t: &Tensor<CudaBackend>) -> *mut c_void {
        self.backend.device_ptr(t) as usize as *mut c_void
    }

    fn same_dtype(
        &self,
        a: &Tensor<CudaBackend>,
        b: &Tensor<CudaBackend>,
        what: &str,
    ) -> Result<sys::ncclDataType_t> {
        if a.dtype() != b.dtype() {
            return Err(Error::Comm(format!(
                "{what}: send is {:?} but receive is {:?}; NCCL moves bytes of one type",
                a.dtype(),
                b.dtype()
            )));
        }
        Ok(nccl_dtype(a.dtype()))
    }

    fn chunk(&self, t: &Tensor<CudaBackend>, what: &str) -> Result<usize> {
        if !t.numel().is_multiple_of(self.size) {
            return Err(Error::Comm(format!(
                "{what}: {} elements do not split into {} equal chunks",
                t.numel(),
                self.size
            )));
        }
        Ok(t.numel() / self.size)
    }

    fn peer(&self, r: usize, what: &str) -> Result<i32> {
        if r >= self.size {
            return Err(Error::Comm(format!(
                "{what}: peer {r} is outside a group of {}",
                self.size
            )));
        }
        Ok(r as i32)
    }

    /// Whether the backend rehearses (`Backend::set_rehearse`): collectives
    /// check their buffers, which are allocated as in a real step, and move
    /// nothing; the events that order them are still recorded.
    fn rehearsing(&self) -> bool {
        self.backend.rehearsing()
    }

    /// Device-to-device copy on the stream (groups of one rank).
    fn copy_bytes(&self, dst: *mut c_void, src: *mut c_void, bytes: usize) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges lie in live tensors of at least `bytes` bytes.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst as u64,
                src as u64,
                bytes,
                self.comm.stream.cu_stream(),
            )
        }
        .map_err(|e| Error::Backend(format!("CUDA driver: device copy: {e:?}")))
    }
}

/// The collectives as queued on the communication stream (callers order
/// them against the compute stream: [`NcclGroup::ordered`]).
impl NcclGroup {
    fn all_to_all_queued(
        &self,
        send: &Tensor<CudaBackend>,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let dt = self.same_dtype(send, recv, "all_to_all")?;
        let n = self.chunk(send, "all_to_all")?;
        if recv.numel() != send.numel() {
            return Err(Error::Comm(
                "all_to_all: send and receive sizes differ".into(),
            ));
        }
        if self.rehearsing() {
            return Ok(());
        }
        let esz = send.dtype().size();
        let (s, r) = (self.ptr(send), self.ptr(recv));
        if self.size == 1 {
            return self.copy_bytes(r, s, n * esz);
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        if native_alltoall() {
            // SAFETY: both buffers hold `size` chunks of `n` elements; they
            // stay alive until the stream has run the transfer.
            return check(
                unsafe { sys::ncclAlltoAll(s, r, n, dt, c, self.stream()) },
                "ncclAlltoAll",
                Some(c),
            );
        }
        // This rank's own chunk is a device copy, not a message to itself.
        let own = self.me * n * esz;
        // SAFETY: chunk `me` lies inside both tensors.
        self.copy_bytes(
            unsafe { (r as *mut u8).add(own) } as *mut c_void,
            unsafe { (s as *mut u8).add(own) } as *mut c_void,
            n * esz,
        )?;
        let g = GroupCall::start()?;
        for j in (0..self.size).filter(|&j| j != self.me) {
            // SAFETY: chunk j of each buffer is n elements inside the tensor;
            // the buffers stay alive until the stream has run the transfer
            // (the pool frees in stream order).
            unsafe {
                let sj = (s as *mut u8).add(j * n * esz) as *const c_void;
                let rj = (r as *mut u8).add(j * n * esz) as *mut c_void;
                check(
                    sys::ncclSend(sj, n, dt, j as i32, c, self.stream()),
                    "ncclSend (all_to_all)",
                    Some(c),
                )?;
                check(
                    sys::ncclRecv(rj, n, dt, j as i32, c, self.stream()),
                    "ncclRecv (all_to_all)",
                    Some(c),
                )?;
            }
        }
        g.end(c)
    }

    fn all_gather_queued(
        &self,
        send: &Tensor<CudaBackend>,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let dt = self.same_dtype(send, recv, "all_gather")?;
        if recv.numel() != send.numel() * self.size {
            return Err(Error::Comm(
                "all_gather: receive must hold size x send".into(),
            ));
        }
        if self.rehearsing() {
            return Ok(());
        }
        if self.size == 1 {
            return self.copy_bytes(self.ptr(recv), self.ptr(send), send.bytes());
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        // SAFETY: sizes checked above; stream-ordered buffers.
        check(
            unsafe {
                sys::ncclAllGather(
                    self.ptr(send),
                    self.ptr(recv),
                    send.numel(),
                    dt,
                    c,
                    self.stream(),
                )
            },
            "ncclAllGather",
            Some(c),
        )
    }

    fn reduce_scatter_queued(
        &self,
        send: &Tensor<CudaBackend>,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        let dt = self.same_dtype(send, recv, "reduce_scatter")?;
        let n = self.chunk(send, "reduce_scatter")?;
        if recv.numel() != n {
            return Err(Error::Comm(
                "reduce_scatter: receive must hold one chunk".into(),
            ));
        }
        if self.rehearsing() {
            return Ok(());
        }
        if self.size == 1 {
            return self.copy_bytes(self.ptr(recv), self.ptr(send), recv.bytes());
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        // SAFETY: sizes checked above; stream-ordered buffers.
        check(
            unsafe {
                sys::ncclReduceScatter(
                    self.ptr(send),
                    self.ptr(recv),
                    n,
                    dt,
                    sys::ncclRedOp_t::ncclSum,
                    c,
                    self.stream(),
                )
            },
            "ncclReduceScatter",
            Some(c),
        )
    }

    fn all_reduce_queued(&self, t: &mut Tensor<CudaBackend>) -> Result<()> {
        if self.size == 1 || t.numel() == 0 || self.rehearsing() {
            return Ok(());
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        let p = self.ptr(t);
        // SAFETY: in-place all-reduce over the tensor's elements.
        check(
            unsafe {
                sys::ncclAllReduce(
                    p,
                    p,
                    t.numel(),
                    nccl_dtype(t.dtype()),
                    sys::ncclRedOp_t::ncclSum,
                    c,
                    self.stream(),
                )
            },
            "ncclAllReduce",
            Some(c),
        )
    }

    fn send_recv_queued(
        &self,
        send: &Tensor<CudaBackend>,
        to: usize,
        recv: &mut Tensor<CudaBackend>,
        from: usize,
    ) -> Result<()> {
        let dt = self.same_dtype(send, recv, "send_recv")?;
        let (to, from) = (self.peer(to, "send_recv")?, self.peer(from, "send_recv")?);
        if self.size == 1 {
            if send.numel() != recv.numel() {
                return Err(Error::Comm(format!(
                    "send_recv: sending {} elements to itself into {}",
                    send.numel(),
                    recv.numel()
                )));
            }
            if self.rehearsing() {
                return Ok(());
            }
            return self.copy_bytes(self.ptr(recv), self.ptr(send), send.bytes());
        }
        if self.rehearsing() {
            return Ok(());
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        let g = GroupCall::start()?;
        // SAFETY: whole tensors, stream-ordered; sizes must match the peer's
        // (NCCL truncation is reported as an error by NCCL itself).
        unsafe {
            check(
                sys::ncclSend(self.ptr(send), send.numel(), dt, to, c, self.stream()),
                "ncclSend",
                Some(c),
            )?;
            check(
                sys::ncclRecv(self.ptr(recv), recv.numel(), dt, from, c, self.stream()),
                "ncclRecv",
                Some(c),
            )?;
        }
        g.end(c)
    }
}

impl ProcessGroup<CudaBackend> for NcclGroup {
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.size
    }
    fn exchange_buffer(
        &self,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Option<Tensor<CudaBackend>>> {
        self.window
            .as_ref()
            .map(|w| w.buffer(shape, dtype))
            .transpose()
    }
    fn in_exchange_window(&self, t: &Tensor<CudaBackend>) -> bool {
        self.window
            .as_ref()
            .is_some_and(|w| w.contains(self.backend.device_ptr(t), t.bytes()))
    }
    fn all_to_all(&self, send: &Tensor<CudaBackend>, recv: &mut Tensor<CudaBackend>) -> Result<()> {
        self.ordered("all_to_all", send.bytes(), || {
            self.all_to_all_queued(send, recv)
        })
    }
    fn start_all_to_all(
        &self,
        send: Tensor<CudaBackend>,
        mut recv: Tensor<CudaBackend>,
    ) -> Result<Pending<CudaBackend>> {
        let done = self.issue("all_to_all", send.bytes(), || {
            self.all_to_all_queued(&send, &mut recv)
        })?;
        Ok(Pending::in_flight(
            vec![recv],
            vec![send],
            Some(self.join(done)),
        ))
    }
    fn start_send_recv(
        &self,
        send: Vec<Tensor<CudaBackend>>,
        to: usize,
        mut recv: Vec<Tensor<CudaBackend>>,
        from: usize,
    ) -> Result<Pending<CudaBackend>> {
        super::same_count(&send, &recv)?;
        let bytes = send.iter().map(|t| t.bytes()).sum();
        let done = self.issue("send_recv", bytes, || {
            for (s, r) in send.iter().zip(recv.iter_mut()) {
                self.send_recv_queued(s, to, r, from)?;
            }
            Ok(())
        })?;
        Ok(Pending::in_flight(recv, send, Some(self.join(done))))
    }
    fn start_all_gather(
        &self,
        send: Tensor<CudaBackend>,
        mut recv: Tensor<CudaBackend>,
    ) -> Result<Pending<CudaBackend>> {
        let done = self.issue("all_gather", send.bytes(), || {
            self.all_gather_queued(&send, &mut recv)
        })?;
        Ok(Pending::in_flight(
            vec![recv],
            vec![send],
            Some(self.join(done)),
        ))
    }
    fn start_reduce_scatter(
        &self,
        send: Tensor<CudaBackend>,
        mut recv: Tensor<CudaBackend>,
    ) -> Result<Pending<CudaBackend>> {
        let done = self.issue("reduce_scatter", send.bytes(), || {
            self.reduce_scatter_queued(&send, &mut recv)
        })?;
        Ok(Pending::in_flight(
            vec![recv],
            vec![send],
            Some(self.join(done)),
        ))
    }
    fn start_all_reduce(&self, mut t: Tensor<CudaBackend>) -> Result<Pending<CudaBackend>> {
        let done = self.issue("all_reduce", t.bytes(), || self.all_reduce_queued(&mut t))?;
        Ok(Pending::in_flight(
            vec![t],
            Vec::new(),
            Some(self.join(done)),
        ))
    }
    fn all_gather(&self, send: &Tensor<CudaBackend>, recv: &mut Tensor<CudaBackend>) -> Result<()> {
        self.ordered("all_gather", send.bytes(), || {
            self.all_gather_queued(send, recv)
        })
    }
    fn reduce_scatter(
        &self,
        send: &Tensor<CudaBackend>,
        recv: &mut Tensor<CudaBackend>,
    ) -> Result<()> {
        self.ordered("reduce_scatter", send.bytes(), || {
            self.reduce_scatter_queued(send, recv)
        })
    }
    fn all_reduce(&self, t: &mut Tensor<CudaBackend>) -> Result<()> {
        self.ordered("all_reduce", t.bytes(), || self.all_reduce_queued(t))
    }
    fn send_recv(
        &self,
        send: &Tensor<CudaBackend>,
        to: usize,
        recv: &mut Tensor<CudaBackend>,
        from: usize,
    ) -> Result<()> {
        self.ordered("send_recv", send.bytes(), || {
            self.send_recv_queued(send, to, recv, from)
        })
    }
}

fn drv<T>(r: std::result::Result<T, cudarc::driver::DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| Error::Backend(format!("CUDA driver: {what}: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn splits_match_mesh_membership() {
        for (d, r, u, replicas) in [
            (1, 1, 2, 1),
            (1, 2, 1, 2),
            (1, 2, 2, 2),
            (2, 2, 2, 4),
            (2, 1, 4, 1),
        ] {
            let shape = MeshShape::new(d, r, u)
                .unwrap()
                .with_fsdp_replicas(replicas)
                .unwrap();
            for rank in 0..shape.world_size() {
                let specs = split_specs(shape, rank).unwrap();
                assert_eq!(specs.len(), 6);
                for s in &specs {
                    assert_eq!(s.members, shape.members(s.kind, rank));
                    assert_eq!(s.members[s.key as usize], rank);
                    // every member of the group passes the same colour and
                    // keys 0..size in member order
                    for (pos, &o) in s.members.iter().enumerate() {
                        let theirs = split_specs(shape, o)
                            .unwrap()
                            .into_iter()
                            .find(|x| x.kind == s.kind)
                            .unwrap();
                        assert_eq!(theirs.color, s.color);
                        assert_eq!(theirs.key as usize, pos);
                    }
                    // ranks outside the group use other colours
                    for o in 0..shape.world_size() {
                        if !s.members.contains(&o) {
                            let theirs = split_specs(shape, o)
                                .unwrap()
                                .into_iter()
                                .find(|x| x.kind == s.kind)
                                .unwrap();
                            assert_ne!(theirs.color, s.color);
                        }
                    }
                }
            }
        }
        assert!(split_specs(MeshShape::new(1, 1, 2).unwrap(), 2).is_err());
    }

    #[test]
    fn unique_id_reaches_every_rank_over_tcp() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = |rank| DistEnv {
            rank,
            world_size: 3,
            local_rank: rank,
            local_world_size: 3,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let id: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let e = env(rank);
                std::thread::spawn(move || {
                    let mut rv = Rendezvous::connect(&e, Duration::from_secs(10))?;
                    exchange_unique_id(&mut rv, || {
                        assert_eq!(rank, 0, "only rank 0 makes the id");
                        Ok(id)
                    })
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
    }

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

    #[test]
    fn id_source_errors_are_reported() {
        let mut rv = Rendezvous::connect(
            &DistEnv {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "127.0.0.1".into(),
                master_port: 1,
            },
            Duration::from_millis(10),
        )
        .unwrap();
        assert_eq!(
            exchange_unique_id(&mut rv, || Ok([9; 128])).unwrap(),
            [9; 128]
        );
        // a failing id source on rank 0 is reported, not panicked on
        let err = exchange_unique_id(&mut rv, || Err(Error::Comm("no nccl".into()))).unwrap_err();
        assert!(err.to_string().contains("no nccl"), "{err}");
    }
}
