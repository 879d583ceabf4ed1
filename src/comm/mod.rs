//! Process groups and collectives over a device mesh.
//!
//! Ranks form a 3-D mesh `data x ring x ulysses` (Ulysses fastest, so a
//! Ulysses group is consecutive ranks, i.e. GPUs of one node). Strategies talk
//! to [`ProcessGroup`]s; `local` runs ranks as threads in one process, `nccl`
//! runs one process per GPU (`watchdog`: its collective-timeout policy).

pub mod counting;
pub mod env;
pub mod local;
pub mod mesh;
pub mod nccl;
pub mod rendezvous;
pub mod traffic;
pub mod watchdog;

pub use mesh::{GroupKind, MeshShape};

use crate::backend::{Backend, DType, Tensor};
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
    /// An uninitialised buffer for this group's all-to-all (send or
    /// receive side) in memory the transport moves without SMs (NCCL: the
    /// symmetric copy-engine window, `UPIPE_CE_EXCHANGE_MB`), or `None` where
    /// the group has no such memory (take it from the backend as usual); an
    /// error names the fix when the window is full. Every member must ask
    /// for the same buffers in the same order (as for collectives), and an
    /// all-to-all takes both its buffers from the window or neither.
    fn exchange_buffer(&self, _shape: &[usize], _dtype: DType) -> Result<Option<Tensor<B>>> {
        Ok(None)
    }
    /// Whether `t` lies in this group's exchange window (always false
    /// without one).
    fn in_exchange_window(&self, _t: &Tensor<B>) -> bool {
        false
    }
    /// Starts `all_to_all(send, recv)` and returns before it finishes where
    /// the group can run transfers beside compute (NCCL: on its own stream);
    /// [`Pending::wait`] hands back `recv` once later work is ordered after
    /// the transfer. Groups that cannot overlap finish it here. Either way
    /// `send` is held until the wait, so memory use is the same on every
    /// backend.
    fn start_all_to_all(&self, send: Tensor<B>, mut recv: Tensor<B>) -> Result<Pending<B>> {
        self.all_to_all(&send, &mut recv)?;
        Ok(Pending::in_flight(vec![recv], vec![send], None))
    }
    /// `recv[j] = send_of_rank_j`.
    fn all_gather(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()>;
    /// Starts `all_gather(send, recv)` (as [`ProcessGroup::start_all_to_all`]:
    /// beside compute where the group can, both buffers held until the wait).
    fn start_all_gather(&self, send: Tensor<B>, mut recv: Tensor<B>) -> Result<Pending<B>> {
        self.all_gather(&send, &mut recv)?;
        Ok(Pending::in_flight(vec![recv], vec![send], None))
    }
    /// Starts `reduce_scatter(send, recv)` (as [`ProcessGroup::start_all_gather`]).
    fn start_reduce_scatter(&self, send: Tensor<B>, mut recv: Tensor<B>) -> Result<Pending<B>> {
        self.reduce_scatter(&send, &mut recv)?;
        Ok(Pending::in_flight(vec![recv], vec![send], None))
    }
    /// Starts `all_reduce(t)` in place; the wait hands `t` back.
    fn start_all_reduce(&self, mut t: Tensor<B>) -> Result<Pending<B>> {
        self.all_reduce(&mut t)?;
        Ok(Pending::done(t))
    }
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
    /// Starts `send_recv` of each `send[j]` into `recv[j]` (one transfer) and
    /// returns before it finishes where the group can overlap it (as
    /// [`ProcessGroup::start_all_to_all`]); the sent tensors stay readable
    /// through [`Pending::sending`] meanwhile and come back from
    /// [`Pending::wait_all`].
    fn start_send_recv(
        &self,
        send: Vec<Tensor<B>>,
        to: usize,
        mut recv: Vec<Tensor<B>>,
        from: usize,
    ) -> Result<Pending<B>> {
        same_count(&send, &recv)?;
        for (s, r) in send.iter().zip(recv.iter_mut()) {
            self.send_recv(s, to, r, from)?;
        }
        Ok(Pending::in_flight(recv, send, None))
    }
    /// Starts sending `send` to group rank `to` and receiving into `recv`
    /// from group rank `from` as one transfer (as [`ProcessGroup::start_send_recv`]),
    /// where either side may be absent: a side whose rank is `None` moves
    /// nothing, and its tensors are only held and handed back by
    /// [`Pending::wait_all`] like the others. A send to `r` pairs with `r`'s
    /// receive from this rank in the same place of both ranks' call orders
    /// (the zigzag ring's direct shifts, which skip the blocks no query of
    /// the receiver sees).
    fn start_shift(
        &self,
        send: Vec<Tensor<B>>,
        to: Option<usize>,
        recv: Vec<Tensor<B>>,
        from: Option<usize>,
    ) -> Result<Pending<B>> {
        let refs: Vec<&Tensor<B>> = send.iter().collect();
        // SAFETY: the returned transfer holds `send` until it is waited for
        // or dropped.
        let pending = unsafe { self.start_shift_from(&refs, to, recv, from)? };
        Ok(pending.holding(send))
    }
    /// [`ProcessGroup::start_shift`] sending from tensors the caller keeps
    /// (the ring's own K/V, sent to another rank at every step without a
    /// copy); the returned transfer holds only `recv`.
    ///
    /// # Safety
    /// Every tensor of `send` must stay alive and unwritten until the
    /// returned transfer has been waited for or dropped: a group that
    /// overlaps transfers (NCCL) reads them until then.
    unsafe fn start_shift_from(
        &self,
        send: &[&Tensor<B>],
        to: Option<usize>,
        recv: Vec<Tensor<B>>,
        from: Option<usize>,
    ) -> Result<Pending<B>>;
}

