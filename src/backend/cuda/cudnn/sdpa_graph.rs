//! The SDPA operation graphs cuDNN fuses into its flash-attention kernels
//! (the "composite" pattern, usable before the single-op SDPA descriptor
//! gained causal masks in 9.21):
//!
//! forward: `S = Q·Kᵀ → ·scale → [causal: row ≥ col ? S : −∞] → [window w:
//! col + w > row ? S : −∞] → softmax
//! (max, sub, exp, sum, div; Stats = max + ln(sum)) → O = P·V`;
//!
//! backward: `softmax_sum = rowsum(dO∘O)`, `P = exp(S·scale − Stats)` (masked),
//! `dV = Pᵀ·dO`, `dS = P∘(dO·Vᵀ − softmax_sum)·scale`, `dK = dSᵀ·Q`,
//! `dQ = dS·K` through an f32 accumulator; with GQA, dK and dV are first
//! formed per query head and reduced over each group.
//!
//! All tensors are `[b=1, h, s, d]` views of our `[s, h, d]` token rows:
//! strides `(s·rs, d, rs, 1)`; or, with `head_major`, of dense `[h, s, d]`
//! head blocks: strides `(h·s·d, s·d, d, 1)` (row strides are then `d`).
//! A ragged call ([`super::ragged`]) views the same rows as `[b, h, s_max,
//! d]`, each operand with a ragged offset table, every matmul's extents
//! overridden by the sequence lengths and a padding mask before the causal
//! one (in the backward, before Stats is subtracted): the form cuDNN's
//! frontend lowers `set_padding_mask(true)` with ragged offsets into. The
//! dQ accumulator and softmax sums are then ragged too (sized by the
//! tokens), and with GQA so are dK and dV per query head (in the
//! workspace, as the frontend does under `max_total_seq_len`).

use super::graph::{Dt, Graph, Pw, Red, Role, packed};
use super::ragged::RaggedDims;
use crate::backend::AttnMask;
use crate::error::Result;

/// Geometry and strides of one SDPA call (also the plan-cache key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SdpaShape {
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
    /// A causal mask's sliding window: row `i` sees columns `i − w < j`
    /// (cuDNN's left bound; a `Bounded` mask that is a plain band is given
    /// as `Causal` with this, `dense_shape`).
    pub window: Option<usize>,
    /// Elements between consecutive tokens of q / dq.
    pub q_rs: usize,
    pub k_rs: usize,
    pub v_rs: usize,
    /// Elements between consecutive tokens of o / dO.
    pub o_rs: usize,
    /// LSE strides in f32 elements: between tokens, between heads.
    pub lse_rs: usize,
    pub lse_hs: usize,
    /// Q, K, V, O, dO and the gradients stored head by head (`[h, s, d]`).
    pub head_major: bool,
    /// Several documents side by side (`mask` is then `Causal`): the
    /// ragged geometry the plan is built for.
    pub ragged: Option<RaggedDims>,
    /// The FP8 graphs ([`super::sdpa_fp8`]): Q, K, V, O in E4M3, dO and
    /// the gradients in E5M2, each with its scale.
    pub fp8: bool,
}

/// Unique ids of the tensors we bind in the variant pack.
pub mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const STATS: i64 = 5;
    pub const SCALE: i64 = 6;
    pub const NEG_INF: i64 = 7;
    pub const D_O: i64 = 8;
    pub const DQ: i64 = 9;
    pub const DK: i64 = 10;
    pub const DV: i64 = 11;
    pub const ONE: i64 = 12;
    pub const SOFTMAX_SUM: i64 = 13;
    pub const DQ_ACCUM: i64 = 14;
    pub const WINDOW: i64 = 15;
    /// The window's own −∞ (cuDNN's composite form gives each mask its own).
    pub const NEG_INF_WINDOW: i64 = 16;
    /// Ragged calls: the offset tables of Q-like rows (Q, O, dO, dQ, the dQ
    /// accumulator), of K-like rows (K, V, dK, dV), of Stats (and the
    /// softmax sums), the sequence lengths (bound twice: of Q and of KV),
    /// the padding mask's −∞, and with GQA dK, dV per query head.
    pub const Q_OFFSETS: i64 = 17;
    pub const KV_OFFSETS: i64 = 18;
    pub const STATS_OFFSETS: i64 = 19;
    pub const SEQ_LEN_Q: i64 = 20;
    pub const SEQ_LEN_KV: i64 = 21;
    pub const NEG_INF_PADDING: i64 = 22;
    pub const DK_FULL: i64 = 23;
    pub const DV_FULL: i64 = 24;
}

