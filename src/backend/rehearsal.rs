//! Rehearsal: a backend that stands in front of a device, allocating
//! exactly what the device would for a workload and computing nothing.
//!
//! [`Rehearsal<D>`] wraps a [`Rehearsable`] device `D`: every tensor comes
//! from `D`'s own allocator (the CPU's zeroed pages, CUDA's stream-ordered
//! pool and pinned host pool), so its ledger and pools are the device's,
//! byte for byte; every op checks its arguments' shapes (not their data: a
//! rehearsal's token ids are zeros it never reads), takes the buffers the
//! device's op takes for itself (what the device's [`OpBuffers`] answer:
//! a GEMM workspace, uploaded token ids, a reduction's accumulator,
//! attention's scratch and kept workspaces, sized and routed by the device
//! itself) and launches, copies and computes nothing.
//! Host reads (`to_host`, `sum_squares`) return zeros. The real backends
//! hold no rehearsal code: this file is the whole of it, and
//! `comm::counting` is its process groups.
//!
//! `upipe train --rehearse` runs the trainer on `Rehearsal<CpuBackend>` or
//! `Rehearsal<CudaBackend>`; the memory planner runs it on a device of no
//! memory ([`CountingBackend`](super::counting::CountingBackend), a
//! `Rehearsal<Counted>`). The engine above asks one question,
//! [`Backend::rehearsing`], only where it would read or write host data
//! (initial weights, RoPE tables, token ids, the host optimizer).

use super::norm_args::{AddRmsNormFwd, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
use super::op_buffers::poisoned;
pub use super::op_buffers::{AttnBuffers, AttnBwdDtypes, AttnShape, OpBuffers};
use super::{
    AttentionBwd, AttentionFwd, Backend, Category, DType, LseMerge, MatLayout, MatMut,
    MemoryLedger, Tensor, TensorDevice, UpdateKernel, UpdateSlot,
};
use super::{Mat, check_same_numel};
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use crate::backend::{GatedAct, PoolReport};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, OnceLock};

/// What a device lends a [`Rehearsal`]: its allocator, and the buffers its
/// ops take for themselves.
pub trait Rehearsable: Send + Sync + 'static {
    /// Storage of one of the device's tensors.
    type Storage: Send + Sync;

    /// The device's name (the rehearsal's too).
    fn device_name(&self) -> String;
    /// The device's byte ledger (the rehearsal records in it).
    fn device_ledger(&self) -> &Arc<MemoryLedger>;
    /// The buffers the device's ops take for themselves, as it sizes them.
    fn op_buffers(&self) -> &dyn OpBuffers;
    /// Storage for a tensor of `shape` from the device's allocator, exactly
    /// as its own allocations take it (same pool, same host memory), never
    /// written; an error where the device refuses the dtype or is out of
    /// memory.
    fn alloc_unwritten(
        &self,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Self::Storage>;
    /// As [`Backend::pool_report`].
    fn device_pool_report(&self) -> Result<Option<PoolReport>> {
        Ok(None)
    }
}

impl<T: Rehearsable> Rehearsable for Arc<T> {
    type Storage = T::Storage;
    fn device_name(&self) -> String {
        (**self).device_name()
    }
    fn device_ledger(&self) -> &Arc<MemoryLedger> {
        (**self).device_ledger()
    }
    fn op_buffers(&self) -> &dyn OpBuffers {
        (**self).op_buffers()
    }
    fn alloc_unwritten(
        &self,
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Self::Storage> {
        (**self).alloc_unwritten(shape, dtype, cat)
    }
    fn device_pool_report(&self) -> Result<Option<PoolReport>> {
        (**self).device_pool_report()
    }
}

/// A [`Backend`] that allocates on `D` what `D` would and computes nothing
/// (module docs).
pub struct Rehearsal<D: Rehearsable> {
    /// The cuBLASLt workspace, taken at the first GEMM that needs one.
    gemm_workspace: OnceLock<Tensor<Rehearsal<D>>>,
    /// cuDNN's execution workspace, kept between calls and grown.
    attn_workspace: Mutex<Option<Tensor<Rehearsal<D>>>>,
    /// The last documents-masked call's key bounds (`[2·sq]` 4-byte
    /// elements), kept as `CudaBackend` keeps them.
    mask_bounds: Mutex<Option<Tensor<Rehearsal<D>>>>,
    /// Run every iteration of the engine's alike loops (tests), rather
    /// than only those that can allocate differently.
    every_iteration: bool,
    device: D,
}

impl<D: Rehearsable> Rehearsal<D> {
    /// A rehearsal on `device` (set up before the first allocation of the
    /// workload it rehearses: its kept buffers start empty).
    pub fn on(device: D) -> Self {
        Rehearsal {
            gemm_workspace: OnceLock::new(),
            attn_workspace: Mutex::new(None),
            mask_bounds: Mutex::new(None),
            every_iteration: false,
            device,
        }
    }

