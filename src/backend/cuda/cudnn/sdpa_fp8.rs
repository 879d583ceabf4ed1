//! The FP8 SDPA graphs cuDNN fuses on Hopper (the composite form its
//! frontend lowers `sdpa_fp8` and `sdpa_fp8_backward` into): Q, K, V, O in
//! E4M3, dO and the gradients in E5M2, every operand with a per-tensor
//! scale, f32 math inside.
//!
//! forward: `S = Q₈·K₈ᵀ · scale · dq · dk → [causal] → softmax (Stats as
//! the BF16 graph) → P₈ = P · sₛ (E4M3) → O = P₈·V₈ · dₛ · dᵥ → amax(O),
//! O₈ = O · sₒ`;
//!
//! backward: `D = rowsum(dO₈ ∘ O₈) · d_dO · dₒ`, `P = exp(S·… − Stats)`
//! (masked), `dV = (P·sₛ)₈ᵀ·dO₈ · dₛ · d_dO · s_dV`, `dS = P ∘ (dO₈·V₈ᵀ ·
//! d_dO · dᵥ − D) · scale`, `dS₈ = dS · s_dP`, `dQ = dS₈·K₈ · d_dP · dk ·
//! s_dQ`, `dK = dS₈ᵀ·Q₈ · d_dP · dq · s_dK`; with GQA each of dK and dV is
//! reduced over its query heads before the scales. Each output also
//! reports its amax (the tensor before its scale).
//!
//! On Hopper cuDNN takes these only without ragged offsets, with a top-left
//! causal mask or none, and the backward only at head dim 128
//! ([`supported`]). The scales live in one small f32 device array
//! ([`Slot`]), filled on the device before the call.

use super::graph::{Dt, Graph, Pw, Red, Role};
use super::sdpa_graph::{SdpaShape, apply_mask, softmax_stats, stats, strides, uid};
use crate::backend::AttnMask;
use crate::backend::fp8::attention::AttnScales;
use crate::error::Result;

/// The FP8 type of Q, K, V, O and of the attention probabilities.
pub const FWD_DT: Dt = Dt::CUDNN_DATA_FP8_E4M3;
/// The FP8 type of dO, dS and the gradients (wider range, as the HYBRID
/// recipes choose for gradients).
pub const BWD_DT: Dt = Dt::CUDNN_DATA_FP8_E5M2;
const F32: Dt = Dt::CUDNN_DATA_FLOAT;

/// The f32 cells of an FP8 call's scale array, in order: each operand's
/// descale (the inverse of the scale it was quantized with), each output's
/// scale, each reported amax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Slot {
    DescaleQ,
    DescaleK,
    DescaleV,
    DescaleO,
    DescaleDo,
    DescaleS,
    ScaleS,
    DescaleDp,
    ScaleDp,
    ScaleO,
    ScaleDq,
    ScaleDk,
    ScaleDv,
    AmaxS,
    AmaxO,
    AmaxDp,
    AmaxDq,
    AmaxDk,
    AmaxDv,
}

/// Cells of the scale array.
pub const SLOTS: usize = Slot::AmaxDv as usize + 1;

impl Slot {
    /// The graph tensor's unique id.
    pub fn uid(self) -> i64 {
        100 + self as i64
    }
}

/// The cells a forward (or backward) graph binds.
pub fn slots(bwd: bool) -> &'static [Slot] {
    use Slot::*;
    if bwd {
        &[
            DescaleQ, DescaleK, DescaleV, DescaleO, DescaleDo, DescaleS, ScaleS, DescaleDp,
            ScaleDp, ScaleDq, ScaleDk, ScaleDv, AmaxDp, AmaxDq, AmaxDk, AmaxDv,
        ]
    } else {
        &[
            DescaleQ, DescaleK, DescaleV, DescaleS, ScaleS, ScaleO, AmaxS, AmaxO,
        ]
    }
}

