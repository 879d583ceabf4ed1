//! `CudaBackend`'s memory ops: allocation (the stream-ordered pool, or pinned
//! host memory for `Category::Offload` tensors) and borrowed blocks (`adopt`),
//! uploads and downloads, host views of offloaded tensors, `zeros` and
//! `zero_raw`, whole-tensor copies on the copy stream beside compute
//! (`copy_start`, [`CopyEvent`]) and the strided 2-D copy or cast (`copy`,
//! [`RowCopy`]).

use super::attention::dt_flag;
use super::backend::{CudaBackend, dt, ptr, ptr_at};
use super::device::drv;
use super::kernels::Args;
use super::pool::{self, AllocError, CudaStorage};
use crate::backend::{
    Backend, Category, ComputePoint, CopyDone, DType, HostValues, HostValuesMut, Mat, MatMut,
    Tensor,
};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, result};
use std::sync::Arc;

/// A copy on the copy stream, finished when `done` fires.
struct CopyEvent {
    done: cudarc::driver::CudaEvent,
    compute: Arc<CudaStream>,
}

impl crate::backend::InFlight for CopyEvent {
    fn order(&self) -> Result<()> {
        drv(self.compute.wait(&self.done), "stream wait")
    }
    fn finish(self: Box<Self>) -> Result<()> {
        drv(self.done.synchronize(), "event synchronize")
    }
}

impl CudaBackend {
    /// Queues `dst = src` on the copy stream after `ready` (an event of the
    /// compute stream).
    fn copy_after(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        ready: &cudarc::driver::CudaEvent,
    ) -> Result<CopyDone> {
        drv(self.copy_stream.wait(ready), "stream wait")?;
        let span = self.profile.span("copy_start", &self.copy_stream)?;
        // SAFETY: both tensors hold `bytes` bytes (`check_copy`) and stay
        // alive until `copy_wait` (the caller's contract); unified addressing
        // lets cuMemcpyAsync take pinned host and device addresses alike.
        let rc = unsafe {
            cudarc::driver::sys::cuMemcpyAsync(
                ptr(dst),
                ptr(src),
                src.bytes(),
                self.copy_stream.cu_stream(),
            )
        };
        drv(rc.result(), "cuMemcpyAsync (copy stream)")?;
        drop(span);
        let done = drv(self.copy_stream.record_event(None), "record event")?;
        Ok(CopyDone::in_flight(Box::new(CopyEvent {
            done,
            compute: self.stream.clone(),
        })))
    }
}

/// A copy takes whole tensors of one shape and dtype.
fn check_copy(dst: &Tensor<CudaBackend>, src: &Tensor<CudaBackend>) -> Result<()> {
    if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
        return Err(Error::Backend(format!(
            "copy_start: {:?} {:?} <- {:?} {:?} (whole tensors of one shape and dtype)",
            dst.shape(),
            dst.dtype(),
            src.shape(),
            src.dtype()
        )));
    }
    Ok(())
}

/// A host-resident (offload) tensor's values as F32: F32 elements, BF16
/// bits widened exactly, or 8-bit codes as integers.
fn host_to_f32(t: &Tensor<CudaBackend>) -> Result<Vec<f32>> {
    let n = t.numel();
    // SAFETY: an Offload tensor is `numel` elements of its dtype in pinned
    // host memory that lives as long as `t`; the caller has waited for the
    // copies into it.
    Ok(match t.dtype() {
        DType::F32 => unsafe { std::slice::from_raw_parts(ptr(t) as *const f32, n) }.to_vec(),
        DType::BF16 => unsafe { std::slice::from_raw_parts(ptr(t) as *const u16, n) }
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect(),
        DType::U8 => unsafe { std::slice::from_raw_parts(ptr(t) as *const u8, n) }
            .iter()
            .map(|&c| f32::from(c))
            .collect(),
        dtype => {
            return Err(Error::Backend(format!(
                "host read of a {dtype:?} offload tensor: only F32, BF16 and U8"
            )));
        }
    })
}

