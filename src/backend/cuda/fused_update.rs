//! `CudaBackend`'s fused optimizer update ([`Backend::fused_update`]): the
//! kernel's program (its sources after `common.cu`) compiled on first use
//! and kept by the backend, then the kernel's launches queued on the
//! stream over the slots' device addresses.

use super::backend::{CudaBackend, ptr};
use super::kernels::{Args, ProgramModule, grid_for, launch, program_source};
#[cfg(doc)]
use crate::backend::Backend;
use crate::backend::fused_update::{DeviceProgram, DeviceSlot, DeviceTensor};
use crate::backend::{Tensor, UpdateKernel, UpdateSlot};
use crate::error::{Error, Result};
use std::sync::Arc;

impl CudaBackend {
    pub(super) fn fused_update_impl(
        &self,
        kernel: &dyn UpdateKernel,
        slots: &mut [UpdateSlot<'_, Self>],
    ) -> Result<()> {
        let _span = self.span(kernel.name())?;
        let device: Vec<DeviceSlot> = (slots.iter())
            .map(|s| DeviceSlot {
                written: s.written.iter().map(|t| device_tensor(t)).collect(),
                read: s.read.iter().map(|t| device_tensor(t)).collect(),
            })
            .collect();
        let launches = kernel.launches(&device)?;
        if launches.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let program = self.program(kernel.device_program())?;
        for l in launches.into_iter().filter(|l| l.threads > 0) {
            let f = program.function(l.function)?;
            let args = (l.params.iter()).fold(Args::new(), |args, p| args.words(p));
            launch(
                &self.stream,
                f,
                grid_for(l.threads, l.block),
                l.block,
                0,
                args,
            )?;
        }
        Ok(())
    }

    /// Program `p`'s module, compiled and loaded on its first use.
    fn program(&self, p: DeviceProgram) -> Result<Arc<ProgramModule>> {
        let mut programs = (self.programs.lock())
            .map_err(|_| Error::Backend("the update programs' table was poisoned".into()))?;
        if let Some(m) = programs.get(p.name) {
            return Ok(m.clone());
        }
        let m = Arc::new(ProgramModule::load(&program_source(p), &self.arch)?);
        programs.insert(p.name, m.clone());
        Ok(m)
    }
}

/// A tensor's device address and dtype.
fn device_tensor(t: &Tensor<CudaBackend>) -> DeviceTensor {
    DeviceTensor {
        addr: ptr(t),
        dtype: t.dtype(),
    }
}