    /// This rehearsal running every iteration of the engine's loops whose
    /// iterations allocate alike ([`Backend::collapses_alike_iterations`]):
    /// slower, and what the collapsed rehearsal must equal.
    pub fn every_iteration(mut self) -> Self {
        self.every_iteration = true;
        self
    }

    /// The device it allocates on.
    pub fn device(&self) -> &D {
        &self.device
    }

    fn rules(&self) -> &dyn OpBuffers {
        self.device.op_buffers()
    }

    /// A tensor of `shape` from the device's allocator, unwritten.
    fn alloc(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let storage = self.device.alloc_unwritten(shape, dtype, cat)?;
        Ok(Tensor::from_parts(
            storage,
            shape,
            dtype,
            cat,
            self.device.device_ledger().clone(),
        ))
    }

    /// The GEMM workspace of `bytes` (if any), taken by the first GEMM that
    /// multiplies something (`nonempty`) and kept.
    fn keep_gemm_workspace(&self, bytes: Option<usize>, nonempty: bool) -> Result<()> {
        if let Some(bytes) = bytes.filter(|_| nonempty)
            && self.gemm_workspace.get().is_none()
        {
            let t = self.alloc(&[bytes / 4], DType::F32, Category::Workspace)?;
            // another thread won the race: ours is released
            let _ = self.gemm_workspace.set(t);
        }
        Ok(())
    }

    /// A transient buffer the op frees before it returns.
    fn scratch(&self, elems: usize, dtype: DType) -> Result<Tensor<Self>> {
        self.alloc(&[elems], dtype, Category::Workspace)
    }

    /// The device's upload of 32-bit ids into a workspace for the op's
    /// duration, where it uploads them.
    fn ids_upload(&self, ids: &[u32]) -> Result<Option<Tensor<Self>>> {
        match self.rules().uploads_ids() {
            true => self.scratch(ids.len(), DType::F32).map(Some),
            false => Ok(None),
        }
    }

    /// Takes what an attention call of `g` takes ([`AttnBuffers`], in its
    /// order), releasing its scratch at the end.
    fn take_attn_buffers(&self, g: &AttnShape, b: AttnBuffers) -> Result<()> {
        let mut scratch = Vec::with_capacity(b.scratch.len());
        for (elems, dtype) in b.scratch {
            scratch.push(self.scratch(elems, dtype)?);
        }
        if let Some(kept) = b.kept_workspace {
            self.grow_attn_workspace(kept)?;
        }
        if b.mask_bounds {
            self.keep_mask_bounds(g.sq)?;
        }
        if let Some(bytes) = b.transient_bytes {
            drop(self.scratch(bytes / 4, DType::F32)?);
        }
        Ok(())
    }

    /// The kept attention workspace grown to hold `kept.need` bytes (the
    /// old one released first).
    fn grow_attn_workspace(&self, kept: super::op_buffers::KeptWorkspace) -> Result<()> {
        let mut ws = self
            .attn_workspace
            .lock()
            .map_err(|_| poisoned("attention workspace"))?;
        let have = ws.as_ref().map_or(0, |t| t.bytes());
        if have < kept.need.max(1) {
            *ws = None;
            *ws = Some(self.alloc(&[kept.bytes / 4], DType::F32, Category::Workspace)?);
        }
        Ok(())
    }

