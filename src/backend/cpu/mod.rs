//! The CPU f32 reference backend: simple, exact-as-f32-allows kernels with
//! rayon parallelism and `matrixmultiply` GEMM. Every other backend and every
//! context-parallel strategy is tested against this one.

use super::fused_update::{HostCells, HostCellsMut, HostSlot};
use super::norm_args::{AddRmsNormFwd, RmsNormBwd, RmsNormFwd, RopeRotate, RopeShape};
use super::profile::{Phase, StepProfile, Track};
use super::{
    AttentionBwd, AttentionFwd, AttnShape, Backend, Category, CopyDone, DType, IGNORE, LseMerge,
    Mat, MatLayout, MatMut, MemoryLedger, Tensor, UpdateKernel, UpdateSlot, check_same_numel,
};
use crate::backend::GatedAct;
use crate::backend::fp8::{Fp8Format, Fp8Gemm, Fp8GemmShape, Fp8Quantize};
use crate::error::{Error, Result};
use rayon::prelude::*;
mod attention;
mod cells;
mod device;
mod fp8;
mod norm;
mod sgemm;

pub use cells::{CpuStorage, stored};
use cells::{data, data_mut, round_view};
pub use device::CpuBackend;
use sgemm::sgemm;

use std::sync::Arc;

impl CpuBackend {
    /// `rms_norm_bwd` / `rms_norm_bwd_add` of a checked call.
    fn norm_bwd(&self, a: RmsNormBwd<'_, Self>, write: norm::DxWrite) -> Result<()> {
        let (xs, ws, dys) = (data(a.x), data(a.w), data(a.dy));
        norm::backward(
            xs,
            ws,
            dys,
            a.norm,
            data_mut(a.dx),
            a.dw.map(data_mut),
            write,
        );
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu-f32".into()
    }
    fn ledger(&self) -> &Arc<MemoryLedger> {
        &self.ledger
    }
    fn compute_dtype(&self) -> DType {
        DType::F32
    }

