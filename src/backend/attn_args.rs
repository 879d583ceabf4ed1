//! The attention ops as descriptors: a forward ([`AttentionFwd`]), a backward
//! ([`AttentionBwd`]) and an LSE merge ([`LseMerge`]), each with its one
//! argument check. [`Backend::attention_fwd`](super::Backend::attention_fwd),
//! [`attention_bwd`](super::Backend::attention_bwd) and
//! [`lse_merge`](super::Backend::lse_merge) check a call here before any
//! device sees it, so the CPU reference, the CUDA backend and the rehearsal
//! refuse alike and own only their arithmetic and their workspaces.

use super::grad_write::AttnGradWrites;
use super::mask::AttnMask;
use super::tensor::{DType, Rows, RowsMut, Tensor, TensorDevice};
use crate::error::{Error, Result};
use std::ops::Range;

/// One attention forward: `o = softmax(scale·q·kᵀ) v` per query row over
/// the keys `mask` lets it see (`mask.visible_keys(i, sk)`), and its
/// log-sum-exp. Query head `h` uses kv head `h / (hq/hkv)`.
pub struct AttentionFwd<'a, B: TensorDevice> {
    pub q: Rows<'a, B>, // [sq, hq, d]
    pub k: Rows<'a, B>, // [sk, hkv, d]
    pub v: Rows<'a, B>, // [sk, hkv, d]
    /// Which keys each query row sees (a causal mask needs `sq == sk`).
    pub mask: &'a AttnMask,
    /// The softmax scale of the scores, e.g. `1/sqrt(d)` (`AttnDims::softmax_scale`).
    pub scale: f32,
    pub o: RowsMut<'a, B>,   // [sq, hq, d], overwritten
    pub lse: RowsMut<'a, B>, // [sq, hq] F32, natural log of Σ exp(scale·q·k)
}

/// One attention backward given the final `o` and `lse` of the full row
/// (also when the call covers only one key block of it): adds into or
/// overwrites `dq` and `dk`, `dv` (F32 or the compute dtype) as `writes`
/// says.
pub struct AttentionBwd<'a, B: TensorDevice> {
    pub q: Rows<'a, B>,   // [sq, hq, d]
    pub k: Rows<'a, B>,   // [sk, hkv, d]
    pub v: Rows<'a, B>,   // [sk, hkv, d]
    pub o: Rows<'a, B>,   // [sq, hq, d]
    pub d_o: Rows<'a, B>, // [sq, hq, d]
    pub lse: Rows<'a, B>, // [sq, hq] F32
    /// As [`AttentionFwd::mask`].
    pub mask: &'a AttnMask,
    /// The forward's softmax scale.
    pub scale: f32,
    pub dq: RowsMut<'a, B>, // [sq, hq, d]
    pub dk: RowsMut<'a, B>, // [sk, hkv, d]
    pub dv: RowsMut<'a, B>, // [sk, hkv, d]
    pub writes: AttnGradWrites,
}

/// Merges a partial attention result into a running one by log-sum-exp:
/// `o_acc, lse_acc <- merge((o_acc, lse_acc), (o_blk, lse_blk))`.
pub struct LseMerge<'a, B: TensorDevice> {
    pub o_acc: RowsMut<'a, B>,   // [n, h, d]
    pub lse_acc: RowsMut<'a, B>, // [n, h] F32
    pub o_blk: Rows<'a, B>,      // [n, h, d]
    pub lse_blk: Rows<'a, B>,    // [n, h] F32
}

/// The geometry of one attention call, checked ([`AttentionFwd::check`],
/// [`AttentionBwd::check`]).
#[derive(Debug, Clone)]
pub struct AttnShape {
    pub sq: usize,
    pub sk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub mask: AttnMask,
}

