//! Ranks as threads in one process: collectives through shared mailboxes.
//!
//! Every message is a host copy of a tensor, queued under (group, src, dst)
//! and received in order. Reductions sum in rank order, so every rank gets
//! bit-identical results.

use super::{Mesh, MeshShape, Pending, ProcessGroup};
use crate::backend::{Backend, Tensor};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

type Key = (u64, usize, usize);

/// Mailboxes shared by all ranks of one process.
pub struct LocalWorld {
    size: usize,
    boxes: Mutex<HashMap<Key, VecDeque<Vec<f32>>>>,
    arrived: Condvar,
    timeout: Duration,
    /// The first rank whose work failed: the others stop waiting for it.
    failed: Mutex<Option<usize>>,
}

impl LocalWorld {
    /// A world of `size` thread ranks.
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(LocalWorld {
            size,
            boxes: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
            timeout: Duration::from_secs(600),
            failed: Mutex::new(None),
        })
    }

    /// Records that `rank` failed (the first one stays) and wakes every
    /// rank waiting for a message, which then fails too.
    fn fail(&self, rank: usize) {
        self.failed
            .lock()
            .expect("failure record poisoned")
            .get_or_insert(rank);
        let _boxes = self.boxes.lock().expect("mailboxes poisoned");
        self.arrived.notify_all();
    }

    fn first_failed(&self) -> Option<usize> {
        *self.failed.lock().expect("failure record poisoned")
    }

    fn post(&self, tag: u64, src: usize, dst: usize, data: Vec<f32>) {
        let mut boxes = self.boxes.lock().expect("mailboxes poisoned");
        boxes.entry((tag, src, dst)).or_default().push_back(data);
        self.arrived.notify_all();
    }

    fn take(&self, tag: u64, src: usize, dst: usize) -> Result<Vec<f32>> {
        let mut boxes = self.boxes.lock().expect("mailboxes poisoned");
        loop {
            if let Some(m) = boxes.get_mut(&(tag, src, dst)).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            if let Some(r) = self.first_failed() {
                return Err(Error::Comm(format!(
                    "rank {r} failed, so rank {dst} stopped waiting for a message from rank {src}"
                )));
            }
            let (b, wait) = self
                .arrived
                .wait_timeout(boxes, self.timeout)
                .expect("mailboxes poisoned");
            boxes = b;
            if wait.timed_out() {
                return Err(Error::Comm(format!(
                    "rank {dst} waited {:?} for a message from rank {src}; a rank failed or the ranks called different collectives",
                    self.timeout
                )));
            }
        }
    }

    /// The groups of global `rank` for a mesh.
    pub fn mesh<B: Backend>(
        self: &Arc<Self>,
        shape: MeshShape,
        rank: usize,
        backend: Arc<B>,
    ) -> Mesh<B> {
        assert_eq!(
            shape.world_size(),
            self.size,
            "mesh does not match the world"
        );
        Mesh::of_groups(shape, rank, |members, me| {
            Box::new(LocalGroup {
                world: self.clone(),
                backend: backend.clone(),
                tag: group_tag(&members),
                me,
                members,
            })
        })
    }
}

/// Distinct member lists get distinct tags, so groups never read each other's mail.
fn group_tag(members: &[usize]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    members.hash(&mut h);
    h.finish()
}

/// Runs `f(rank, mesh)` on one thread per rank, each with its own backend from
/// `make_backend`, and returns the per-rank results in rank order. When a
/// rank's thread cannot be started, the ranks already running are woken
/// (as for a failed rank) and the error names the fix.
pub fn run_ranks<B, T, F>(
    shape: MeshShape,
    make_backend: impl Fn() -> B + Sync,
    f: F,
) -> Result<Vec<T>>
where
    B: Backend,
    T: Send,
    F: Fn(usize, Arc<B>, Mesh<B>) -> Result<T> + Sync,
{
    run_ranks_on(shape, rank_thread, make_backend, f)
}

/// The thread of a rank (the same for every rank).
fn rank_thread(_rank: usize) -> std::thread::Builder {
    std::thread::Builder::new()
}

