//! One attention layer of one rank, walked as the engine allocates it
//! ([`AttnWalk`]: the staged layer's forward and backward, the ring, the
//! local reference).

use super::lora::Adapters;
use crate::attention::schedule::{Upcoming, grad_write, upcoming};
use crate::attention::{AttnDims, CpPlan, Settle, Strategy};
use crate::backend::Category::{self, Activations, Comm, Grads, Workspace};
use crate::backend::{AttnGradWrites, AttnMask, GradWrite};
use crate::model::WINDOW_MASK;
use crate::model::lora::LoraTarget::{self, K, O, Q, V};
use crate::plan::shapes::StageShapes;
use crate::plan::sim::{Buf, Sim};

const F32: usize = 4;

/// The cuDNN a plan assumes when no cuDNN is loaded (`upipe plan` on a
/// machine without one, unless `--cudnn-version` names another): the one on
/// our H200 machine (9.14; its backward needs `s_kv % 128 == 0`, newer ones
/// take more shapes). A run plans the version it loaded.
pub const PLANNED_CUDNN_VERSION: usize = 91400;

/// A transfer in flight: (receive buffer, send buffer held until the wait).
type InFlight = (Buf, Option<Buf>);

/// A projection's gradient sent back: in flight, its heads per
/// destination, the projection.
type GradInFlight = (InFlight, usize, LoraTarget);

fn numel<const K: usize>(shape: [usize; K]) -> usize {
    shape.iter().product()
}

/// The gradients of one attention backward: bytes per element of dQ and of
/// dK/dV, and how the call writes them.
#[derive(Debug, Clone, Copy)]
struct BwdGrads {
    dq_eb: usize,
    dkv_eb: usize,
    writes: AttnGradWrites,
}

impl BwdGrads {
    /// F32 gradients added into.
    const F32_ADD: BwdGrads = BwdGrads {
        dq_eb: F32,
        dkv_eb: F32,
        writes: AttnGradWrites::ADD,
    };
}

/// One attention layer of one rank, as the engine runs it.
#[derive(Debug, Clone, Copy)]
pub struct AttnWalk {
    /// Shapes of the (backward) stages.
    pub sh: StageShapes,
    pub strategy: Strategy,
    pub phases: usize,
    pub stages_per_phase: usize,
    /// The forward's stages (`CpPlan::fwd_schedule`): shapes, kv phases and
    /// stages per phase.
    pub fwd_sh: StageShapes,
    pub fwd_phases: usize,
    pub fwd_stages_per_phase: usize,
    pub qk_norm: bool,
    /// Bytes per element of activations (the compute dtype).
    pub ab: usize,
    /// The stage-prefetch schedule (`CpPlan::overlap`).
    pub overlap: bool,
    /// When query gradients are taken in (`CpPlan::settle_every`).
    pub settle_every: Settle,
    /// The backend's attention backward takes a transient workspace (CUDA flash path).
    pub flash_ws: bool,
    /// The cuDNN version whose limits put attention calls on cuDNN (CUDA,
    /// `--attn-kernel auto`); `None`: our kernels only.
    pub cudnn: Option<usize>,
    /// The masks are documents masks, on our kernels (CUDA): each call's
    /// per-row key bounds are kept on the device (`CudaBackend::mask_bounds`).
    pub documents: bool,
    /// This rank's ring index (ring blocks differ by rank).
    pub ring_rank: usize,
    /// The model's sliding window (`ModelConfig::sliding_window`): the
    /// sequence's mask is then its band ([`crate::model::stream_mask`]),
    /// whose ring blocks outside every local query's window are skipped.
    pub window: Option<usize>,
    /// The LoRA adapters of the projections (`--lora-rank`; none by default).
    pub lora: Adapters,
}

/// What the attention forward keeps (`AttnSaved`) and returns.
pub struct AttnFwd {
    pub o: Buf,
    pub lse: Vec<Buf>,
    pub y: Buf,
}

