//! Owned cuDNN backend descriptors and typed attribute setters (the only
//! place that calls the raw `cudnnBackend*` functions of cudarc's sys layer).

use crate::error::{Error, Result};
use cudarc::cudnn::sys;
use std::ffi::c_void;

pub use sys::cudnnBackendAttributeName_t as Attr;
use sys::cudnnBackendAttributeType_t as Ty;
pub use sys::cudnnBackendDescriptorType_t as Kind;

/// Turns a cuDNN status into our error, with cuDNN's last error message.
pub fn check(status: sys::cudnnStatus_t, what: &str) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut buf = vec![0 as std::ffi::c_char; 1024];
    // SAFETY: the buffer holds `buf.len()` bytes and cuDNN NUL-terminates it.
    unsafe { sys::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by cuDNN (or all zeros).
    let last = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Err(Error::Backend(format!(
        "cuDNN {what}: {status:?} ({}){}",
        status as u32,
        if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        }
    )))
}

/// One backend descriptor, destroyed on drop.
pub struct Desc {
    raw: sys::cudnnBackendDescriptor_t,
    kind: Kind,
}

// SAFETY: a descriptor is plain host memory owned by this value; cuDNN does not
// tie it to a thread. Execution plans are used under the owner's lock.
unsafe impl Send for Desc {}
// SAFETY: shared access only reads it (execute takes it as const input).
unsafe impl Sync for Desc {}

