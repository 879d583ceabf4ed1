//! Stream-ordered pool allocator: every tensor's bytes come from one
//! `cuMemPool` via `cuMemAllocFromPoolAsync` on the backend's stream and go
//! back with `cuMemFreeAsync` on drop. The pool's release threshold is raised
//! to "never" so freed memory is reused instead of returned to the driver.
//! The pool's own high-water attribute (`USED_MEM_HIGH`) cross-checks the
//! ledger's peak.

use super::device::drv;
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaStream, result, sys};
use std::sync::Arc;

/// Byte counters the driver keeps for the pool.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolStats {
    /// Bytes handed out and not yet freed (stream-ordered).
    pub used_current: u64,
    /// High-water mark of `used_current` since the last reset.
    pub used_high: u64,
    /// Bytes the pool holds from the driver.
    pub reserved_current: u64,
    /// High-water mark of `reserved_current` since the last reset.
    pub reserved_high: u64,
}

/// The device memory pool of one backend.
pub struct Pool {
    pool: sys::CUmemoryPool,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) ctx: Arc<CudaContext>,
}

// SAFETY: the pool handle is a driver object usable from any thread once the
// context is bound (every method binds it first).
unsafe impl Send for Pool {}
// SAFETY: as above; the driver serialises access to the pool.
unsafe impl Sync for Pool {}

/// What went wrong in an allocation.
pub enum AllocError {
    OutOfMemory,
    Other(crate::error::Error),
}

impl Pool {
    /// A fresh pool on `ctx`'s device whose memory is kept for reuse.
    pub fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Arc<Pool>> {
        drv(ctx.bind_to_thread(), "bind context")?;
        // SAFETY: all-zero is a valid bit pattern for this plain C struct; the
        // fields that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.ordinal() as i32;
        // SAFETY: `props` is fully initialised.
        let pool = drv(
            unsafe { result::mem_pool::create(&props) },
            "cuMemPoolCreate",
        )?;
        let p = Arc::new(Pool { pool, stream, ctx });
        let mut threshold: u64 = u64::MAX;
        // SAFETY: RELEASE_THRESHOLD takes a u64.
        drv(
            unsafe {
                result::mem_pool::set_attribute(
                    p.pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
            },
            "cuMemPoolSetAttribute(RELEASE_THRESHOLD)",
        )?;
        Ok(p)
    }

    /// `bytes` of device memory, ordered on the backend stream. Zero bytes give a null pointer.
    pub fn alloc(&self, bytes: usize) -> std::result::Result<u64, AllocError> {
        if bytes == 0 {
            return Ok(0);
        }
        drv(self.ctx.bind_to_thread(), "bind context").map_err(AllocError::Other)?;
        match self.alloc_once(bytes) {
            Err(AllocError::OutOfMemory) => {
                // free blocks of other sizes may hold the memory: once the
                // stream has run its frees, give them back and ask again
                self.trim().map_err(AllocError::Other)?;
                self.alloc_once(bytes)
            }
            r => r,
        }
    }

    fn alloc_once(&self, bytes: usize) -> std::result::Result<u64, AllocError> {
        // SAFETY: pool and stream are alive; the memory is only used on this stream.
        match unsafe { result::mem_pool::alloc_async(self.pool, bytes, self.stream.cu_stream()) } {
            Ok(p) => Ok(p),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(AllocError::OutOfMemory)
            }
            Err(e) => Err(AllocError::Other(crate::error::Error::Backend(format!(
                "cuMemAllocFromPoolAsync({bytes}): {e:?}"
            )))),
        }
    }

    /// Returns the pool's free memory to the driver (after the stream's
    /// queued frees), so that it can be mapped again in the sizes asked.
    fn trim(&self) -> Result<()> {
        drv(self.stream.synchronize(), "stream synchronize")?;
        let before = self.stats()?;
        // SAFETY: the pool is alive; trimming only releases unused memory.
        drv(
            unsafe { result::mem_pool::trim_to(self.pool, 0) },
            "cuMemPoolTrimTo",
        )?;
        let after = self.stats()?;
        tracing::debug!(
            "device pool: {} reserved for {} in use; trimmed to {}",
            crate::backend::Bytes(before.reserved_current as usize),
            crate::backend::Bytes(before.used_current as usize),
            crate::backend::Bytes(after.reserved_current as usize)
        );
        Ok(())
    }

