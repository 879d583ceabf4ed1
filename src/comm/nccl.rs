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

use super::env::DistEnv;
use super::rendezvous::Rendezvous;
use super::{GroupKind, Mesh, MeshShape, Pending, ProcessGroup};
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::libs::{self, Lib, LoadedLib};
use crate::backend::{DType, Tensor};
use crate::error::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::sys;
use std::ffi::{CStr, c_void};
use std::sync::{Arc, Mutex};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Loads libnccl (once per process) and returns where it came from.
pub fn library() -> Result<&'static LoadedLib> {
    libs::load(Lib::Nccl)
}

/// Converts an NCCL result into ours: the call, NCCL's string for the code,
/// and (when a communicator is known) its last error message.
fn check(r: sys::ncclResult_t, what: &str, comm: Option<sys::ncclComm_t>) -> Result<()> {
    if matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    ) {
        return Ok(());
    }
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
    Err(Error::Comm(msg))
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

/// An owned communicator; destroyed on drop.
struct Comm {
    raw: sys::ncclComm_t,
    /// The stream its collectives run on: drained before the communicator
    /// is destroyed, so no transfer is in flight then.
    stream: Arc<CudaStream>,
    /// Serialises enqueueing (NCCL communicators are not thread-safe).
    lock: Mutex<()>,
}

// SAFETY: the handle is only used under `lock`, and NCCL allows a
// communicator to be used from any thread as long as calls do not overlap.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
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

/// This process's world communicator on its GPU; builds meshes.
pub struct NcclWorld {
    backend: Arc<CudaBackend>,
    /// The world communicator; its stream is the one every collective of
    /// this process runs on, ordered against the compute stream by events.
    comm: Arc<Comm>,
    rank: usize,
    size: usize,
}

impl NcclWorld {
    /// Joins the world of `env` on `backend`'s GPU: loads libnccl (logging the
    /// file), exchanges the unique id through `rv` and initialises the
    /// communicator. Collective over all ranks.
    pub fn connect(
        env: &DistEnv,
        rv: &mut Rendezvous,
        backend: Arc<CudaBackend>,
    ) -> Result<NcclWorld> {
        let lib = library()?;
        tracing::info!(rank = env.rank, "NCCL: {}", lib.describe());
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
        // pay: docs/multi-gpu.md); collectives not beside compute are unaffected
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
        let comm = Arc::new(Comm {
            raw,
            stream: comm_stream,
            lock: Mutex::new(()),
        });
        Ok(NcclWorld {
            backend,
            comm,
            rank: env.rank,
            size: env.world_size,
        })
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
        drv_bind(&self.backend)?;
        let mut groups = Vec::new();
        for spec in split_specs(shape, self.rank)? {
            let mut raw: sys::ncclComm_t = std::ptr::null_mut();
            let _g = lock(&self.comm)?;
            // SAFETY: the world communicator is valid; a null config inherits
            // the parent's; every rank makes the same sequence of splits.
            check(
                unsafe {
                    sys::ncclCommSplit(
                        self.comm.raw,
                        spec.color,
                        spec.key,
                        &mut raw,
                        std::ptr::null_mut(),
                    )
                },
                &format!("ncclCommSplit ({:?} group {:?})", spec.kind, spec.members),
                Some(self.comm.raw),
            )?;
            if raw.is_null() {
                return Err(Error::Comm(format!(
                    "NCCL returned no communicator for the {:?} group {:?}",
                    spec.kind, spec.members
                )));
            }
            groups.push(self.group(
                Arc::new(Comm {
                    raw,
                    stream: self.comm.stream.clone(),
                    lock: Mutex::new(()),
                }),
                spec.members,
            ));
        }
        let mut it = groups.into_iter();
        let mut next = || it.next().expect("four splits");
        let (ulysses, ring, context, data) = (next(), next(), next(), next());
        Ok(Mesh {
            shape,
            rank: self.rank,
            world: self.group(self.comm.clone(), (0..self.size).collect()),
            ulysses,
            ring,
            context,
            data,
        })
    }

    fn group(&self, comm: Arc<Comm>, members: Vec<usize>) -> Box<dyn ProcessGroup<CudaBackend>> {
        let me = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("split_specs puts the rank in its groups");
        Box::new(NcclGroup {
            backend: self.backend.clone(),
            comm,
            me,
            size: members.len(),
        })
    }
}

fn drv_bind(b: &CudaBackend) -> Result<()> {
    b.context()
        .bind_to_thread()
        .map_err(|e| Error::Backend(format!("CUDA driver: bind context: {e:?}")))
}

fn lock(c: &Comm) -> Result<std::sync::MutexGuard<'_, ()>> {
    c.lock
        .lock()
        .map_err(|_| Error::Comm("an NCCL communicator was poisoned by a panic".into()))
}

/// One group of an [`NcclWorld`] mesh.
struct NcclGroup {
    backend: Arc<CudaBackend>,
    comm: Arc<Comm>,
    me: usize,
    size: usize,
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
    /// their end. No host synchronisation.
    fn issue(
        &self,
        kind: &'static str,
        bytes: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<CudaEvent> {
        drv_bind(&self.backend)?;
        let ready = drv(self.backend.stream().record_event(None), "record event")?;
        drv(self.comm.stream.wait(&ready), "stream wait")?;
        {
            let _span = self
                .backend
                .profile()
                .span_shaped(kind, &self.comm.stream, || format!("{bytes} B"))?;
            f()?;
        }
        drv(self.comm.stream.record_event(None), "record event")
    }

    /// What makes the compute stream wait for transfers ending at `done`
    /// (for a [`Pending`]; no host synchronisation).
    fn join(&self, done: CudaEvent) -> super::Join {
        let compute = self.backend.stream().clone();
        Box::new(move || drv(compute.wait(&done), "stream wait"))
    }

    /// `issue`, then orders the compute stream after the transfers.
    fn ordered(
        &self,
        kind: &'static str,
        bytes: usize,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let done = self.issue(kind, bytes, f)?;
        drv(self.backend.stream().wait(&done), "stream wait")
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
        if self.size == 1 || t.numel() == 0 {
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
            return self.copy_bytes(self.ptr(recv), self.ptr(send), send.bytes());
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
        for (d, r, u) in [(1, 1, 2), (1, 2, 1), (1, 2, 2), (2, 2, 2), (2, 1, 4)] {
            let shape = MeshShape::new(d, r, u).unwrap();
            for rank in 0..shape.world_size() {
                let specs = split_specs(shape, rank).unwrap();
                assert_eq!(specs.len(), 4);
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