impl AttnShape {
    /// The geometry of `q` `[sq, hq, d]` attending to `k` `[sk, hkv, d]`
    /// under `mask`: a GQA pair (hq a multiple of hkv, one head dim) of
    /// lengths the mask allows.
    fn of<B: TensorDevice>(q: &Rows<'_, B>, k: &Rows<'_, B>, mask: &AttnMask) -> Result<Self> {
        let (hq, hkv, d) = (q.heads(), k.heads(), q.head_dim());
        if hkv == 0 || !hq.is_multiple_of(hkv) || k.head_dim() != d {
            return Err(Error::Backend(format!(
                "attention: q {:?} and k {:?} do not form a GQA pair",
                q.t.shape(),
                k.t.shape()
            )));
        }
        if let Err(why) = mask.check_shape(q.len(), k.len()) {
            return Err(Error::Backend(format!("attention: {why}")));
        }
        Ok(AttnShape {
            sq: q.len(),
            sk: k.len(),
            hq,
            hkv,
            d,
            mask: mask.clone(),
        })
    }

    /// Self-attention of `s` rows of `hq` query heads over `hkv` kv heads
    /// of `d` under `mask` (unchecked: the shape a call would have).
    pub fn square(s: usize, hq: usize, hkv: usize, d: usize, mask: &AttnMask) -> Self {
        AttnShape {
            sq: s,
            sk: s,
            hq,
            hkv,
            d,
            mask: mask.clone(),
        }
    }

    /// Whether the call has queries, keys and heads.
    pub fn nonempty(&self) -> bool {
        self.sq > 0 && self.sk > 0 && self.hq > 0
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// Elements of one query (and o, dO, dQ) row: `hq·d`.
    pub fn q_row(&self) -> usize {
        self.hq * self.d
    }

    /// Elements of one key (and v, dK, dV) row: `hkv·d`.
    pub fn kv_row(&self) -> usize {
        self.hkv * self.d
    }
}

/// What a check reads of one operand: its name, its rows and their
/// elements, its dtype, and whether its rows lie inside its tensor.
struct Operand {
    name: &'static str,
    rows: usize,
    row_len: usize,
    dtype: DType,
    inside: bool,
}

impl Operand {
    fn of<B: TensorDevice>(name: &'static str, t: &Tensor<B>, r: &Range<usize>) -> Self {
        Operand {
            name,
            rows: r.len(),
            row_len: t.row_len(),
            dtype: t.dtype(),
            inside: r.start <= r.end && r.end <= t.rows(),
        }
    }
}

/// Checks that each operand has `rows` rows of `row_len` elements inside
/// its tensor (`op` names the call).
fn check_rows(op: &str, want: &[(Operand, usize, usize)]) -> Result<()> {
    for (x, rows, row_len) in want {
        if !x.inside || x.rows != *rows || x.row_len != *row_len {
            return Err(Error::Backend(format!(
                "{op}: {} has {} rows of {} elements{}, expected {rows} of {row_len}",
                x.name,
                x.rows,
                x.row_len,
                if x.inside { "" } else { " outside its tensor" }
            )));
        }
    }
    Ok(())
}

/// Checks that `x` is of dtype `want` (`op` names the call).
fn check_dtype(op: &str, x: &Operand, want: DType) -> Result<()> {
    if x.dtype != want {
        return Err(Error::Backend(format!(
            "{op}: {} must be {want:?}, got {:?} (see the Backend dtype contract)",
            x.name, x.dtype
        )));
    }
    Ok(())
}

/// Checks the operands every attention call shares: q, k and v of one
/// dtype, v shaped like k, the LSE in F32, and a finite positive scale.
fn check_inputs(
    op: &str,
    g: &AttnShape,
    qkv: [Operand; 3],
    lse: &Operand,
    scale: f32,
) -> Result<()> {
    let [q, k, v] = qkv;
    if q.dtype != k.dtype || q.dtype != v.dtype {
        return Err(Error::Backend(format!(
            "{op}: q, k and v must share a dtype ({:?}, {:?}, {:?})",
            q.dtype, k.dtype, v.dtype
        )));
    }
    if !(scale.is_finite() && scale > 0.0) {
        return Err(Error::Backend(format!(
            "{op}: the softmax scale {scale} is not a finite positive number"
        )));
    }
    check_dtype(op, lse, DType::F32)?;
    check_rows(
        op,
        &[
            (q, g.sq, g.q_row()),
            (k, g.sk, g.kv_row()),
            (v, g.sk, g.kv_row()),
        ],
    )
}

impl<B: TensorDevice> AttentionFwd<'_, B> {
    /// The call's geometry, checked: q and k a GQA pair the mask allows,
    /// v, o and lse shaped to match, q, k, v of one dtype, lse F32, a
    /// finite positive scale.
    pub fn check(&self) -> Result<AttnShape> {
        const OP: &str = "attention_fwd";
        let g = AttnShape::of(&self.q, &self.k, self.mask)?;
        let qkv = [
            Operand::of("q", self.q.t, &self.q.range),
            Operand::of("k", self.k.t, &self.k.range),
            Operand::of("v", self.v.t, &self.v.range),
        ];
        let lse = Operand::of("lse", self.lse.t, &self.lse.range);
        check_inputs(OP, &g, qkv, &lse, self.scale)?;
        let o = Operand::of("o", self.o.t, &self.o.range);
        check_rows(OP, &[(o, g.sq, g.q_row()), (lse, g.sq, g.hq)])?;
        Ok(g)
    }
}

