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

use super::graph::{Dt, Graph, Pw, Red, Role, packed};
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
}

const F32: Dt = Dt::CUDNN_DATA_FLOAT;
const BF16: Dt = Dt::CUDNN_DATA_BFLOAT16;

fn i(x: usize) -> i64 {
    x as i64
}

/// Strides `(batch, head, token)` of `h` heads of `s` tokens stored as token
/// rows with row stride `rs`, or head by head.
fn strides(h: usize, s: usize, d: usize, rs: usize, head_major: bool) -> [i64; 3] {
    if head_major {
        [i(h * s * d), i(s * d), i(d)]
    } else {
        [i(s * rs), i(d), i(rs)]
    }
}

/// `[1, h, s, d]` view of token rows with row stride `rs` (or of head blocks).
fn bhsd(g: &mut Graph, id: i64, h: usize, s: usize, d: usize, rs: (usize, bool)) -> Result<usize> {
    let [b, hs, ts] = strides(h, s, d, rs.0, rs.1);
    g.tensor(id, BF16, &[1, i(h), i(s), i(d)], &[b, hs, ts, 1], Role::Io)
}

/// `[1, h, d, s]` transposed view (Kᵀ or Vᵀ) of token rows with row stride
/// `rs` (or of head blocks).
fn bhds(g: &mut Graph, id: i64, h: usize, s: usize, d: usize, rs: (usize, bool)) -> Result<usize> {
    let [b, hs, ts] = strides(h, s, d, rs.0, rs.1);
    g.tensor(id, BF16, &[1, i(h), i(d), i(s)], &[b, hs, 1, ts], Role::Io)
}

fn stats(g: &mut Graph, s: &SdpaShape) -> Result<usize> {
    g.tensor(
        uid::STATS,
        F32,
        &[1, i(s.hq), i(s.sq), 1],
        &[i(s.sq * s.lse_rs), i(s.lse_hs), i(s.lse_rs), 1],
        Role::Io,
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
fn apply_mask(g: &mut Graph, x: usize, s: &SdpaShape, dims: &[i64]) -> Result<usize> {
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

/// The forward graph (writes O and Stats = ln Σ exp(scale·q·k), natural log).
pub fn forward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let q = bhsd(&mut g, uid::Q, s.hq, s.sq, s.d, (s.q_rs, s.head_major))?;
    let kt = bhds(&mut g, uid::K, s.hkv, s.sk, s.d, (s.k_rs, s.head_major))?;
    let v = bhsd(&mut g, uid::V, s.hkv, s.sk, s.d, (s.v_rs, s.head_major))?;
    let o = bhsd(&mut g, uid::O, s.hq, s.sq, s.d, (s.o_rs, s.head_major))?;
    let st = stats(&mut g, s)?;
    let sdims = [1, i(s.hq), i(s.sq), i(s.sk)];
    let rdims = [1, i(s.hq), i(s.sq), 1];

    let s0 = g.virt(F32, &sdims)?;
    g.matmul(q, kt, s0)?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let mut sc = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, s0, scale, sc)?;
    sc = apply_mask(&mut g, sc, s, &sdims)?;
    let mx = g.virt(F32, &rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_MAX, sc, mx)?;
    let sub = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, sc, mx, sub)?;
    let ex = g.virt(F32, &sdims)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, sub, ex)?;
    let sum = g.virt(F32, &rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, ex, sum)?;
    let ln = g.virt(F32, &rdims)?;
    g.unary(Pw::CUDNN_POINTWISE_LOG, sum, ln)?;
    g.binary(Pw::CUDNN_POINTWISE_ADD, mx, ln, st)?;
    // P goes into the second matmul in the I/O type.
    let p = g.virt(BF16, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_DIV, ex, sum, p)?;
    g.matmul(p, v, o)?;
    Ok(g)
}

/// Bytes of the f32 scratch tensors the backward graph keeps in the workspace
/// (after the plan's own workspace): `(dq_accum, softmax_sum)`.
pub fn backward_scratch_bytes(s: &SdpaShape) -> (usize, usize) {
    (s.hq * s.sq * s.d * 4, s.hq * s.sq * 4)
}

