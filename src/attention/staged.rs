//! The staged context-parallel engine behind `ulysses`, `ring`, `usp` and
//! `upipe` (DESIGN.md §4).
//!
//! Per kv phase, each rank projects the phase's K/V heads for its local
//! tokens, packed by destination Ulysses rank (`[pu * s, m, d]`), and one
//! all-to-all turns that into the whole ring shard for its own `m` kv heads
//! (`[n, m, d]`, `n = pu * s`). Per stage the same happens for `u` query heads;
//! attention (ring attention when `pr > 1`) produces `[n, u, d]`, which a
//! second all-to-all returns to the token owners, who write it into O at the
//! heads' canonical positions. Only one stage's buffers are alive at a time
//! (with `overlap`, the next stage's and the next kv phase's inputs and the
//! previous stage's returning output or gradients too).
//!
//! Backward recomputes each phase's K/V and each stage's Q, fetches that
//! stage's O and dO slices through the same exchanges, runs the attention
//! backward, and sends dQ (per stage) and dK/dV (per phase) back to the token
//! owners, where the weight gradients and dx accumulate (`Staged::settle`).
//! Replicated kv heads (fewer kv heads than Ulysses ranks) sum their
//! gradients there naturally.

use super::lora_delta::{DeltaPart, LoraPair, LoraPairGrads};
use super::lora_delta::{lora_delta_bwd_mat as delta_bwd, lora_delta_fwd_mat as delta_fwd};
use super::ring::RingBwd;
use super::rope::RopeTables;
use super::schedule::{KvPhase, LsePiece, StageSchedule, Upcoming, grad_write, upcoming};
use super::settle::{Proj, Run, SettleLayout, settle_layout};
use super::shapes::StageShapes;
use super::{
    AttentionGrads, AttentionWeights, AttnDims, AttnSaved, CpPlan, norm_rope, norm_rope_bwd,
    ring_shift,
};
use crate::backend::fp8::{
    Fp8Format, Fp8Operand, Fp8Ref, LinearGemm, LinearRole, OutputGrad, Quantized,
    linear_gemm_quantized,
};
use crate::backend::{
    AttnGradWrites, AttnMask, AttnShape, Backend, Category, DType, GradWrite, Mat, MatLayout,
    Tensor,
};
use crate::comm::{Mesh, Pending};
use crate::error::Result;
use std::ops::Range;

/// A kv phase's K (normed, rotated), its pre-norm copy when kept, and V: `[n, m, d]`.
struct PhaseKv<B: Backend> {
    k: Tensor<B>,
    k_raw: Option<Tensor<B>>,
    v: Tensor<B>,
}

/// A kv phase's K and V projections on their way to the attention layout.
struct KvInFlight<B: Backend> {
    k: Pending<B>,
    v: Pending<B>,
}

/// A projection's gradient on its way back to the token owners: packed by
/// source rank `[pu * s, nh, d]`, block `j` = heads `heads[j]`.
struct GradInFlight<'h, B: Backend> {
    grad: Pending<B>,
    proj: Proj,
    heads: &'h [Range<usize>],
}

/// One stage's attention output on its way back to the token owners.
struct OutInFlight<'h, B: Backend> {
    o_att: Pending<B>,
    heads: &'h [Range<usize>],
}

/// One backward stage's exchanged inputs, possibly still in flight.
struct BwdStageInputs<B: Backend> {
    o_att: Pending<B>,
    d_o: Pending<B>,
    q_raw: Pending<B>,
}

/// The layer's input `x: [s, hidden]` and, under fp8, its codes, quantized
/// once per call rather than once per stage: row-major for the q/k/v
/// projections and, from the same read, transposed for their weight
/// gradients (a backward with any of them to compute).
struct Input<'x, B: Backend> {
    x: &'x Tensor<B>,
    x8: Option<Fp8Operand<B>>,
}

impl<'x, B: Backend> Input<'x, B> {
    fn new(b: &B, dims: &AttnDims, x: &'x Tensor<B>, weight_grads: bool) -> Result<Self> {
        let p = dims.precision;
        let x8 = Fp8Operand::both(b, p, x.mat(), Fp8Format::E4M3, weight_grads)?;
        Ok(Input { x, x8 })
    }
}

/// One rank's view of the staged layer for one call.
pub struct Staged<'a, B: Backend> {
    b: &'a B,
    mesh: &'a Mesh<B>,
    dims: &'a AttnDims,
    plan: &'a CpPlan,
    rope: &'a RopeTables<B>,
    /// The whole sequence's mask (every stage attends over all of it).
    mask: &'a AttnMask,
    /// Local tokens of this rank.
    s: usize,
    /// Buffer shapes (shared with the memory planner).
    shapes: StageShapes,
}

