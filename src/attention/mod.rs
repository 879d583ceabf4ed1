//! Context-parallel attention: the attention layer (Q/K/V projection,
//! optional QK RMSNorm, RoPE, masked attention, output projection) with an
//! explicit backward, under five strategies. The mask is an [`AttnMask`]
//! value (defined in `backend/`, which the kernels read; re-exported here)
//! carried from the caller through every strategy to the kernels.
//!
//! `local` is the single-device reference ([`local`]). `ulysses`, `ring`,
//! `usp` and `upipe` are one staged engine ([`staged`]) with different
//! parameters: Ulysses degree `pu`, ring degree `pr` and heads per stage `U`:
//!
//! | strategy | pu | pr | U |
//! |---|---|---|---|
//! | ulysses | C | 1 | H |
//! | ring | 1 | C | H |
//! | usp | Pu | Pr | H |
//! | upipe | Pu | Pr | any valid multiple of Pu (default Pu) |
//!
//! Forward saves only the layer input (owned by the caller), the attention
//! output O in canonical head order and one LSE per stage; backward recomputes
//! each stage's projections and exchanges. Parameter gradients are partial
//! sums over this rank's tokens until the caller reduces them over the mesh.

pub mod layout;
pub mod local;
pub mod lora_delta;
pub mod ring;
pub mod ring_shift;
pub mod rope;
pub mod schedule;
pub mod settle;
pub mod shapes;
pub mod staged;
pub mod trial;

pub use crate::backend::AttnMask;
use crate::backend::{Backend, Category, DType, Tensor};
use crate::comm::{Mesh, MeshShape};
use crate::error::Result;
use layout::SeqLayout;
use lora_delta::{AttnAdapters, LoraPair, LoraPairGrads};
use rope::{RopeConfig, RopeTables};
use schedule::StageSchedule;
pub use settle::Settle;
use std::fmt;
use std::str::FromStr;

/// Dimensions of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub norm_eps: f32,
    pub rope: RopeConfig,
}

impl AttnDims {
    /// Checks the dimensions once.
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 || self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return crate::config_err!("attention dimensions must be positive: {self:?}");
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return crate::config_err!(
                "{} heads must be a multiple of {} kv heads (GQA groups)",
                self.heads,
                self.kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return crate::config_err!("head_dim {} must be even for RoPE", self.head_dim);
        }
        Ok(())
    }
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A context-parallel attention strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    Local,
    Ulysses,
    Ring,
    Usp,
    Upipe,
}

impl Strategy {
    pub const ALL: [Strategy; 5] = [
        Strategy::Local,
        Strategy::Ulysses,
        Strategy::Ring,
        Strategy::Usp,
        Strategy::Upipe,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Local => "local",
            Strategy::Ulysses => "ulysses",
            Strategy::Ring => "ring",
            Strategy::Usp => "usp",
            Strategy::Upipe => "upipe",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Strategy::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                crate::Error::Config(format!(
                    "unknown attention strategy '{s}'; use one of local, ulysses, ring, usp, upipe"
                ))
            })
    }
}

/// A strategy resolved for a layer, sequence and context-parallel degree.
#[derive(Debug, Clone, PartialEq)]
pub struct CpPlan {
    pub strategy: Strategy,
    pub layout: SeqLayout,
    pub schedule: StageSchedule,
    /// The forward's stages: the backward's, or wider ones (`--fwd-chunk-heads`)
    /// where every rank keeps its query heads ([`schedule::lse_pieces`]).
    /// The forward holds fewer buffers than the backward, so wider forward
    /// stages can run fewer, larger attention calls under the same peak.
    pub fwd_schedule: StageSchedule,
    /// Issue stage t+1's projections and exchanges before stage t's attention
    /// (one extra stage of buffers) so that an asynchronous backend overlaps
    /// communication with attention. Same results either way.
    pub overlap: bool,
    /// When backward takes in the query gradients: per stage, or per kv
    /// phase (one dx GEMM and per-destination dW GEMMs for the whole phase,
    /// holding the phase's dQ until then). Same results either way.
    pub settle_every: Settle,
}