/// [`run_ranks`] with each rank's thread built by `thread_of(rank)`.
fn run_ranks_on<B, T, F>(
    shape: MeshShape,
    thread_of: impl Fn(usize) -> std::thread::Builder,
    make_backend: impl Fn() -> B + Sync,
    f: F,
) -> Result<Vec<T>>
where
    B: Backend,
    T: Send,
    F: Fn(usize, Arc<B>, Mesh<B>) -> Result<T> + Sync,
{
    let world = LocalWorld::new(shape.world_size());
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(shape.world_size());
        let mut not_started = None;
        for rank in 0..shape.world_size() {
            let (world, f, make_backend) = (&world, &f, &make_backend);
            let started = thread_of(rank).spawn_scoped(s, move || {
                let b = Arc::new(make_backend());
                let mesh = world.mesh(shape, rank, b.clone());
                let out = f(rank, b, mesh);
                if out.is_err() {
                    world.fail(rank);
                }
                out
            });
            match started {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    // the running ranks would wait for this one: wake them
                    world.fail(rank);
                    not_started = Some(Error::thread_spawn(
                        format!("rank {rank} of {} thread ranks", shape.world_size()),
                        e,
                    ));
                    break;
                }
            }
        }
        let mut out: Vec<Result<T>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| Error::Comm("a rank thread panicked".into()))?
            })
            .collect();
        if let Some(e) = not_started {
            return Err(e);
        }
        // the first rank to fail says why; the others only stopped waiting
        if let Some(r) = world.first_failed() {
            return Err(out.swap_remove(r).err().expect("the rank failed"));
        }
        out.into_iter().collect()
    })
}

struct LocalGroup<B: Backend> {
    world: Arc<LocalWorld>,
    backend: Arc<B>,
    tag: u64,
    me: usize,
    members: Vec<usize>,
}

impl<B: Backend> LocalGroup<B> {
    fn send(&self, to: usize, data: Vec<f32>) {
        self.world
            .post(self.tag, self.members[self.me], self.members[to], data);
    }
    fn recv(&self, from: usize) -> Result<Vec<f32>> {
        self.world
            .take(self.tag, self.members[from], self.members[self.me])
    }
    /// A host copy of `t` to send.
    fn host(&self, t: &Tensor<B>) -> Result<Vec<f32>> {
        self.backend.to_host(t)
    }
    /// Sends `host`'s chunk `j` of `n` elements to every rank `j`.
    fn scatter(&self, host: &[f32], n: usize) {
        for j in 0..self.size() {
            let chunk = host.get(j * n..(j + 1) * n).unwrap_or_default();
            self.send(j, chunk.to_vec());
        }
    }
    /// Writes the received `data` into `t`.
    fn put(&self, t: &mut Tensor<B>, data: &[f32]) -> Result<()> {
        self.backend.upload(t, data)
    }
    /// The sum of one message from every rank, in rank order.
    fn sum_from_all(&self, n: usize) -> Result<Vec<f32>> {
        let mut acc = vec![0.0f32; n];
        for j in 0..self.size() {
            for (a, b) in acc.iter_mut().zip(self.recv(j)?) {
                *a += b;
            }
        }
        Ok(acc)
    }
    fn chunks(&self, t: &Tensor<B>, what: &str) -> Result<usize> {
        let p = self.members.len();
        if !t.numel().is_multiple_of(p) {
            return Err(Error::Comm(format!(
                "{what}: {} elements do not split into {p} equal chunks",
                t.numel()
            )));
        }
        Ok(t.numel() / p)
    }
}

impl<B: Backend> ProcessGroup<B> for LocalGroup<B> {
    fn rank(&self) -> usize {
        self.me
    }
    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_to_all(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        let n = self.chunks(send, "all_to_all")?;
        if recv.numel() != send.numel() {
            return Err(Error::Comm(
                "all_to_all: send and receive sizes differ".into(),
            ));
        }
        self.scatter(&self.host(send)?, n);
        let mut out = Vec::with_capacity(send.numel());
        for j in 0..self.size() {
            out.extend(self.recv(j)?);
        }
        self.put(recv, &out)
    }

    fn all_gather(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        if recv.numel() != send.numel() * self.size() {
            return Err(Error::Comm(
                "all_gather: receive must hold size x send".into(),
            ));
        }
        let host = self.host(send)?;
        for j in 0..self.size() {
            self.send(j, host.clone());
        }
        let mut out = Vec::with_capacity(recv.numel());
        for j in 0..self.size() {
            out.extend(self.recv(j)?);
        }
        self.put(recv, &out)
    }

    fn reduce_scatter(&self, send: &Tensor<B>, recv: &mut Tensor<B>) -> Result<()> {
        let n = self.chunks(send, "reduce_scatter")?;
        if recv.numel() != n {
            return Err(Error::Comm(
                "reduce_scatter: receive must hold one chunk".into(),
            ));
        }
        self.scatter(&self.host(send)?, n);
        let acc = self.sum_from_all(n)?;
        self.put(recv, &acc)
    }