/// Checks that `t` is an F32 tensor in pinned host memory.
fn host_resident(t: &Tensor<CudaBackend>) -> Result<()> {
    if t.category() != Category::Offload || t.dtype() != DType::F32 {
        return Err(Error::Backend(format!(
            "host access to a {:?} {} tensor: only F32 host-resident (offload) tensors",
            t.dtype(),
            t.category().name()
        )));
    }
    Ok(())
}

/// A copy (or cast) of rows of `cols` contiguous elements between two
/// byte-strided places.
#[derive(Debug, Clone, Copy)]
struct RowCopy {
    dst: u64,
    dst_row: usize,
    src: u64,
    src_row: usize,
    cols: usize,
}

impl RowCopy {
    /// Whether every row on both sides starts on a 16-byte boundary, so the
    /// copy can move whole 16-byte vectors (`copy_rows16`, `cast_rows8`).
    fn aligned(&self) -> bool {
        self.dst.is_multiple_of(16)
            && self.src.is_multiple_of(16)
            && self.dst_row.is_multiple_of(16)
            && self.src_row.is_multiple_of(16)
    }

    /// Whether rows are whole groups of `per` elements (and not empty).
    fn whole_vectors(&self, per: usize) -> bool {
        self.cols > 0 && self.cols.is_multiple_of(per)
    }
}

impl CudaBackend {
    /// Limits the pinned host memory offloaded tensors may take (`None`: no limit).
    pub fn set_host_budget(&self, bytes: Option<usize>) {
        self.host_pool.set_budget(bytes);
    }

    /// Pinned host bytes held for offloaded tensors.
    pub fn host_pinned(&self) -> usize {
        self.host_pool.pinned()
    }