impl CpPlan {
    /// Resolves `strategy` on `ulysses x ring` ranks (ulysses/ring strategies use all
    /// of them as one group). `chunk_heads` is UPipe's U (default: the Ulysses degree).
    pub fn new(
        strategy: Strategy,
        dims: &AttnDims,
        seq: usize,
        ulysses: usize,
        ring: usize,
        chunk_heads: Option<usize>,
    ) -> Result<Self> {
        dims.validate()?;
        let Some(c) = ulysses.checked_mul(ring) else {
            return crate::config_err!(
                "Ulysses degree {ulysses} x ring degree {ring} is more ranks than can be counted; \
                 give degrees whose product is at most the sequence length"
            );
        };
        let (pu, pr, u) = match strategy {
            Strategy::Local => {
                if c != 1 {
                    return crate::config_err!("the local strategy runs on one rank, not {c}");
                }
                (1, 1, dims.heads)
            }
            Strategy::Ulysses => (c, 1, dims.heads),
            Strategy::Ring => (1, c, dims.heads),
            Strategy::Usp => (ulysses, ring, dims.heads),
            Strategy::Upipe => (ulysses, ring, chunk_heads.unwrap_or(ulysses)),
        };
        if chunk_heads.is_some() && strategy != Strategy::Upipe {
            return crate::config_err!("--chunk-heads applies to upipe only, not {strategy}");
        }
        let schedule = StageSchedule::new(dims.heads, dims.kv_heads, pu, u)?;
        let layout = SeqLayout::new(seq, pu, pr)?;
        Ok(CpPlan {
            strategy,
            layout,
            fwd_schedule: schedule.clone(),
            schedule,
            overlap: false,
            settle_every: Settle::default(),
        })
    }
    /// The same plan running its forward in stages of `fwd_chunk` heads
    /// (`None`: the backward's). UPipe only; the value must be one of
    /// [`schedule::valid_fwd_chunks`], which the error lists.
    pub fn with_fwd_chunk(self, fwd_chunk: Option<usize>) -> Result<Self> {
        let Some(c) = fwd_chunk else {
            return Ok(self);
        };
        if self.strategy != Strategy::Upipe {
            return crate::config_err!(
                "--fwd-chunk-heads applies to upipe only, not {}",
                self.strategy
            );
        }
        let bwd = &self.schedule;
        let fwd = StageSchedule::new(bwd.heads, bwd.kv_heads, bwd.pu, c)
            .and_then(|fwd| schedule::lse_pieces(&fwd, bwd).map(|_| fwd));
        match fwd {
            Ok(fwd_schedule) => Ok(CpPlan {
                fwd_schedule,
                ..self
            }),
            Err(e) => crate::config_err!(
                "--fwd-chunk-heads {c}: {e}; valid values with --chunk-heads {}: {:?}",
                bwd.chunk,
                schedule::valid_fwd_chunks(bwd)
            ),
        }
    }

    /// U as tables print it: `2`, or `2f8` when the forward runs in wider
    /// stages (of 8 heads).
    pub fn chunk_text(&self) -> String {
        let (u, uf) = (self.schedule.chunk, self.fwd_schedule.chunk);
        if u == uf {
            u.to_string()
        } else {
            format!("{u}f{uf}")
        }
    }

    /// The same plan with the stage-prefetch schedule on or off.
    pub fn with_overlap(self, overlap: bool) -> Self {
        CpPlan { overlap, ..self }
    }

    /// The same plan taking in query gradients per stage or per kv phase.
    pub fn with_settle(self, settle: Settle) -> Self {
        CpPlan {
            settle_every: settle,
            ..self
        }
    }

    /// The mesh this plan runs on (one data replica).
    pub fn mesh_shape(&self) -> MeshShape {
        MeshShape {
            data: 1,
            ring: self.layout.pr,
            ulysses: self.layout.pu,
            fsdp_replicas: 1,
        }
    }
}