impl AttnWalk {
    pub fn new(plan: &CpPlan, dims: &AttnDims, ab: usize) -> Self {
        let (phases, stages_per_phase) = StageShapes::phases_and_stages(&plan.schedule);
        let (fwd_phases, fwd_stages_per_phase) = StageShapes::phases_and_stages(&plan.fwd_schedule);
        AttnWalk {
            sh: StageShapes::new(plan, dims),
            strategy: plan.strategy,
            phases,
            stages_per_phase,
            fwd_sh: StageShapes::forward(plan, dims),
            fwd_phases,
            fwd_stages_per_phase,
            qk_norm: dims.qk_norm,
            ab,
            overlap: plan.overlap,
            settle_every: plan.settle_every,
            flash_ws: false,
            cudnn: None,
            documents: false,
            ring_rank: 0,
            window: None,
            lora: Adapters::default(),
        }
    }

    /// The mask of the whole sequence the engine attends under on a stream
    /// window: causal, or the band of the model's sliding window. A
    /// documents run on cuDNN walks the rehearsal's window of two documents
    /// (`[0, 1)` and the rest: `train::step_windows::draw_step`), whose
    /// calls over their own rows take cuDNN's ragged path (what they keep
    /// depends on their rows only, never on the documents).
    fn seq_mask(&self) -> AttnMask {
        let seq = self.sh.n * self.sh.pr;
        let two = self.cudnn.is_some() && self.documents && seq >= 2;
        let starts: &[u32] = if two { &[0, 1] } else { &[0] };
        crate::model::window_mask(starts, seq, self.window).unwrap_or(WINDOW_MASK)
    }

    /// `ring::local_block_mask`: this rank's queries against its own keys.
    fn local_block_mask(&self, seq_mask: &AttnMask) -> AttnMask {
        match seq_mask {
            AttnMask::Bounded(m) => {
                let rows =
                    crate::attention::ring::shard_rows(self.ring_rank, self.sh.pr, self.sh.n);
                AttnMask::Bounded(m.with_rows(rows, rows))
            }
            AttnMask::Full | AttnMask::Causal => seq_mask.clone(),
        }
    }

    /// `CudaBackend::attention_fwd`: on cuDNN the call runs with the kept
    /// workspace, which exists from the first call on (cuDNN's forward plan
    /// workspace is counted as 0: what the H200 ledger shows); on our
    /// kernels under documents masks, with the call's key bounds kept.
    fn attention_fwd(
        &self,
        sim: &mut Sim,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        mask: &AttnMask,
    ) {
        use crate::backend::cuda::cudnn;
        let shape = cudnn::dense_shape(sq, sk, hq, hkv, self.sh.head_dim, mask.clone());
        if self.on_cudnn(&shape, false) {
            // cuDNN's own part: the forward reserve for one document, the ragged one for several
            let own = cudnn::own_workspace(&shape, 0).unwrap_or(0);
            let need = cudnn::fwd_workspace_bytes(&shape, own);
            sim.keep_at_least(
                "cudnn workspace",
                Workspace,
                cudnn::kept_workspace_bytes(need),
            );
        } else {
            self.keep_mask_bounds(sim, sq, mask);
        }
    }

    /// `CudaBackend::mask_bounds` on our kernels, in a documents run or
    /// under a bounded mask (a sliding window): the call's `[2·sq]` key
    /// bounds (4-byte elements) kept, in place of the last call's when their
    /// size differs (bounds of equal size leave the ledger alike).
    fn keep_mask_bounds(&self, sim: &mut Sim, sq: usize, mask: &AttnMask) {
        let bounded = self.flash_ws && matches!(mask, AttnMask::Bounded(_));
        if (self.documents || bounded) && sq > 0 {
            sim.keep_exactly("mask bounds", Workspace, 2 * sq * F32);
        }
    }

