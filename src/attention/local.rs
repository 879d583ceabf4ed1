//! The single-device attention layer: the reference every strategy must equal.
//! Written plainly, without stages or exchanges.

use super::lora_delta::{LoraPair, add_delta, add_delta_bwd};
use super::rope::RopeTables;
use super::{AttentionGrads, AttentionWeights, AttnDims, AttnSaved, norm_rope, norm_rope_bwd};
use crate::backend::fp8::{
    Fp8Format, Fp8Operand, Fp8Ref, LinearGemm, LinearRole, OutputGrad, Precision, Quantized,
    linear_gemm_quantized,
};
use crate::backend::{
    AttentionBwd, AttentionFwd, AttnGradWrites, AttnMask, Backend, Category, DType, Tensor,
};
use crate::error::Result;

/// `x @ w^T (+ bias) (+ the adapter's delta)` for a `[rows, hidden]` input,
/// `[heads*d, hidden]` weight and optional `[heads*d]` bias, shaped
/// `[rows, heads, d]`.
fn project<B: Backend>(
    b: &B,
    (x, x8): (&Tensor<B>, Option<Fp8Ref<'_, B>>),
    (w, bias, lora): (&Tensor<B>, Option<&Tensor<B>>, Option<&LoraPair<B>>),
    (heads, d): (usize, usize),
    precision: Precision,
) -> Result<Tensor<B>> {
    let mut out = b.zeros(&[x.rows(), heads, d], x.dtype(), Category::Workspace)?;
    let g = LinearGemm::new(LinearRole::Forward, out.mat_mut(), x.mat(), w.mat().t());
    linear_gemm_quantized(b, precision, g, Quantized { a: x8, b: None })?;
    if let Some(bias) = bias {
        super::add_head_bias(b, out.mat_mut(), bias, &(0..heads), d)?;
    }
    add_delta(b, lora, x.mat(), out.mat_mut())?;
    Ok(out)
}

/// q, k and v of `x`, each `[rows, heads, d]`.
fn project_qkv<B: Backend>(
    b: &B,
    dims: &AttnDims,
    w: &AttentionWeights<B>,
    x: &Tensor<B>,
) -> Result<[Tensor<B>; 3]> {
    let (d, l, p) = (dims.head_dim, &w.lora, dims.precision);
    // q, k and v read x: under fp8 it is quantized once for the three
    let x8 = Fp8Operand::of(b, p, x.mat(), Fp8Format::E4M3)?;
    let x = (x, x8.as_ref().map(Fp8Operand::codes));
    let q = project(
        b,
        x,
        (&w.wq, w.bq.as_ref(), l.q.as_ref()),
        (dims.heads, d),
        p,
    )?;
    let k = project(
        b,
        x,
        (&w.wk, w.bk.as_ref(), l.k.as_ref()),
        (dims.kv_heads, d),
        p,
    )?;
    let v = project(
        b,
        x,
        (&w.wv, w.bv.as_ref(), l.v.as_ref()),
        (dims.kv_heads, d),
        p,
    )?;
    Ok([q, k, v])
}

/// The layer on one device: the backend, the layer's dims, its RoPE
/// tables and its mask.
pub struct Local<'a, B: Backend> {
    pub b: &'a B,
    pub dims: &'a AttnDims,
    pub rope: &'a RopeTables<B>,
    pub mask: &'a AttnMask,
}