/// Weights of one attention layer in HF layout: `wq [H*d, hidden]`,
/// `wk, wv [Hkv*d, hidden]`, `wo [hidden, H*d]`, norms `[d]`, and the
/// projection biases of families that have them (Qwen2): `bq [H*d]`,
/// `bk, bv [Hkv*d]`, added to the projections before norm and RoPE.
pub struct AttentionWeights<B: Backend> {
    pub wq: Tensor<B>,
    pub wk: Tensor<B>,
    pub wv: Tensor<B>,
    pub wo: Tensor<B>,
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    pub bq: Option<Tensor<B>>,
    pub bk: Option<Tensor<B>>,
    pub bv: Option<Tensor<B>>,
    /// LoRA adapters of the projections (`--lora-rank`; none by default),
    /// added beside the frozen weights' GEMMs, never merged.
    pub lora: AttnAdapters<LoraPair<B>>,
}

/// F32 gradients of [`AttentionWeights`], by shape: `None` for a parameter
/// the layer does not have, or one that is frozen (`model::Freeze`): its
/// weight gradient is not computed.
pub struct AttentionGrads<B: Backend> {
    pub wq: Option<Tensor<B>>,
    pub wk: Option<Tensor<B>>,
    pub wv: Option<Tensor<B>>,
    pub wo: Option<Tensor<B>>,
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    pub bq: Option<Tensor<B>>,
    pub bk: Option<Tensor<B>>,
    pub bv: Option<Tensor<B>>,
    /// The adapters' gradients (where `AttentionWeights::lora` has adapters).
    pub lora: AttnAdapters<LoraPairGrads<B>>,
}

impl<B: Backend> AttentionGrads<B> {
    /// Zero F32 `Grads` tensors for every weight of `dims` (no biases).
    pub fn zeros(b: &B, dims: &AttnDims) -> Result<Self> {
        let (h, d) = (dims.hidden, dims.head_dim);
        let z = |shape: &[usize]| b.zeros(shape, DType::F32, Category::Grads);
        Ok(AttentionGrads {
            wq: Some(z(&[dims.q_width(), h])?),
            wk: Some(z(&[dims.kv_width(), h])?),
            wv: Some(z(&[dims.kv_width(), h])?),
            wo: Some(z(&[h, dims.q_width()])?),
            q_norm: if dims.qk_norm { Some(z(&[d])?) } else { None },
            k_norm: if dims.qk_norm { Some(z(&[d])?) } else { None },
            bq: None,
            bk: None,
            bv: None,
            lora: AttnAdapters::default(),
        })
    }

    /// Every gradient held, with its short name, in the order of
    /// [`AttentionWeights::named`].
    pub fn named(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let s = self;
        let slots = [
            &s.wq, &s.bq, &s.wk, &s.bk, &s.wv, &s.bv, &s.wo, &s.q_norm, &s.k_norm,
        ];
        in_hf_order(slots.map(Option::as_ref))
    }

    /// Every gradient held, owned, in the order of [`named`](Self::named).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let s = self;
        let slots = [s.wq, s.bq, s.wk, s.bk, s.wv, s.bv, s.wo, s.q_norm, s.k_norm];
        in_hf_order(slots).into_iter().map(|(_, t)| t).collect()
    }
}

/// The short names of an attention layer's tensors, in HF order.
const HF_ORDER: [&str; 9] = ["wq", "bq", "wk", "bk", "wv", "bv", "wo", "q_norm", "k_norm"];

/// The tensors held in `slots` (in [`HF_ORDER`]) with their short names:
/// the one walk of the weights and of their gradients, shared, mutable or owned.
fn in_hf_order<T>(slots: [Option<T>; 9]) -> Vec<(&'static str, T)> {
    let named = HF_ORDER.into_iter().zip(slots);
    named.filter_map(|(n, t)| t.map(|t| (n, t))).collect()
}

/// An attention layer's tensors (its weights, or their gradients) and its
/// adapters, walked mutably in HF order ([`HF_ORDER`]).
pub trait AttnTensors<B: Backend> {
    /// What its adapters hold: the factors, or their gradients.
    type Pair;

    /// Its tensors in [`HF_ORDER`] (`None`: absent, or frozen) and its
    /// adapters, borrowed together.
    #[allow(clippy::type_complexity)]
    fn slots_mut(&mut self) -> ([Option<&mut Tensor<B>>; 9], &mut AttnAdapters<Self::Pair>);