/// The scale array's cells of `f` (each descale the inverse of its scale;
/// the amax cells are cuDNN's to write).
pub fn cells(f: &AttnScales) -> [(Slot, f32); 13] {
    use Slot::*;
    [
        (DescaleQ, 1.0 / f.q),
        (DescaleK, 1.0 / f.k),
        (DescaleV, 1.0 / f.v),
        (DescaleO, 1.0 / f.o),
        (DescaleDo, 1.0 / f.d_o),
        (DescaleS, 1.0 / f.s),
        (ScaleS, f.s),
        (DescaleDp, 1.0 / f.dp),
        (ScaleDp, f.dp),
        (ScaleO, f.o),
        (ScaleDq, f.dq),
        (ScaleDk, f.dk),
        (ScaleDv, f.dv),
    ]
}

/// The most query heads a grouped-query (GQA) FP8 backward call was
/// measured fast with: cuDNN 9.14's one engine runs 4:1 to 28:4 heads
/// 1.12-1.19× faster than BF16, and 32:4, 32:8, 32:16, 64:8, 64:16 at half
/// BF16's speed (S 32K, one H100), while 32:32 (no grouping) is fast.
pub const FAST_GQA_BWD_HEADS: usize = 28;

/// Whether an FP8 backward call of `hq` query heads over `hkv` kv heads is
/// one cuDNN runs slowly ([`FAST_GQA_BWD_HEADS`]).
pub fn slow_bwd(hq: usize, hkv: usize) -> bool {
    hkv < hq && hq > FAST_GQA_BWD_HEADS
}

/// Why cuDNN cannot take an FP8 call of `s` on Hopper, if it cannot.
pub fn unsupported(s: &SdpaShape, bwd: bool) -> Option<String> {
    if s.ragged.is_some() {
        return Some("documents side by side (ragged calls have no FP8 form on Hopper)".into());
    }
    if s.window.is_some() {
        return Some("a sliding window".into());
    }
    if matches!(s.mask, AttnMask::Bounded(_)) {
        return Some("a documents mask".into());
    }
    if !s.d.is_multiple_of(16) || s.d > 256 || (bwd && s.d != 128) {
        return Some(format!(
            "head dim {} (cuDNN's FP8 backward on Hopper takes 128 only)",
            s.d
        ));
    }
    None
}

fn i(x: usize) -> i64 {
    x as i64
}

/// `[1, h, s, d]` (or, `transposed`, `[1, h, d, s]`) view of `dt` token
/// rows with the shape's row stride `rs` (or head blocks).
fn view(
    g: &mut Graph,
    (id, dt): (i64, Dt),
    (h, s, d, rs): (usize, usize, usize, usize),
    head_major: bool,
    transposed: bool,
) -> Result<usize> {
    let [b, hs, ts] = strides(h, s, d, rs, head_major);
    if transposed {
        g.tensor(id, dt, &[1, i(h), i(d), i(s)], &[b, hs, 1, ts], Role::Io)
    } else {
        g.tensor(id, dt, &[1, i(h), i(s), i(d)], &[b, hs, ts, 1], Role::Io)
    }
}

/// A scale cell `[1, 1, 1, 1]` in device memory.
fn cell(g: &mut Graph, slot: Slot) -> Result<usize> {
    g.tensor(slot.uid(), F32, &[1; 4], &[1; 4], Role::Io)
}

/// `x · cells…` in f32, one pointwise op per cell; the last into `out`
/// when given.
fn times(
    g: &mut Graph,
    x: usize,
    cells: &[Slot],
    dims: &[i64],
    out: Option<usize>,
) -> Result<usize> {
    let mut y = x;
    for (n, &c) in cells.iter().enumerate() {
        let c = cell(g, c)?;
        let z = match out {
            Some(o) if n + 1 == cells.len() => o,
            _ => g.virt(F32, dims)?,
        };
        g.binary(Pw::CUDNN_POINTWISE_MUL, y, c, z)?;
        y = z;
    }
    Ok(y)
}

/// The frontend's `matmul_fp8`: `c = (a·b [reduced over query heads to
/// c's]) · descales`, its amax reported before `scale`, `c` written scaled.
fn matmul_fp8(
    g: &mut Graph,
    (a, b, c): (usize, usize, usize),
    (mm_dims, c_dims): (&[i64], &[i64]),
    (descales, scale, amax): (&[Slot; 2], Slot, Slot),
) -> Result<()> {
    let mm = g.virt(F32, mm_dims)?;
    g.matmul(a, b, mm)?;
    let mut x = mm;
    if mm_dims != c_dims {
        x = g.virt(F32, c_dims)?;
        g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, mm, x)?;
    }
    let descaled = times(g, x, descales, c_dims, None)?;
    let s = cell(g, scale)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, descaled, s, c)?;
    let a = cell(g, amax)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_AMAX, descaled, a)
}