    /// `CudaBackend::attention_bwd` with gradients of `g.dq_eb`, `g.dkv_eb`
    /// bytes per element written as `g.writes` says. On cuDNN
    /// (`CudnnSdpa::bwd`): bf16 scratch during the call for each gradient
    /// cuDNN does not write in place, and the kept workspace grown to hold
    /// cuDNN's plan workspace (known only once a plan is built on a GPU:
    /// `estimated_bwd_plan_workspace`), the dQ accumulator and softmax sums.
    /// On our kernels: F32 scratch for each gradient of another dtype, and a
    /// transient `flash_bwd_workspace_bytes(sq, hq)` buffer when the flash
    /// kernels take the geometry.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        sim: &mut Sim,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        mask: &AttnMask,
        g: BwdGrads,
    ) {
        use crate::backend::DType;
        use crate::backend::cuda::{cudnn, flash};
        let d = self.sh.head_dim;
        let shape = cudnn::dense_shape(sq, sk, hq, hkv, d, mask.clone());
        let dtype = |eb: usize| if eb == F32 { DType::F32 } else { DType::BF16 };
        let (nq, nk) = cudnn::bwd_scratch_elems(&shape);
        let grads = [
            (nq, g.dq_eb, g.writes.dq),
            (nk, g.dkv_eb, g.writes.dkv),
            (nk, g.dkv_eb, g.writes.dkv),
        ];
        if self.on_cudnn(&shape, true) {
            let scratch: Vec<Buf> = grads
                .iter()
                .filter(|&&(_, eb, w)| !cudnn::bwd_writes_in_place(w, dtype(eb)))
                .map(|&(n, _, _)| sim.alloc(Workspace, n * 2))
                .collect();
            let plan_ws = cudnn::estimated_bwd_plan_workspace(&shape);
            let need = cudnn::bwd_workspace_bytes(&shape, plan_ws);
            sim.keep_at_least(
                "cudnn workspace",
                Workspace,
                cudnn::kept_workspace_bytes(need),
            );
            scratch.into_iter().for_each(|t| sim.free(t));
            return;
        }
        let scratch: Vec<Buf> = grads
            .iter()
            .filter(|&&(_, eb, _)| eb != F32)
            .map(|&(n, _, _)| sim.alloc(Workspace, n * F32))
            .collect();
        self.keep_mask_bounds(sim, sq, mask);
        if self.flash_ws && flash::check_supported(sq, sk, hq, hkv, d, mask).is_ok() {
            let ws = sim.alloc(Workspace, flash::flash_bwd_workspace_bytes(sq, hq));
            sim.free(ws);
        }
        scratch.into_iter().for_each(|t| sim.free(t));
    }

    /// `Backend::attention_bwd_in_place` for one stage's call (`[n, u, d]`
    /// over `[n, m, d]`): always where activations are F32 (the CPU), on CUDA
    /// where cuDNN takes the call.
    fn attention_bwd_in_place(&self) -> bool {
        use crate::backend::cuda::cudnn;
        if self.ab == F32 {
            return true;
        }
        let (n, u, m, d) = (self.sh.n, self.sh.u, self.sh.m, self.sh.head_dim);
        let shape = cudnn::dense_shape(n, n, u, m, d, self.seq_mask());
        self.on_cudnn(&shape, true)
    }

    /// Whether the planned cuDNN takes a call of `shape` (`bwd`: the backward).
    fn on_cudnn(&self, shape: &crate::backend::cuda::cudnn::SdpaShape, bwd: bool) -> bool {
        self.cudnn.is_some_and(|v| {
            crate::backend::cuda::cudnn::select::shape_supported(v, shape, bwd).is_ok()
        })
    }

    fn act(&self, sim: &mut Sim, cat: Category, n: usize) -> Buf {
        sim.alloc(cat, n * self.ab)
    }

    /// `attention::norm_rope`.
    fn norm_rope(&self, sim: &mut Sim, t: Buf, keep_raw: bool) -> (Buf, Option<Buf>) {
        if !self.qk_norm {
            return (t, None);
        }
        let y = sim.alloc(Workspace, t.bytes);
        if keep_raw {
            (y, Some(t))
        } else {
            sim.free(t);
            (y, None)
        }
    }

    /// `attention::norm_rope_bwd` (gradients are F32).
    fn norm_rope_bwd(&self, sim: &mut Sim, d_out: Buf, raw: Option<Buf>) -> Buf {
        match (self.qk_norm, raw) {
            (true, Some(_)) => {
                let dx = sim.alloc(Workspace, d_out.bytes);
                sim.free(d_out);
                dx
            }
            _ => d_out,
        }
    }

    // ---- staged engine (`attention::staged`) ----

    fn packed(&self, sim: &mut Sim, nh: usize) -> Buf {
        self.act(sim, Comm, numel(self.sh.packed(nh)))
    }

    /// `Staged::exchange_start`: (receive buffer, send buffer held until the wait).
    fn exchange_start(&self, sim: &mut Sim, send: Buf) -> InFlight {
        if self.sh.pu == 1 {
            return (send, None);
        }
        (sim.alloc(Comm, send.bytes), Some(send))
    }

    /// `Pending::wait`.
    fn wait(&self, sim: &mut Sim, (recv, send): InFlight) -> Buf {
        sim.free_opt(send);
        recv
    }

    /// `Staged::exchange_back_start`: an F32 gradient sent back in the
    /// compute dtype (freed once cast).
    fn exchange_back_start(&self, sim: &mut Sim, grad: Buf, grad_eb: usize) -> InFlight {
        if grad_eb == self.ab {
            return self.exchange_start(sim, grad);
        }
        let send = sim.alloc(Comm, grad.bytes / grad_eb * self.ab);
        sim.free(grad);
        self.exchange_start(sim, send)
    }

    /// `Staged::project_by_destination`: the packed projection of `nh` heads.
    fn project(&self, sim: &mut Sim, nh: usize) -> Buf {
        if !self.sh.merge_destinations(nh) {
            return self.packed(sim, nh);
        }
        let stacked = self.act(sim, Workspace, numel(self.sh.stacked_operands(nh)));
        let proj = self.act(sim, Workspace, numel(self.sh.stacked_projection(nh)));
        sim.free(stacked);
        let buf = self.packed(sim, nh);
        sim.free(proj);
        buf
    }

    /// `Staged::project_packed`: the packed projection of `nh` heads of
    /// `target`, each destination's block with its adapter's delta.
    fn project_adapted(&self, sim: &mut Sim, nh: usize, target: LoraTarget) -> Buf {
        let buf = self.project(sim, nh);
        self.lora.fwd(sim, target, self.sh.s, self.ab);
        buf
    }

    /// `Staged::kv_start`: K and V in flight.
    fn kv_start(&self, sim: &mut Sim) -> [InFlight; 2] {
        let k = self.project_adapted(sim, self.sh.m, K);
        let k = self.exchange_start(sim, k);
        let v = self.project_adapted(sim, self.sh.m, V);
        let v = self.exchange_start(sim, v);
        [k, v]
    }

    /// `Staged::kv_ready`: (K, K before norm, V).
    fn kv_ready(
        &self,
        sim: &mut Sim,
        [k, v]: [InFlight; 2],
        keep_raw: bool,
    ) -> (Buf, Option<Buf>, Buf) {
        let k = self.wait(sim, k);
        let v = self.wait(sim, v);
        let (k, k_raw) = self.norm_rope(sim, k, keep_raw);
        (k, k_raw, v)
    }

    /// `Staged::q_exchanged`.
    fn q_exchanged(&self, sim: &mut Sim) -> InFlight {
        let q = self.project_adapted(sim, self.sh.u, Q);
        self.exchange_start(sim, q)
    }

    /// `Staged::bwd_stage_inputs`: (O, dO, raw Q) of a stage, in flight:
    /// O's heads leave first, then dO is formed (with the o_proj adapter's
    /// backward).
    fn bwd_stage_inputs(&self, sim: &mut Sim) -> [InFlight; 3] {
        let q_raw = self.q_exchanged(sim);
        let o_att = self.packed(sim, self.sh.u);
        let o_att = self.exchange_start(sim, o_att);
        let d_o = self.project(sim, self.sh.u);
        self.lora.bwd(sim, O, self.sh.s, self.ab);
        let d_o = self.exchange_start(sim, d_o);
        [o_att, d_o, q_raw]
    }

    /// `ring::pass_on`: receive buffers shaped like `sizes`, then the transfer
    /// holds `sending` until it is waited for.
    fn pass_on(&self, sim: &mut Sim, sizes: [usize; 2], sending: [Buf; 2]) -> ([Buf; 2], [Buf; 2]) {
        let recv = sizes.map(|bytes| sim.alloc(Comm, bytes));
        (recv, sending)
    }

    /// `ring::forward`: (O of the stage, its LSE). Under a bounded mask the
    /// engine takes `ring_shift::forward`, whose buffers hold the same bytes
    /// of the same categories at every peak, whatever it skips.
    fn ring_fwd(&self, sim: &mut Sim, q: Buf, k: Buf, v: Buf) -> (Buf, Buf) {
        let p = self.sh.pr;
        let lse_bytes = numel(self.sh.stage_lse()) * F32;
        let (n, u, m) = (self.sh.n, self.sh.u, self.sh.m);
        let o = sim.alloc(Workspace, q.bytes);
        let lse = sim.alloc(Activations, lse_bytes);
        let kv = [k.bytes, v.bytes];
        let mut in_flight = (p > 1).then(|| {
            let copies = kv.map(|bytes| sim.alloc(Comm, bytes));
            self.pass_on(sim, kv, copies)
        });
        let seq_mask = self.seq_mask();
        self.attention_fwd(sim, n, n, u, m, &self.local_block_mask(&seq_mask));
        if p == 1 {
            return (o, lse);
        }
        let o_blk = sim.alloc(Workspace, q.bytes);
        let lse_blk = sim.alloc(Workspace, lse_bytes);
        for step in 1..p {
            let (arrived, sent) = in_flight.take().expect("a block arrives every step");
            sent.into_iter().for_each(|t| sim.free(t));
            let last = step + 1 == p;
            let arrived = if last {
                Some(arrived)
            } else {
                in_flight = Some(self.pass_on(sim, kv, arrived));
                None
            };
            let blk = crate::attention::ring::ring_block(self.ring_rank, step, p, n / 2, &seq_mask);
            let (sq, sk) = (blk.q_rows.len(), blk.k_rows.len());
            if !blk.mask.hides_all(sq, sk) {
                self.attention_fwd(sim, sq, sk, u, m, &blk.mask);
            }
            arrived.into_iter().flatten().for_each(|t| sim.free(t));
        }
        sim.free(o_blk);
        sim.free(lse_blk);
        (o, lse)
    }

    /// `ring::backward` (`dk`, `dv` shaped like K, V, of `g.dkv_eb` bytes
    /// per element); `ring_shift::backward` alike.
    fn ring_bwd(&self, sim: &mut Sim, k: Buf, v: Buf, dk: Buf, g: BwdGrads) {
        let (p, n, u, m) = (self.sh.pr, self.sh.n, self.sh.u, self.sh.m);
        let seq_mask = self.seq_mask();
        if p == 1 {
            self.attention_bwd(sim, n, n, u, m, &self.local_block_mask(&seq_mask), g);
            return;
        }
        let kv = [k.bytes, v.bytes];
        let copies = kv.map(|bytes| sim.alloc(Comm, bytes));
        let mut in_flight = Some(self.pass_on(sim, kv, copies));
        let mut grads = [dk.bytes; 2].map(|bytes| sim.alloc(Workspace, bytes));
        // `ring::pass_grads`
        let pass_grads = |sim: &mut Sim, grads: [Buf; 2]| {
            let (recv, sent) = self.pass_on(sim, [dk.bytes; 2], grads);
            sent.into_iter().for_each(|t| sim.free(t));
            recv
        };
        let bwd = |sim: &mut Sim, step: usize| {
            let blk = crate::attention::ring::ring_block(self.ring_rank, step, p, n / 2, &seq_mask);
            let (sq, sk) = (blk.q_rows.len(), blk.k_rows.len());
            if blk.mask.hides_all(sq, sk) {
                return;
            }
            let writes = AttnGradWrites {
                dq: if step == 0 {
                    g.writes.dq
                } else {
                    GradWrite::Add
                },
                dkv: GradWrite::Add,
            };
            self.attention_bwd(sim, sq, sk, u, m, &blk.mask, BwdGrads { writes, ..g });
        };
        bwd(sim, 0);
        for step in 1..p {
            grads = pass_grads(sim, grads);
            let (arrived, sent) = in_flight.take().expect("a block arrives every step");
            sent.into_iter().for_each(|t| sim.free(t));
            if step + 1 < p {
                in_flight = Some(self.pass_on(sim, kv, arrived));
                bwd(sim, step);
            } else {
                bwd(sim, step);
                arrived.into_iter().for_each(|t| sim.free(t));
            }
        }
        let grads = pass_grads(sim, grads);
        grads.into_iter().for_each(|t| sim.free(t));
    }

    /// `Staged::upcoming`.
    fn upcoming(&self, p: usize, t: usize) -> Upcoming {
        if !self.overlap {
            return Upcoming::End;
        }
        upcoming(p, t, self.phases, self.stages_per_phase)
    }

    /// `Staged::take_output`.
    fn take_output(&self, sim: &mut Sim, out: InFlight) {
        let back = self.wait(sim, out);
        sim.free(back);
    }

    /// This walk with the forward's stages in place of the backward's.
    fn forward_stages(&self) -> AttnWalk {
        AttnWalk {
            sh: self.fwd_sh,
            phases: self.fwd_phases,
            stages_per_phase: self.fwd_stages_per_phase,
            ..*self
        }
    }

    /// `Staged::split_lse`: a forward stage's LSE, whole or as one `[n, u]`
    /// copy per backward stage it serves.
    fn split_lse(&self, sim: &mut Sim, l: Buf, lse: &mut Vec<Buf>) {
        let pieces = self.fwd_sh.u / self.sh.u;
        if pieces == 1 {
            lse.push(l);
            return;
        }
        let bytes = numel(self.sh.stage_lse()) * F32;
        lse.extend((0..pieces).map(|_| sim.alloc(Activations, bytes)));
        sim.free(l);
    }

    /// `Staged::forward` (its stages: [`Self::forward_stages`]).
    fn staged_fwd(&self, sim: &mut Sim) -> AttnFwd {
        let f = self.forward_stages();
        let o = f.act(sim, Activations, numel(f.sh.saved_o()));
        let mut lse = Vec::new();
        let mut next_kv: Option<[InFlight; 2]> = None;
        let mut next_q: Option<InFlight> = None;
        let mut out: Option<InFlight> = None;
        for p in 0..f.phases {
            let kv = match next_kv.take() {
                Some(kv) => kv,
                None => f.kv_start(sim),
            };
            let (k, _, v) = f.kv_ready(sim, kv, false);
            for t in 0..f.stages_per_phase {
                let q_raw = match next_q.take() {
                    Some(q) => q,
                    None => f.q_exchanged(sim),
                };
                let q_raw = f.wait(sim, q_raw);
                let (q, _) = f.norm_rope(sim, q_raw, false);
                match f.upcoming(p, t) {
                    Upcoming::Stage => next_q = Some(f.q_exchanged(sim)),
                    Upcoming::PhaseStart => {
                        next_kv = Some(f.kv_start(sim));
                        next_q = Some(f.q_exchanged(sim));
                    }
                    Upcoming::End => {}
                }
                let (o_att, l) = f.ring_fwd(sim, q, k, v);
                sim.free(q);
                self.split_lse(sim, l, &mut lse);
                let this = f.exchange_start(sim, o_att);
                if let Some(prev) = out.replace(this) {
                    f.take_output(sim, prev);
                }
                if !f.overlap
                    && let Some(this) = out.take()
                {
                    f.take_output(sim, this);
                }
            }
            sim.free(k);
            sim.free(v);
        }
        if let Some(last) = out.take() {
            f.take_output(sim, last);
        }
        let y = f.act(sim, Activations, numel(f.sh.layer_io()));
        self.lora.fwd(sim, O, self.sh.s, self.ab);
        AttnFwd { o, lse, y }
    }

    /// `Staged::settle`: takes in all but the newest `keep` gradients in
    /// flight (each with its heads per destination).
    fn settle(&self, sim: &mut Sim, in_flight: &mut Vec<GradInFlight>, keep: usize) {
        if in_flight.len() <= keep {
            return;
        }
        let ready: Vec<GradInFlight> = in_flight.drain(..in_flight.len() - keep).collect();
        let mut nh = 0;
        let mut got = Vec::with_capacity(ready.len());
        // the settled projections with an adapter (each run's backward alike)
        let adapted = ready.iter().map(|r| r.2).find(|&t| self.lora.has(t));
        for (grad, n, _) in ready {
            got.push(self.wait(sim, grad));
            nh += n;
        }
        let gathered = self.act(sim, Workspace, numel(self.sh.gathered_grads(nh)));
        let stacked = self.act(sim, Workspace, numel(self.sh.gathered_weights(nh)));
        for g in got {
            sim.free(g);
        }
        if let Some(target) = adapted {
            self.lora.bwd(sim, target, self.sh.s, self.ab);
        }
        sim.free(gathered);
        sim.free(stacked);
    }

    /// `Staged::backward`: consumes the saved state, returns dx.
    fn staged_bwd(&self, sim: &mut Sim, o: Buf, lse: Vec<Buf>) -> Buf {
        let keep = usize::from(self.overlap);
        let dx = self.act(sim, Grads, numel(self.sh.layer_io()));
        let mut in_flight: Vec<GradInFlight> = Vec::new();
        let mut next_kv: Option<[InFlight; 2]> = None;
        let mut next_inputs: Option<[InFlight; 3]> = None;
        let in_place = self.attention_bwd_in_place();
        let kv_write = grad_write(self.stages_per_phase, self.sh.pr, self.qk_norm, in_place);
        let q_write = grad_write(1, self.sh.pr, self.qk_norm, in_place);
        let eb = |w: GradWrite| match w {
            GradWrite::Overwrite => self.ab,
            GradWrite::Add => F32,
        };
        let (q_eb, kv_eb) = (eb(q_write), eb(kv_write));
        for p in 0..self.phases {
            let kv = match next_kv.take() {
                Some(kv) => kv,
                None => self.kv_start(sim),
            };
            if next_inputs.is_none() {
                next_inputs = Some(self.bwd_stage_inputs(sim));
            }
            let (k, k_raw, v) = self.kv_ready(sim, kv, true);
            let kv_bytes = numel(self.sh.packed(self.sh.m)) * kv_eb;
            let dk = sim.alloc(Workspace, kv_bytes);
            let dv = sim.alloc(Workspace, kv_bytes);
            for t in 0..self.stages_per_phase {
                let [o_att, d_o, q_raw] = match next_inputs.take() {
                    Some(p) => p,
                    None => self.bwd_stage_inputs(sim),
                };
                let q_raw = self.wait(sim, q_raw);
                let (q, q_raw) = self.norm_rope(sim, q_raw, true);
                let o_att = self.wait(sim, o_att);
                let d_o = self.wait(sim, d_o);
                match self.upcoming(p, t) {
                    Upcoming::Stage => next_inputs = Some(self.bwd_stage_inputs(sim)),
                    Upcoming::PhaseStart => {
                        next_kv = Some(self.kv_start(sim));
                        next_inputs = Some(self.bwd_stage_inputs(sim));
                    }
                    Upcoming::End => {}
                }
                let dq = sim.alloc(Workspace, q.bytes / self.ab * q_eb);
                let writes = AttnGradWrites {
                    dq: q_write,
                    dkv: if t == 0 { kv_write } else { GradWrite::Add },
                };
                let g = BwdGrads {
                    dq_eb: q_eb,
                    dkv_eb: kv_eb,
                    writes,
                };
                self.ring_bwd(sim, k, v, dk, g);
                sim.free(q);
                sim.free(o_att);
                sim.free(d_o);
                let dq = self.norm_rope_bwd(sim, dq, q_raw);
                sim.free_opt(q_raw);
                let dq = self.exchange_back_start(sim, dq, q_eb);
                in_flight.push((dq, self.sh.u, Q));
                if self.settle_every.after_stage(t) {
                    self.settle(sim, &mut in_flight, keep);
                }
            }
            sim.free(k);
            sim.free(v);
            let dk = self.norm_rope_bwd(sim, dk, k_raw);
            sim.free_opt(k_raw);
            for (grad, target) in [(dk, K), (dv, V)] {
                let grad = self.exchange_back_start(sim, grad, kv_eb);
                in_flight.push((grad, self.sh.m, target));
            }
            self.settle(sim, &mut in_flight, 2 * keep);
        }
        self.settle(sim, &mut in_flight, 0);
        sim.free(o);
        for l in lse {
            sim.free(l);
        }
        dx
    }

    // ---- single-rank reference (`attention::local`) ----

    /// `local::project_qkv`: each projection with its adapter's delta.
    fn local_proj(&self, sim: &mut Sim) -> (Buf, Buf, Buf) {
        let (s, d) = (self.sh.s, self.sh.head_dim);
        let mut proj = |heads: usize, target: LoraTarget| {
            let p = self.act(sim, Workspace, s * heads * d);
            self.lora.fwd(sim, target, s, self.ab);
            p
        };
        let q = proj(self.sh.heads, Q);
        let k = proj(self.sh.kv_heads, K);
        let v = proj(self.sh.kv_heads, V);
        (q, k, v)
    }

    /// `local::forward`.
    fn local_fwd(&self, sim: &mut Sim) -> AttnFwd {
        let s = self.sh.s;
        let (q, k, v) = self.local_proj(sim);
        let (q, _) = self.norm_rope(sim, q, false);
        let (k, _) = self.norm_rope(sim, k, false);
        let o = self.act(sim, Activations, numel(self.sh.saved_o()));
        let lse = sim.alloc(Activations, s * self.sh.heads * F32);
        let mask = self.seq_mask();
        self.attention_fwd(sim, s, s, self.sh.heads, self.sh.kv_heads, &mask);
        sim.free(q);
        sim.free(k);
        sim.free(v);
        let y = self.act(sim, Activations, numel(self.sh.layer_io()));
        self.lora.fwd(sim, O, s, self.ab);
        AttnFwd {
            o,
            lse: vec![lse],
            y,
        }
    }

    /// `local::backward`.
    fn local_bwd(&self, sim: &mut Sim, o: Buf, lse: Vec<Buf>) -> Buf {
        let d_o = self.act(sim, Workspace, numel(self.sh.saved_o()));
        self.lora.bwd(sim, O, self.sh.s, self.ab);
        let (q, k, v) = self.local_proj(sim);
        let (q, q_raw) = self.norm_rope(sim, q, true);
        let (k, k_raw) = self.norm_rope(sim, k, true);
        let dq = sim.alloc(Workspace, q.bytes / self.ab * F32);
        let dk = sim.alloc(Workspace, k.bytes / self.ab * F32);
        let dv = sim.alloc(Workspace, v.bytes / self.ab * F32);
        let (s, h, hkv) = (self.sh.s, self.sh.heads, self.sh.kv_heads);
        let mask = self.seq_mask();
        self.attention_bwd(sim, s, s, h, hkv, &mask, BwdGrads::F32_ADD);
        for b in [q, k, v, d_o, o] {
            sim.free(b);
        }
        for l in lse {
            sim.free(l);
        }
        let dq = self.norm_rope_bwd(sim, dq, q_raw);
        let dk = self.norm_rope_bwd(sim, dk, k_raw);
        let dx = self.act(sim, Grads, numel(self.sh.layer_io()));
        for (dp, target) in [(dq, Q), (dk, K), (dv, V)] {
            // `cast_ref`: a copy in the activations' dtype where it differs
            let c = (self.ab != F32).then(|| sim.alloc(Workspace, dp.bytes / F32 * self.ab));
            self.lora.bwd(sim, target, s, self.ab);
            sim.free_opt(c);
        }
        for b in [dq, dk, dv] {
            sim.free(b);
        }
        sim.free_opt(q_raw);
        sim.free_opt(k_raw);
        dx
    }

    /// `CpAttention::forward`.
    pub fn forward(&self, sim: &mut Sim) -> AttnFwd {
        match self.strategy {
            Strategy::Local => self.local_fwd(sim),
            _ => self.staged_fwd(sim),
        }
    }

    /// `CpAttention::backward`: consumes the saved state, returns dx.
    pub fn backward(&self, sim: &mut Sim, o: Buf, lse: Vec<Buf>) -> Buf {
        match self.strategy {
            Strategy::Local => self.local_bwd(sim, o, lse),
            _ => self.staged_bwd(sim, o, lse),
        }
    }

    /// RoPE tables the layer holds for the whole run (`RopeTables::new`).
    pub fn rope_bytes(&self) -> usize {
        2 * numel(crate::plan::shapes::rope_table(self.sh.n, self.sh.head_dim)) * F32
    }
}