    /// Returns `ptr` to the pool (stream-ordered after all queued work).
    fn free(&self, ptr: u64) {
        if ptr == 0 {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from this pool and is freed exactly once.
        if let Err(e) = unsafe { result::free_async(ptr, self.stream.cu_stream()) } {
            tracing::error!("cuMemFreeAsync failed: {e:?}");
        }
    }

    fn attr(&self, a: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: the *_MEM_* attributes are u64.
        drv(
            unsafe { result::mem_pool::get_attribute(self.pool, a, (&mut v as *mut u64).cast()) },
            "cuMemPoolGetAttribute",
        )?;
        Ok(v)
    }

    /// The driver's counters for this pool.
    pub fn stats(&self) -> Result<PoolStats> {
        use sys::CUmemPool_attribute as A;
        drv(self.ctx.bind_to_thread(), "bind context")?;
        Ok(PoolStats {
            used_current: self.attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.attr(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved_current: self.attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    /// The driver's free and total bytes of this pool's device (memory
    /// neither the pool nor anything else in the process holds).
    pub fn device_info(&self) -> Result<(usize, usize)> {
        drv(self.ctx.bind_to_thread(), "bind context")?;
        drv(result::mem_get_info(), "cuMemGetInfo")
    }

    /// What this pool and its device held when a request of `bytes` failed
    /// (after the trim and retry of [`alloc`](Self::alloc)), as the tail of
    /// an out-of-memory message: what lies outside the ledger and the pool's
    /// own fragmentation tell a plan's reserve apart from its slack.
    pub fn failure_state(&self) -> String {
        let gib = |b: u64| crate::backend::Bytes(b as usize);
        match (self.stats(), self.device_info()) {
            (Ok(p), Ok((free, total))) => {
                let outside = (total as u64).saturating_sub(free as u64 + p.reserved_current);
                format!(
                    "; the pool held {} for {} in use, the driver had {} free, {} lay outside the pool",
                    gib(p.reserved_current),
                    gib(p.used_current),
                    gib(free as u64),
                    gib(outside)
                )
            }
            _ => String::new(),
        }
    }

    /// Resets both high-water marks to the current values.
    pub fn reset_high(&self) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        drv(self.ctx.bind_to_thread(), "bind context")?;
        for a in [
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water attributes take a u64 (only 0 is allowed).
            drv(
                unsafe {
                    result::mem_pool::set_attribute(self.pool, a, (&mut zero as *mut u64).cast())
                },
                "cuMemPoolSetAttribute(*_HIGH)",
            )?;
        }
        Ok(())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: every allocation of this pool has been freed (each storage holds
        // an Arc to the pool) and the stream is idle.
        unsafe {
            let _ = result::mem_pool::destroy(self.pool);
        }
    }
}

/// Memory outside the pool that tensors borrow (an exchange window): told
/// when each tensor is dropped.
pub trait BlockOwner: Send + Sync {
    /// The `bytes` at `ptr` are free again (in stream order, as for the pool).
    fn release(&self, ptr: u64, bytes: usize);
}

/// Where a tensor's bytes go back to.
enum Home {
    Pool(Arc<Pool>),
    Owner(Arc<dyn BlockOwner>),
}

/// Device bytes of one tensor; returned to the pool (or their owner) on drop.
pub struct CudaStorage {
    ptr: u64,
    bytes: usize,
    home: Home,
}

impl CudaStorage {
    pub(crate) fn new(ptr: u64, bytes: usize, pool: Arc<Pool>) -> Self {
        CudaStorage {
            ptr,
            bytes,
            home: Home::Pool(pool),
        }
    }
    /// Bytes borrowed from `owner`, handed back to it on drop.
    pub(crate) fn borrowed(ptr: u64, bytes: usize, owner: Arc<dyn BlockOwner>) -> Self {
        CudaStorage {
            ptr,
            bytes,
            home: Home::Owner(owner),
        }
    }
    /// The device address (0 for an empty tensor).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Allocated bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        match &self.home {
            Home::Pool(pool) => pool.free(self.ptr),
            Home::Owner(owner) => owner.release(self.ptr, self.bytes),
        }
    }
}
