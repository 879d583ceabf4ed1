//! One group of an NCCL mesh: the collectives, queued on the backend's
//! stream and followed by the watchdog.

use super::comm::{Comm, drv, drv_bind, fault_check, lock};
use super::exchange_window::{self, ExchangeWindow};
use super::library::{check, native_alltoall, nccl_dtype};
use super::watch::{AbandonUnlessRecorded, ENQUEUEING, EndMark, Issued, RECORDED, Watch};
use crate::backend::cuda::CudaBackend;
use crate::backend::{DType, Tensor};
use crate::comm::{Pending, ProcessGroup};
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// One group of an [`NcclWorld`] mesh.
pub(super) struct NcclGroup {
    pub(super) backend: Arc<CudaBackend>,
    pub(super) comm: Arc<Comm>,
    pub(super) me: usize,
    pub(super) size: usize,
    pub(super) watch: Option<Arc<Watch>>,
    /// Where its all-to-all buffers come from when they move on copy
    /// engines (`UPIPE_CE_EXCHANGE_MB`, Ulysses groups only).
    pub(super) window: Option<Arc<ExchangeWindow>>,
}

/// A communicator config of NCCL 2.28's layout with every field unset but
/// the CTA policy: zero-CTA, so that collectives NCCL can run on copy
/// engines do (the rest keep their kernels).
pub(super) fn zero_cta_config() -> sys::ncclConfig_t {
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
pub(super) struct GroupCall(bool);

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
    fn join(&self, done: Arc<EndMark>) -> crate::comm::Join {
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

    /// One NCCL group of an `ncclSend` to `to` for each of `send` and an
    /// `ncclRecv` from `from` for each of `recv`, either side left out when
    /// its peer is `None` (the ring's direct shifts).
    fn shift_queued(
        &self,
        send: &[&Tensor<CudaBackend>],
        to: Option<usize>,
        recv: &mut [Tensor<CudaBackend>],
        from: Option<usize>,
    ) -> Result<()> {
        let to = to.map(|r| self.peer(r, "shift")).transpose()?;
        let from = from.map(|r| self.peer(r, "shift")).transpose()?;
        if to.is_none() && from.is_none() {
            return Ok(());
        }
        drv_bind(&self.backend)?;
        let _g = lock(&self.comm)?;
        let c = self.comm.raw;
        let g = GroupCall::start()?;
        // SAFETY: whole tensors, stream-ordered; sizes must match the peer's
        // (NCCL truncation is reported as an error by NCCL itself).
        unsafe {
            for t in send.iter().filter(|_| to.is_some()) {
                let (dt, peer) = (nccl_dtype(t.dtype()), to.expect("filtered"));
                let r = sys::ncclSend(self.ptr(t), t.numel(), dt, peer, c, self.stream());
                check(r, "ncclSend", Some(c))?;
            }
            for t in recv.iter_mut().filter(|_| from.is_some()) {
                let (dt, peer) = (nccl_dtype(t.dtype()), from.expect("filtered"));
                let r = sys::ncclRecv(self.ptr(t), t.numel(), dt, peer, c, self.stream());
                check(r, "ncclRecv", Some(c))?;
            }
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
        crate::comm::same_count(&send, &recv)?;
        let bytes = send.iter().map(|t| t.bytes()).sum();
        let done = self.issue("send_recv", bytes, || {
            for (s, r) in send.iter().zip(recv.iter_mut()) {
                self.send_recv_queued(s, to, r, from)?;
            }
            Ok(())
        })?;
        Ok(Pending::in_flight(recv, send, Some(self.join(done))))
    }
    unsafe fn start_shift_from(
        &self,
        send: &[&Tensor<CudaBackend>],
        to: Option<usize>,
        mut recv: Vec<Tensor<CudaBackend>>,
        from: Option<usize>,
    ) -> Result<Pending<CudaBackend>> {
        if to.is_none() && from.is_none() {
            return Ok(Pending::in_flight(recv, Vec::new(), None));
        }
        let bytes = send
            .iter()
            .filter(|_| to.is_some())
            .map(|t| t.bytes())
            .sum();
        let done = self.issue("shift", bytes, || {
            self.shift_queued(send, to, &mut recv, from)
        })?;
        // `send` is the caller's until the join (this function's contract)
        Ok(Pending::in_flight(recv, Vec::new(), Some(self.join(done))))
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
