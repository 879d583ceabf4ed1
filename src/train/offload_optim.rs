//! `--offload-optimizer`: the F32 master weights and both AdamW moments live
//! in pinned host memory and the update runs on host threads. Gradients stay
//! on the device through the backward (the global norm needs all of them
//! before any update); at the step each slot's F32 gradient streams
//! device→host one slot ahead of the host's update of the slot before, and
//! the updated master goes host→device into the parameter (cast to the
//! compute dtype on the device, as the on-device optimizer casts).
//!
//! A slot is one parameter tensor (whole model on every rank) or one unit's
//! shard (FSDP). The per-element arithmetic is the CPU reference's
//! (`backend::host_adamw`), so results equal the on-device optimizer's.

use crate::backend::host_adamw::adamw_parallel;
use crate::backend::{AdamWStep, Backend, Category, CopyDone, DType, Tensor, cast};
use crate::error::Result;
use std::ops::Range;

/// One slot's parameter, gradient and host-resident optimizer state, and
/// the updates of its element ranges (ranges of one slot may differ in
/// weight decay: a flat FSDP shard holds norm and matrix weights).
pub struct HostSlot<'a, B: Backend> {
    /// `[..]` in the compute dtype, on the device.
    pub param: &'a mut Tensor<B>,
    /// `[..]` F32, on the device.
    pub grad: &'a Tensor<B>,
    /// F32 master, first and second moments: host memory, `param`'s shape.
    pub master: &'a mut Tensor<B>,
    pub m: &'a mut Tensor<B>,
    pub v: &'a mut Tensor<B>,
    pub updates: Vec<(Range<usize>, AdamWStep)>,
}

/// A host-resident F32 copy of `param` (the master weights at start).
pub fn host_master<B: Backend>(b: &B, param: &Tensor<B>) -> Result<Tensor<B>> {
    let mut master = b.empty(param.shape(), DType::F32, Category::Offload)?;
    if param.dtype() == DType::F32 {
        let done = b.copy_start(&mut master, param)?;
        b.copy_finish(done)?;
    } else {
        let wide = cast(b, param, DType::F32, Category::Workspace)?;
        let done = b.copy_start(&mut master, &wide)?;
        b.copy_finish(done)?;
    }
    Ok(master)
}

/// A zero F32 tensor of `shape` in host memory (a moment).
pub fn host_zeros<B: Backend>(b: &B, shape: &[usize]) -> Result<Tensor<B>> {
    let mut t = b.empty(shape, DType::F32, Category::Offload)?;
    if !b.rehearsing() {
        b.host_f32_mut(&mut t)?.fill(0.0);
    }
    Ok(t)
}

/// One optimizer step over `slots`, in order: slot k+1's gradient is on its
/// way to the host while the host updates slot k.
pub fn step_on_host<B: Backend>(b: &B, mut slots: Vec<HostSlot<'_, B>>) -> Result<()> {
    let mut next = match slots.first() {
        Some(s) => Some(start_download(b, s.grad)?),
        None => None,
    };
    for k in 0..slots.len() {
        let Some((grad, done)) = next.take() else {
            break;
        };
        if let Some(s) = slots.get(k + 1) {
            next = Some(start_download(b, s.grad)?);
        }
        b.copy_finish(done)?;
        // a rehearsal computes nothing (and touches no host page)
        if !b.rehearsing() {
            update(b, &mut slots[k], &grad)?;
        }
        drop(grad);
        let slot = &mut slots[k];
        upload(b, slot.param, slot.master)?;
    }
    Ok(())
}

/// Starts copying `grad` into a fresh host buffer.
fn start_download<B: Backend>(b: &B, grad: &Tensor<B>) -> Result<(Tensor<B>, CopyDone)> {
    let mut host = b.empty(grad.shape(), DType::F32, Category::Offload)?;
    let done = b.copy_start(&mut host, grad)?;
    Ok((host, done))
}

/// The host's AdamW update of one slot from its downloaded gradient.
fn update<B: Backend>(b: &B, slot: &mut HostSlot<'_, B>, grad: &Tensor<B>) -> Result<()> {
    let g = b.host_f32(grad)?;
    let master = b.host_f32_mut(slot.master)?;
    let m = b.host_f32_mut(slot.m)?;
    let v = b.host_f32_mut(slot.v)?;
    for (r, hp) in &slot.updates {
        let r = r.clone();
        adamw_parallel(
            &mut master[r.clone()],
            &g[r.clone()],
            &mut m[r.clone()],
            &mut v[r],
            *hp,
        );
    }
    Ok(())
}

/// `param = master`: a direct copy for F32 parameters, else through a
/// device F32 buffer cast on the device.
fn upload<B: Backend>(b: &B, param: &mut Tensor<B>, master: &Tensor<B>) -> Result<()> {
    if param.dtype() == DType::F32 {
        let done = b.copy_start(param, master)?;
        return b.copy_wait(done);
    }
    let mut wide = b.empty(param.shape(), DType::F32, Category::Workspace)?;
    let done = b.copy_start(&mut wide, master)?;
    b.copy_wait(done)?;
    b.copy(param.mat_mut(), wide.mat())
}