impl<'a, B: Backend> Staged<'a, B> {
    pub fn new(
        b: &'a B,
        mesh: &'a Mesh<B>,
        dims: &'a AttnDims,
        plan: &'a CpPlan,
        rope: &'a RopeTables<B>,
        mask: &'a AttnMask,
    ) -> Self {
        Staged {
            b,
            mesh,
            dims,
            plan,
            rope,
            mask,
            s: plan.layout.local_len(),
            shapes: StageShapes::new(plan, dims),
        }
    }

    fn pu(&self) -> usize {
        self.plan.layout.pu
    }

    /// Weight rows of heads `h` in a `[heads*d, hidden]` weight, as a `[h*d, hidden]` view layout.
    fn head_rows(&self, h: &Range<usize>) -> MatLayout {
        let (d, hid) = (self.dims.head_dim, self.dims.hidden);
        MatLayout::block(h.start * d * hid, h.len() * d, hid, hid)
    }

    /// Block `j` of a `[pu * s, nh, d]` packed buffer as an `[s, nh*d]` layout.
    fn packed_block(&self, j: usize, nh: usize) -> MatLayout {
        let w = nh * self.dims.head_dim;
        MatLayout::block(j * self.s * w, self.s, w, w)
    }

    /// Columns of heads `h` in a `[s, H*d]` (or `[hidden, H*d]`) matrix with `rows` rows.
    fn head_cols(&self, h: &Range<usize>, rows: usize) -> MatLayout {
        let d = self.dims.head_dim;
        MatLayout::block(h.start * d, rows, h.len() * d, self.dims.q_width())
    }

    /// `x @ w[heads]^T (+ bias[heads]) (+ the adapter's delta on those
    /// heads' rows)` for every destination's heads, packed `[pu * s, nh, d]`:
    /// each block gets its own heads' bias rows and adapter rows.
    fn project_packed(
        &self,
        x: &Input<'_, B>,
        (w, bias, lora): (&Tensor<B>, Option<&Tensor<B>>, Option<&LoraPair<B>>),
        heads: &[Range<usize>],
    ) -> Result<Tensor<B>> {
        let operand = |h: &Range<usize>| w.view(self.head_rows(h)).t();
        let mut buf = self.project_by_destination(
            (x.x, x.x8.as_ref().map(Fp8Operand::codes)),
            heads,
            operand,
        )?;
        let (nh, d) = (heads[0].len(), self.dims.head_dim);
        for (j, h) in heads.iter().enumerate() {
            if let Some(bias) = bias {
                let block = buf.view_mut(self.packed_block(j, nh));
                super::add_head_bias(self.b, block, bias, h, d)?;
            }
            if let Some(pair) = lora {
                let part = DeltaPart::out_rows(self.dims.hidden, h.start * d..h.end * d);
                let block = buf.view_mut(self.packed_block(j, nh));
                delta_fwd(self.b, pair, &part, x.x.mat(), block)?;
            }
        }
        Ok(buf)
    }

    /// `input @ operand(heads[j])` for every destination `j`, packed
    /// `[pu * s, nh, d]`; `operand(h)` is the `[hidden, nh*d]` weight view of heads `h`.
    fn project_by_destination<'w>(
        &self,
        (input, input8): (&Tensor<B>, Option<Fp8Ref<'_, B>>),
        heads: &[Range<usize>],
        operand: impl Fn(&Range<usize>) -> Mat<'w, B>,
    ) -> Result<Tensor<B>>
    where
        B: 'w,
    {
        let (b, nh) = (self.b, heads[0].len());
        let dtype = input.dtype();
        // weight rows seen transposed: the q/k/v projections' forward; Wo's
        // column blocks: dO, an input gradient
        let role = match operand(&heads[0]).l.trans {
            true => LinearRole::Forward,
            false => LinearRole::InputGrad,
        };
        let p = self.dims.precision;
        if !self.shapes.merge_destinations(nh) {
            let mut buf = self.exchange_buffer(&self.shapes.packed(nh), dtype)?;
            for (j, h) in heads.iter().enumerate() {
                let (c, a) = (buf.view_mut(self.packed_block(j, nh)), input.mat());
                let g = LinearGemm::new(role, c, a, operand(h));
                let pre = Quantized { a: input8, b: None };
                linear_gemm_quantized(b, p, g, pre)?;
            }
            return Ok(buf);
        }
        // one GEMM over every destination's weights: the input is read once
        let w_nh = nh * self.dims.head_dim;
        let wide = self.pu() * w_nh;
        let mut stacked = b.empty(
            &self.shapes.stacked_operands(nh),
            dtype,
            Category::Workspace,
        )?;
        // Weight rows seen transposed (Q/K/V) are stacked as rows (whole
        // contiguous rows copied) and multiplied by the stack's transpose;
        // column blocks (Wo for dO) are stacked side by side.
        let hidden = self.dims.hidden;
        let rows_stacked = operand(&heads[0]).l.trans;
        for (j, h) in heads.iter().enumerate() {
            if rows_stacked {
                let dst = MatLayout::block(j * w_nh * hidden, w_nh, hidden, hidden);
                b.copy(stacked.view_mut(dst), operand(h).t())?;
            } else {
                let dst = MatLayout::block(j * w_nh, hidden, w_nh, wide);
                b.copy(stacked.view_mut(dst), operand(h))?;
            }
        }
        let rhs = if rows_stacked {
            stacked.view(MatLayout::row_major(wide, hidden)).t()
        } else {
            stacked.mat()
        };
        let mut proj = b.empty(
            &self.shapes.stacked_projection(nh),
            dtype,
            Category::Workspace,
        )?;
        let (c, a) = (proj.mat_mut(), input.mat());
        let g = LinearGemm::new(role, c, a, rhs);
        linear_gemm_quantized(b, p, g, Quantized { a: input8, b: None })?;
        drop(stacked);
        let mut buf = self.exchange_buffer(&self.shapes.packed(nh), dtype)?;
        for j in 0..heads.len() {
            let src = MatLayout::block(j * w_nh, self.s, w_nh, wide);
            b.copy(buf.view_mut(self.packed_block(j, nh)), proj.view(src))?;
        }
        Ok(buf)
    }