impl Desc {
    pub fn new(kind: Kind) -> Result<Desc> {
        let mut raw: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) },
            &format!("create {kind:?}"),
        )?;
        Ok(Desc { raw, kind })
    }

    pub fn raw(&self) -> sys::cudnnBackendDescriptor_t {
        self.raw
    }

    fn set(&self, a: Attr, ty: Ty, n: usize, p: *const c_void) -> Result<()> {
        // SAFETY: `p` points at `n` elements of the C type `ty` names (callers
        // below pass slices of exactly that type).
        check(
            unsafe { sys::cudnnBackendSetAttribute(self.raw, a, ty, n as i64, p) },
            &format!("{:?}.{a:?}", self.kind),
        )
    }

    pub fn i64s(&self, a: Attr, v: &[i64]) -> Result<&Self> {
        self.set(a, Ty::CUDNN_TYPE_INT64, v.len(), v.as_ptr().cast())?;
        Ok(self)
    }
    pub fn i64(&self, a: Attr, v: i64) -> Result<&Self> {
        self.i64s(a, &[v])
    }
    pub fn f32(&self, a: Attr, v: f32) -> Result<&Self> {
        self.set(a, Ty::CUDNN_TYPE_FLOAT, 1, (&v as *const f32).cast())?;
        Ok(self)
    }
    pub fn boolean(&self, a: Attr, v: bool) -> Result<&Self> {
        self.set(a, Ty::CUDNN_TYPE_BOOLEAN, 1, (&v as *const bool).cast())?;
        Ok(self)
    }
    pub fn dtype(&self, a: Attr, v: sys::cudnnDataType_t) -> Result<&Self> {
        self.set(
            a,
            Ty::CUDNN_TYPE_DATA_TYPE,
            1,
            &v as *const _ as *const c_void,
        )?;
        Ok(self)
    }
    pub fn pw_mode(&self, a: Attr, v: sys::cudnnPointwiseMode_t) -> Result<&Self> {
        self.set(
            a,
            Ty::CUDNN_TYPE_POINTWISE_MODE,
            1,
            &v as *const _ as *const c_void,
        )?;
        Ok(self)
    }
    pub fn reduce_op(&self, a: Attr, v: sys::cudnnReduceTensorOp_t) -> Result<&Self> {
        self.set(
            a,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            1,
            &v as *const _ as *const c_void,
        )?;
        Ok(self)
    }
    pub fn heur_mode(&self, a: Attr, v: sys::cudnnBackendHeurMode_t) -> Result<&Self> {
        self.set(
            a,
            Ty::CUDNN_TYPE_HEUR_MODE,
            1,
            &v as *const _ as *const c_void,
        )?;
        Ok(self)
    }
    pub fn handle(&self, a: Attr, h: sys::cudnnHandle_t) -> Result<&Self> {
        self.set(a, Ty::CUDNN_TYPE_HANDLE, 1, &h as *const _ as *const c_void)?;
        Ok(self)
    }
    pub fn descs(&self, a: Attr, d: &[&Desc]) -> Result<&Self> {
        let raws: Vec<sys::cudnnBackendDescriptor_t> = d.iter().map(|x| x.raw).collect();
        self.set(
            a,
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            raws.len(),
            raws.as_ptr().cast(),
        )?;
        Ok(self)
    }
    pub fn desc(&self, a: Attr, d: &Desc) -> Result<&Self> {
        self.descs(a, &[d])
    }
    pub fn ptrs(&self, a: Attr, p: &[*mut c_void]) -> Result<&Self> {
        self.set(a, Ty::CUDNN_TYPE_VOID_PTR, p.len(), p.as_ptr().cast())?;
        Ok(self)
    }

    pub fn finalize(&self) -> Result<&Self> {
        // SAFETY: `raw` is a live descriptor.
        check(
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            &format!("finalize {:?}", self.kind),
        )?;
        Ok(self)
    }

    /// Reads one attribute of cuDNN type `ty` into a `T`.
    ///
    /// # Safety
    /// `T` is the C type `ty` names (`i64` for INT64, a 4-byte C enum for
    /// KNOB_TYPE): cuDNN writes one such element into it.
    unsafe fn get_one<T: Default>(&self, a: Attr, ty: Ty) -> Result<T> {
        let mut v = T::default();
        let mut n: i64 = 0;
        // SAFETY: room for one element of `ty` (the caller's contract).
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(self.raw, a, ty, 1, &mut n, (&mut v as *mut T).cast())
            },
            &format!("get {:?}.{a:?}", self.kind),
        )?;
        Ok(v)
    }

    /// Reads one INT64 attribute.
    pub fn get_i64(&self, a: Attr) -> Result<i64> {
        // SAFETY: INT64 is an `i64`.
        unsafe { self.get_one(a, Ty::CUDNN_TYPE_INT64) }
    }

    /// Reads one knob-type attribute (a C enum) as its number.
    pub fn get_knob_type(&self, a: Attr) -> Result<u32> {
        // SAFETY: `cudnnBackendKnobType_t` is a 4-byte C enum.
        unsafe { self.get_one(a, Ty::CUDNN_TYPE_KNOB_TYPE) }
    }

    /// Reads up to `out.len()` descriptors into pre-created `out`; returns how many were written.
    pub fn get_descs(&self, a: Attr, out: &[Desc]) -> Result<usize> {
        let mut raws: Vec<sys::cudnnBackendDescriptor_t> = out.iter().map(|d| d.raw).collect();
        let mut n: i64 = 0;
        // SAFETY: `raws` holds `out.len()` created descriptors cuDNN fills in place.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(
                    self.raw,
                    a,
                    Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    raws.len() as i64,
                    &mut n,
                    raws.as_mut_ptr().cast(),
                )
            },
            &format!("get {:?}.{a:?}", self.kind),
        )?;
        Ok((n.max(0) as usize).min(out.len()))
    }

    /// Number of elements of an attribute (asks with room for none).
    pub fn count(&self, a: Attr, ty_backend_desc: bool) -> Result<usize> {
        let mut n: i64 = 0;
        let ty = if ty_backend_desc {
            Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR
        } else {
            Ty::CUDNN_TYPE_INT64
        };
        // SAFETY: requestedElementCount 0 writes nothing but the count.
        check(
            unsafe {
                sys::cudnnBackendGetAttribute(self.raw, a, ty, 0, &mut n, std::ptr::null_mut())
            },
            &format!("count {:?}.{a:?}", self.kind),
        )?;
        Ok(n.max(0) as usize)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once.
        unsafe {
            sys::cudnnBackendDestroyDescriptor(self.raw);
        }
    }
}