const F32: Dt = Dt::CUDNN_DATA_FLOAT;
const BF16: Dt = Dt::CUDNN_DATA_BFLOAT16;
const INT32: Dt = Dt::CUDNN_DATA_INT32;
const BOOL: Dt = Dt::CUDNN_DATA_BOOLEAN;

/// How a graph views the call: batches, rows of Q and of KV per batch, and
/// for a ragged call its tables' tensors.
pub(super) struct Layout {
    nb: usize,
    sq: usize,
    sk: usize,
    ragged: Option<Tables>,
}

/// The graph tensors of a ragged call's tables.
#[derive(Clone, Copy)]
struct Tables {
    q: usize,
    kv: usize,
    stats: usize,
    len_q: usize,
    len_kv: usize,
}

impl Layout {
    /// One batch of the shape's rows, no tables.
    pub(super) fn dense(s: &SdpaShape) -> Layout {
        Layout {
            nb: 1,
            sq: s.sq,
            sk: s.sk,
            ragged: None,
        }
    }

    fn new(g: &mut Graph, s: &SdpaShape) -> Result<Layout> {
        let Some(r) = s.ragged else {
            return Ok(Layout {
                nb: 1,
                sq: s.sq,
                sk: s.sk,
                ragged: None,
            });
        };
        let mut int32 =
            |uid: i64, n: usize| g.tensor(uid, INT32, &[i(n), 1, 1, 1], &[1; 4], Role::Io);
        let tables = Tables {
            q: int32(uid::Q_OFFSETS, r.b + 1)?,
            kv: int32(uid::KV_OFFSETS, r.b + 1)?,
            stats: int32(uid::STATS_OFFSETS, r.b + 1)?,
            len_q: int32(uid::SEQ_LEN_Q, r.b)?,
            len_kv: int32(uid::SEQ_LEN_KV, r.b)?,
        };
        Ok(Layout {
            nb: r.b,
            sq: r.s_max,
            sk: r.s_max,
            ragged: Some(tables),
        })
    }

    /// The offset table of Q-like, K-like or Stats rows.
    fn q_off(&self) -> Option<usize> {
        self.ragged.map(|t| t.q)
    }
    fn kv_off(&self) -> Option<usize> {
        self.ragged.map(|t| t.kv)
    }
    fn stats_off(&self) -> Option<usize> {
        self.ragged.map(|t| t.stats)
    }
    /// GEMM extent overrides `[m, n, k]` from the sequence lengths, each
    /// `Q` (of Q) or `K` (of KV) as `which` says.
    fn over(&self, which: [Option<char>; 3]) -> [Option<usize>; 3] {
        which.map(|w| match (self.ragged, w) {
            (Some(t), Some('q')) => Some(t.len_q),
            (Some(t), Some(_)) => Some(t.len_kv),
            _ => None,
        })
    }
}

fn i(x: usize) -> i64 {
    x as i64
}

/// Strides `(batch, head, token)` of `h` heads of `s` tokens stored as token
/// rows with row stride `rs`, or head by head.
pub(super) fn strides(h: usize, s: usize, d: usize, rs: usize, head_major: bool) -> [i64; 3] {
    if head_major {
        [i(h * s * d), i(s * d), i(d)]
    } else {
        [i(s * rs), i(d), i(rs)]
    }
}

/// Batches of a view and its ragged offset table, if any.
type Batches = (usize, Option<usize>);

/// `[nb, h, s, d]` view of token rows with row stride `rs` (or of head blocks).
fn bhsd(
    g: &mut Graph,
    id: i64,
    (h, s, d): (usize, usize, usize),
    rs: (usize, bool),
    (nb, off): Batches,
) -> Result<usize> {
    let [b, hs, ts] = strides(h, s, d, rs.0, rs.1);
    let dims = [i(nb), i(h), i(s), i(d)];
    g.tensor_ragged(id, BF16, &dims, &[b, hs, ts, 1], Role::Io, off)
}