    /// A send or receive buffer of a Ulysses exchange: from the group's
    /// exchange window where it has one, else the backend's pool.
    fn exchange_buffer(&self, shape: &[usize], dtype: DType) -> Result<Tensor<B>> {
        match self.mesh.ulysses.exchange_buffer(shape, dtype)? {
            Some(t) => Ok(t),
            None => self.b.empty(shape, dtype, Category::Comm),
        }
    }

    /// Starts the all-to-all of `send`; it runs beside the work queued until
    /// [`Pending::wait`] (the send buffer lives until then).
    fn exchange_start(&self, send: Tensor<B>) -> Result<Pending<B>> {
        if self.pu() == 1 {
            return Ok(Pending::done(send));
        }
        let (send, recv) = self.exchange_pair(send)?;
        self.mesh.ulysses.start_all_to_all(send, recv)
    }

    /// The send and receive buffers of one exchange: with an exchange
    /// window both lie in it (a send made elsewhere, such as an attention
    /// output, is copied in), so NCCL moves every exchange on copy engines;
    /// without one the receive buffer comes from the pool. (On NCCL 2.28.3
    /// an all-to-all with only its receive buffer in the window ran NCCL's
    /// kernels and hung, so the two never mix.)
    fn exchange_pair(&self, send: Tensor<B>) -> Result<(Tensor<B>, Tensor<B>)> {
        let group = &self.mesh.ulysses;
        let (shape, dtype) = (send.shape().to_vec(), send.dtype());
        if group.in_exchange_window(&send) {
            let recv = self.exchange_buffer(&shape, dtype)?;
            return Ok((send, recv));
        }
        let Some(mut staged) = group.exchange_buffer(&shape, dtype)? else {
            // no window: both from the pool
            let recv = self.b.empty(&shape, dtype, Category::Comm)?;
            return Ok((send, recv));
        };
        self.b.copy(staged.mat_mut(), send.mat())?;
        // freed before the receive buffer is taken: at most two of the
        // three are alive at once
        drop(send);
        let recv = self.exchange_buffer(&shape, dtype)?;
        Ok((staged, recv))
    }

    /// Starts sending a gradient back to the token owners in the compute
    /// dtype (an F32 gradient is freed once cast).
    fn exchange_back_start(&self, grad: Tensor<B>, dtype: DType) -> Result<Pending<B>> {
        let send = if grad.dtype() == dtype {
            grad
        } else {
            let mut send = self.exchange_buffer(grad.shape(), dtype)?;
            self.b.copy(send.mat_mut(), grad.mat())?;
            drop(grad);
            send
        };
        self.exchange_start(send)
    }

    /// Projects this phase's K and V heads and starts their exchanges.
    fn kv_start(
        &self,
        w: &AttentionWeights<B>,
        x: &Input<'_, B>,
        phase: &KvPhase,
    ) -> Result<KvInFlight<B>> {
        let heads = &phase.kv_heads;
        let (wk, wv) = (
            (&w.wk, w.bk.as_ref(), w.lora.k.as_ref()),
            (&w.wv, w.bv.as_ref(), w.lora.v.as_ref()),
        );
        let k = self.exchange_start(self.project_packed(x, wk, heads)?)?;
        let v = self.exchange_start(self.project_packed(x, wv, heads)?)?;
        Ok(KvInFlight { k, v })
    }