    /// Every tensor held, mutable, with its short name, in HF order.
    fn named_mut(&mut self) -> Vec<(&'static str, &mut Tensor<B>)> {
        self.named_and_lora_mut().0
    }

    /// [`named_mut`](Self::named_mut) and the adapters, borrowed together.
    #[allow(clippy::type_complexity)]
    fn named_and_lora_mut(
        &mut self,
    ) -> (
        Vec<(&'static str, &mut Tensor<B>)>,
        &mut AttnAdapters<Self::Pair>,
    ) {
        let (slots, lora) = self.slots_mut();
        (in_hf_order(slots), lora)
    }
}

impl<B: Backend> AttnTensors<B> for AttentionWeights<B> {
    type Pair = LoraPair<B>;
    fn slots_mut(&mut self) -> ([Option<&mut Tensor<B>>; 9], &mut AttnAdapters<LoraPair<B>>) {
        let s = self;
        let (bq, bk, bv) = (s.bq.as_mut(), s.bk.as_mut(), s.bv.as_mut());
        let (wq, wk, wv) = (Some(&mut s.wq), Some(&mut s.wk), Some(&mut s.wv));
        let (wo, q_norm, k_norm) = (Some(&mut s.wo), s.q_norm.as_mut(), s.k_norm.as_mut());
        let slots = [wq, bq, wk, bk, wv, bv, wo, q_norm, k_norm];
        (slots, &mut s.lora)
    }
}

impl<B: Backend> AttnTensors<B> for AttentionGrads<B> {
    type Pair = LoraPairGrads<B>;
    fn slots_mut(
        &mut self,
    ) -> (
        [Option<&mut Tensor<B>>; 9],
        &mut AttnAdapters<LoraPairGrads<B>>,
    ) {
        let s = self;
        let slots = [
            &mut s.wq,
            &mut s.bq,
            &mut s.wk,
            &mut s.bk,
            &mut s.wv,
            &mut s.bv,
            &mut s.wo,
            &mut s.q_norm,
            &mut s.k_norm,
        ];
        (slots.map(Option::as_mut), &mut s.lora)
    }
}

impl<B: Backend> AttentionWeights<B> {
    /// Every tensor with its short name, in HF order (wq, bq, wk, bk, wv,
    /// bv, wo, q_norm, k_norm; absent ones left out).
    pub fn named(&self) -> Vec<(&'static str, &Tensor<B>)> {
        let s = self;
        let (bq, bk, bv) = (s.bq.as_ref(), s.bk.as_ref(), s.bv.as_ref());
        let (wq, wk, wv, wo) = (Some(&s.wq), Some(&s.wk), Some(&s.wv), Some(&s.wo));
        in_hf_order([
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            wo,
            s.q_norm.as_ref(),
            s.k_norm.as_ref(),
        ])
    }
    /// Every tensor, owned, in the order of [`named`](Self::named).
    pub fn into_tensors(self) -> Vec<Tensor<B>> {
        let s = self;
        let (wq, wk, wv, wo) = (Some(s.wq), Some(s.wk), Some(s.wv), Some(s.wo));
        let slots = [wq, s.bq, wk, s.bk, wv, s.bv, wo, s.q_norm, s.k_norm];
        in_hf_order(slots).into_iter().map(|(_, t)| t).collect()
    }
}

/// Adds the bias rows of `heads` (`bias [heads*d]`) to every row of `out`,
/// a `[rows, heads.len()*d]` view of a projection: `out[r, :] += bias[heads]`.
pub(crate) fn add_head_bias<B: Backend>(
    b: &B,
    out: crate::backend::MatMut<'_, B>,
    bias: &Tensor<B>,
    heads: &std::ops::Range<usize>,
    head_dim: usize,
) -> Result<()> {
    let w = heads.len() * head_dim;
    let row = crate::backend::MatLayout::block(heads.start * head_dim, 1, w, w);
    b.add_bias_rows(out, bias.view(row))
}

/// Accumulates the gradient of the bias rows of `heads` (`dbias [heads*d]`,
/// F32) from `dproj`, a `[rows, heads.len()*d]` view of the projection's
/// gradient: `dbias[heads] += Σ_r dproj[r, :]`.
pub(crate) fn head_bias_grad<B: Backend>(
    b: &B,
    dbias: &mut Tensor<B>,
    dproj: crate::backend::Mat<'_, B>,
    heads: &std::ops::Range<usize>,
    head_dim: usize,
) -> Result<()> {
    let w = heads.len() * head_dim;
    let row = crate::backend::MatLayout::block(heads.start * head_dim, 1, w, w);
    b.bias_grad(dbias.view_mut(row), dproj)
}

/// What forward keeps for backward besides the layer input.
pub struct AttnSaved<B: Backend> {
    /// Attention output before the output projection, canonical heads: `[s_local, H, d]`.
    pub o: Tensor<B>,
    /// One `[shard, u]` F32 LSE per stage.
    pub lse: Vec<Tensor<B>>,
}

/// The attention layer of one rank under a context-parallel plan.
pub struct CpAttention<B: Backend> {
    pub dims: AttnDims,
    pub plan: CpPlan,
    /// RoPE tables for the positions this rank attends over (its ring
    /// shard): sequence positions, or positions within each document under
    /// a documents mask.
    rope: RopeTables<B>,
    /// Whether `rope` holds positions within documents (else sequence positions).
    rope_per_document: bool,
    /// This rank's place in its ring group.
    ring_rank: usize,
    /// The mask over the whole sequence (each strategy cuts it into its
    /// calls' masks).
    mask: AttnMask,
}

impl<B: Backend> CpAttention<B> {
    /// Prepares the layer for the rank `mesh.rank` of `plan.mesh_shape()`,
    /// attending under `mask` over the whole sequence.
    pub fn new(
        b: &B,
        dims: AttnDims,
        plan: CpPlan,
        mesh: &Mesh<B>,
        mask: AttnMask,
    ) -> Result<Self> {
        let ring = mesh.ring.rank();
        let n = plan.layout.seq / plan.layout.pr;
        let positions = || plan.layout.ring_shard_positions(ring);
        let rope = RopeTables::of(b, &dims.rope, dims.head_dim, n, positions)?;
        let mut layer = CpAttention {
            dims,
            plan,
            rope,
            rope_per_document: false,
            ring_rank: ring,
            mask: AttnMask::Causal,
        };
        layer.set_mask(b, mask)?;
        Ok(layer)
    }