/// The scores `Q₈·K₈ᵀ · scale · dq · dk`, masked (`[1, hq, sq, sk]` f32).
fn scores(g: &mut Graph, s: &SdpaShape, q: usize, kt: usize, sdims: &[i64]) -> Result<usize> {
    let s0 = g.virt(F32, sdims)?;
    g.matmul(q, kt, s0)?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let s1 = g.virt(F32, sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, s0, scale, s1)?;
    let s2 = times(g, s1, &[Slot::DescaleQ, Slot::DescaleK], sdims, None)?;
    apply_mask(g, s2, s, sdims)
}

/// The FP8 forward graph: O₈ (E4M3) and Stats.
pub fn forward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let (hq, hkv, d, hm) = (s.hq, s.hkv, s.d, s.head_major);
    let q = view(&mut g, (uid::Q, FWD_DT), (hq, s.sq, d, s.q_rs), hm, false)?;
    let kt = view(&mut g, (uid::K, FWD_DT), (hkv, s.sk, d, s.k_rs), hm, true)?;
    let v = view(&mut g, (uid::V, FWD_DT), (hkv, s.sk, d, s.v_rs), hm, false)?;
    let o = view(&mut g, (uid::O, FWD_DT), (hq, s.sq, d, s.o_rs), hm, false)?;
    let layout = super::sdpa_graph::Layout::dense(s);
    let st = stats(&mut g, s, &layout)?;
    let sdims = [1, i(hq), i(s.sq), i(s.sk)];
    let rdims = [1, i(hq), i(s.sq), 1];
    let odims = [1, i(hq), i(s.sq), i(d)];

    let sc = scores(&mut g, s, q, kt, &sdims)?;
    let (ex, sum) = softmax_stats(&mut g, sc, st, (&sdims, &rdims))?;
    let p = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_DIV, ex, sum, p)?;
    let amax_s = cell(&mut g, Slot::AmaxS)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_AMAX, p, amax_s)?;
    let scale_s = cell(&mut g, Slot::ScaleS)?;
    let p8 = g.virt(FWD_DT, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, p, scale_s, p8)?;
    let descales = [Slot::DescaleS, Slot::DescaleV];
    matmul_fp8(
        &mut g,
        (p8, v, o),
        (&odims, &odims),
        (&descales, Slot::ScaleO, Slot::AmaxO),
    )?;
    Ok(g)
}