    /// An uninitialised tensor; `Category::Offload` tensors live in pinned
    /// host memory (only `copy_start` may touch them).
    pub fn alloc(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let storage = self.storage(shape, dtype, cat)?;
        Ok(Tensor::from_parts(
            storage,
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    /// The memory of an uninitialised tensor ([`alloc`](Self::alloc)): a
    /// block of the stream-ordered pool, or of pinned host memory for
    /// `Category::Offload`.
    pub(super) fn storage(
        &self,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<CudaStorage> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        if cat == Category::Offload {
            let p = self.host_pool.alloc(bytes)?;
            let owner: Arc<dyn pool::BlockOwner> = self.host_pool.clone();
            return Ok(CudaStorage::borrowed(p, bytes, owner));
        }
        match self.pool.alloc(bytes) {
            Ok(p) => Ok(CudaStorage::new(p, bytes, self.pool.clone())),
            Err(AllocError::OutOfMemory) => Err(crate::backend::out_of_memory(
                &self.name,
                &self.ledger,
                bytes,
                self.pool.failure_state(),
            )),
            Err(AllocError::Other(e)) => Err(e),
        }
    }

    /// A tensor over `bytes` of device memory that `owner` lends (an
    /// exchange window); counted by the ledger like any tensor of `cat`.
    pub fn adopt(
        &self,
        ptr: u64,
        bytes: usize,
        owner: Arc<dyn pool::BlockOwner>,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        let need = shape.iter().product::<usize>() * dtype.size();
        if need != bytes {
            return Err(Error::Backend(format!(
                "adopt: {shape:?} {dtype:?} needs {need} bytes, the block has {bytes}"
            )));
        }
        Ok(Tensor::from_parts(
            CudaStorage::borrowed(ptr, bytes, owner),
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    /// Uploads 32-bit ids into a workspace tensor (stored as 4-byte elements).
    pub(super) fn upload_ids(&self, ids: &[u32]) -> Result<Tensor<Self>> {
        let t = self.alloc(&[ids.len()], DType::F32, Category::Workspace)?;
        if !ids.is_empty() {
            // SAFETY: `t` holds ids.len() 4-byte elements; the pageable source is
            // staged before the call returns.
            drv(
                unsafe { result::memcpy_htod_async(ptr(&t), ids, self.stream.cu_stream()) },
                "upload ids",
            )?;
        }
        Ok(t)
    }

    /// Zeroes `bytes` bytes at a raw device address, queued on the stream.
    pub fn zero_raw(&self, p: u64, bytes: usize) -> Result<()> {
        let _span = self.span("memset")?;
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers pass an address inside a live allocation of this
        // backend with `bytes` bytes after it, ordered on this stream.
        drv(
            unsafe { result::memset_d8_async(p, 0, bytes, self.stream.cu_stream()) },
            "memset",
        )
    }

    pub(super) fn copy_start_impl(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
    ) -> Result<CopyDone> {
        check_copy(dst, src)?;
        if src.bytes() == 0 {
            return Ok(CopyDone::finished());
        }
        self.bind()?;
        // the copy runs after the compute queued so far, on the copy stream
        let ready = drv(self.stream.record_event(None), "record event")?;
        self.copy_after(dst, src, &ready)
    }

    pub(super) fn compute_point_impl(&self) -> Result<ComputePoint> {
        self.bind()?;
        let now = drv(self.stream.record_event(None), "record event")?;
        Ok(ComputePoint::marker(Box::new(now)))
    }

    pub(super) fn copy_start_from_impl(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        since: &ComputePoint,
    ) -> Result<CopyDone> {
        let Some(point) = since.get::<cudarc::driver::CudaEvent>() else {
            return self.copy_start(dst, src);
        };
        check_copy(dst, src)?;
        if src.bytes() == 0 {
            return Ok(CopyDone::finished());
        }
        self.bind()?;
        self.copy_after(dst, src, point)
    }

    pub(super) fn host_f32_impl<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        host_resident(t)?;
        if t.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: an Offload tensor is `numel` f32 of pinned host memory
        // (checked above) that lives as long as `t`; the caller has waited
        // for the copies into it.
        Ok(unsafe { std::slice::from_raw_parts(ptr(t) as *const f32, t.numel()) })
    }

    pub(super) fn host_values_impl<'t>(&self, t: &'t Tensor<Self>) -> Result<HostValues<'t>> {
        if t.dtype() != DType::BF16 {
            return self.host_f32_impl(t).map(HostValues::F32);
        }
        if t.category() != Category::Offload {
            return Err(Error::Backend(format!(
                "host access to a BF16 {} tensor: only host-resident (offload) tensors",
                t.category().name()
            )));
        }
        if t.numel() == 0 {
            return Ok(HostValues::Bf16(&[]));
        }
        // SAFETY: a BF16 Offload tensor is `numel` u16 of pinned host memory
        // that lives as long as `t`; the caller has waited for the copies
        // into it.
        let bits = unsafe { std::slice::from_raw_parts(ptr(t) as *const u16, t.numel()) };
        Ok(HostValues::Bf16(bits))
    }

    pub(super) fn host_bf16_mut_impl<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [u16]> {
        if t.category() != Category::Offload || t.dtype() != DType::BF16 {
            return Err(Error::Backend(format!(
                "host bf16 access to a {:?} {} tensor: only BF16 host-resident (offload) tensors",
                t.dtype(),
                t.category().name()
            )));
        }
        if t.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: a BF16 Offload tensor is `numel` u16 of pinned host memory
        // that lives as long as `t`, borrowed mutably here; no copy out of
        // it is in flight (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr(t) as *mut u16, t.numel()) })
    }

    pub(super) fn host_values_mut_impl<'t>(
        &self,
        t: &'t mut Tensor<Self>,
    ) -> Result<HostValuesMut<'t>> {
        match t.dtype() {
            DType::F32 => self.host_f32_mut_impl(t).map(HostValuesMut::F32),
            DType::BF16 => self.host_bf16_mut_impl(t).map(HostValuesMut::Bf16),
            DType::U8 if t.category() == Category::Offload => {
                if t.numel() == 0 {
                    return Ok(HostValuesMut::U8(&mut []));
                }
                // SAFETY: a U8 Offload tensor is `numel` bytes of pinned host
                // memory that lives as long as `t`, borrowed mutably here; no
                // copy out of it is in flight (the caller's contract).
                let codes = unsafe { std::slice::from_raw_parts_mut(ptr(t) as *mut u8, t.numel()) };
                Ok(HostValuesMut::U8(codes))
            }
            dtype => Err(Error::Backend(format!(
                "host access to a {dtype:?} {} tensor: only F32, BF16 and U8 host-resident (offload) \
                 tensors",
                t.category().name()
            ))),
        }
    }

    pub(super) fn host_f32_mut_impl<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        host_resident(t)?;
        if t.numel() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `host_f32`; `t` is borrowed mutably, so this is the
        // only view, and no copy out of it is in flight (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr(t) as *mut f32, t.numel()) })
    }

