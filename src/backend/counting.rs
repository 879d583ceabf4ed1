//! A backend of shapes without memory: its tensors carry shape, dtype and
//! bytes (recorded in its [`MemoryLedger`] like any backend's) but no
//! storage, and its ops check their arguments and allocate exactly what the
//! device it models would allocate (the outputs the caller asks for, and
//! the op's own workspaces and kept buffers), computing nothing. Running
//! the engine's own step on it gives the step's ledger without a device:
//! the memory planner's prediction (`plan::engine`).
//!
//! It models a [`CountedDevice`]: the CPU reference (F32 only, no buffers of
//! its own) or a CUDA device (BF16 compute; the cuBLASLt workspace at the
//! first GEMM, token ids uploaded for the embedding and the loss, `sum_squares`'
//! accumulator, and attention routed as `CudaBackend` routes it, with the
//! sizes `backend::cuda::{cudnn, flash, gemm}` define: cuDNN's kept
//! workspace and bf16 gradient scratch, or our kernels' F32 scratch and the
//! flash backward's transient workspace).

use super::{
    AdamWStep, AttnGradWrites, Backend, Category, DType, MatLayout, MatMut, MemoryLedger, Rows,
    RowsMut, Tensor, check_elems, check_token_ids,
};
use super::{AttnMask, GradWrite, Mat, attention_heads, check_same_numel};
use crate::backend::cuda::{cudnn, flash, gemm};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, OnceLock};

/// The device whose allocations a [`CountingBackend`] reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountedDevice {
    /// The CPU reference: everything F32, no buffers of the backend's own.
    Cpu,
    /// A CUDA device computing in BF16. `cudnn`: the cuDNN version whose
    /// limits decide which attention calls run on cuDNN SDPA (`None`: our
    /// kernels only, `--attn-kernel native`).
    Cuda { cudnn: Option<usize> },
}

/// The storage of a counted tensor: none.
pub struct NoMemory;

/// A [`Backend`] that allocates what its [`CountedDevice`] would and
/// computes nothing (module docs). It always rehearses.
pub struct CountingBackend {
    ledger: Arc<MemoryLedger>,
    device: CountedDevice,
    /// The cuBLASLt workspace, taken at the first GEMM that needs one.
    gemm_workspace: OnceLock<Tensor<CountingBackend>>,
    /// cuDNN's execution workspace, kept between calls and grown.
    attn_workspace: Mutex<Option<Tensor<CountingBackend>>>,
}

impl CountingBackend {
    /// A counting backend of `device` with an empty ledger.
    pub fn new(device: CountedDevice) -> Self {
        CountingBackend {
            ledger: Arc::new(MemoryLedger::new()),
            device,
            gemm_workspace: OnceLock::new(),
            attn_workspace: Mutex::new(None),
        }
    }

    /// The device this backend models.
    pub fn device(&self) -> CountedDevice {
        self.device
    }

    fn is_cuda(&self) -> bool {
        matches!(self.device, CountedDevice::Cuda { .. })
    }