    fn all_reduce(&self, t: &mut Tensor<B>) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let host = self.host(t)?;
        for j in 0..self.size() {
            self.send(j, host.clone());
        }
        let acc = self.sum_from_all(t.numel())?;
        self.put(t, &acc)
    }

    fn send_recv(
        &self,
        send: &Tensor<B>,
        to: usize,
        recv: &mut Tensor<B>,
        from: usize,
    ) -> Result<()> {
        self.send(to, self.host(send)?);
        let got = self.recv(from)?;
        if got.len() != recv.numel() {
            return Err(Error::Comm(format!(
                "send_recv: expected {} elements from rank {from}, got {}",
                recv.numel(),
                got.len()
            )));
        }
        self.backend.upload(recv, &got)
    }

    unsafe fn start_shift_from(
        &self,
        send: &[&Tensor<B>],
        to: Option<usize>,
        mut recv: Vec<Tensor<B>>,
        from: Option<usize>,
    ) -> Result<Pending<B>> {
        // the sends are host copies, made here
        if let Some(to) = to {
            for t in send {
                self.send(to, self.host(t)?);
            }
        }
        if let Some(from) = from {
            for t in recv.iter_mut() {
                let got = self.recv(from)?;
                if got.len() != t.numel() {
                    return Err(Error::Comm(format!(
                        "shift: expected {} elements from rank {from}, got {}",
                        t.numel(),
                        got.len()
                    )));
                }
                self.backend.upload(t, &got)?;
            }
        }
        Ok(Pending::in_flight(recv, Vec::new(), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Category, DType};

    #[test]
    fn collectives_match_their_definitions() {
        let shape = MeshShape::new(1, 1, 4).unwrap();
        let out = run_ranks(shape, CpuBackend::new, |rank, b, mesh| {
            let g = &mesh.world;
            let send: Vec<f32> = (0..8).map(|i| (rank * 100 + i) as f32).collect();
            let s = b.from_host(&send, &[8], DType::F32, Category::Comm)?;
            let mut r = b.zeros(&[8], DType::F32, Category::Comm)?;
            g.all_to_all(&s, &mut r)?;
            let a2a = b.to_host(&r)?;
            let mut ar = b.from_host(&[rank as f32 + 1.0], &[1], DType::F32, Category::Comm)?;
            g.all_reduce(&mut ar)?;
            let mut rs = b.zeros(&[2], DType::F32, Category::Comm)?;
            g.reduce_scatter(&s, &mut rs)?;
            let mut ag = b.zeros(&[32], DType::F32, Category::Comm)?;
            g.all_gather(&s, &mut ag)?;
            let mut sr = b.zeros(&[8], DType::F32, Category::Comm)?;
            g.send_recv(&s, (rank + 1) % 4, &mut sr, (rank + 3) % 4)?;
            Ok((
                a2a,
                b.to_host(&ar)?,
                b.to_host(&rs)?,
                b.to_host(&ag)?,
                b.to_host(&sr)?,
            ))
        })
        .unwrap();
        for (rank, (a2a, ar, rs, ag, sr)) in out.into_iter().enumerate() {
            let expect: Vec<f32> = (0..4)
                .flat_map(|j| (0..2).map(move |i| (j * 100 + rank * 2 + i) as f32))
                .collect();
            assert_eq!(a2a, expect);
            assert_eq!(ar, vec![10.0]);
            let sum_chunk: Vec<f32> = (0..2)
                .map(|i| (0..4).map(|j| (j * 100 + rank * 2 + i) as f32).sum())
                .collect();
            assert_eq!(rs, sum_chunk);
            assert_eq!(
                ag[8..16].to_vec(),
                (0..8).map(|i| (100 + i) as f32).collect::<Vec<_>>()
            );
            let prev = (rank + 3) % 4;
            assert_eq!(
                sr,
                (0..8).map(|i| (prev * 100 + i) as f32).collect::<Vec<_>>()
            );
        }
    }

    /// A rank whose thread cannot start (a stack no machine can map stands
    /// in for a process out of threads) fails the run with an error naming
    /// the fix, and the ranks already waiting for it stop at once instead
    /// of waiting for the 600 s message timeout.
    #[test]
    fn a_rank_thread_that_cannot_start_fails_the_run_with_the_fix() {
        let shape = MeshShape::new(1, 1, 4).unwrap();
        let thread_of = |rank: usize| match rank {
            2 => std::thread::Builder::new().stack_size(1 << 62),
            _ => std::thread::Builder::new(),
        };
        let started = std::time::Instant::now();
        let got = run_ranks_on(shape, thread_of, CpuBackend::new, |_, b, mesh| {
            let mut t = b.from_host(&[1.0], &[1], DType::F32, Category::Comm)?;
            mesh.world.all_reduce(&mut t)
        });
        match got {
            Err(Error::Config(msg)) => {
                assert!(msg.contains("rank 2 of 4 thread ranks"), "{msg}");
                assert!(msg.contains("run fewer ranks"), "{msg}");
            }
            other => panic!("expected a configuration error, got {other:?}"),
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
    }
}