/// A grouped transfer pairs each sent tensor with one received tensor.
pub fn same_count<B: Backend>(send: &[Tensor<B>], recv: &[Tensor<B>]) -> Result<()> {
    if send.len() != recv.len() {
        return Err(crate::error::Error::Comm(format!(
            "send_recv of {} tensors into {}",
            send.len(),
            recv.len()
        )));
    }
    Ok(())
}

/// A collective in flight (see [`ProcessGroup::start_all_to_all`]): the
/// tensors it receives into and the ones it sends from, which it holds until
/// [`Pending::wait`] so no buffer a transfer uses returns to the pool early.
/// Dropped without a wait (an error path), it still orders later work after
/// the transfer before releasing them.
pub struct Pending<B: Backend> {
    recv: Vec<Tensor<B>>,
    send: Vec<Tensor<B>>,
    /// Orders later work after the transfer (`None`: already finished).
    join: Option<Join>,
}

/// A finished transfer's buffers.
pub struct Finished<B: Backend> {
    pub received: Vec<Tensor<B>>,
    pub sent: Vec<Tensor<B>>,
}

/// Makes later work wait for a transfer (in stream order, no host wait).
pub type Join = Box<dyn FnOnce() -> Result<()>>;

impl<B: Backend> Pending<B> {
    /// A finished transfer that received `recv`.
    pub fn done(recv: Tensor<B>) -> Self {
        Pending::in_flight(vec![recv], Vec::new(), None)
    }

    /// A transfer into `recv` from `send`; `join` makes later work wait for it.
    pub fn in_flight(recv: Vec<Tensor<B>>, send: Vec<Tensor<B>>, join: Option<Join>) -> Self {
        Pending { recv, send, join }
    }

    /// This transfer, also holding `send` until its wait (tensors it sends
    /// that the caller handed over).
    pub fn holding(mut self, send: Vec<Tensor<B>>) -> Self {
        self.send.extend(send);
        self
    }

    /// The tensors being sent: readable while they are in flight.
    pub fn sending(&self) -> &[Tensor<B>] {
        &self.send
    }

    /// The received tensors and the sent ones, usable by work queued from now on.
    pub fn wait_all(mut self) -> Result<Finished<B>> {
        if let Some(join) = self.join.take() {
            join()?;
        }
        Ok(Finished {
            received: std::mem::take(&mut self.recv),
            sent: std::mem::take(&mut self.send),
        })
    }

