//! Process groups and collectives over a device mesh.
//!
//! Ranks form a 3-D mesh `data x ring x ulysses` (Ulysses fastest, so a
//! Ulysses group is consecutive ranks, i.e. GPUs of one node). Strategies talk
//! to [`ProcessGroup`]s; `local` runs ranks as threads in one process, `nccl`
//! runs one process per GPU.

pub mod env;
pub mod local;
pub mod mesh;
pub mod nccl;
pub mod rendezvous;

pub use mesh::{GroupKind, MeshShape};

use crate::backend::{Backend, Tensor};
use crate::error::Result;

/// A group of ranks that run collectives together. Every member must call the
/// same collectives in the same order. Buffers of "P chunks" are laid out
/// `[P, chunk]` with chunk `j` belonging to group rank `j`.
pub trait ProcessGroup<B: Backend>: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// `recv[j] = send_of_rank_j[me]`: chunk `j` of `send` goes to rank `j`.
    fn all_to_all(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()>;
    /// Starts `all_to_all(send, recv)` and returns before it finishes where
    /// the group can run transfers beside compute (NCCL: on its own stream);
    /// [`Pending::wait`] hands back `recv` once later work is ordered after
    /// the transfer. Groups that cannot overlap finish it here. Either way
    /// `send` is released at the wait, so memory use is the same on every
    /// backend.
    fn start_all_to_all(&self, send: Tensor<B>, mut recv: Tensor<B>) -> Result<Pending<B>> {
        self.all_to_all(&send, &mut recv)?;
        Ok(Pending::new(
            recv,
            Box::new(move || {
                drop(send);
                Ok(())
            }),
        ))
    }
    /// `recv[j] = send_of_rank_j`.
    fn all_gather(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()>;
    /// `recv = sum_j send_of_rank_j[me]`.
    fn reduce_scatter(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()>;
    /// `t = sum_j t_of_rank_j`, identical on every rank.
    fn all_reduce(&self, t: &mut Tensor<B>) -> Result<()>;
    /// Sends `send` to group rank `to` while receiving `recv` from group rank `from`.
    fn send_recv(
        &self,
        send: &Tensor<B>,
        to: usize,
        recv: &mut Tensor<B>,
        from: usize,
    ) -> Result<()>;
}

/// A collective's result in flight (see [`ProcessGroup::start_all_to_all`]).
/// Dropped without [`Pending::wait`] (an error path), it still orders later
/// work after the transfer before releasing the buffers it reads.
pub struct Pending<B: Backend> {
    recv: Option<Tensor<B>>,
    /// Orders later work after the transfer and releases what it reads.
    join: Option<Box<dyn FnOnce() -> Result<()>>>,
}

impl<B: Backend> Pending<B> {
    /// A finished transfer.
    pub fn done(recv: Tensor<B>) -> Self {
        Pending {
            recv: Some(recv),
            join: None,
        }
    }

    /// A transfer that `join` completes (in stream order, without host waits).
    pub fn new(recv: Tensor<B>, join: Box<dyn FnOnce() -> Result<()>>) -> Self {
        Pending {
            recv: Some(recv),
            join: Some(join),
        }
    }

    /// The received tensor, usable by work queued from now on.
    pub fn wait(mut self) -> Result<Tensor<B>> {
        if let Some(join) = self.join.take() {
            join()?;
        }
        Ok(self.recv.take().expect("taken only here"))
    }
}

impl<B: Backend> Drop for Pending<B> {
    fn drop(&mut self) {
        if let Some(join) = self.join.take()
            && let Err(e) = join()
        {
            tracing::warn!("a dropped collective could not be joined: {e}");
        }
    }
}

/// The process groups one rank belongs to.
pub struct Mesh<B: Backend> {
    pub shape: MeshShape,
    /// This rank's global index.
    pub rank: usize,
    /// All ranks.
    pub world: Box<dyn ProcessGroup<B>>,
    /// Ranks sharing this rank's data and ring coordinates (all-to-all over heads).
    pub ulysses: Box<dyn ProcessGroup<B>>,
    /// Ranks sharing this rank's data and Ulysses coordinates (K/V ring).
    pub ring: Box<dyn ProcessGroup<B>>,
    /// The context-parallel group: ring x Ulysses ranks of one data replica.
    pub context: Box<dyn ProcessGroup<B>>,
    /// Ranks holding the same sequence shard in different data replicas.
    pub data: Box<dyn ProcessGroup<B>>,
}