/// `[nb, h, d, s]` transposed view (Kᵀ or Vᵀ) of token rows with row stride
/// `rs` (or of head blocks).
fn bhds(
    g: &mut Graph,
    id: i64,
    (h, s, d): (usize, usize, usize),
    rs: (usize, bool),
    (nb, off): Batches,
) -> Result<usize> {
    let [b, hs, ts] = strides(h, s, d, rs.0, rs.1);
    let dims = [i(nb), i(h), i(d), i(s)];
    g.tensor_ragged(id, BF16, &dims, &[b, hs, 1, ts], Role::Io, off)
}

/// Strides of Stats (`[nb, hq, sq, 1]` f32 with the shape's LSE strides).
fn stats_strides(s: &SdpaShape, sq: usize) -> [i64; 4] {
    [i(sq * s.lse_rs), i(s.lse_hs), i(s.lse_rs), 1]
}

pub(super) fn stats(g: &mut Graph, s: &SdpaShape, l: &Layout) -> Result<usize> {
    g.tensor_ragged(
        uid::STATS,
        F32,
        &[i(l.nb), i(s.hq), i(l.sq), 1],
        &stats_strides(s, l.sq),
        Role::Io,
        l.stats_off(),
    )
}

/// Whether the graph of `mask` reads the `NEG_INF` scalar (a mask that
/// puts −∞ on the scores it hides).
pub fn reads_neg_inf(mask: &AttnMask) -> bool {
    match mask {
        AttnMask::Full => false,
        AttnMask::Causal | AttnMask::Bounded(_) => true,
    }
}

/// Applies the shape's mask to the scores `x` (`[1, hq, sq, sk]` f32):
/// causal, then the window's left bound; returns the masked tensor (`x`
/// itself when the mask hides nothing).
pub(super) fn apply_mask(g: &mut Graph, x: usize, s: &SdpaShape, dims: &[i64]) -> Result<usize> {
    let causal = match &s.mask {
        AttnMask::Full => x,
        AttnMask::Causal => causal_mask(g, x, dims)?,
        AttnMask::Bounded(_) => {
            return Err(crate::Error::Backend(
                "cuDNN SDPA graphs do not take a documents mask (refused by shape_supported)"
                    .into(),
            ));
        }
    };
    match s.window {
        None => Ok(causal),
        Some(_) => window_mask(g, causal, dims),
    }
}

/// Applies a sliding window's left bound to `x` (`[1, hq, sq, sk]` f32):
/// keeps `col + w > row` (w the `WINDOW` scalar, f32), puts −∞
/// elsewhere; cuDNN's own composite form of the bound (an f32 add of the
/// window to the column index, then a greater-than against the row index),
/// which its fused kernels recognise.
fn window_mask(g: &mut Graph, x: usize, dims: &[i64]) -> Result<usize> {
    let (row, col) = row_col_index(g, x, dims)?;
    let w = g.scalar(uid::WINDOW, F32)?;
    let reach = g.virt(F32, dims)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_ADD,
        F32,
        col,
        Some(w),
        None,
        reach,
        Some(3),
    )?;
    let keep = g.virt(Dt::CUDNN_DATA_BOOLEAN, dims)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_CMP_GT,
        Dt::CUDNN_DATA_BOOLEAN,
        reach,
        Some(row),
        None,
        keep,
        None,
    )?;
    hide_outside(g, x, keep, uid::NEG_INF_WINDOW, dims)
}

/// Applies the top-left causal mask to `x` (`[1, hq, sq, sk]` f32): keeps
/// `row >= col`, puts −∞ elsewhere. Returns the masked tensor.
fn causal_mask(g: &mut Graph, x: usize, dims: &[i64]) -> Result<usize> {
    let (row, col) = row_col_index(g, x, dims)?;
    let keep = g.virt(Dt::CUDNN_DATA_BOOLEAN, dims)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_CMP_GE,
        Dt::CUDNN_DATA_BOOLEAN,
        row,
        Some(col),
        None,
        keep,
        None,
    )?;
    hide_outside(g, x, keep, uid::NEG_INF, dims)
}