impl<B: Backend> Local<'_, B> {
    /// Forward on the whole sequence under its mask: `x: [s, hidden]` →
    /// `y: [s, hidden]` and the saved state.
    pub fn forward(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
    ) -> Result<(Tensor<B>, AttnSaved<B>)> {
        let (b, dims, rope, mask) = (self.b, self.dims, self.rope, self.mask);
        let (s, d) = (x.rows(), dims.head_dim);
        let [q, k, v] = project_qkv(b, dims, w, x)?;
        let (q, _) = norm_rope(b, q, w.q_norm.as_ref(), dims.norm, rope, false)?;
        let (k, _) = norm_rope(b, k, w.k_norm.as_ref(), dims.norm, rope, false)?;
        let mut o = b.zeros(&[s, dims.heads, d], x.dtype(), Category::Activations)?;
        let mut lse = b.zeros(&[s, dims.heads], DType::F32, Category::Activations)?;
        b.attention_fwd(AttentionFwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: v.all_rows(),
            mask,
            scale: dims.softmax_scale,
            o: o.all_rows_mut(),
            lse: lse.all_rows_mut(),
        })?;
        drop((q, k, v));
        let y = super::output_projection(b, &o, w, dims.precision)?;
        Ok((y, AttnSaved { o, lse: vec![lse] }))
    }

    /// Backward on the whole sequence under its mask from the forward's
    /// `saved` state and the output's gradient `dy`; returns `dx`.
    pub fn backward(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        saved: AttnSaved<B>,
        dy: &Tensor<B>,
        g: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        let AttnSaved { o, lse } = saved;
        let d_o = self.output_bwd(w, (&o, dy), g)?;
        let dqkv = self.core_bwd(w, x, (o, lse, d_o), g)?;
        self.qkv_bwd(w, x, dqkv, g)
    }

    /// The output projection's backward: Wo's (and its adapter's) gradients
    /// from the attention output `o` `[s, heads, d]` and `dy` `[s, hidden]`;
    /// returns dO `[s, heads, d]`.
    fn output_bwd(
        &self,
        w: &AttentionWeights<B>,
        (o, dy): (&Tensor<B>, &Tensor<B>),
        g: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        let (b, dims) = (self.b, self.dims);
        let (s, d, p) = (o.rows(), dims.head_dim, dims.precision);
        // dy is read by Wo's weight gradient and by dO's GEMM (under fp8
        // quantized once, in both layouts)
        let dy8 = OutputGrad::new(b, p, dy.mat(), g.wo.is_some())?;
        if let Some(gwo) = g.wo.as_mut() {
            dy8.weight_grad(b, gwo.mat_mut(), (o.mat(), None))?;
        }
        let mut d_o = b.zeros(&[s, dims.heads, d], o.dtype(), Category::Workspace)?;
        dy8.input_grad(b, (d_o.mat_mut(), 0.0), (w.wo.mat(), None))?;
        drop(dy8);
        let (lo, glo) = (w.lora.o.as_ref(), g.lora.o.as_mut());
        add_delta_bwd(b, lo, glo, o.mat(), dy.mat(), d_o.mat_mut())?;
        Ok(d_o)
    }

    /// The attention core's backward with q, k and v recomputed from `x`:
    /// dq, dk (through QK-norm and RoPE) and dv, in F32.
    fn core_bwd(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        (o, lse, d_o): (Tensor<B>, Vec<Tensor<B>>, Tensor<B>),
        g: &mut AttentionGrads<B>,
    ) -> Result<[Tensor<B>; 3]> {
        let (b, dims, rope, mask) = (self.b, self.dims, self.rope, self.mask);
        let eps = dims.norm;
        let [q, k, v] = project_qkv(b, dims, w, x)?;
        let (q, q_raw) = norm_rope(b, q, w.q_norm.as_ref(), eps, rope, true)?;
        let (k, k_raw) = norm_rope(b, k, w.k_norm.as_ref(), eps, rope, true)?;
        let mut dq = b.zeros(q.shape(), DType::F32, Category::Workspace)?;
        let mut dk = b.zeros(k.shape(), DType::F32, Category::Workspace)?;
        let mut dv = b.zeros(v.shape(), DType::F32, Category::Workspace)?;
        b.attention_bwd(AttentionBwd {
            q: q.all_rows(),
            k: k.all_rows(),
            v: v.all_rows(),
            o: o.all_rows(),
            d_o: d_o.all_rows(),
            lse: lse[0].all_rows(),
            mask,
            scale: dims.softmax_scale,
            dq: dq.all_rows_mut(),
            dk: dk.all_rows_mut(),
            dv: dv.all_rows_mut(),
            writes: AttnGradWrites::ADD,
        })?;
        drop((q, k, v, d_o, o, lse));
        let dq = norm_rope_bwd(
            b,
            dq,
            q_raw.as_ref(),
            w.q_norm.as_ref().map(|w| (w, g.q_norm.as_mut())),
            eps,
            rope,
        )?;
        let dk = norm_rope_bwd(
            b,
            dk,
            k_raw.as_ref(),
            w.k_norm.as_ref().map(|w| (w, g.k_norm.as_mut())),
            eps,
            rope,
        )?;
        Ok([dq, dk, dv])
    }

    /// The q, k and v projections' backward: their weights', biases' and
    /// adapters' gradients, and `dx` `[s, hidden]`.
    fn qkv_bwd(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        [dq, dk, dv]: [Tensor<B>; 3],
        g: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        let (b, dims) = (self.b, self.dims);
        let (s, d, p) = (x.rows(), dims.head_dim, dims.precision);
        let mut dx = b.zeros(&[s, dims.hidden], x.dtype(), Category::Grads)?;
        // the weight gradients read xᵀ: under fp8 it is quantized once
        let xt8 = match g.wq.is_some() || g.wk.is_some() || g.wv.is_some() {
            true => Fp8Operand::of(b, p, x.mat().t(), Fp8Format::E4M3)?,
            false => None,
        };
        let (l, gl) = (&w.lora, &mut g.lora);
        for (dp, wp, gp, gb, heads, lora) in [
            (
                &dq,
                &w.wq,
                g.wq.as_mut(),
                g.bq.as_mut(),
                dims.heads,
                (&l.q, &mut gl.q),
            ),
            (
                &dk,
                &w.wk,
                g.wk.as_mut(),
                g.bk.as_mut(),
                dims.kv_heads,
                (&l.k, &mut gl.k),
            ),
            (
                &dv,
                &w.wv,
                g.wv.as_mut(),
                g.bv.as_mut(),
                dims.kv_heads,
                (&l.v, &mut gl.v),
            ),
        ] {
            let dp = crate::backend::cast_ref(b, dp, x.dtype())?;
            // read by the weight gradient and by dx's GEMM
            let dp8 = OutputGrad::new(b, p, dp.mat(), gp.is_some())?;
            if let Some(gp) = gp {
                let xt8 = xt8.as_ref().map(Fp8Operand::codes);
                dp8.weight_grad(b, gp.mat_mut(), (x.mat(), xt8))?;
            }
            if let Some(gb) = gb {
                super::head_bias_grad(b, gb, dp.mat(), &(0..heads), d)?;
            }
            dp8.input_grad(b, (dx.mat_mut(), 1.0), (wp.mat(), None))?;
            drop(dp8);
            let (pair, grads) = (lora.0.as_ref(), lora.1.as_mut());
            add_delta_bwd(b, pair, grads, x.mat(), dp.mat(), dx.mat_mut())?;
        }
        Ok(dx)
    }
}