    pub(super) fn zeros_impl(
        &self,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        let _span = self.span("memset")?;
        self.bind()?;
        let t = self.alloc(shape, dtype, cat)?;
        if t.bytes() > 0 {
            // SAFETY: `t` owns `bytes` bytes, ordered on this stream.
            drv(
                unsafe { result::memset_d8_async(ptr(&t), 0, t.bytes(), self.stream.cu_stream()) },
                "memset",
            )?;
        }
        Ok(t)
    }

    pub(super) fn tensor_from_host_impl(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(Error::Backend(format!(
                "from_host: {} values for shape {shape:?}",
                data.len()
            )));
        }
        self.bind()?;
        let mut t = self.alloc(shape, dtype, cat)?;
        self.upload(&mut t, data)?;
        Ok(t)
    }

    pub(super) fn upload_impl(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()> {
        if data.len() != t.numel() {
            return Err(Error::Backend(format!(
                "upload: {} values into a tensor of shape {:?}",
                data.len(),
                t.shape()
            )));
        }
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let _span = self.span("upload")?;
        if t.category() == Category::Offload {
            // host memory: written here once no copy out of it is in flight
            self.synchronize()?;
            drv(self.copy_stream.synchronize(), "copy stream synchronize")?;
            match self.host_values_mut_impl(t)? {
                HostValuesMut::F32(cells) => cells.copy_from_slice(data),
                HostValuesMut::Bf16(bits) => {
                    let rounded = data.iter().map(|&x| half::bf16::from_f32(x).to_bits());
                    bits.iter_mut().zip(rounded).for_each(|(b, r)| *b = r);
                }
                HostValuesMut::U8(codes) => {
                    codes.copy_from_slice(&crate::backend::narrow::codes_of(data)?)
                }
            }
            return Ok(());
        }
        let s = self.stream.cu_stream();
        // SAFETY: `t` holds exactly data.len() elements of its dtype; pageable
        // sources are staged before the copy call returns.
        match t.dtype() {
            DType::F32 => drv(
                unsafe { result::memcpy_htod_async(ptr(t), data, s) },
                "upload",
            ),
            DType::BF16 => {
                use rayon::prelude::*;
                let h: Vec<u16> = data
                    .par_iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                drv(
                    unsafe { result::memcpy_htod_async(ptr(t), &h, s) },
                    "upload",
                )
            }
            DType::U8 => {
                let h = crate::backend::narrow::codes_of(data)?;
                drv(
                    unsafe { result::memcpy_htod_async(ptr(t), &h, s) },
                    "upload",
                )
            }
            DType::F8E4M3 | DType::F8E5M2 => {
                let f = t
                    .dtype()
                    .fp8_format()
                    .ok_or_else(|| Error::Backend("fp8".into()))?;
                let h: Vec<u8> = data.iter().map(|&x| f.encode(x)).collect();
                drv(
                    unsafe { result::memcpy_htod_async(ptr(t), &h, s) },
                    "upload",
                )
            }
        }
    }

    pub(super) fn to_host_impl(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        self.bind()?;
        let n = t.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        if t.category() == Category::Offload {
            // host memory already: once the copies into it are done
            self.synchronize()?;
            drv(self.copy_stream.synchronize(), "copy stream synchronize")?;
            return host_to_f32(t);
        }
        // the copy into pageable memory blocks inside the driver until the
        // stream reaches it: let queued work (maybe a collective) finish first
        self.wait_idle()?;
        let _span = self.span("download")?;
        let s = self.stream.cu_stream();
        let out = match t.dtype() {
            DType::F32 => {
                let mut v = vec![0f32; n];
                // SAFETY: `t` holds n f32 values; we wait for the stream below.
                drv(
                    unsafe { result::memcpy_dtoh_async(&mut v, ptr(t), s) },
                    "download",
                )?;
                self.synchronize()?;
                v
            }
            DType::BF16 => {
                let mut v = vec![0u16; n];
                // SAFETY: `t` holds n bf16 values; we wait for the stream below.
                drv(
                    unsafe { result::memcpy_dtoh_async(&mut v, ptr(t), s) },
                    "download",
                )?;
                self.synchronize()?;
                v.into_iter()
                    .map(|b| half::bf16::from_bits(b).to_f32())
                    .collect()
            }
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => {
                let mut v = vec![0u8; n];
                // SAFETY: `t` holds n bytes; we wait for the stream below.
                drv(
                    unsafe { result::memcpy_dtoh_async(&mut v, ptr(t), s) },
                    "download",
                )?;
                self.synchronize()?;
                match t.dtype().fp8_format() {
                    Some(f) => v.into_iter().map(|c| f.decode(c)).collect(),
                    None => v.into_iter().map(f32::from).collect(),
                }
            }
        };
        Ok(out)
    }

    pub(super) fn copy_impl(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        let _span = self.span_shaped("copy", || {
            format!(
                "{}x{} {:?}->{:?} strides {:?}->{:?}",
                src.l.rows,
                src.l.cols,
                src.t.dtype(),
                dst.t.dtype(),
                src.l.strides(),
                dst.l.strides()
            )
        })?;
        if dst.l.rows != src.l.rows || dst.l.cols != src.l.cols {
            return Err(Error::Backend(format!(
                "copy shapes: {:?} <- {:?}",
                dst.l, src.l
            )));
        }
        self.bind()?;
        let (drs, dcs) = dst.l.strides();
        let (srs, scs) = src.l.strides();
        let (sdt, ddt) = (src.t.dtype(), dst.t.dtype());
        let (d0, s0) = (ptr_at(dst.t, dst.l.offset), ptr_at(src.t, src.l.offset));
        let rows = RowCopy {
            dst: d0,
            dst_row: drs * ddt.size(),
            src: s0,
            src_row: srs * sdt.size(),
            cols: src.l.cols,
        };
        if dcs == 1 && scs == 1 && rows.aligned() {
            if sdt == ddt && rows.whole_vectors(16 / sdt.size()) {
                let vecs = rows.cols * sdt.size() / 16;
                let args = Args::new()
                    .ptr(d0)
                    .usize(rows.dst_row)
                    .ptr(s0)
                    .usize(rows.src_row)
                    .usize(src.l.rows)
                    .usize(vecs);
                return self.launch1d(self.kernels.copy_rows16, src.l.rows * vecs, args);
            }
            if sdt != ddt && rows.whole_vectors(8) {
                let groups = rows.cols / 8;
                let args = Args::new()
                    .ptr(d0)
                    .i32(dt_flag(ddt))
                    .usize(rows.dst_row)
                    .ptr(s0)
                    .i32(dt_flag(sdt))
                    .usize(rows.src_row)
                    .usize(src.l.rows)
                    .usize(groups);
                return self.launch1d(self.kernels.cast_rows8, src.l.rows * groups, args);
            }
        }
        let args = Args::new()
            .ptr(ptr(dst.t))
            .i32(dt(dst.t))
            .usize(dst.l.offset)
            .usize(drs)
            .usize(dcs)
            .ptr(ptr(src.t))
            .i32(dt(src.t))
            .usize(src.l.offset)
            .usize(srs)
            .usize(scs)
            .usize(src.l.rows)
            .usize(src.l.cols);
        self.launch1d(self.kernels.copy2d, src.l.rows * src.l.cols, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_copies_vectorize_only_on_whole_aligned_16_byte_rows() {
        // a bf16 head block: 128 columns out of a 4096-wide row
        let head = RowCopy {
            dst: 1 << 20,
            dst_row: 256,
            src: (1 << 20) + 256,
            src_row: 8192,
            cols: 128,
        };
        assert!(head.aligned() && head.whole_vectors(8));
        assert!(!RowCopy { cols: 12, ..head }.whole_vectors(8));
        assert!(!RowCopy { cols: 0, ..head }.whole_vectors(8));
        for odd in [
            RowCopy {
                src: head.src + 2,
                ..head
            },
            RowCopy {
                dst: head.dst + 8,
                ..head
            },
            RowCopy {
                src_row: 8194,
                ..head
            },
            RowCopy {
                dst_row: 264,
                ..head
            },
        ] {
            assert!(!odd.aligned(), "{odd:?}");
        }
    }
}