/// A ragged call's padding mask on `x` (`[b, hq, s_max, s_max]` f32):
/// keeps `row < seq_len_q[b] && col < seq_len_kv[b]`, puts −∞ elsewhere
/// (the frontend's `padding_mask`: int32 indices, boolean compares, a
/// logical and, a select with its own −∞). `x` itself without tables.
fn padding_mask(g: &mut Graph, x: usize, l: &Layout, dims: &[i64]) -> Result<usize> {
    let Some(t) = l.ragged else {
        return Ok(x);
    };
    let mut below = |axis: i64, len: usize| -> Result<usize> {
        let index = g.virt(INT32, dims)?;
        g.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            INT32,
            x,
            None,
            None,
            index,
            Some(axis),
        )?;
        let inside = g.virt(BOOL, dims)?;
        g.pointwise(
            Pw::CUDNN_POINTWISE_CMP_LT,
            BOOL,
            index,
            Some(len),
            None,
            inside,
            None,
        )?;
        Ok(inside)
    };
    let row = below(2, t.len_q)?;
    let col = below(3, t.len_kv)?;
    let keep = g.virt(BOOL, dims)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_LOGICAL_AND,
        BOOL,
        row,
        Some(col),
        None,
        keep,
        None,
    )?;
    hide_outside(g, x, keep, uid::NEG_INF_PADDING, dims)
}

/// The row and the column index of every score of `x` (int32, `dims`).
fn row_col_index(g: &mut Graph, x: usize, dims: &[i64]) -> Result<(usize, usize)> {
    let mut index = |axis: i64| -> Result<usize> {
        let t = g.virt(Dt::CUDNN_DATA_INT32, dims)?;
        g.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            F32,
            x,
            None,
            None,
            t,
            Some(axis),
        )?;
        Ok(t)
    };
    let row = index(2)?;
    Ok((row, index(3)?))
}

/// `x` where `keep`, else −∞ (the by-value scalar `neg_uid`: each mask
/// reads its own, as cuDNN's composite form does).
fn hide_outside(g: &mut Graph, x: usize, keep: usize, neg_uid: i64, dims: &[i64]) -> Result<usize> {
    let neg = g.scalar(neg_uid, F32)?;
    let y = g.virt(F32, dims)?;
    g.pointwise(
        Pw::CUDNN_POINTWISE_BINARY_SELECT,
        F32,
        x,
        Some(neg),
        Some(keep),
        y,
        None,
    )?;
    Ok(y)
}

/// The softmax of the scores `sc` along the keys, as cuDNN's fused
/// kernels recognise it: writes Stats = max + ln Σ exp(sc − max) into
/// `st` and returns `(exp(sc − max), Σ)` (`sdims` the scores', `rdims` a
/// row's).
pub(super) fn softmax_stats(
    g: &mut Graph,
    sc: usize,
    st: usize,
    (sdims, rdims): (&[i64], &[i64]),
) -> Result<(usize, usize)> {
    let mx = g.virt(F32, rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_MAX, sc, mx)?;
    let sub = g.virt(F32, sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, sc, mx, sub)?;
    let ex = g.virt(F32, sdims)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, sub, ex)?;
    let sum = g.virt(F32, rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, ex, sum)?;
    let ln = g.virt(F32, rdims)?;
    g.unary(Pw::CUDNN_POINTWISE_LOG, sum, ln)?;
    g.binary(Pw::CUDNN_POINTWISE_ADD, mx, ln, st)?;
    Ok((ex, sum))
}