impl<B: TensorDevice> AttentionBwd<'_, B> {
    /// The call's geometry, checked as [`AttentionFwd::check`], and o, dO, dQ
    /// shaped like q, dK and dV like k.
    pub fn check(&self) -> Result<AttnShape> {
        const OP: &str = "attention_bwd";
        let g = AttnShape::of(&self.q, &self.k, self.mask)?;
        let qkv = [
            Operand::of("q", self.q.t, &self.q.range),
            Operand::of("k", self.k.t, &self.k.range),
            Operand::of("v", self.v.t, &self.v.range),
        ];
        let lse = Operand::of("lse", self.lse.t, &self.lse.range);
        check_inputs(OP, &g, qkv, &lse, self.scale)?;
        let (qr, kr) = (g.q_row(), g.kv_row());
        check_rows(
            OP,
            &[
                (lse, g.sq, g.hq),
                (Operand::of("o", self.o.t, &self.o.range), g.sq, qr),
                (Operand::of("dO", self.d_o.t, &self.d_o.range), g.sq, qr),
                (Operand::of("dQ", self.dq.t, &self.dq.range), g.sq, qr),
                (Operand::of("dK", self.dk.t, &self.dk.range), g.sk, kr),
                (Operand::of("dV", self.dv.t, &self.dv.range), g.sk, kr),
            ],
        )?;
        Ok(g)
    }
}

impl<B: TensorDevice> LseMerge<'_, B> {
    /// Checks the merge: both results of the same rows, heads and head
    /// dim, their LSEs F32 `[n, h]`.
    pub fn check(&self) -> Result<()> {
        const OP: &str = "lse_merge";
        let (n, h, d) = (self.o_acc.len(), self.o_acc.heads(), self.o_acc.head_dim());
        if self.o_blk.heads() != h || self.o_blk.head_dim() != d {
            return Err(Error::Backend(format!(
                "{OP}: block shapes differ ({:?} vs {:?})",
                self.o_acc.t.shape(),
                self.o_blk.t.shape()
            )));
        }
        let lse_acc = Operand::of("lse_acc", self.lse_acc.t, &self.lse_acc.range);
        let lse_blk = Operand::of("lse_blk", self.lse_blk.t, &self.lse_blk.range);
        check_dtype(OP, &lse_acc, DType::F32)?;
        check_dtype(OP, &lse_blk, DType::F32)?;
        check_rows(
            OP,
            &[
                (
                    Operand::of("o_acc", self.o_acc.t, &self.o_acc.range),
                    n,
                    h * d,
                ),
                (
                    Operand::of("o_blk", self.o_blk.t, &self.o_blk.range),
                    n,
                    h * d,
                ),
                (lse_acc, n, h),
                (lse_blk, n, h),
            ],
        )
    }
}