/// The backward graph: bf16 dQ `[sq, hq·d]`, dK, dV `[sk, hkv·d]` (dense rows),
/// overwritten.
pub fn backward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let (hq, hkv, sq, sk, d) = (s.hq, s.hkv, s.sq, s.sk, s.d);
    let q = bhsd(&mut g, uid::Q, hq, sq, d, (s.q_rs, s.head_major))?;
    let kt = bhds(&mut g, uid::K, hkv, sk, d, (s.k_rs, s.head_major))?;
    let vt = bhds(&mut g, uid::V, hkv, sk, d, (s.v_rs, s.head_major))?;
    let o = bhsd(&mut g, uid::O, hq, sq, d, (s.o_rs, s.head_major))?;
    let d_o = bhsd(&mut g, uid::D_O, hq, sq, d, (s.o_rs, s.head_major))?;
    let st = stats(&mut g, s)?;
    let dq = bhsd(&mut g, uid::DQ, hq, sq, d, (hq * d, s.head_major))?;
    let dk = bhsd(&mut g, uid::DK, hkv, sk, d, (hkv * d, s.head_major))?;
    let dv = bhsd(&mut g, uid::DV, hkv, sk, d, (hkv * d, s.head_major))?;
    let sdims = [1, i(hq), i(sq), i(sk)];
    let rdims = [1, i(hq), i(sq), 1];
    let tdims = [1, i(hq), i(sk), i(sq)];
    let tstrides = [i(hq * sq * sk), i(sq * sk), 1, i(sk)];

    // softmax_sum = rowsum(dO * O) (kept in the workspace)
    let odims = [1, i(hq), i(sq), i(d)];
    let doo = g.virt_strided(F32, &odims, &[i(hq * sq * d), i(sq * d), i(hq * d), 1])?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, d_o, o, doo)?;
    let red = g.virt(F32, &rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, doo, red)?;
    let one = g.scalar(uid::ONE, F32)?;
    let ssum = g.tensor(uid::SOFTMAX_SUM, F32, &rdims, &packed(&rdims), Role::Io)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, red, one, ssum)?;

    // P = exp(S * scale - stats), masked
    let s0 = g.virt(F32, &sdims)?;
    g.matmul(q, kt, s0)?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let s1 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, s0, scale, s1)?;
    let mut s2 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, s1, st, s2)?;
    s2 = apply_mask(&mut g, s2, s, &sdims)?;
    let p = g.virt(F32, &sdims)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, s2, p)?;

    // dV = P^T dO
    let pt = g.virt_strided(BF16, &tdims, &tstrides)?;
    g.reshape(p, pt)?;
    if hq == hkv {
        g.matmul(pt, d_o, dv)?;
    } else {
        let full = g.virt(BF16, &[1, i(hq), i(sk), i(d)])?;
        g.matmul(pt, d_o, full)?;
        g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, full, dv)?;
    }

    // dS = P * (dO V^T - softmax_sum) * scale
    let dp = g.virt(F32, &sdims)?;
    g.matmul(d_o, vt, dp)?;
    let t = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, dp, ssum, t)?;
    let ds0 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, t, p, ds0)?;
    let ds = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, ds0, scale, ds)?;

    // dK = dS^T Q
    let dst = g.virt_strided(BF16, &tdims, &tstrides)?;
    g.reshape(ds, dst)?;
    if hq == hkv {
        g.matmul(dst, q, dk)?;
    } else {
        let full = g.virt(BF16, &[1, i(hq), i(sk), i(d)])?;
        g.matmul(dst, q, full)?;
        g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, full, dk)?;
    }

    // dQ = dS K (f32 accumulator in the workspace, then converted)
    let k = g.virt_strided(
        BF16,
        &[1, i(hkv), i(sk), i(d)],
        &[i(sk * s.k_rs), i(d), i(s.k_rs), 1],
    )?;
    g.reshape(kt, k)?;
    let qdims = [1, i(hq), i(sq), i(d)];
    let acc = g.tensor(uid::DQ_ACCUM, F32, &qdims, &packed(&qdims), Role::Io)?;
    g.matmul(ds, k, acc)?;
    g.unary(Pw::CUDNN_POINTWISE_IDENTITY, acc, dq)?;
    Ok(g)
}