    /// This phase's K (normed, rotated), its pre-norm copy if needed, and V: `[n, m, d]`.
    fn kv_ready(
        &self,
        w: &AttentionWeights<B>,
        kv: KvInFlight<B>,
        keep_raw: bool,
    ) -> Result<PhaseKv<B>> {
        let (k, v) = (kv.k.wait()?, kv.v.wait()?);
        let (k, k_raw) = norm_rope(
            self.b,
            k,
            w.k_norm.as_ref(),
            self.dims.norm,
            self.rope,
            keep_raw,
        )?;
        Ok(PhaseKv { k, k_raw, v })
    }

    /// This stage's Q projected and exchanged, before norm and RoPE: `[n, u, d]`.
    fn q_exchanged(
        &self,
        w: &AttentionWeights<B>,
        x: &Input<'_, B>,
        q_heads: &[Range<usize>],
    ) -> Result<Pending<B>> {
        let wq = (&w.wq, w.bq.as_ref(), w.lora.q.as_ref());
        self.exchange_start(self.project_packed(x, wq, q_heads)?)
    }

    /// Q normed and rotated, and its pre-norm copy if needed.
    fn q_ready(
        &self,
        w: &AttentionWeights<B>,
        q_raw: Tensor<B>,
        keep_raw: bool,
    ) -> Result<(Tensor<B>, Option<Tensor<B>>)> {
        norm_rope(
            self.b,
            q_raw,
            w.q_norm.as_ref(),
            self.dims.norm,
            self.rope,
            keep_raw,
        )
    }

    /// [`grad_write`] of a gradient `calls` stages contribute to.
    fn grad_write(&self, calls: usize, normed: bool, in_place: bool) -> GradWrite {
        grad_write(calls, self.plan.layout.pr, normed, in_place)
    }

    /// A gradient buffer of one attention backward for `write`: unfilled in
    /// the compute dtype (overwritten), or zeroed F32 (added into).
    fn attention_grad(&self, shape: &[usize], write: GradWrite) -> Result<Tensor<B>> {
        match write {
            GradWrite::Overwrite => {
                self.b
                    .empty(shape, self.b.compute_dtype(), Category::Workspace)
            }
            GradWrite::Add => self.b.zeros(shape, DType::F32, Category::Workspace),
        }
    }

    /// Whether transfers run beside attention (`--overlap`): the next stage's
    /// projections and exchanges (at a phase's last stage, the next phase's
    /// K/V too) are issued before this stage's attention, and this stage's
    /// output (forward) or gradients (backward) are taken in only after the
    /// next stage's attention is queued. Costs one extra stage (and kv phase)
    /// of buffers.
    fn prefetch(&self) -> bool {
        self.plan.overlap
    }

    /// What to prefetch once stage `t` of phase `p` of `sched` has its inputs:
    /// [`Upcoming::End`] (nothing) unless overlapping.
    fn upcoming(&self, sched: &StageSchedule, p: usize, t: usize) -> Upcoming {
        if !self.prefetch() {
            return Upcoming::End;
        }
        let phases = &sched.phases;
        upcoming(p, t, phases.len(), phases[p].stages.len())
    }

