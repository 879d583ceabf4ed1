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
pub mod exchange_window;
mod group;
mod watch;
mod world;

use exchange_window::ExchangeWindow;
use group::*;
use watch::*;
pub use world::NcclWorld;

use super::rendezvous::Rendezvous;
use super::watchdog::{self, Failure, InFlight, Watchdog};
use super::{GroupKind, Mesh, MeshShape, Pending, ProcessGroup};
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::libs::{self, Lib, LoadedLib};
use crate::backend::{DType, Tensor};
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
        DType::U8 => sys::ncclDataType_t::ncclUint8,
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
