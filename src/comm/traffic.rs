//! A process group that records its point-to-point traffic: every tensor it
//! sends to another rank (`send_recv`, `start_send_recv`, `start_shift_from`),
//! with its peer and bytes, passed on to the group it wraps. Tests read it
//! to count what a strategy moves (the zigzag ring's skipped blocks).

use super::{Pending, ProcessGroup};
use crate::backend::{Backend, DType, Tensor};
use crate::error::Result;
use std::sync::Mutex;

/// One tensor sent: the group rank it went to and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub to: usize,
    pub bytes: usize,
}

/// `inner` with its point-to-point sends recorded in call order.
pub struct TrafficGroup<'a, B: Backend> {
    inner: &'a dyn ProcessGroup<B>,
    sent: Mutex<Vec<Sent>>,
}

impl<'a, B: Backend> TrafficGroup<'a, B> {
    pub fn new(inner: &'a dyn ProcessGroup<B>) -> Self {
        TrafficGroup {
            inner,
            sent: Mutex::new(Vec::new()),
        }
    }

    /// Every tensor sent so far, in call order.
    pub fn sent(&self) -> Vec<Sent> {
        self.sent.lock().expect("traffic record poisoned").clone()
    }

    fn record<'t>(&self, to: usize, ts: impl IntoIterator<Item = &'t Tensor<B>>) {
        let mut sent = self.sent.lock().expect("traffic record poisoned");
        sent.extend(ts.into_iter().map(|t| Sent {
            to,
            bytes: t.bytes(),
        }));
    }
}

impl<B: Backend> ProcessGroup<B> for TrafficGroup<'_, B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_to_all(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        self.inner.all_to_all(send, recv)
    }
    fn exchange_buffer(&self, shape: &[usize], dtype: DType) -> Result<Option<Tensor<B>>> {
        self.inner.exchange_buffer(shape, dtype)
    }
    fn in_exchange_window(&self, t: &Tensor<B>) -> bool {
        self.inner.in_exchange_window(t)
    }
    fn start_all_to_all(&self, send: Tensor<B>, recv: Tensor<B>) -> Result<Pending<B>> {
        self.inner.start_all_to_all(send, recv)
    }
    fn all_gather(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        self.inner.all_gather(send, recv)
    }
    fn start_all_gather(&self, send: Tensor<B>, recv: Tensor<B>) -> Result<Pending<B>> {
        self.inner.start_all_gather(send, recv)
    }
    fn start_reduce_scatter(&self, send: Tensor<B>, recv: Tensor<B>) -> Result<Pending<B>> {
        self.inner.start_reduce_scatter(send, recv)
    }
    fn start_all_reduce(&self, t: Tensor<B>) -> Result<Pending<B>> {
        self.inner.start_all_reduce(t)
    }
    fn reduce_scatter(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        self.inner.reduce_scatter(send, recv)
    }
    fn all_reduce(&self, t: &mut Tensor<B>) -> Result<()> {
        self.inner.all_reduce(t)
    }
    fn send_recv(
        &self,
        send: &Tensor<B>,
        to: usize,
        recv: &mut Tensor<B>,
        from: usize,
    ) -> Result<()> {
        self.record(to, [send]);
        self.inner.send_recv(send, to, recv, from)
    }
    fn start_send_recv(
        &self,
        send: Vec<Tensor<B>>,
        to: usize,
        recv: Vec<Tensor<B>>,
        from: usize,
    ) -> Result<Pending<B>> {
        self.record(to, &send);
        self.inner.start_send_recv(send, to, recv, from)
    }
    unsafe fn start_shift_from(
        &self,
        send: &[&Tensor<B>],
        to: Option<usize>,
        recv: Vec<Tensor<B>>,
        from: Option<usize>,
    ) -> Result<Pending<B>> {
        if let Some(to) = to {
            self.record(to, send.iter().copied());
        }
        // SAFETY: the caller's promise, passed on
        unsafe { self.inner.start_shift_from(send, to, recv, from) }
    }
}