    /// What the attention backward of one stage needs, in the attention
    /// layout: O, dO and the raw (pre-norm) Q.
    fn bwd_stage_inputs(
        &self,
        w: &AttentionWeights<B>,
        x: &Input<'_, B>,
        o: &Tensor<B>,
        dy: (&Tensor<B>, Option<Fp8Ref<'_, B>>),
        heads: &[Range<usize>],
        g: &mut AttentionGrads<B>,
    ) -> Result<BwdStageInputs<B>> {
        // Q leaves first: its norm and RoPE run while O and dO travel
        let q_raw = self.q_exchanged(w, x, heads)?;
        let o_att = self.exchange_start(self.gather_heads(o, heads)?)?;
        let mut d_o = self.project_dout(dy, &w.wo, heads)?;
        self.lora_o_bwd(w, o, dy.0, heads, g.lora.o.as_mut(), &mut d_o)?;
        let d_o = self.exchange_start(d_o)?;
        Ok(BwdStageInputs { q_raw, o_att, d_o })
    }

    /// The o_proj adapter's backward on the columns of `heads`: its
    /// `dA[:, heads]`, its share of `dB`, and `dO[heads] += scale ·
    /// (dy·B)·A[:, heads]` in every destination's block of `d_o`.
    fn lora_o_bwd(
        &self,
        w: &AttentionWeights<B>,
        o: &Tensor<B>,
        dy: &Tensor<B>,
        heads: &[Range<usize>],
        grads: Option<&mut LoraPairGrads<B>>,
        d_o: &mut Tensor<B>,
    ) -> Result<()> {
        let (Some(pair), Some(grads)) = (w.lora.o.as_ref(), grads) else {
            return Ok(());
        };
        let (nh, d) = (heads[0].len(), self.dims.head_dim);
        for (j, h) in heads.iter().enumerate() {
            let part = DeltaPart::in_cols(h.start * d..h.end * d, self.dims.hidden);
            let o_heads = o.view(self.head_cols(h, self.s));
            let block = d_o.view_mut(self.packed_block(j, nh));
            delta_bwd(self.b, pair, &part, o_heads, dy.mat(), grads, block)?;
        }
        Ok(())
    }

    /// Writes a stage's returned attention output into O at its heads' columns.
    fn take_output(&self, o: &mut Tensor<B>, out: OutInFlight<'_, B>) -> Result<()> {
        let back = out.o_att.wait()?;
        let u = out.heads[0].len();
        for (j, h) in out.heads.iter().enumerate() {
            self.b.copy(
                o.view_mut(self.head_cols(h, self.s)),
                back.view(self.packed_block(j, u)),
            )?;
        }
        Ok(())
    }

    /// Forward: `x: [s, hidden]` → `y: [s, hidden]`.
    pub fn forward(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
    ) -> Result<(Tensor<B>, AttnSaved<B>)> {
        let b = self.b;
        let sched = &self.plan.fwd_schedule;
        let mut o = b.empty(&self.shapes.saved_o(), x.dtype(), Category::Activations)?;
        let input = Input::new(b, self.dims, x, false)?;
        let x = &input;
        // one LSE per backward stage
        let mut lses: Vec<Option<Tensor<B>>> =
            (0..self.plan.schedule.n_stages()).map(|_| None).collect();
        // for each forward stage, the backward stages whose LSE it computes
        // (the plan was validated against this when it was built)
        let pieces = super::schedule::lse_pieces(sched, &self.plan.schedule)?;
        let mut fwd_stage = 0;
        let mut next_kv: Option<KvInFlight<B>> = None;
        let mut next_q: Option<Pending<B>> = None;
        let mut out: Option<OutInFlight<'_, B>> = None;
        for (p, phase) in sched.phases.iter().enumerate() {
            let kv = match next_kv.take() {
                Some(kv) => kv,
                None => self.kv_start(w, x, phase)?,
            };
            let PhaseKv { k, v, .. } = self.kv_ready(w, kv, false)?;
            for (t, stage) in phase.stages.iter().enumerate() {
                let q_raw = match next_q.take() {
                    Some(q) => q,
                    None => self.q_exchanged(w, x, &stage.q_heads)?,
                }
                .wait()?;
                let (q, _) = self.q_ready(w, q_raw, false)?;
                match self.upcoming(sched, p, t) {
                    Upcoming::Stage => {
                        let next = &phase.stages[t + 1];
                        next_q = Some(self.q_exchanged(w, x, &next.q_heads)?);
                    }
                    Upcoming::PhaseStart => {
                        let next = &sched.phases[p + 1];
                        next_kv = Some(self.kv_start(w, x, next)?);
                        next_q = Some(self.q_exchanged(w, x, &next.stages[0].q_heads)?);
                    }
                    Upcoming::End => {}
                }
                let ring = self.mesh.ring.as_ref();
                let scale = self.dims.softmax_scale;
                let (o_att, lse) = ring_shift::forward(b, ring, &q, &k, &v, self.mask, scale)?;
                drop(q);
                self.split_lse(lse, &pieces[fwd_stage], &mut lses)?;
                fwd_stage += 1;
                let this = OutInFlight {
                    o_att: self.exchange_start(o_att)?,
                    heads: &stage.q_heads,
                };
                // with overlap the previous stage's output came back beside
                // this stage's attention
                if let Some(prev) = out.replace(this) {
                    self.take_output(&mut o, prev)?;
                }
                if !self.prefetch()
                    && let Some(this) = out.take()
                {
                    self.take_output(&mut o, this)?;
                }
            }
        }
        if let Some(last) = out.take() {
            self.take_output(&mut o, last)?;
        }
        drop(input);
        let y = super::output_projection(b, &o, w, self.dims.precision)?;
        let lse = lses
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                l.ok_or_else(|| {
                    crate::error::Error::Backend(format!(
                        "no forward stage computed backward stage {i}'s LSE"
                    ))
                })
            })
            .collect::<Result<_>>()?;
        Ok((y, AttnSaved { o, lse }))
    }

    /// Hands a forward stage's LSE (`[n, u_f]` F32) to the backward stages
    /// it serves: whole when it serves one, else one `[n, u]` copy of its
    /// columns per backward stage.
    fn split_lse(
        &self,
        lse: Tensor<B>,
        pieces: &[LsePiece],
        out: &mut [Option<Tensor<B>>],
    ) -> Result<()> {
        let &[n, width] = lse.shape() else {
            return Err(crate::error::Error::Backend(format!(
                "a stage's LSE is [n, heads], not {:?}",
                lse.shape()
            )));
        };
        if let [one] = pieces
            && one.cols.len() == width
        {
            out[one.bwd_stage] = Some(lse);
            return Ok(());
        }
        for piece in pieces {
            let u = piece.cols.len();
            let mut part = self.b.empty(&[n, u], DType::F32, Category::Activations)?;
            self.b.copy(
                part.mat_mut(),
                lse.view(MatLayout::block(piece.cols.start, n, u, width)),
            )?;
            out[piece.bwd_stage] = Some(part);
        }
        Ok(())
    }

    /// Backward; returns `dx` and accumulates this rank's partial weight gradients.
    ///
    /// Gradients return to the token owners in flight (`GradInFlight`), taken
    /// in by `settle`: at once, or (with overlap) after the next
    /// stage's attention is queued. Each settlement meets the weights in one
    /// `dx` GEMM over its head blocks side by side, so `dx` (`[s, hidden]`,
    /// the largest operand) is read and written once per settlement.
    // Long: the stage loop is UPipe's backward written out in the order it
    // runs (projections, exchanges, attention, gradients in flight,
    // settlements), as an explicit backward reads best.
    pub fn backward(
        &self,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        saved: AttnSaved<B>,
        dy: &Tensor<B>,
        g: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        let (b, eps) = (self.b, self.dims.norm);
        let act = x.dtype();
        let sched = &self.plan.schedule;
        // gradients left in flight after each settlement
        let keep = usize::from(self.prefetch());
        let AttnSaved { o, lse } = saved;
        // dy is read by Wo's weight gradient, transposed, and by every
        // stage's dO projection: under fp8 it is quantized once, in both
        // layouts, and the transpose dropped after the weight gradient
        let mut dy8 = OutputGrad::new(b, self.dims.precision, dy.mat(), g.wo.is_some())?;
        if let Some(gwo) = g.wo.as_mut() {
            dy8.weight_grad(b, gwo.mat_mut(), (o.mat(), None))?;
        }
        dy8.weight_grad_done();
        let dy = (dy, dy8.codes());
        let mut dx = b.zeros(&self.shapes.layer_io(), act, Category::Grads)?;
        let weight_grads = g.wq.is_some() || g.wk.is_some() || g.wv.is_some();
        let x = &Input::new(b, self.dims, x, weight_grads)?;
        let mut in_flight: Vec<GradInFlight<'_, B>> = Vec::new();
        let mut next_kv: Option<KvInFlight<B>> = None;
        let mut next_inputs: Option<BwdStageInputs<B>> = None;
        let mut stage_index = 0;
        // every stage's attention call on this rank: [n, u, d] over [n, m, d]
        let sh = &self.shapes;
        let call = AttnShape::square(sh.n, sh.u, sh.m, sh.head_dim, self.mask);
        let in_place = b.attention_bwd_in_place(&call);
        let q_write = self.grad_write(1, w.q_norm.is_some(), in_place);
        for (p, phase) in sched.phases.iter().enumerate() {
            let kv = match next_kv.take() {
                Some(kv) => kv,
                None => self.kv_start(w, x, phase)?,
            };
            // the phase's first stage inputs are made while its K/V travel
            if next_inputs.is_none() {
                let heads = &phase.stages[0].q_heads;
                next_inputs = Some(self.bwd_stage_inputs(w, x, &o, dy, heads, g)?);
            }
            let PhaseKv { k, k_raw, v } = self.kv_ready(w, kv, true)?;
            let kv_write = self.grad_write(phase.stages.len(), w.k_norm.is_some(), in_place);
            let (mut dk, mut dv) = (
                self.attention_grad(k.shape(), kv_write)?,
                self.attention_grad(v.shape(), kv_write)?,
            );
            for (t, stage) in phase.stages.iter().enumerate() {
                let heads = &stage.q_heads;
                // O, dO and Q of this stage, moved to the attention layout.
                let BwdStageInputs { o_att, d_o, q_raw } = match next_inputs.take() {
                    Some(p) => p,
                    None => self.bwd_stage_inputs(w, x, &o, dy, heads, g)?,
                };
                let (q, q_raw) = self.q_ready(w, q_raw.wait()?, true)?;
                let (o_att, d_o) = (o_att.wait()?, d_o.wait()?);
                match self.upcoming(sched, p, t) {
                    Upcoming::Stage => {
                        let heads = &phase.stages[t + 1].q_heads;
                        next_inputs = Some(self.bwd_stage_inputs(w, x, &o, dy, heads, g)?);
                    }
                    Upcoming::PhaseStart => {
                        let next = &sched.phases[p + 1];
                        next_kv = Some(self.kv_start(w, x, next)?);
                        let heads = &next.stages[0].q_heads;
                        next_inputs = Some(self.bwd_stage_inputs(w, x, &o, dy, heads, g)?);
                    }
                    Upcoming::End => {}
                }
                let mut dq = self.attention_grad(q.shape(), q_write)?;
                let args = RingBwd {
                    q: &q,
                    k: &k,
                    v: &v,
                    o: &o_att,
                    d_o: &d_o,
                    lse: &lse[stage_index],
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                    writes: AttnGradWrites {
                        dq: q_write,
                        // a kv phase's later stages add into the first's
                        dkv: if t == 0 { kv_write } else { GradWrite::Add },
                    },
                    mask: self.mask,
                    scale: self.dims.softmax_scale,
                };
                ring_shift::backward(b, self.mesh.ring.as_ref(), args)?;
                drop((q, o_att, d_o));
                let norm = w.q_norm.as_ref().map(|w| (w, g.q_norm.as_mut()));
                let dq = norm_rope_bwd(b, dq, q_raw.as_ref(), norm, eps, self.rope)?;
                drop(q_raw);
                in_flight.push(GradInFlight {
                    grad: self.exchange_back_start(dq, act)?,
                    proj: Proj::Q,
                    heads,
                });
                if self.plan.settle_every.after_stage(t) {
                    self.settle(&mut in_flight, keep, x, w, g, &mut dx)?;
                }
                stage_index += 1;
            }
            drop((k, v));
            let norm = w.k_norm.as_ref().map(|w| (w, g.k_norm.as_mut()));
            let dk = norm_rope_bwd(b, dk, k_raw.as_ref(), norm, eps, self.rope)?;
            drop(k_raw);
            let heads = &phase.kv_heads;
            for (grad, proj) in [(dk, Proj::K), (dv, Proj::V)] {
                in_flight.push(GradInFlight {
                    grad: self.exchange_back_start(grad, act)?,
                    proj,
                    heads,
                });
            }
            self.settle(&mut in_flight, 2 * keep, x, w, g, &mut dx)?;
        }
        self.settle(&mut in_flight, 0, x, w, g, &mut dx)?;
        drop((o, lse));
        Ok(dx)
    }

    /// Takes in every gradient in flight but the newest `keep`: their blocks
    /// side by side (`settle_layout`), `dW[run] += gathered[run]^T x` per run
    /// of contiguous heads, and `dx += gathered W[stacked rows]` as one GEMM,
    /// so `dx` is read and written once per settlement, not once per block.
    fn settle(
        &self,
        in_flight: &mut Vec<GradInFlight<'_, B>>,
        keep: usize,
        x: &Input<'_, B>,
        w: &AttentionWeights<B>,
        g: &mut AttentionGrads<B>,
        dx: &mut Tensor<B>,
    ) -> Result<()> {
        if in_flight.len() <= keep {
            return Ok(());
        }
        let ready: Vec<GradInFlight<'_, B>> = in_flight.drain(..in_flight.len() - keep).collect();
        let (gathered, mut stacked, layout) = self.gather_grads(ready, x.x.dtype())?;
        let (b, d, hid) = (self.b, self.dims.head_dim, self.dims.hidden);
        let width = layout.width * d;
        // the dx GEMM reads the gradients as they are, the weight gradients
        // read column runs of them transposed: under fp8 both layouts are
        // quantized at once, under the scale of all of them
        let any_wgrad = g.wq.is_some() || g.wk.is_some() || g.wv.is_some();
        let p = self.dims.precision;
        let g8 = Fp8Operand::both(b, p, gathered.mat(), Fp8Format::E5M2, any_wgrad)?;
        for run in &layout.runs {
            let cols = MatLayout::block(run.col * d, self.s, run.heads.len() * d, width);
            let grad = (gathered.view(cols), g8.as_ref());
            self.settle_run(run, grad, x, w, g, dx)?;
            let rows = MatLayout::block(run.col * d * hid, run.heads.len() * d, hid, hid);
            let wt = match run.proj {
                Proj::Q => &w.wq,
                Proj::K => &w.wk,
                Proj::V => &w.wv,
            };
            b.copy(stacked.view_mut(rows), wt.view(self.head_rows(&run.heads)))?;
        }
        let (c, a, role) = (dx.mat_mut(), gathered.mat(), LinearRole::InputGrad);
        let g = LinearGemm {
            c,
            a,
            b: stacked.mat(),
            alpha: 1.0,
            beta: 1.0,
            role,
        };
        let pre = Quantized {
            a: g8.as_ref().map(Fp8Operand::codes),
            b: None,
        };
        linear_gemm_quantized(b, p, g, pre)
    }

    /// Waits for `ready` and copies their head blocks side by side into one
    /// `[s, width · d]` buffer, laid out by [`settle_layout`]; with it, the
    /// (unfilled) `[width · d, hidden]` buffer of the runs' weight rows.
    fn gather_grads(
        &self,
        ready: Vec<GradInFlight<'_, B>>,
        dtype: DType,
    ) -> Result<(Tensor<B>, Tensor<B>, SettleLayout)> {
        let mut parts = Vec::with_capacity(ready.len());
        for r in ready {
            parts.push((r.grad.wait()?, r.proj, r.heads));
        }
        // every block: (projection, heads, its packed tensor, block index)
        let mut blocks = Vec::new();
        for (grad, proj, heads) in &parts {
            for (j, h) in heads.iter().enumerate() {
                blocks.push((*proj, h.clone(), grad, self.packed_block(j, heads[0].len())));
            }
        }
        let layout = settle_layout(
            &blocks
                .iter()
                .map(|(p, h, ..)| (*p, h.clone()))
                .collect::<Vec<_>>(),
        );
        let d = self.dims.head_dim;
        let width = layout.width * d;
        let mut gathered = self.b.empty(&[self.s, width], dtype, Category::Workspace)?;
        let hidden = self.dims.hidden;
        let stacked = self.b.empty(&[width, hidden], dtype, Category::Workspace)?;
        for (i, (_, h, grad, blk)) in blocks.iter().enumerate() {
            let to = MatLayout::block(layout.col[i] * d, self.s, h.len() * d, width);
            self.b.copy(gathered.view_mut(to), grad.view(*blk))?;
        }
        Ok((gathered, stacked, layout))
    }

    /// One run of contiguous heads of one projection in a settlement: its
    /// weight gradient `dW[heads] += grad^T x`, its bias gradient, and its
    /// adapter's (`dA`, its share of `dB`, and its part of `dx`). `grad` is
    /// the run's columns of the gathered buffer and, under fp8, the
    /// buffer's codes.
    fn settle_run(
        &self,
        run: &Run,
        grad: (Mat<'_, B>, Option<&Fp8Operand<B>>),
        x: &Input<'_, B>,
        w: &AttentionWeights<B>,
        g: &mut AttentionGrads<B>,
        dx: &mut Tensor<B>,
    ) -> Result<()> {
        let (b, d, hid) = (self.b, self.dims.head_dim, self.dims.hidden);
        let (cols, g8) = grad;
        let (dw, db) = match run.proj {
            Proj::Q => (g.wq.as_mut(), g.bq.as_mut()),
            Proj::K => (g.wk.as_mut(), g.bk.as_mut()),
            Proj::V => (g.wv.as_mut(), g.bv.as_mut()),
        };
        // a frozen projection's weight gradient is not computed
        if let Some(dw) = dw {
            let c = dw.view_mut(self.head_rows(&run.heads));
            let lin = LinearGemm::new(LinearRole::WeightGrad, c, cols.t(), x.x.mat());
            let run_cols = run.col * d..(run.col + run.heads.len()) * d;
            let pre = Quantized {
                a: g8.and_then(|g8| g8.codes_t_rows(run_cols)),
                b: x.x8.as_ref().and_then(Fp8Operand::codes_t),
            };
            linear_gemm_quantized(b, self.dims.precision, lin.accumulate(), pre)?;
        }
        // the bias rows of the run's heads: their gradient summed over tokens
        if let Some(db) = db {
            super::head_bias_grad(b, db, cols, &run.heads, d)?;
        }
        let (l, gl) = (&w.lora, &mut g.lora);
        let lora = match run.proj {
            Proj::Q => (l.q.as_ref(), gl.q.as_mut()),
            Proj::K => (l.k.as_ref(), gl.k.as_mut()),
            Proj::V => (l.v.as_ref(), gl.v.as_mut()),
        };
        if let (Some(pair), Some(grads)) = lora {
            let part = DeltaPart::out_rows(hid, run.heads.start * d..run.heads.end * d);
            delta_bwd(b, pair, &part, x.x.mat(), cols, grads, dx.mat_mut())?;
        }
        Ok(())
    }

    /// O's columns of every destination's heads, packed `[pu * s, u, d]`.
    fn gather_heads(&self, o: &Tensor<B>, heads: &[Range<usize>]) -> Result<Tensor<B>> {
        let nh = heads[0].len();
        let mut buf = self.exchange_buffer(&self.shapes.packed(nh), o.dtype())?;
        for (j, h) in heads.iter().enumerate() {
            self.b.copy(
                buf.view_mut(self.packed_block(j, nh)),
                o.view(self.head_cols(h, self.s)),
            )?;
        }
        Ok(buf)
    }

    /// `dO[heads] = dy @ wo[:, heads]` for every destination, packed `[pu * s, u, d]`.
    fn project_dout(
        &self,
        dy: (&Tensor<B>, Option<Fp8Ref<'_, B>>),
        wo: &Tensor<B>,
        heads: &[Range<usize>],
    ) -> Result<Tensor<B>> {
        let hidden = self.dims.hidden;
        self.project_by_destination(dy, heads, |h| wo.view(self.head_cols(h, hidden)))
    }
}