    /// The one received tensor (the sent ones are released).
    pub fn wait(self) -> Result<Tensor<B>> {
        let mut recv = self.wait_all()?.received;
        match (recv.pop(), recv.is_empty()) {
            (Some(t), true) => Ok(t),
            _ => Err(crate::error::Error::Comm(
                "Pending::wait on a transfer of several tensors; use wait_all".into(),
            )),
        }
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
    /// The ranks this rank's FSDP shards are spread over (the world, or a
    /// group of `world / fsdp_replicas` consecutive ranks under HSDP).
    pub shard: Box<dyn ProcessGroup<B>>,
    /// The ranks holding the same FSDP shards in the other replicas.
    pub replica: Box<dyn ProcessGroup<B>>,
}

impl<B: Backend> Mesh<B> {
    /// The groups of global rank `rank` of `shape`, each made by `group` from
    /// its members (global ranks, in group-rank order) and this rank's place
    /// among them.
    pub fn of_groups(
        shape: MeshShape,
        rank: usize,
        mut group: impl FnMut(Vec<usize>, usize) -> Box<dyn ProcessGroup<B>>,
    ) -> Mesh<B> {
        let mut make = |kind: GroupKind| {
            let members = shape.members(kind, rank);
            let me = members
                .iter()
                .position(|&r| r == rank)
                .expect("rank in its group");
            group(members, me)
        };
        Mesh {
            shape,
            rank,
            world: make(GroupKind::World),
            ulysses: make(GroupKind::Ulysses),
            ring: make(GroupKind::Ring),
            context: make(GroupKind::Context),
            data: make(GroupKind::Data),
            shard: make(GroupKind::Shard),
            replica: make(GroupKind::Replica),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Category, DType};
    use std::cell::Cell;
    use std::rc::Rc;

    fn t(b: &CpuBackend, n: usize) -> Tensor<CpuBackend> {
        b.zeros(&[n], DType::F32, Category::Comm).unwrap()
    }

    /// A join that counts its calls.
    fn counting(calls: &Rc<Cell<u32>>) -> Join {
        let c = calls.clone();
        Box::new(move || {
            c.set(c.get() + 1);
            Ok(())
        })
    }

    #[test]
    fn pending_holds_its_buffers_until_the_wait_and_joins_once() {
        let b = CpuBackend::new();
        let calls = Rc::new(Cell::new(0));
        let p = Pending::in_flight(vec![t(&b, 4)], vec![t(&b, 4)], Some(counting(&calls)));
        assert_eq!(b.ledger().current(), 32, "send and receive held");
        assert_eq!(p.sending().len(), 1);
        let recv = p.wait().unwrap();
        assert_eq!(calls.get(), 1);
        assert_eq!(
            b.ledger().current(),
            16,
            "the send buffer is released at the wait"
        );
        drop(recv);
        let p = Pending::in_flight(vec![t(&b, 2), t(&b, 2)], vec![t(&b, 2), t(&b, 2)], None);
        let done = p.wait_all().unwrap();
        assert_eq!((done.received.len(), done.sent.len()), (2, 2));
    }

    #[test]
    fn a_dropped_pending_still_joins_before_releasing() {
        let b = CpuBackend::new();
        let calls = Rc::new(Cell::new(0));
        drop(Pending::in_flight(
            vec![t(&b, 4)],
            vec![t(&b, 4)],
            Some(counting(&calls)),
        ));
        assert_eq!(calls.get(), 1);
        assert_eq!(b.ledger().current(), 0);
    }

    #[test]
    fn waiting_for_one_tensor_of_several_is_an_error() {
        let b = CpuBackend::new();
        let p = Pending::in_flight(vec![t(&b, 1), t(&b, 1)], Vec::new(), None);
        assert!(p.wait().unwrap_err().to_string().contains("wait_all"));
        let e = same_count(&[t(&b, 1)], &[]).unwrap_err().to_string();
        assert!(e.contains("1 tensors into 0"), "{e}");
    }
}