/// The forward graph (writes O and Stats = ln Σ exp(scale·q·k), natural log).
pub fn forward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let l = Layout::new(&mut g, s)?;
    let (qb, kvb) = ((l.nb, l.q_off()), (l.nb, l.kv_off()));
    let hm = s.head_major;
    let q = bhsd(&mut g, uid::Q, (s.hq, l.sq, s.d), (s.q_rs, hm), qb)?;
    let kt = bhds(&mut g, uid::K, (s.hkv, l.sk, s.d), (s.k_rs, hm), kvb)?;
    let v = bhsd(&mut g, uid::V, (s.hkv, l.sk, s.d), (s.v_rs, hm), kvb)?;
    let o = bhsd(&mut g, uid::O, (s.hq, l.sq, s.d), (s.o_rs, hm), qb)?;
    let st = stats(&mut g, s, &l)?;
    let sdims = [i(l.nb), i(s.hq), i(l.sq), i(l.sk)];
    let rdims = [i(l.nb), i(s.hq), i(l.sq), 1];

    let s0 = g.virt(F32, &sdims)?;
    g.matmul_over(q, kt, s0, l.over([Some('q'), Some('k'), None]))?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let mut sc = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, s0, scale, sc)?;
    sc = padding_mask(&mut g, sc, &l, &sdims)?;
    sc = apply_mask(&mut g, sc, s, &sdims)?;
    let (ex, sum) = softmax_stats(&mut g, sc, st, (&sdims, &rdims))?;
    // P goes into the second matmul in the I/O type.
    let p = g.virt(BF16, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_DIV, ex, sum, p)?;
    g.matmul_over(p, v, o, l.over([Some('q'), None, Some('k')]))?;
    Ok(g)
}

/// Bytes of the f32 scratch tensors the backward graph keeps in the workspace
/// (after the plan's own workspace): `(dq_accum, softmax_sum)`.
pub fn backward_scratch_bytes(s: &SdpaShape) -> (usize, usize) {
    (s.hq * s.sq * s.d * 4, s.hq * s.sq * 4)
}

/// Bytes of each of dK and dV per query head that a ragged backward with
/// GQA keeps in the workspace (bf16 rows of `hq·d`; sized as the frontend
/// sizes them, 4 bytes an element); 0 otherwise (cuDNN keeps its own).
pub fn backward_full_head_bytes(s: &SdpaShape) -> usize {
    match s.ragged {
        Some(_) if s.hq > s.hkv => s.sk * s.hq * s.d * 4,
        _ => 0,
    }
}

/// dK or dV: `t` (`[nb, hq, sk, sq]`, bf16) times `rhs` into `out`, through
/// per-query-head gradients reduced over each group with GQA (ragged: in
/// the workspace tensor `full_uid`).
fn head_grad(
    g: &mut Graph,
    s: &SdpaShape,
    l: &Layout,
    (t, rhs, out): (usize, usize, usize),
    full_uid: i64,
) -> Result<()> {
    let over = l.over([Some('k'), None, Some('q')]);
    if s.hq == s.hkv {
        return g.matmul_over(t, rhs, out, over);
    }
    let dims = [i(l.nb), i(s.hq), i(l.sk), i(s.d)];
    let full = match l.ragged {
        None => g.virt(BF16, &dims)?,
        Some(r) => {
            let strides = [i(l.sk * s.hq * s.d), i(s.d), i(s.hq * s.d), 1];
            g.tensor_ragged(full_uid, BF16, &dims, &strides, Role::Io, Some(r.kv))?
        }
    };
    g.matmul_over(t, rhs, full, over)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, full, out)
}

