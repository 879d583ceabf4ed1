//! A rehearsal's process groups: a group of one rank standing for all of
//! them, whose collectives check their buffers as the real ones do and move
//! nothing, and allocate what the real ones allocate (nothing beyond the
//! caller's buffers; the exchange window is off, `exchange_buffer` is
//! `None`, so every exchange buffer comes from the backend as the planner
//! predicts). The local and NCCL groups hold no rehearsal code: a rehearsal
//! runs on these instead (`train::trainer`, with the rank's backend in a
//! [`Rehearsal`](crate::backend::rehearsal::Rehearsal)), and with a
//! [`CountingBackend`](crate::backend::counting::CountingBackend) they let
//! one rank run the engine's step alone, as the memory planner does
//! (`plan::engine`): no other rank is waited for.

use super::{Mesh, MeshShape, Pending, ProcessGroup};
use crate::backend::{Backend, Tensor};
use crate::error::{Error, Result};

/// Group rank `rank` of `size`, with no other member behind it.
pub struct CountingGroup {
    rank: usize,
    size: usize,
}

impl CountingGroup {
    /// Rank `rank` of a group of `size`.
    pub fn new(rank: usize, size: usize) -> Self {
        CountingGroup { rank, size }
    }

    fn chunk<B: Backend>(&self, t: &Tensor<B>, what: &str) -> Result<usize> {
        if !t.numel().is_multiple_of(self.size) {
            return Err(Error::Comm(format!(
                "{what}: {} elements do not split into {} equal chunks",
                t.numel(),
                self.size
            )));
        }
        Ok(t.numel() / self.size)
    }

    fn peer(&self, r: usize, what: &str) -> Result<()> {
        if r >= self.size {
            return Err(Error::Comm(format!(
                "{what}: rank {r} is outside a group of {}",
                self.size
            )));
        }
        Ok(())
    }
}

/// The groups of global rank `rank` of `shape`, every one counting.
pub fn counting_mesh<B: Backend>(shape: MeshShape, rank: usize) -> Mesh<B> {
    Mesh::of_groups(shape, rank, |members, me| {
        Box::new(CountingGroup::new(me, members.len()))
    })
}

impl<B: Backend> ProcessGroup<B> for CountingGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_to_all(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        self.chunk(send, "all_to_all")?;
        if recv.numel() != send.numel() {
            return Err(Error::Comm(
                "all_to_all: send and receive sizes differ".into(),
            ));
        }
        Ok(())
    }
    fn all_gather(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        if recv.numel() != send.numel() * self.size {
            return Err(Error::Comm(
                "all_gather: receive must hold size x send".into(),
            ));
        }
        Ok(())
    }
    fn reduce_scatter(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        if recv.numel() != self.chunk(send, "reduce_scatter")? {
            return Err(Error::Comm(
                "reduce_scatter: receive must hold one chunk".into(),
            ));
        }
        Ok(())
    }
    fn all_reduce(&self, _t: &mut Tensor<B>) -> Result<()> {
        Ok(())
    }
    fn send_recv(
        &self,
        _send: &Tensor<B>,
        to: usize,
        _recv: &mut Tensor<B>,
        from: usize,
    ) -> Result<()> {
        self.peer(to, "send_recv")?;
        self.peer(from, "send_recv")
    }
    unsafe fn start_shift_from(
        &self,
        _send: &[&Tensor<B>],
        to: Option<usize>,
        recv: Vec<Tensor<B>>,
        from: Option<usize>,
    ) -> Result<Pending<B>> {
        for r in to.into_iter().chain(from) {
            self.peer(r, "shift")?;
        }
        Ok(Pending::in_flight(recv, Vec::new(), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::counting::CountingBackend;
    use crate::backend::{Category, DType};

    #[test]
    fn collectives_check_sizes_and_allocate_nothing() {
        let b = CountingBackend::reference();
        let mesh: Mesh<CountingBackend> = counting_mesh(MeshShape::new(1, 2, 2).unwrap(), 3);
        assert_eq!((mesh.ulysses.rank(), mesh.ring.rank()), (1, 1));
        let send = b.zeros(&[8], DType::F32, Category::Comm).unwrap();
        let mut recv = b.zeros(&[8], DType::F32, Category::Comm).unwrap();
        mesh.ulysses.all_to_all(&send, &mut recv).unwrap();
        let mut small = b.zeros(&[3], DType::F32, Category::Comm).unwrap();
        assert!(mesh.ulysses.all_to_all(&send, &mut small).is_err());
        assert!(mesh.world.all_gather(&send, &mut recv).is_err());
        assert!(mesh.ring.send_recv(&send, 2, &mut recv, 0).is_err());
        assert_eq!(b.ledger().current(), 8 * 4 * 2 + 3 * 4);
    }
}