    /// A documents mask's key bounds for `sq` rows (`[2·sq]` 4-byte
    /// elements), replacing the last call's (freed first) unless they are
    /// the same size. The ledger sees only their size: bounds of equal size
    /// replaced or kept leave it alike.
    fn keep_mask_bounds(&self, sq: usize) -> Result<()> {
        let mut kept = self
            .mask_bounds
            .lock()
            .map_err(|_| poisoned("attention mask bounds"))?;
        if kept.as_ref().is_none_or(|t| t.numel() != 2 * sq) {
            *kept = None;
            *kept = Some(self.alloc(&[2 * sq], DType::F32, Category::Workspace)?);
        }
        Ok(())
    }
}

fn check_rows<B: Backend>(rows: usize, row_len: usize, t: &Tensor<B>, op: &str) -> Result<()> {
    if t.rows() != rows || t.row_len() != row_len {
        return Err(Error::Backend(format!(
            "{op}: {:?} is not [{rows}, {row_len}]",
            t.shape()
        )));
    }
    Ok(())
}

fn check_views(c: &MatLayout, a: &MatLayout, b: &MatLayout) -> Result<()> {
    if a.cols != b.rows || c.rows != a.rows || c.cols != b.cols {
        return Err(Error::Backend(format!(
            "gemm: {}x{} @ {}x{} into {}x{}",
            a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
        )));
    }
    Ok(())
}

impl<D: Rehearsable> TensorDevice for Rehearsal<D> {
    type Storage = D::Storage;
}

impl<D: Rehearsable> Backend for Rehearsal<D> {
    fn name(&self) -> String {
        self.device.device_name()
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        self.device.device_ledger()
    }
    fn compute_dtype(&self) -> DType {
        self.rules().compute_dtype()
    }
    /// A rehearsal, always.
    fn rehearsing(&self) -> bool {
        true
    }
    fn collapses_alike_iterations(&self) -> bool {
        !self.every_iteration
    }
    fn pool_report(&self) -> Result<Option<PoolReport>> {
        self.device.device_pool_report()
    }

    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.alloc(shape, dtype, cat)
    }
    fn from_host(
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
        self.alloc(shape, dtype, cat)
    }
    fn upload(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()> {
        if data.len() != t.numel() {
            return Err(Error::Backend(format!(
                "upload: {} values into a tensor of shape {:?}",
                data.len(),
                t.shape()
            )));
        }
        Ok(())
    }
    /// Zeros, as a rehearsal's host reads return.
    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        Ok(vec![0.0; t.numel()])
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        Err(Error::Backend(format!(
            "host access to a {:?} tensor: a rehearsal reads and writes no host data (`Backend::rehearsing`)",
            t.shape()
        )))
    }
    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        Err(Error::Backend(format!(
            "host access to a {:?} tensor: a rehearsal reads and writes no host data (`Backend::rehearsing`)",
            t.shape()
        )))
    }

    fn gemm(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        _alpha: f32,
        _beta: f32,
    ) -> Result<()> {
        check_views(&c.l, &a.l, &b.l)?;
        let workspace = self
            .rules()
            .gemm_workspace(a.t.dtype(), b.t.dtype(), c.t.dtype())?;
        let (m, k, n) = (a.l.rows, a.l.cols, b.l.cols);
        self.keep_gemm_workspace(workspace, m > 0 && n > 0 && k > 0)
    }
    /// Quantizes nothing: the device's quantization takes no buffer of its
    /// own (its amax is reduced in the inverse scale's cell).
    fn run_fp8_quantize(&self, _f: Fp8Format, _a: Fp8Quantize<'_, Self>) -> Result<()> {
        Ok(())
    }
    /// The GEMM workspace taken at the first non-empty FP8 GEMM as the
    /// device's takes it (the one `gemm` keeps).
    fn run_fp8_gemm(&self, g: &Fp8GemmShape, _a: Fp8Gemm<'_, Self>) -> Result<()> {
        let workspace = self.rules().fp8_gemm_workspace()?;
        self.keep_gemm_workspace(workspace, g.m > 0 && g.n > 0 && g.k > 0)
    }
    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        if (dst.l.rows, dst.l.cols) != (src.l.rows, src.l.cols) {
            return Err(Error::Backend(format!(
                "copy: {}x{} into {}x{}",
                src.l.rows, src.l.cols, dst.l.rows, dst.l.cols
            )));
        }
        Ok(())
    }
    fn fill(&self, _t: &mut Tensor<Self>, _value: f32) -> Result<()> {
        Ok(())
    }
    fn axpy(&self, y: &mut Tensor<Self>, _alpha: f32, x: &Tensor<Self>) -> Result<()> {
        check_same_numel(y, x, "axpy")
    }
    fn add_bias_rows(&self, x: MatMut<'_, Self>, bias: Mat<'_, Self>) -> Result<()> {
        super::check_bias_views(&x.l, &bias.l, "add_bias_rows")
    }
    fn bias_grad(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()> {
        super::check_bias_views(&dy.l, &dbias.l, "bias_grad")
    }
    /// The device's accumulator taken and freed; nothing is summed.
    fn sum_squares(&self, _t: &Tensor<Self>) -> Result<f64> {
        let elems = self.rules().sum_squares_scratch();
        if elems > 0 {
            drop(self.scratch(elems, DType::F32)?);
        }
        Ok(0.0)
    }

    // the norm and RoPE calls are checked by the trait's provided methods;
    // they take no buffer of their own
    fn run_rms_norm_fwd(&self, _rows: usize, _a: RmsNormFwd<'_, Self>) -> Result<()> {
        Ok(())
    }
    fn run_rms_norm_bwd(&self, _rows: usize, _a: RmsNormBwd<'_, Self>) -> Result<()> {
        Ok(())
    }
    fn run_add_rms_norm_fwd(&self, _rows: usize, _a: AddRmsNormFwd<'_, Self>) -> Result<()> {
        Ok(())
    }
    fn run_rms_norm_bwd_add(&self, _rows: usize, _a: RmsNormBwd<'_, Self>) -> Result<()> {
        Ok(())
    }
    fn run_rope(&self, _g: RopeShape, _a: RopeRotate<'_, Self>) -> Result<()> {
        Ok(())
    }

    fn run_attention_fwd(&self, g: &AttnShape, a: AttentionFwd<'_, Self>) -> Result<()> {
        let bf16 = a.q.t.dtype() == DType::BF16 && a.o.t.dtype() == DType::BF16;
        let buffers = self.rules().attention_fwd(g, bf16)?;
        self.take_attn_buffers(g, buffers)
    }
    fn run_attention_bwd(&self, g: &AttnShape, a: AttentionBwd<'_, Self>) -> Result<()> {
        let dtypes = AttnBwdDtypes {
            inputs: [a.q.t.dtype(), a.o.t.dtype(), a.d_o.t.dtype()],
            grads: [a.dq.t.dtype(), a.dk.t.dtype(), a.dv.t.dtype()],
            writes: a.writes,
        };
        let buffers = self.rules().attention_bwd(g, &dtypes)?;
        self.take_attn_buffers(g, buffers)
    }
    fn attention_bwd_in_place(&self, g: &AttnShape) -> bool {
        self.rules().bwd_in_place(g)
    }
    fn run_lse_merge(&self, _a: LseMerge<'_, Self>) -> Result<()> {
        Ok(())
    }

    fn gated_act_fwd(
        &self,
        _act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        check_same_numel(gate, up, "gated_act_fwd")?;
        check_same_numel(gate, out, "gated_act_fwd")
    }
    fn gated_act_bwd(
        &self,
        _act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        for t in [up, dout, &*dgate, &*dup] {
            check_same_numel(gate, t, "gated_act_bwd")?;
        }
        Ok(())
    }
    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        _scale: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        check_rows(ids.len(), table.row_len(), out, "embedding_fwd")?;
        self.ids_upload(ids).map(drop)
    }
    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        _scale: f32,
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        check_rows(ids.len(), dtable.row_len(), dout, "embedding_bwd")?;
        self.ids_upload(ids).map(drop)
    }
    fn cross_entropy(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        _grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()> {
        if logits.rows() != targets.len() || loss_sum.numel() != 1 {
            return Err(Error::Backend(format!(
                "cross_entropy: logits {:?} for {} targets",
                logits.shape(),
                targets.len()
            )));
        }
        self.ids_upload(targets).map(drop)
    }
    fn fused_update(
        &self,
        _kernel: &dyn UpdateKernel,
        _slots: &mut [UpdateSlot<'_, Self>],
    ) -> Result<()> {
        Ok(())
    }
}
