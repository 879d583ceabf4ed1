//! The one optimizer op every device runs: a fused update of a step's
//! slots ([`Backend::fused_update`](super::Backend::fused_update)), whose
//! arithmetic the optimizer supplies through an [`UpdateKernel`]: a host
//! function for the CPU reference, and for a GPU a CUDA C program with the
//! launches that run it. The backend only lends the slots' tensors (host
//! cells, or device addresses) and runs what it is given; it knows no
//! optimizer's formulas or state.

use super::{DType, Tensor, TensorDevice};
use crate::error::Result;

/// One slot of a fused update: the tensors it writes (weights, optimizer
/// state, copies of the weights) and those it only reads (the gradient),
/// each in the order its kernel names them.
pub struct UpdateSlot<'a, B: TensorDevice> {
    pub written: Vec<&'a mut Tensor<B>>,
    pub read: Vec<&'a Tensor<B>>,
}

/// A written tensor on the host: the CPU reference's cells, one f32 per
/// element whatever the dtype (a BF16 tensor's cells hold BF16 values, a
/// U8 tensor's its codes as integers).
pub struct HostCellsMut<'s> {
    pub dtype: DType,
    pub cells: &'s mut [f32],
}

/// A read tensor on the host ([`HostCellsMut`], read-only).
pub struct HostCells<'s> {
    pub dtype: DType,
    pub cells: &'s [f32],
}

/// One slot's tensors on the host, in [`UpdateSlot`]'s order.
pub struct HostSlot<'s> {
    pub written: Vec<HostCellsMut<'s>>,
    pub read: Vec<HostCells<'s>>,
}

/// A tensor on a GPU: its first element's device address and its dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTensor {
    pub addr: u64,
    pub dtype: DType,
}

/// One slot's tensors on a GPU, in [`UpdateSlot`]'s order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSlot {
    pub written: Vec<DeviceTensor>,
    pub read: Vec<DeviceTensor>,
}

/// An update's CUDA C program: source files compiled, in order, after the
/// device's common helpers (`cuda/kernels/common.cu`: `i64`, `bf16_t`,
/// the `DT_*` dtype codes, `ld`, `st`, `f2bf`), once per backend; `name`
/// tells programs apart.
#[derive(Debug, Clone, Copy)]
pub struct DeviceProgram {
    pub name: &'static str,
    pub sources: &'static [(&'static str, &'static str)],
}

/// One kernel launch of an update: `function` of the program, enough
/// blocks of `block` threads for `threads` threads (capped: kernels loop
/// grid-stride), and its parameters, each as the 8-byte words of its value
/// (a struct passed by value is several words). No launch for 0 threads.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub function: &'static str,
    pub threads: usize,
    pub block: u32,
    pub params: Vec<Vec<u64>>,
}

/// The arithmetic of one fused update, supplied by an optimizer. Its
/// caller checks the slots (lengths, dtypes, element ranges) before the
/// update: a kernel indexes what it was given.
pub trait UpdateKernel {
    /// The op's name in profiles (`adamw_multi`).
    fn name(&self) -> &'static str;
    /// Updates slot `k` (the `k`-th slot of the call) on the host.
    fn host(&self, k: usize, slot: HostSlot<'_>) -> Result<()>;
    /// The CUDA C program of the update.
    fn device_program(&self) -> DeviceProgram;
    /// The launches, in order, that update `slots` (the call's slots) with
    /// [`device_program`](UpdateKernel::device_program).
    fn launches(&self, slots: &[DeviceSlot]) -> Result<Vec<Launch>>;
}