    /// The mask over the whole sequence.
    pub fn mask(&self) -> &AttnMask {
        &self.mask
    }

    /// Attends under `mask` from the next call on (a window's documents
    /// change every window). A documents mask ([`AttnMask::Bounded`] of
    /// several documents, with or without a sliding window) over the
    /// plan's sequence also restarts RoPE's positions at each document:
    /// the tables are rewritten in place (no allocation; a rehearsal
    /// computes nothing).
    pub fn set_mask(&mut self, b: &B, mask: AttnMask) -> Result<()> {
        let seq = self.plan.layout.seq;
        let per_document = match &mask {
            AttnMask::Full | AttnMask::Causal => false,
            AttnMask::Bounded(m) if m.seq() == seq && m.rows().0.len() == seq => !m.one_document(),
            AttnMask::Bounded(m) => {
                return crate::config_err!(
                    "a documents mask over {} positions for a sequence of {seq}; build it from \
                     the window's document starts",
                    m.seq()
                );
            }
        };
        if (per_document || self.rope_per_document) && !b.rehearsing() {
            let shard = self.plan.layout.ring_shard_positions(self.ring_rank);
            let positions: Vec<usize> = match &mask {
                AttnMask::Bounded(m) => shard.iter().map(|&p| p - m.doc_start_at(p)).collect(),
                AttnMask::Full | AttnMask::Causal => shard,
            };
            self.rope
                .rewrite(b, &self.dims.rope, self.dims.head_dim, &positions)?;
        }
        self.rope_per_document = per_document;
        self.mask = mask;
        Ok(())
    }

