//! Handles of asynchronous work: a copy in flight ([`CopyDone`], what a
//! device's copy can be asked: [`InFlight`]) and a point in a device's
//! order of queued work ([`ComputePoint`]).

use crate::error::Result;

/// A copy started by [`Backend::copy_start`]: later device work is ordered
/// after it ([`Backend::copy_wait`], no host wait) or the host waits for it
/// ([`Backend::copy_finish`]); `None`: the copy is done.
pub struct CopyDone(Option<Box<dyn InFlight>>);

/// A point in a device's order of queued work ([`Backend::compute_point`]):
/// the device's own marker (a CUDA event), or none on the CPU.
pub struct ComputePoint(Option<Box<dyn std::any::Any + Send>>);

impl ComputePoint {
    /// No work in flight to follow.
    pub fn none() -> Self {
        ComputePoint(None)
    }
    /// A device's marker.
    pub fn marker(m: Box<dyn std::any::Any + Send>) -> Self {
        ComputePoint(Some(m))
    }
    /// The device's marker, if it is a `T`.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.0.as_ref().and_then(|m| m.downcast_ref::<T>())
    }
}

/// What a device's copy in flight can be asked.
pub trait InFlight: Send {
    /// Makes later work on the device wait for the copy.
    fn join(self: Box<Self>) -> Result<()> {
        self.order()
    }
    /// [`join`](InFlight::join), keeping the copy to wait for later.
    fn order(&self) -> Result<()>;
    /// Blocks the host until the copy is done.
    fn finish(self: Box<Self>) -> Result<()>;
}

impl CopyDone {
    /// A copy that has already finished.
    pub fn finished() -> Self {
        CopyDone(None)
    }
    /// A copy in flight.
    pub fn in_flight(copy: Box<dyn InFlight>) -> Self {
        CopyDone(Some(copy))
    }
    pub(crate) fn join(self) -> Result<()> {
        self.0.map_or(Ok(()), |c| c.join())
    }
    pub(crate) fn order(&self) -> Result<()> {
        self.0.as_ref().map_or(Ok(()), |c| c.order())
    }
    pub(crate) fn finish(self) -> Result<()> {
        self.0.map_or(Ok(()), |c| c.finish())
    }
}
