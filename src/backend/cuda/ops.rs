//! `impl Backend for CudaBackend`: each op handed to the file of its
//! family: `memory_ops.rs` (allocation, uploads/downloads, copies),
//! `attention_ops.rs` (attention routing, `lse_merge`), `elementwise_ops.rs`
//! (fill, axpy, norms, RoPE, SwiGLU, embedding, loss), `fused_update.rs`
//! (an optimizer's update program) and
//! `gemm_ops.rs` (`gemm`); synchronisation and profiling are the backend's
//! own (`backend.rs`).

use super::backend::CudaBackend;
use crate::backend::PoolReport;
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use crate::backend::{AddRmsNormFwd, GatedAct, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
use crate::backend::{
    AttentionBwd, AttentionFwd, AttnShape, Backend, Category, ComputePoint, CopyDone, DType,
    HostValues, HostValuesMut, LseMerge, Mat, MatMut, MemoryLedger, Tensor, UpdateKernel,
    UpdateSlot,
};
use crate::error::{Error, Result};
use std::sync::Arc;

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn compute_dtype(&self) -> DType {
        DType::BF16
    }
    fn pool_report(&self) -> Result<Option<PoolReport>> {
        let stats = self.pool_stats()?;
        let (free, total) = self.pool.device_info()?;
        Ok(Some(PoolReport {
            reserved_peak: stats.reserved_high as usize,
            outside: total.saturating_sub(free + stats.reserved_current as usize),
        }))
    }

    fn supports_fp8(&self) -> Result<()> {
        self.supports_fp8_impl()
    }
    fn run_fp8_quantize(&self, f: Fp8Format, a: Fp8Quantize<'_, Self>) -> Result<()> {
        self.fp8_quantize_impl(f, a)
    }
    fn run_fp8_gemm(&self, g: &Fp8GemmShape, a: Fp8Gemm<'_, Self>) -> Result<()> {
        self.fp8_gemm_impl(g, a)
    }

    fn copy_start(&self, dst: &mut Tensor<Self>, src: &Tensor<Self>) -> Result<CopyDone> {
        self.copy_start_impl(dst, src)
    }

    fn compute_point(&self) -> Result<ComputePoint> {
        self.compute_point_impl()
    }

    fn copy_start_from(
        &self,
        dst: &mut Tensor<Self>,
        src: &Tensor<Self>,
        since: &ComputePoint,
    ) -> Result<CopyDone> {
        self.copy_start_from_impl(dst, src, since)
    }

    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        self.host_f32_impl(t)
    }

    fn host_values<'t>(&self, t: &'t Tensor<Self>) -> Result<HostValues<'t>> {
        self.host_values_impl(t)
    }

    fn host_bf16_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [u16]> {
        self.host_bf16_mut_impl(t)
    }

    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        self.host_f32_mut_impl(t)
    }

    fn host_values_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<HostValuesMut<'t>> {
        self.host_values_mut_impl(t)
    }

    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.zeros_impl(shape, dtype, cat)
    }

    fn empty(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        self.bind()?;
        self.alloc(shape, dtype, cat)
    }

    fn from_host(
        &self,
        data: &[f32],
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        self.tensor_from_host_impl(data, shape, dtype, cat)
    }

    fn upload(&self, t: &mut Tensor<Self>, data: &[f32]) -> Result<()> {
        self.upload_impl(t, data)
    }

    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        self.to_host_impl(t)
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.wait_idle()?;
        match self.comm_fault.get() {
            Some(m) => Err(Error::Comm(m.clone())),
            None => Ok(()),
        }
    }

    fn enable_profile(&self) {
        self.profile.enable();
    }
    fn set_phase(&self, phase: crate::backend::profile::Phase) {
        self.profile.set_phase(phase);
    }
    fn take_profile(&self) -> Result<Option<crate::backend::profile::StepProfile>> {
        if !self.profile.enabled() {
            return Ok(None);
        }
        self.bind()?;
        self.profile.take_step()
    }

    fn gemm(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        self.gemm_impl(c, a, b, alpha, beta)
    }

    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        self.copy_impl(dst, src)
    }

    fn fill(&self, t: &mut Tensor<Self>, value: f32) -> Result<()> {
        self.fill_impl(t, value)
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f32, x: &Tensor<Self>) -> Result<()> {
        self.axpy_impl(y, alpha, x)
    }

    fn sum_squares(&self, t: &Tensor<Self>) -> Result<f64> {
        self.sum_squares_impl(&[t])
    }
    fn sum_squares_all(&self, ts: &[&Tensor<Self>]) -> Result<f64> {
        self.sum_squares_impl(ts)
    }

    fn add_bias_rows(&self, x: MatMut<'_, Self>, bias: Mat<'_, Self>) -> Result<()> {
        self.add_bias_rows_impl(x, bias)
    }

    fn bias_grad(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()> {
        self.bias_grad_impl(dbias, dy)
    }

    fn run_rms_norm_fwd(&self, rows: usize, a: RmsNormFwd<'_, Self>) -> Result<()> {
        self.rms_norm_fwd_impl(rows, a)
    }

    fn run_rms_norm_bwd(&self, rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()> {
        self.rms_norm_bwd_impl(rows, a, false)
    }

    fn run_add_rms_norm_fwd(&self, rows: usize, a: AddRmsNormFwd<'_, Self>) -> Result<()> {
        self.add_rms_norm_fwd_impl(rows, a)
    }

    fn run_rms_norm_bwd_add(&self, rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()> {
        self.rms_norm_bwd_impl(rows, a, true)
    }

    fn run_rope(&self, g: RopeShape, a: RopeRotate<'_, Self>) -> Result<()> {
        self.rope_impl(g, a)
    }

    fn run_attention_fwd(&self, g: &AttnShape, a: AttentionFwd<'_, Self>) -> Result<()> {
        self.attention_fwd_impl(g, a)
    }

    fn attention_bwd_in_place(&self, g: &AttnShape) -> bool {
        self.attention_bwd_in_place_impl(g)
    }

    fn run_attention_bwd(&self, g: &AttnShape, a: AttentionBwd<'_, Self>) -> Result<()> {
        self.attention_bwd_impl(g, a)
    }

    fn run_lse_merge(&self, a: LseMerge<'_, Self>) -> Result<()> {
        self.lse_merge_impl(a)
    }

    fn gated_act_fwd(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        self.gated_act_fwd_impl(act, gate, up, out)
    }

    fn gated_act_bwd(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        dout: &Tensor<Self>,
        dgate: &mut Tensor<Self>,
        dup: &mut Tensor<Self>,
    ) -> Result<()> {
        self.gated_act_bwd_impl(act, gate, up, dout, dgate, dup)
    }

    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        self.embedding_fwd_impl(table, ids, scale, out)
    }

    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        self.embedding_bwd_impl(dout, ids, scale, dtable)
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()> {
        self.cross_entropy_impl(logits, targets, grad_scale, loss_sum)
    }

    fn fused_update(
        &self,
        kernel: &dyn UpdateKernel,
        slots: &mut [UpdateSlot<'_, Self>],
    ) -> Result<()> {
        self.fused_update_impl(kernel, slots)
    }
}