    fn staged<'a>(&'a self, b: &'a B, mesh: &'a Mesh<B>) -> staged::Staged<'a, B> {
        staged::Staged::new(b, mesh, &self.dims, &self.plan, &self.rope, &self.mask)
    }

    /// `x: [s_local, hidden]` → `y: [s_local, hidden]` and the saved state.
    pub fn forward(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
    ) -> Result<(Tensor<B>, AttnSaved<B>)> {
        match self.plan.strategy {
            Strategy::Local => local::forward(b, &self.dims, &self.rope, &self.mask, w, x),
            _ => self.staged(b, mesh).forward(w, x),
        }
    }

    /// Backward: returns `dx` and accumulates this rank's partial parameter gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        b: &B,
        mesh: &Mesh<B>,
        w: &AttentionWeights<B>,
        x: &Tensor<B>,
        saved: AttnSaved<B>,
        dy: &Tensor<B>,
        grads: &mut AttentionGrads<B>,
    ) -> Result<Tensor<B>> {
        match self.plan.strategy {
            Strategy::Local => {
                let (dims, rope, mask) = (&self.dims, &self.rope, &self.mask);
                local::backward(b, dims, rope, mask, w, x, saved, dy, grads)
            }
            _ => self.staged(b, mesh).backward(w, x, saved, dy, grads),
        }
    }
}

/// The output projection `y = O·Woᵀ` (plus the o_proj adapter's delta):
/// `o: [s, H, d]` → `y: [s, hidden]` (`Activations`). Forward and a checkpointed block's recompute from a kept
/// O call this one function, so both give the same `y`.
pub fn output_projection<B: Backend>(
    b: &B,
    o: &Tensor<B>,
    w: &AttentionWeights<B>,
) -> Result<Tensor<B>> {
    let wo = &w.wo;
    let mut y = b.empty(&[o.rows(), wo.rows()], o.dtype(), Category::Activations)?;
    b.gemm(y.mat_mut(), o.mat(), wo.mat().t(), 1.0, 0.0)?;
    lora_delta::add_delta(b, w.lora.o.as_ref(), o.mat(), y.mat_mut())?;
    Ok(y)
}

/// Applies optional per-head RMSNorm then RoPE to `t: [n, heads, d]`.
/// Returns the rotated tensor and, when normalised, the pre-norm input (for backward).
pub(crate) fn norm_rope<B: Backend>(
    b: &B,
    t: Tensor<B>,
    norm: Option<&Tensor<B>>,
    eps: f32,
    rope: &RopeTables<B>,
    keep_raw: bool,
) -> Result<(Tensor<B>, Option<Tensor<B>>)> {
    let (mut out, raw) = match norm {
        Some(w) => {
            let mut y = b.empty(t.shape(), t.dtype(), Category::Workspace)?;
            b.rms_norm_fwd(&t, w, eps, &mut y)?;
            (y, if keep_raw { Some(t) } else { None })
        }
        None => (t, None),
    };
    b.rope(&mut out, &rope.cos, &rope.sin, false)?;
    Ok((out, raw))
}

/// Backward of [`norm_rope`]: turns `d_out` (gradient w.r.t. the rotated
/// tensor) into the gradient w.r.t. its input, accumulating the norm weight's
/// gradient (`norm`: the weight and its gradient, `None` when frozen).
pub(crate) fn norm_rope_bwd<B: Backend>(
    b: &B,
    mut d_out: Tensor<B>,
    raw: Option<&Tensor<B>>,
    norm: Option<(&Tensor<B>, Option<&mut Tensor<B>>)>,
    eps: f32,
    rope: &RopeTables<B>,
) -> Result<Tensor<B>> {
    b.rope(&mut d_out, &rope.cos, &rope.sin, true)?;
    match (norm, raw) {
        (Some((w, dw)), Some(raw)) => {
            let mut dx = b.empty(d_out.shape(), d_out.dtype(), Category::Workspace)?;
            b.rms_norm_bwd(raw, w, &d_out, eps, &mut dx, dw)?;
            Ok(dx)
        }
        _ => Ok(d_out),
    }
}