/// The FP8 backward graph: dQ₈, dK₈, dV₈ (E5M2, dense rows), overwritten.
pub fn backward(s: &SdpaShape) -> Result<Graph> {
    let mut g = Graph::new();
    let (hq, hkv, d, hm) = (s.hq, s.hkv, s.d, s.head_major);
    let (sq, sk) = (s.sq, s.sk);
    let q = view(&mut g, (uid::Q, FWD_DT), (hq, sq, d, s.q_rs), hm, false)?;
    let kt = view(&mut g, (uid::K, FWD_DT), (hkv, sk, d, s.k_rs), hm, true)?;
    let vt = view(&mut g, (uid::V, FWD_DT), (hkv, sk, d, s.v_rs), hm, true)?;
    let o = view(&mut g, (uid::O, FWD_DT), (hq, sq, d, s.o_rs), hm, false)?;
    let d_o = view(&mut g, (uid::D_O, BWD_DT), (hq, sq, d, s.o_rs), hm, false)?;
    let layout = super::sdpa_graph::Layout::dense(s);
    let st = stats(&mut g, s, &layout)?;
    let dq = view(&mut g, (uid::DQ, BWD_DT), (hq, sq, d, hq * d), hm, false)?;
    let dk = view(&mut g, (uid::DK, BWD_DT), (hkv, sk, d, hkv * d), hm, false)?;
    let dv = view(&mut g, (uid::DV, BWD_DT), (hkv, sk, d, hkv * d), hm, false)?;
    let sdims = [1, i(hq), i(sq), i(sk)];
    let rdims = [1, i(hq), i(sq), 1];
    let tdims = [1, i(hq), i(sk), i(sq)];
    let tstrides = [i(hq * sq * sk), i(sq * sk), 1, i(sk)];
    let qdims = [1, i(hq), i(sq), i(d)];
    let kv_full = [1, i(hq), i(sk), i(d)];
    let kv_dims = [1, i(hkv), i(sk), i(d)];

    // D = rowsum(dO₈ ∘ O₈) · d_dO · dₒ
    let doo = g.virt(F32, &qdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, d_o, o, doo)?;
    let red = g.virt(F32, &rdims)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_ADD, doo, red)?;
    let dsum = times(
        &mut g,
        red,
        &[Slot::DescaleDo, Slot::DescaleO],
        &rdims,
        None,
    )?;

    // P = exp(S − Stats), masked first
    let sc = scores(&mut g, s, q, kt, &sdims)?;
    let sub = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, sc, st, sub)?;
    let p = g.virt(F32, &sdims)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, sub, p)?;

    // dV = P₈ᵀ·dO₈
    let scale_s = cell(&mut g, Slot::ScaleS)?;
    let p8 = g.virt(FWD_DT, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, p, scale_s, p8)?;
    let p8t = g.virt_strided(FWD_DT, &tdims, &tstrides)?;
    g.reshape(p8, p8t)?;
    matmul_fp8(
        &mut g,
        (p8t, d_o, dv),
        (&kv_full, &kv_dims),
        (
            &[Slot::DescaleS, Slot::DescaleDo],
            Slot::ScaleDv,
            Slot::AmaxDv,
        ),
    )?;

    // dS = P ∘ (dO₈·V₈ᵀ · d_dO · dᵥ − D) · scale, then dS₈
    let dp0 = g.virt(F32, &sdims)?;
    g.matmul(d_o, vt, dp0)?;
    let dp1 = times(
        &mut g,
        dp0,
        &[Slot::DescaleDo, Slot::DescaleV],
        &sdims,
        None,
    )?;
    let dp2 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, dp1, dsum, dp2)?;
    let dp3 = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, dp2, p, dp3)?;
    let scale = g.scalar(uid::SCALE, F32)?;
    let ds = g.virt(F32, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, dp3, scale, ds)?;
    let amax_dp = cell(&mut g, Slot::AmaxDp)?;
    g.reduction(Red::CUDNN_REDUCE_TENSOR_AMAX, ds, amax_dp)?;
    let scale_dp = cell(&mut g, Slot::ScaleDp)?;
    let ds8 = g.virt(BWD_DT, &sdims)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, ds, scale_dp, ds8)?;

    // dQ = dS₈·K₈
    let [kb, khs, kts] = strides(hkv, sk, d, s.k_rs, hm);
    let k = g.virt_strided(FWD_DT, &kv_dims, &[kb, khs, kts, 1])?;
    g.reshape(kt, k)?;
    matmul_fp8(
        &mut g,
        (ds8, k, dq),
        (&qdims, &qdims),
        (
            &[Slot::DescaleDp, Slot::DescaleK],
            Slot::ScaleDq,
            Slot::AmaxDq,
        ),
    )?;

    // dK = dS₈ᵀ·Q₈
    let ds8t = g.virt_strided(BWD_DT, &tdims, &tstrides)?;
    g.reshape(ds8, ds8t)?;
    matmul_fp8(
        &mut g,
        (ds8t, q, dk),
        (&kv_full, &kv_dims),
        (
            &[Slot::DescaleDp, Slot::DescaleQ],
            Slot::ScaleDk,
            Slot::AmaxDk,
        ),
    )?;
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes measured slow are slow, those measured fast are not.
    #[test]
    fn slow_backwards_are_the_grouped_ones_of_many_query_heads() {
        for (hq, hkv) in [(32, 4), (32, 8), (32, 16), (64, 8), (64, 16)] {
            assert!(slow_bwd(hq, hkv), "{hq}:{hkv}");
        }
        for (hq, hkv) in [(4, 1), (8, 2), (16, 4), (16, 8), (28, 4), (32, 32)] {
            assert!(!slow_bwd(hq, hkv), "{hq}:{hkv}");
        }
    }
}