    fn zeros(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let _span = self.profile.span("memset", Track::Compute);
        let n = shape.iter().product();
        Ok(Tensor::from_parts(
            self.storage(n, 0.0),
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    fn empty(&self, shape: &[usize], dtype: DType, cat: Category) -> Result<Tensor<Self>> {
        let n = shape.iter().product();
        Ok(Tensor::from_parts(
            self.storage(n, f32::NAN),
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    fn from_host(
        &self,
        host: &[f32],
        shape: &[usize],
        dtype: DType,
        cat: Category,
    ) -> Result<Tensor<Self>> {
        let _span = self.profile.span("upload", Track::Compute);
        if host.len() != shape.iter().product::<usize>() {
            return Err(Error::Backend(format!(
                "from_host: {} values for shape {shape:?}",
                host.len()
            )));
        }
        let storage = CpuStorage(stored(dtype, host)?);
        Ok(Tensor::from_parts(
            storage,
            shape,
            dtype,
            cat,
            self.ledger.clone(),
        ))
    }

    fn upload(&self, t: &mut Tensor<Self>, host: &[f32]) -> Result<()> {
        let _span = self.profile.span("upload", Track::Compute);
        if host.len() != t.numel() {
            return Err(Error::Backend(format!(
                "upload: {} values into a tensor of shape {:?}",
                host.len(),
                t.shape()
            )));
        }
        let values = stored(t.dtype(), host)?;
        data_mut(t).copy_from_slice(&values);
        Ok(())
    }

    fn to_host(&self, t: &Tensor<Self>) -> Result<Vec<f32>> {
        let _span = self.profile.span("download", Track::Compute);
        Ok(data(t).to_vec())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn enable_profile(&self) {
        self.profile.enable();
    }
    fn set_phase(&self, phase: Phase) {
        self.profile.set_phase(phase);
    }
    fn take_profile(&self) -> Result<Option<StepProfile>> {
        self.profile.take()
    }

    /// Copies at once, timed on the copy track (the device's copy stream).
    fn copy_start(&self, dst: &mut Tensor<Self>, src: &Tensor<Self>) -> Result<CopyDone> {
        let _span = self.profile.span("copy_start", Track::Copy);
        self.copy(dst.mat_mut(), src.mat())?;
        Ok(CopyDone::finished())
    }

    fn gemm(
        &self,
        c: MatMut<'_, Self>,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let _span = self.profile.span("gemm", Track::Compute);
        sgemm(c, a, b, alpha, beta)
    }

    fn run_fp8_quantize(&self, f: Fp8Format, a: Fp8Quantize<'_, Self>) -> Result<()> {
        let _span = self.profile.span("fp8_quantize", Track::Compute);
        fp8::quantize(f, a)
    }

    fn run_fp8_gemm(&self, _g: &Fp8GemmShape, a: Fp8Gemm<'_, Self>) -> Result<()> {
        let _span = self.profile.span("fp8_gemm", Track::Compute);
        fp8::gemm(a)
    }

    fn copy(&self, dst: MatMut<'_, Self>, src: Mat<'_, Self>) -> Result<()> {
        let _span = self.profile.span("copy", Track::Compute);
        if dst.l.rows != src.l.rows || dst.l.cols != src.l.cols {
            return Err(Error::Backend(format!(
                "copy shapes: {:?} <- {:?}",
                dst.l, src.l
            )));
        }
        let (rsd, csd) = dst.l.strides();
        let (rss, css) = src.l.strides();
        let (ddt, dl) = (dst.t.dtype(), dst.l);
        let s = data(src.t);
        let d = data_mut(dst.t);
        for i in 0..src.l.rows {
            let (bd, bs) = (dst.l.offset + i * rsd, src.l.offset + i * rss);
            if csd == 1 && css == 1 {
                d[bd..bd + src.l.cols].copy_from_slice(&s[bs..bs + src.l.cols]);
            } else {
                for j in 0..src.l.cols {
                    d[bd + j * csd] = s[bs + j * css];
                }
            }
        }
        round_view(ddt, d, &dl);
        Ok(())
    }

    fn fill(&self, t: &mut Tensor<Self>, value: f32) -> Result<()> {
        let _span = self.profile.span("fill", Track::Compute);
        data_mut(t).fill(value);
        Ok(())
    }

    fn axpy(&self, y: &mut Tensor<Self>, alpha: f32, x: &Tensor<Self>) -> Result<()> {
        let _span = self.profile.span("axpy", Track::Compute);
        check_same_numel(y, x, "axpy")?;
        let whole = MatLayout::block(0, 1, y.numel(), y.numel());
        let ydt = y.dtype();
        let yd = data_mut(y);
        for (a, b) in yd.iter_mut().zip(data(x)) {
            *a += alpha * b;
        }
        round_view(ydt, yd, &whole);
        Ok(())
    }

    fn add_bias_rows(&self, x: MatMut<'_, Self>, bias: Mat<'_, Self>) -> Result<()> {
        let _span = self.profile.span("add_bias_rows", Track::Compute);
        super::check_bias_views(&x.l, &bias.l, "add_bias_rows")?;
        let ((rs, cs), (_, bcs)) = (x.l.strides(), bias.l.strides());
        let (b, b0, x0) = (data(bias.t), bias.l.offset, x.l.offset);
        let xd = data_mut(x.t);
        for i in 0..x.l.rows {
            for j in 0..x.l.cols {
                xd[x0 + i * rs + j * cs] += b[b0 + j * bcs];
            }
        }
        Ok(())
    }

    fn bias_grad(&self, dbias: MatMut<'_, Self>, dy: Mat<'_, Self>) -> Result<()> {
        let _span = self.profile.span("bias_grad", Track::Compute);
        super::check_bias_views(&dy.l, &dbias.l, "bias_grad")?;
        let ((rs, cs), (_, dcs)) = (dy.l.strides(), dbias.l.strides());
        let (g, g0, d0) = (data(dy.t), dy.l.offset, dbias.l.offset);
        let db = data_mut(dbias.t);
        for j in 0..dy.l.cols {
            let sum: f32 = (0..dy.l.rows).map(|i| g[g0 + i * rs + j * cs]).sum();
            db[d0 + j * dcs] += sum;
        }
        Ok(())
    }

    fn sum_squares(&self, t: &Tensor<Self>) -> Result<f64> {
        let _span = self.profile.span("sum_squares", Track::Compute);
        Ok(data(t).iter().map(|&x| (x as f64) * (x as f64)).sum())
    }

    fn run_rms_norm_fwd(&self, _rows: usize, a: RmsNormFwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("rms_norm", Track::Compute);
        norm::forward(data(a.x), data(a.w), a.norm, data_mut(a.y));
        Ok(())
    }

    fn run_rms_norm_bwd(&self, _rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("rms_norm_bwd", Track::Compute);
        self.norm_bwd(a, norm::DxWrite::Overwrite)
    }

    fn run_add_rms_norm_fwd(&self, _rows: usize, a: AddRmsNormFwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("add_rms_norm", Track::Compute);
        norm::add(data_mut(a.x), data(a.y));
        norm::forward(data(a.x), data(a.w), a.norm, data_mut(a.out));
        Ok(())
    }

    fn run_rms_norm_bwd_add(&self, _rows: usize, a: RmsNormBwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("rms_norm_bwd_add", Track::Compute);
        self.norm_bwd(a, norm::DxWrite::Add)
    }

    fn run_rope(&self, g: RopeShape, a: RopeRotate<'_, Self>) -> Result<()> {
        let _span = self.profile.span("rope", Track::Compute);
        let RopeRotate {
            x,
            cos,
            sin,
            inverse,
        } = a;
        let (d, half) = (g.d, g.d / 2);
        let (cs, ss) = (data(cos), data(sin));
        let sign = if inverse { -1.0 } else { 1.0 };
        let row = x.row_len();
        data_mut(x)
            .par_chunks_mut(row)
            .enumerate()
            .for_each(|(t, xr)| {
                let (c, sn) = (&cs[t * half..(t + 1) * half], &ss[t * half..(t + 1) * half]);
                for head in xr.chunks_mut(d) {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        let si = sign * sn[i];
                        head[i] = a * c[i] - b * si;
                        head[i + half] = b * c[i] + a * si;
                    }
                }
            });
        Ok(())
    }

    fn run_attention_fwd(&self, g: &AttnShape, a: AttentionFwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("attention_fwd", Track::Compute);
        let g = attention::geometry(g, a.scale);
        attention::forward(&g, a.q, a.k, a.v, a.mask, a.o, a.lse);
        Ok(())
    }

    fn run_attention_bwd(&self, g: &AttnShape, a: AttentionBwd<'_, Self>) -> Result<()> {
        let _span = self.profile.span("attention_bwd", Track::Compute);
        let g = attention::geometry(g, a.scale);
        let io = [a.q, a.k, a.v, a.o, a.d_o, a.lse];
        let grads = attention::grads_by_kv_head(&g, io, a.mask);
        attention::write_grads(&g, &grads, [a.dq, a.dk, a.dv], a.writes);
        Ok(())
    }

    fn run_lse_merge(&self, a: LseMerge<'_, Self>) -> Result<()> {
        let _span = self.profile.span("lse_merge", Track::Compute);
        attention::lse_merge(a.o_acc, a.lse_acc, a.o_blk, a.lse_blk);
        Ok(())
    }

    fn gated_act_fwd(
        &self,
        act: GatedAct,
        gate: &Tensor<Self>,
        up: &Tensor<Self>,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.profile.span("gated_act", Track::Compute);
        check_same_numel(gate, up, "gated_act_fwd")?;
        check_same_numel(gate, out, "gated_act_fwd")?;
        let (g, u) = (data(gate), data(up));
        data_mut(out)
            .par_iter_mut()
            .zip(g.par_iter().zip(u.par_iter()))
            .for_each(|(o, (&a, &b))| *o = act.forward(a, b));
        Ok(())
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
        let _span = self.profile.span("gated_act_bwd", Track::Compute);
        check_same_numel(gate, dout, "gated_act_bwd")?;
        let (g, u, dy) = (data(gate), data(up), data(dout));
        data_mut(dgate)
            .par_iter_mut()
            .zip(data_mut(dup).par_iter_mut())
            .enumerate()
            .for_each(|(i, (dg, du))| (*dg, *du) = act.backward(g[i], u[i], dy[i]));
        Ok(())
    }

    fn embedding_fwd(
        &self,
        table: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        out: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.profile.span("embedding", Track::Compute);
        let (vocab, h) = (table.rows(), table.row_len());
        if out.numel() != ids.len() * h {
            return Err(Error::Backend(
                "embedding_fwd: output is not [ids, hidden]".into(),
            ));
        }
        super::check_token_ids(ids, vocab)?;
        let t = data(table);
        let odt = out.dtype();
        let od = data_mut(out);
        for (row, &id) in od.chunks_mut(h).zip(ids) {
            let id = id as usize;
            row.copy_from_slice(&t[id * h..(id + 1) * h]);
            if scale != 1.0 {
                row.iter_mut().for_each(|x| *x *= scale);
            }
        }
        round_view(
            odt,
            od,
            &MatLayout::block(0, 1, ids.len() * h, ids.len() * h),
        );
        Ok(())
    }

    fn embedding_bwd(
        &self,
        dout: &Tensor<Self>,
        ids: &[u32],
        scale: f32,
        dtable: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.profile.span("embedding_bwd", Track::Compute);
        let h = dtable.row_len();
        if dout.numel() != ids.len() * h {
            return Err(Error::Backend(
                "embedding_bwd: dout is not [ids, hidden]".into(),
            ));
        }
        super::check_token_ids(ids, dtable.rows())?;
        let dy = data(dout);
        // the scaled gradient as dout's dtype holds it (no copy at scale 1)
        let scaled;
        let dy = if scale == 1.0 {
            dy
        } else {
            scaled = stored(
                dout.dtype(),
                &dy.iter().map(|x| x * scale).collect::<Vec<_>>(),
            )?;
            &scaled[..]
        };
        let dt = data_mut(dtable);
        for (row, &id) in dy.chunks(h).zip(ids) {
            let id = id as usize;
            for (a, b) in dt[id * h..(id + 1) * h].iter_mut().zip(row) {
                *a += b;
            }
        }
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: &mut Tensor<Self>,
        targets: &[u32],
        grad_scale: f32,
        loss_sum: &mut Tensor<Self>,
    ) -> Result<()> {
        let _span = self.profile.span("cross_entropy", Track::Compute);
        let v = logits.row_len();
        if logits.rows() != targets.len() {
            return Err(Error::Backend(
                "cross_entropy: one target per logits row".into(),
            ));
        }
        let losses: Vec<f64> = data_mut(logits)
            .par_chunks_mut(v)
            .zip(targets.par_iter())
            .map(|(row, &t)| {
                if t == IGNORE {
                    row.fill(0.0);
                    return 0.0;
                }
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s: f32 = row.iter().map(|&x| (x - m).exp()).sum();
                let lse = m + s.ln();
                let loss = (lse - row[t as usize]) as f64;
                for x in row.iter_mut() {
                    *x = grad_scale * (*x - lse).exp();
                }
                row[t as usize] -= grad_scale;
                loss
            })
            .collect();
        data_mut(loss_sum)[0] += losses.iter().sum::<f64>() as f32;
        Ok(())
    }

    fn host_f32<'t>(&self, t: &'t Tensor<Self>) -> Result<&'t [f32]> {
        Ok(data(t))
    }

    fn host_f32_mut<'t>(&self, t: &'t mut Tensor<Self>) -> Result<&'t mut [f32]> {
        Ok(data_mut(t))
    }

    fn fused_update(
        &self,
        kernel: &dyn UpdateKernel,
        slots: &mut [UpdateSlot<'_, Self>],
    ) -> Result<()> {
        let _span = self.profile.span(kernel.name(), Track::Compute);
        for (k, slot) in slots.iter_mut().enumerate() {
            let written = (slot.written.iter_mut())
                .map(|t| HostCellsMut {
                    dtype: t.dtype(),
                    cells: data_mut(t),
                })
                .collect();
            let read = (slot.read.iter())
                .map(|t| HostCells {
                    dtype: t.dtype(),
                    cells: data(t),
                })
                .collect();
            kernel.host(k, HostSlot { written, read })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::CpuBackend;
    use crate::backend::{Backend, Category, DType, Tensor};
    use crate::rng::Rng;

    fn host(b: &CpuBackend, v: &[f32], shape: &[usize], dt: DType) -> Tensor<CpuBackend> {
        b.from_host(v, shape, dt, Category::Workspace).unwrap()
    }

    fn bits(b: &CpuBackend, t: &Tensor<CpuBackend>) -> Vec<u32> {
        b.to_host(t).unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// The embedding ops' scale: 1 copies the rows (and adds the gradient)
    /// exactly; another scale equals the rows then `0 + c·x` by `axpy` (the
    /// scaled copy the decoder made before the ops took a scale), bit for
    /// bit, in F32 and rounded to BF16, forward and backward.
    #[test]
    fn embedding_scale_multiplies_rows_and_gradients() {
        let b = CpuBackend::new();
        let mut rng = Rng::new(5);
        let (vocab, h, ids) = (7, 6, [3u32, 0, 6, 3]);
        let n = ids.len();
        let table: Vec<f32> = (0..vocab * h).map(|_| rng.uniform() as f32 - 0.5).collect();
        let dout: Vec<f32> = (0..n * h).map(|_| rng.uniform() as f32 - 0.5).collect();
        let dt0: Vec<f32> = (0..vocab * h).map(|_| rng.uniform() as f32).collect();
        for dt in [DType::F32, DType::BF16] {
            let t = host(&b, &table, &[vocab, h], dt);
            let mut plain = b.empty(&[n, h], dt, Category::Workspace).unwrap();
            b.embedding_fwd(&t, &ids, 1.0, &mut plain).unwrap();
            let want: Vec<u32> = ids
                .iter()
                .flat_map(|&i| b.to_host(&t).unwrap()[i as usize * h..][..h].to_vec())
                .map(f32::to_bits)
                .collect();
            assert_eq!(bits(&b, &plain), want, "{dt:?}: scale 1 copies");
            let c = 1152f32.sqrt();
            let mut scaled = b.empty(&[n, h], dt, Category::Workspace).unwrap();
            b.embedding_fwd(&t, &ids, c, &mut scaled).unwrap();
            let mut old = b.zeros(&[n, h], dt, Category::Workspace).unwrap();
            b.axpy(&mut old, c, &plain).unwrap();
            assert_eq!(bits(&b, &scaled), bits(&b, &old), "{dt:?}: forward");
            assert_ne!(bits(&b, &scaled), bits(&b, &plain), "{dt:?}: not scaled");

            let dy = host(&b, &dout, &[n, h], dt);
            let mut d1 = host(&b, &dt0, &[vocab, h], DType::F32);
            b.embedding_bwd(&dy, &ids, c, &mut d1).unwrap();
            let mut dy_scaled = b.zeros(&[n, h], dt, Category::Workspace).unwrap();
            b.axpy(&mut dy_scaled, c, &dy).unwrap();
            let mut d2 = host(&b, &dt0, &[vocab, h], DType::F32);
            b.embedding_bwd(&dy_scaled, &ids, 1.0, &mut d2).unwrap();
            assert_eq!(bits(&b, &d1), bits(&b, &d2), "{dt:?}: backward");
            // row 3 took two gradients, row 1 none
            let (got, dy_host) = (b.to_host(&d2).unwrap(), b.to_host(&dy_scaled).unwrap());
            for j in 0..h {
                let want = dt0[3 * h + j] + dy_host[j] + dy_host[3 * h + j];
                assert_eq!(got[3 * h + j].to_bits(), want.to_bits());
                assert_eq!(got[h + j].to_bits(), dt0[h + j].to_bits());
            }
        }
    }
}