/// The backward graph: bf16 dQ `[sq, hq·d]`, dK, dV `[sk, hkv·d]` (dense rows),
/// overwritten.
pub fn backward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let l = Layout::new(&mut g, s)?;
    let (hq, hkv, d, hm) = (s.hq, s.hkv, s.d, s.head_major);
    let (sq, sk, nb) = (l.sq, l.sk, l.nb);
    let (qb, kvb) = ((nb, l.q_off()), (nb, l.kv_off()));
    let q = bhsd(&mut g, uid::Q, (hq, sq, d), (s.q_rs, hm), qb)?;
    let kt = bhds(&mut g, uid::K, (hkv, sk, d), (s.k_rs, hm), kvb)?;
    let vt = bhds(&mut g, uid::V, (hkv, sk, d), (s.v_rs, hm), kvb)?;
    let o = bhsd(&mut g, uid::O, (hq, sq, d), (s.o_rs, hm), qb)?;
    let d_o = bhsd(&mut g, uid::D_O, (hq, sq, d), (s.o_rs, hm), qb)?;
    let st = stats(&mut g, s, &l)?;
    let dq = bhsd(&mut g, uid::DQ, (hq, sq, d), (hq * d, hm), qb)?;
    let dk = bhsd(&mut g, uid::DK, (hkv, sk, d), (hkv * d, hm), kvb)?;
    let dv = bhsd(&mut g, uid::DV, (hkv, sk, d), (hkv * d, hm), kvb)?;
    let sdims = [i(nb), i(hq), i(sq), i(sk)];
    let rdims = [i(nb), i(hq), i(sq), 1];
    let tdims = [i(nb), i(hq), i(sk), i(sq)];
    let tstrides = [i(hq * sq * sk), i(sq * sk), 1, i(sk)];

    // softmax_sum = rowsum(dO * O) (kept in the workspace)
    let odims = [i(nb), i(hq), i(sq), i(d)];
    let doo = g.virt_strided(F32, &odims, &[i(hq * sq * d), i(sq * d), i(hq * d), 1])?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, d_o, o, doo)?;
    let red = g.virt(F32, &rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, doo, red)?;
    let one = g.scalar(uid::ONE, F32)?;
    let ssum = match l.ragged {
        None => g.tensor(uid::SOFTMAX_SUM, F32, &rdims, &packed(&rdims), Role::Io)?,
        Some(t) => {
            let strides = stats_strides(s, sq);
            g.tensor_ragged(
                uid::SOFTMAX_SUM,
                F32,
                &rdims,
                &strides,
                Role::Io,
                Some(t.stats),
            )?
        }
    };
    g.binary(Pw::CUDNN_POINTWISE_MUL, red, one, ssum)?;

    // P = exp(S * scale - stats), masked (a ragged call's padding first)
    let s0 = g.virt(F32, &sdims)?;
    g.matmul_over(q, kt, s0, l.over([Some('q'), Some('k'), None]))?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let mut s1 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, s0, scale, s1)?;
    s1 = padding_mask(&mut g, s1, &l, &sdims)?;
    let mut s2 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, s1, st, s2)?;
    s2 = apply_mask(&mut g, s2, s, &sdims)?;
    let p = g.virt(F32, &sdims)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, s2, p)?;

    // dV = P^T dO
    let pt = g.virt_strided(BF16, &tdims, &tstrides)?;
    g.reshape(p, pt)?;
    head_grad(&mut g, s, &l, (pt, d_o, dv), uid::DV_FULL)?;

    // dS = P * (dO V^T - softmax_sum) * scale
    let dp = g.virt(F32, &sdims)?;
    g.matmul_over(d_o, vt, dp, l.over([Some('q'), Some('k'), None]))?;
    let t = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, dp, ssum, t)?;
    let ds0 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, t, p, ds0)?;
    let ds = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, ds0, scale, ds)?;

    // dK = dS^T Q
    let dst = g.virt_strided(BF16, &tdims, &tstrides)?;
    g.reshape(ds, dst)?;
    head_grad(&mut g, s, &l, (dst, q, dk), uid::DK_FULL)?;

    // dQ = dS K (f32 accumulator in the workspace, then converted)
    let kdims = [i(nb), i(hkv), i(sk), i(d)];
    let kstrides = [i(sk * s.k_rs), i(d), i(s.k_rs), 1];
    let k = g.tensor_ragged(0, BF16, &kdims, &kstrides, Role::Virtual, l.kv_off())?;
    g.reshape(kt, k)?;
    let qdims = [i(nb), i(hq), i(sq), i(d)];
    let acc = match l.ragged {
        None => g.tensor(uid::DQ_ACCUM, F32, &qdims, &packed(&qdims), Role::Io)?,
        Some(t) => {
            let strides = [i(sq * hq * d), i(d), i(hq * d), 1];
            g.tensor_ragged(uid::DQ_ACCUM, F32, &qdims, &strides, Role::Io, Some(t.q))?
        }
    };
    g.matmul_over(ds, k, acc, l.over([Some('q'), None, Some('k')]))?;
    g.unary(Pw::CUDNN_POINTWISE_IDENTITY, acc, dq)?;
    Ok(g)
}