    /// A tensor of `shape` counted in the ledger (after the dtype check).
    fn alloc(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        if !self.is_cuda() && dtype != DType::F32 {
            return Err(Error::Backend(format!(
                "the CPU backend computes in f32 only (asked for {dtype:?}); use --device cuda for bf16"
            )));
        }
        Ok(Tensor::from_parts(
            NoMemory,
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    /// A transient buffer the op frees before it returns.
    fn scratch(&self, elems: usize, dtype: DType) -> Result<Tensor<Self>> {
        self.alloc(&[elems], dtype, Category::Workspace)
    }

    /// CUDA's upload of 32-bit ids into a workspace for the op's duration.
    fn ids_upload(&self, ids: &[u32]) -> Result<Option<Tensor<Self>>> {
        match self.is_cuda() {
            true => self.scratch(ids.len(), DType::F32).map(Some),
            false => Ok(None),
        }
    }

    /// Whether cuDNN SDPA takes a call of `shape` (`bwd`: the backward).
    fn on_cudnn(&self, shape: &cudnn::SdpaShape, bwd: bool) -> bool {
        match self.device {
            CountedDevice::Cuda { cudnn: Some(v) } => {
                cudnn::select::shape_supported(v, shape, bwd).is_ok()
            }
            _ => false,
        }
    }

    /// cuDNN's kept workspace grown to hold `need` bytes (the old one is
    /// released first, as `CudnnSdpa::run` does).
    fn grow_attn_workspace(&self, need: usize) -> Result<()> {
        let mut ws = self
            .attn_workspace
            .lock()
            .map_err(|_| Error::Backend("attention workspace lock poisoned".into()))?;
        let have = ws.as_ref().map_or(0, |t| t.bytes());
        if have < need.max(1) {
            *ws = None;
            let bytes = cudnn::kept_workspace_bytes(need);
            *ws = Some(self.alloc(&[bytes / 4], DType::F32, Category::Workspace)?);
        }
        Ok(())
    }

    /// `CudaBackend::attention_bwd`'s allocations on cuDNN: bf16 scratch for
    /// each gradient it does not write in place, and the kept workspace
    /// grown to the plan's (estimated) workspace, dQ accumulator and sums.
    fn cudnn_bwd(
        &self,
        shape: &cudnn::SdpaShape,
        grads: [(DType, GradWrite); 3],
        elems: [usize; 3],
    ) -> Result<()> {
        let mut scratch = Vec::new();
        for ((dt, w), n) in grads.into_iter().zip(elems) {
            if !cudnn::bwd_writes_in_place(w, dt) {
                scratch.push(self.scratch(n, DType::BF16)?);
            }
        }
        let plan_ws = cudnn::estimated_bwd_plan_workspace(shape);
        self.grow_attn_workspace(cudnn::bwd_workspace_bytes(shape, plan_ws))
    }

    /// `CudaBackend::attention_bwd`'s allocations on our kernels: F32
    /// scratch for each gradient of another dtype, and the flash backward's
    /// transient workspace when the flash kernels take the geometry.
    /// What the CUDA backend uploads for a documents mask: its rows' key
    /// bounds (`[2·sq]` 4-byte elements) for the call's duration.
    fn mask_bounds(&self, g: &AttnShape) -> Result<Option<Tensor<Self>>> {
        match g.mask {
            AttnMask::Bounded(_) if g.sq > 0 => self.scratch(2 * g.sq, DType::F32).map(Some),
            AttnMask::Full | AttnMask::Causal | AttnMask::Bounded(_) => Ok(None),
        }
    }

    fn native_bwd(
        &self,
        g: &AttnShape,
        grads: [DType; 3],
        elems: [usize; 3],
        nonempty: bool,
    ) -> Result<()> {
        let mut scratch = Vec::new();
        for (dt, n) in grads.into_iter().zip(elems) {
            if dt != DType::F32 {
                scratch.push(self.scratch(n, DType::F32)?);
            }
        }
        let _bounds = self.mask_bounds(g)?;
        if nonempty && flash::check_supported(g.sq, g.sk, g.hq, g.hkv, g.d, &g.mask).is_ok() {
            let bytes = flash::flash_bwd_workspace_bytes(g.sq, g.hq);
            drop(self.scratch(bytes / 4, DType::F32)?);
        }
        Ok(())
    }
}

/// The geometry of one attention call, checked.
struct AttnShape {
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    mask: AttnMask,
}

impl AttnShape {
    fn check(
        q: &Rows<'_, CountingBackend>,
        k: &Rows<'_, CountingBackend>,
        mask: &AttnMask,
    ) -> Result<Self> {
        let (hq, hkv, d) = attention_heads(q, k, mask)?;
        Ok(AttnShape {
            sq: q.len(),
            sk: k.len(),
            hq,
            hkv,
            d,
            mask: mask.clone(),
        })
    }

    fn sdpa(&self) -> cudnn::SdpaShape {
        cudnn::dense_shape(
            self.sq,
            self.sk,
            self.hq,
            self.hkv,
            self.d,
            self.mask.clone(),
        )
    }
}

fn check_rows(rows: usize, row_len: usize, t: &Tensor<CountingBackend>, op: &str) -> Result<()> {
    if t.rows() != rows || t.row_len() != row_len {
        return Err(Error::Backend(format!(
            "{op}: {:?} is not [{rows}, {row_len}]",
            t.shape()
        )));
    }
    Ok(())
}

/// RMSNorm's weight spans `x`'s last dimension.
fn check_last_dim(
    x: &Tensor<CountingBackend>,
    w: &Tensor<CountingBackend>,
    op: &str,
) -> Result<()> {
    if x.shape().last() != Some(&w.numel()) {
        return Err(Error::Backend(format!(
            "{op}: weight {:?} does not span the last dimension of {:?}",
            w.shape(),
            x.shape()
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

impl Backend for CountingBackend {
    type Storage = NoMemory;

    fn name(&self) -> String {
        match self.device {
            CountedDevice::Cpu => "counting cpu-f32".into(),
            CountedDevice::Cuda { .. } => "counting cuda-bf16".into(),
        }
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn compute_dtype(&self) -> DType {
        match self.device {
            CountedDevice::Cpu => DType::F32,
            CountedDevice::Cuda { .. } => DType::BF16,
        }
    }
    /// A counting backend always rehearses.
    fn set_rehearse(&self, _on: bool) {}
    fn rehearsing(&self) -> bool {
        true
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
            "host access to a {:?} tensor: a counting backend holds no memory",
            t.shape()
        )))
    }
    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        Err(Error::Backend(format!(
            "host access to a {:?} tensor: a counting backend holds no memory",
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
        let (ab, cd) = (a.t.dtype(), c.t.dtype());
        if b.t.dtype() != ab || (cd != DType::F32 && cd != ab) {
            return Err(Error::Backend(format!(
                "gemm: a {ab:?}, b {:?}, c {cd:?}; a and b must share a dtype and c be F32 or that dtype",
                b.t.dtype()
            )));
        }
        let (m, k, n) = (a.l.rows, a.l.cols, b.l.cols);
        if self.is_cuda() && m > 0 && n > 0 && k > 0 && self.gemm_workspace.get().is_none() {
            let t = self.alloc(
                &[gemm::WORKSPACE_BYTES / 4],
                DType::F32,
                Category::Workspace,
            )?;
            // another thread won the race: ours is released
            let _ = self.gemm_workspace.set(t);
        }
        Ok(())
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
    /// CUDA accumulates into one f64 on the device; nothing is summed.
    fn sum_squares(&self, _t: &Tensor<Self>) -> Result<f64> {
        if self.is_cuda() {
            drop(self.scratch(2, DType::F32)?);
        }
        Ok(0.0)
    }

    fn rms_norm_fwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        _eps: f32,
        y: &mut Tensor<Self>,
    ) -> Result<()> {
        check_last_dim(x, w, "rms_norm_fwd")?;
        check_same_numel(x, y, "rms_norm_fwd")
    }
    fn rms_norm_bwd(
        &self,
        x: &Tensor<Self>,
        w: &Tensor<Self>,
        dy: &Tensor<Self>,
        _eps: f32,
        dx: &mut Tensor<Self>,
        dw: &mut Tensor<Self>,
    ) -> Result<()> {
        check_last_dim(x, w, "rms_norm_bwd")?;
        check_same_numel(x, dy, "rms_norm_bwd")?;
        check_same_numel(x, dx, "rms_norm_bwd")?;
        check_same_numel(w, dw, "rms_norm_bwd")
    }
    fn rope(
        &self,
        x: &mut Tensor<Self>,
        cos: &Tensor<Self>,
        sin: &Tensor<Self>,
        _inverse: bool,
    ) -> Result<()> {
        if cos.numel() != sin.numel() {
            return Err(Error::Backend(format!(
                "rope: tables {:?} do not cover {:?}",
                cos.shape(),
                x.shape()
            )));
        }
        Ok(())
    }

    fn attention_fwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        mask: &AttnMask,
        o: RowsMut<'_, Self>,
        lse: RowsMut<'_, Self>,
    ) -> Result<()> {
        let g = AttnShape::check(&q, &k, mask)?;
        if v.len() != g.sk || o.len() != g.sq || lse.len() != g.sq {
            return Err(Error::Backend("attention_fwd: row counts differ".into()));
        }
        let bf16 = q.t.dtype() == DType::BF16 && o.t.dtype() == DType::BF16;
        if bf16 && g.sq > 0 && g.hq > 0 && self.on_cudnn(&g.sdpa(), false) {
            // cuDNN's forward plan workspace counts as 0 (what the H200 ledger shows)
            self.grow_attn_workspace(0)?;
        } else if self.is_cuda() {
            drop(self.mask_bounds(&g)?);
        }
        Ok(())
    }
    fn attention_bwd(
        &self,
        q: Rows<'_, Self>,
        k: Rows<'_, Self>,
        v: Rows<'_, Self>,
        o: Rows<'_, Self>,
        d_o: Rows<'_, Self>,
        lse: Rows<'_, Self>,
        mask: &AttnMask,
        dq: RowsMut<'_, Self>,
        dk: RowsMut<'_, Self>,
        dv: RowsMut<'_, Self>,
        writes: AttnGradWrites,
    ) -> Result<()> {
        let g = AttnShape::check(&q, &k, mask)?;
        let rows = [
            v.len(),
            o.len(),
            d_o.len(),
            lse.len(),
            dq.len(),
            dk.len(),
            dv.len(),
        ];
        if rows != [g.sk, g.sq, g.sq, g.sq, g.sq, g.sk, g.sk] {
            return Err(Error::Backend("attention_bwd: row counts differ".into()));
        }
        if !self.is_cuda() {
            return Ok(());
        }
        let elems = [g.sq * g.hq * g.d, g.sk * g.hkv * g.d, g.sk * g.hkv * g.d];
        let dts = [dq.t.dtype(), dk.t.dtype(), dv.t.dtype()];
        let bf16_in = [q.t.dtype(), o.t.dtype(), d_o.t.dtype()] == [DType::BF16; 3];
        let nonempty = g.sq > 0 && g.sk > 0 && g.hq > 0;
        if bf16_in && dts[1] == dts[2] && nonempty && self.on_cudnn(&g.sdpa(), true) {
            let w = [writes.dq, writes.dkv, writes.dkv];
            let grads = [(dts[0], w[0]), (dts[1], w[1]), (dts[2], w[2])];
            return self.cudnn_bwd(&g.sdpa(), grads, elems);
        }
        self.native_bwd(&g, dts, elems, nonempty)
    }
    fn attention_bwd_in_place(
        &self,
        s: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        mask: &AttnMask,
    ) -> bool {
        match self.device {
            CountedDevice::Cpu => true,
            CountedDevice::Cuda { .. } => {
                let shape = cudnn::dense_shape(s, s, hq, hkv, d, mask.clone());
                s > 0 && hq > 0 && self.on_cudnn(&shape, true)
            }
        }
    }
    fn lse_merge(
        &self,
        o_acc: RowsMut<'_, Self>,
        lse_acc: RowsMut<'_, Self>,
        o_blk: Rows<'_, Self>,
        lse_blk: Rows<'_, Self>,
    ) -> Result<()> {
        let n = o_acc.len();
        if o_blk.len() != n || lse_acc.len() != n || lse_blk.len() != n {
            return Err(Error::Backend("lse_merge: block shapes differ".into()));
        }
        Ok(())
    }

    fn swiglu_fwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        check_same_numel(gate, up, "swiglu_fwd")?;
        check_same_numel(gate, out, "swiglu_fwd")
    }
    fn swiglu_bwd(
        &self,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        for t in [up, dout, &*dgate, &*dup] {
            check_same_numel(gate, t, "swiglu_bwd")?;
        }
        Ok(())
    }
    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        check_token_ids(ids, table.rows())?;
        check_rows(ids.len(), table.row_len(), out, "embedding_fwd")?;
        self.ids_upload(ids).map(drop)
    }
    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        check_token_ids(ids, dtable.rows())?;
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
    fn adamw(
        &self,
        param: &mut Tensor<Self>,
        grad: &Tensor<Self>,
        m: &mut Tensor<Self>,
        v: &mut Tensor<Self>,
        elems: std::ops::Range<usize>,
        _hp: AdamWStep,
    ) -> Result<()> {
        check_elems(&elems, param.numel(), "adamw")?;
        for t in [grad, &*m, &*v] {
            check_same_numel(param, t, "adamw")?;
        }
        Ok(())
    }
}
