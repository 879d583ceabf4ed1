//! Driver-level device queries and error conversion.

use super::libs::{self, Lib};
use crate::error::{Error, Result};
use cudarc::driver::{result, sys};

/// Converts a driver error into ours, saying what was being done.
pub(crate) fn drv<T>(r: std::result::Result<T, result::DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| Error::Backend(format!("CUDA driver: {what}: {e:?}")))
}

/// One GPU as `upipe info` shows it.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_mem: usize,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
}

/// Loads the driver library and initialises it. Never panics.
pub fn init_driver() -> Result<()> {
    libs::load(Lib::Cuda)?;
    drv(result::init(), "cuInit")
}

/// The CUDA version the driver supports, e.g. `(13, 0)`.
pub fn driver_version() -> Result<(i32, i32)> {
    init_driver()?;
    let mut v = 0;
    // SAFETY: the driver library is loaded; `v` is a valid out pointer.
    drv(
        unsafe { sys::cuDriverGetVersion(&mut v) }.result(),
        "cuDriverGetVersion",
    )?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// Every visible GPU.
pub fn gpus() -> Result<Vec<GpuInfo>> {
    init_driver()?;
    let n = drv(result::device::get_count(), "cuDeviceGetCount")?;
    let mut out = Vec::new();
    for i in 0..n {
        let dev = drv(result::device::get(i), "cuDeviceGet")?;
        let attr = |a| {
            // SAFETY: `dev` is a valid device handle.
            drv(
                unsafe { result::device::get_attribute(dev, a) },
                "cuDeviceGetAttribute",
            )
        };
        use sys::CUdevice_attribute_enum as A;
        out.push(GpuInfo {
            ordinal: i as usize,
            name: drv(result::device::get_name(dev), "cuDeviceGetName")?,
            // SAFETY: `dev` is a valid device handle.
            total_mem: drv(
                unsafe { result::device::total_mem(dev) },
                "cuDeviceTotalMem",
            )?,
            compute_capability: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        });
    }
    Ok(out)
}
