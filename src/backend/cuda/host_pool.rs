//! Pinned (page-locked) host memory for offloaded tensors: allocated in
//! large chunks once ([`PinnedRegion`]), laid out first-fit inside them
//! ([`ArenaMap`]) and reused, never pinned per tensor. The device's copy
//! engines move it at full PCIe speed, beside compute.
//!
//! Blocks are given back in host order. That is safe because every GPU
//! access to this memory is a copy on the backend's one copy stream, which
//! runs its copies in the order they were queued: a block reused by a later
//! copy is only touched after the earlier copy that used it.
//!
//! A chunk stays pinned when its blocks are given back, so a later step
//! finds it again. When a request would pass the host budget, the chunks
//! that hold nothing are unpinned first (after the copy stream drains):
//! own-size chunks of one step's sizes would otherwise strand memory that
//! the next step asks for in other sizes. What stays pinned beyond the live
//! tensors is then at most the free tails of the shared chunks, which
//! plans leave out of the budget ([`PINNED_SLACK`]).

use super::pinned::PinnedRegion;
use super::pool::BlockOwner;
use crate::backend::Bytes;
use crate::backend::arena::ArenaMap;
use crate::backend::memory::PINNED_SLACK;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::{Arc, Mutex};

/// Bytes pinned at a time for small requests, which share such chunks.
const CHUNK: usize = PINNED_SLACK / 2;
/// Requests of at least this many bytes get a chunk of their own size:
/// packed into shared chunks, each would strand up to its size at the end
/// of a chunk.
const OWN: usize = CHUNK / 32;
const ALIGN: usize = 256;

/// The chunk a request of `bytes` lives in: `(bytes pinned for a new
/// chunk, whether small requests share it)`. A shared chunk's unused tail
/// is below `OWN`; an own chunk holds exactly one request of its size.
fn chunk_for(bytes: usize) -> (usize, bool) {
    let rounded = bytes.div_ceil(ALIGN) * ALIGN;
    if rounded >= OWN {
        (rounded, false)
    } else {
        (CHUNK, true)
    }
}

struct Chunk {
    region: PinnedRegion,
    map: ArenaMap,
    /// Small requests share it; otherwise it holds one request of its size.
    shared: bool,
}

struct Inner {
    chunks: Vec<Chunk>,
    pinned: usize,
}

/// One GPU's pinned host pool.
pub struct HostPool {
    ctx: Arc<CudaContext>,
    /// The one stream whose copies touch this memory.
    copy_stream: Arc<CudaStream>,
    inner: Mutex<Inner>,
    /// The most bytes this pool may pin (`--host-mem`), if limited.
    budget: Mutex<Option<usize>>,
}

impl HostPool {
    pub fn new(ctx: Arc<CudaContext>, copy_stream: Arc<CudaStream>) -> Arc<Self> {
        Arc::new(HostPool {
            ctx,
            copy_stream,
            inner: Mutex::new(Inner {
                chunks: Vec::new(),
                pinned: 0,
            }),
            budget: Mutex::new(None),
        })
    }

    /// Limits the bytes pinned from now on.
    pub fn set_budget(&self, bytes: Option<usize>) {
        *self.budget.lock().expect("host pool poisoned") = bytes;
    }

    /// Bytes pinned so far.
    pub fn pinned(&self) -> usize {
        self.inner.lock().expect("host pool poisoned").pinned
    }

    /// A block of `bytes` pinned host bytes (its address; 0 for none).
    pub fn alloc(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Ok(0);
        }
        let mut g = self.inner.lock().expect("host pool poisoned");
        let (size, shared) = chunk_for(bytes);
        // a large request reuses a free chunk of its own size; small ones share
        let fits = |c: &Chunk| c.shared == shared && (shared || c.map.capacity() == size);
        for c in g.chunks.iter_mut().filter(|c| fits(c)) {
            if let Some(off) = c.map.take(bytes) {
                return Ok(c.region.addr() + off as u64);
            }
        }
        let budget = *self.budget.lock().expect("host pool poisoned");
        if budget.is_some_and(|b| g.pinned + size > b) {
            self.unpin_empty(&mut g)?;
        }
        if let Some(budget) = budget
            && g.pinned + size > budget
        {
            return Err(Error::Config(format!(
                "pinned host memory: {} more would exceed the host budget of {} ({} pinned); \
                 raise --host-mem, offload fewer blocks, or shorten --seq",
                Bytes(size),
                Bytes(budget),
                Bytes(g.pinned)
            )));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::Backend(format!("CUDA driver: bind context: {e:?}")))?;
        let region = PinnedRegion::new(size)?;
        let mut map = ArenaMap::new(size, ALIGN);
        let off = map.take(bytes).expect("a fresh chunk holds the request");
        let addr = region.addr() + off as u64;
        g.chunks.push(Chunk {
            region,
            map,
            shared,
        });
        g.pinned += size;
        Ok(addr)
    }

    /// Unpins every chunk no block lives in, once no copy can touch it.
    fn unpin_empty(&self, g: &mut Inner) -> Result<()> {
        if g.chunks.iter().all(|c| c.map.used() > 0) {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .and_then(|_| self.copy_stream.synchronize())
            .map_err(|e| Error::Backend(format!("CUDA driver: copy stream synchronize: {e:?}")))?;
        let before = g.pinned;
        g.chunks.retain(|c| c.map.used() > 0);
        g.pinned = g.chunks.iter().map(|c| c.map.capacity()).sum();
        tracing::debug!(
            "pinned host memory: unpinned {} of empty chunks",
            Bytes(before - g.pinned)
        );
        Ok(())
    }
}

impl BlockOwner for HostPool {
    fn release(&self, ptr: u64, bytes: usize) {
        if ptr == 0 {
            return;
        }
        let mut g = self.inner.lock().expect("host pool poisoned");
        if let Some(c) = g
            .chunks
            .iter_mut()
            .find(|c| ptr >= c.region.addr() && ptr < c.region.addr() + c.map.capacity() as u64)
        {
            c.map.give((ptr - c.region.addr()) as usize, bytes);
        }
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.copy_stream.synchronize();
        // every block was given back (each tensor holds an Arc to the pool)
        // and the copy stream, the only GPU user, is idle
        self.inner
            .get_mut()
            .expect("host pool poisoned")
            .chunks
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Large requests are pinned at their own (aligned) size; small ones
        /// share chunks in which each strands less than `OWN` bytes.
        #[test]
        fn chunks_waste_little(bytes in 1usize..(3usize << 30)) {
            let (size, shared) = chunk_for(bytes);
            prop_assert!(size >= bytes);
            if shared {
                prop_assert_eq!(size, CHUNK);
                prop_assert!(bytes < OWN);
            } else {
                prop_assert!(size - bytes < ALIGN);
            }
        }
    }
}
