//! The arithmetic of a LoRA adapter on host `f32` slices, row-major: its
//! forward delta `scale · (x·Aᵀ)·Bᵀ`, the backward of that delta, the merge
//! `W + scale·B·A`, and the part of the delta and of its backward that a
//! contiguous range of attention heads owns (what a stage of the staged
//! engine computes). These
//! are the CPU reference's building blocks; shapes follow PEFT (`A`
//! `[r, in]`, `B` `[out, r]`).

use super::lora::{LoraFactors, LoraTarget};
use std::ops::Range;

/// `scale · (x·Aᵀ)·Bᵀ` for `x` `[s, in]`: the adapter's addition to the
/// layer's output, `[s, out]`.
pub fn lora_forward(x: &[f32], f: &LoraFactors, scale: f32) -> Vec<f32> {
    let d = f.dims;
    assert_eq!(x.len() % d.in_features, 0, "x is [s, in_features]");
    let h = down(x, d.in_features, &f.a, d.in_features, 0); // [s, r]
    up(&h, &f.b, d.rank, 0..d.out_features, scale) // [s, out]
}

/// The gradients of [`lora_forward`]'s output with respect to its inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraGrads {
    /// `[r, in]`.
    pub da: Vec<f32>,
    /// `[out, r]`.
    pub db: Vec<f32>,
    /// `[s, in]`: the adapter's part of the input's gradient (the base
    /// layer's `dy·W` is added by the caller).
    pub dx: Vec<f32>,
}

/// The backward of [`lora_forward`] given `dy` `[s, out]`: with
/// `h = x·Aᵀ` `[s, r]` and `g = scale · dy·B` `[s, r]`,
/// `dB = scale · dyᵀ·h`, `dA = gᵀ·x`, `dx = g·A`.
pub fn lora_backward(x: &[f32], dy: &[f32], f: &LoraFactors, scale: f32) -> LoraGrads {
    let d = f.dims;
    let part = Part {
        cols: 0..d.in_features,
        rows: 0..d.out_features,
    };
    backward_part(x, dy, f, scale, part)
}

/// The columns of `A` (inputs) and rows of `B` (outputs) one part of an
/// adapter's computation touches.
struct Part {
    cols: Range<usize>,
    rows: Range<usize>,
}

/// [`lora_backward`] restricted to `part`: `x` `[s, cols]`, `dy`
/// `[s, rows]`; `dA` `[r, cols]`, `dB` `[rows, r]`, `dx` `[s, cols]`.
fn backward_part(x: &[f32], dy: &[f32], f: &LoraFactors, scale: f32, part: Part) -> LoraGrads {
    let (r, n_in) = (f.dims.rank, f.dims.in_features);
    let (k, n) = (part.cols.len(), part.rows.len());
    let s = x.len() / k;
    assert_eq!(x.len(), s * k, "x is [s, {k}]");
    assert_eq!(dy.len(), s * n, "dy is [s, {n}]");
    let h = down(x, k, &f.a, n_in, part.cols.start); // [s, r]
    let mut g = vec![0.0f32; s * r]; // [s, r]
    let mut db = vec![0.0f32; n * r];
    for i in 0..s {
        for (q, o) in part.rows.clone().enumerate() {
            let dyo = dy[i * n + q];
            let b_o = &f.b[o * r..(o + 1) * r];
            let db_o = &mut db[q * r..(q + 1) * r];
            for j in 0..r {
                g[i * r + j] += scale * dyo * b_o[j];
                db_o[j] += scale * dyo * h[i * r + j];
            }
        }
    }
    let mut da = vec![0.0f32; r * k];
    let mut dx = vec![0.0f32; s * k];
    for i in 0..s {
        let x_i = &x[i * k..(i + 1) * k];
        let dx_i = &mut dx[i * k..(i + 1) * k];
        for j in 0..r {
            let gij = g[i * r + j];
            let a_j = &f.a[j * n_in + part.cols.start..j * n_in + part.cols.end];
            let da_j = &mut da[j * k..(j + 1) * k];
            for c in 0..k {
                da_j[c] += gij * x_i[c];
                dx_i[c] += gij * a_j[c];
            }
        }
    }
    LoraGrads { da, db, dx }
}

/// `W + scale·B·A` for the layer's weight `w` `[out, in]`: the merged
/// weight, in f32 (each entry's sum over the rank in f64, rounded once).
pub fn merge(w: &[f32], f: &LoraFactors, scale: f32) -> Vec<f32> {
    let d = f.dims;
    let (r, n_in) = (d.rank, d.in_features);
    assert_eq!(w.len(), d.out_features * n_in, "w is [out, in]");
    let mut out = w.to_vec();
    for (o, row) in out.chunks_exact_mut(n_in).enumerate() {
        let b_o = &f.b[o * r..(o + 1) * r];
        for (c, v) in row.iter_mut().enumerate() {
            let ba: f64 = (0..r)
                .map(|j| b_o[j] as f64 * f.a[j * n_in + c] as f64)
                .sum();
            *v = (*v as f64 + scale as f64 * ba) as f32;
        }
    }
    out
}

/// Which part of an adapter a contiguous range of attention heads owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadSlice {
    /// q/k/v: the heads' output rows of `B` (`B[h0·d..h1·d, :]`); their
    /// delta is those output columns of the whole delta.
    BRows(Range<usize>),
    /// o_proj: the heads' input columns of `A` (`A[:, h0·d..h1·d]`), since
    /// o_proj's input is the attention output `[s, H·d]`; their delta is a
    /// partial sum of the whole `[s, out]` delta.
    AColumns(Range<usize>),
}

/// The part of `target`'s adapter that heads `heads` own (query heads for
/// q and o, kv heads for k and v), for heads of `head_dim`; `None` for an
/// MLP target, which has no heads.
pub fn head_slice(target: LoraTarget, head_dim: usize, heads: Range<usize>) -> Option<HeadSlice> {
    let span = heads.start * head_dim..heads.end * head_dim;
    match target {
        LoraTarget::Q | LoraTarget::K | LoraTarget::V => Some(HeadSlice::BRows(span)),
        LoraTarget::O => Some(HeadSlice::AColumns(span)),
        LoraTarget::Gate | LoraTarget::Up | LoraTarget::Down => None,
    }
}

/// The delta a head range computes. [`HeadSlice::BRows`]: `x` is the
/// whole input `[s, in]` and the result the heads' output columns
/// `[s, rows]`. [`HeadSlice::AColumns`]: `x` is the heads' columns of the
/// input `[s, cols]` and the result a partial `[s, out]` that the head
/// ranges sum to the whole delta.
pub fn lora_forward_heads(x: &[f32], f: &LoraFactors, scale: f32, slice: &HeadSlice) -> Vec<f32> {
    let d = f.dims;
    match slice {
        HeadSlice::BRows(rows) => {
            let h = down(x, d.in_features, &f.a, d.in_features, 0);
            up(&h, &f.b, d.rank, rows.clone(), scale)
        }
        HeadSlice::AColumns(cols) => {
            let h = down(x, cols.len(), &f.a, d.in_features, cols.start);
            up(&h, &f.b, d.rank, 0..d.out_features, scale)
        }
    }
}

/// The backward of [`lora_forward_heads`] for the same `x` and `slice`,
/// given the gradient of its result `dy`. [`HeadSlice::BRows`]: `dB` is the
/// heads' rows `[rows, r]`; `dA` `[r, in]` and `dx` `[s, in]` are partial
/// sums over the head ranges. [`HeadSlice::AColumns`]: `dA` is the heads'
/// columns `[r, cols]` and `dx` the input's `[s, cols]`; `dB` `[out, r]` is
/// a partial sum. Placed and summed, the ranges' gradients are
/// [`lora_backward`]'s.
pub fn lora_backward_heads(
    x: &[f32],
    dy: &[f32],
    f: &LoraFactors,
    scale: f32,
    slice: &HeadSlice,
) -> LoraGrads {
    let d = f.dims;
    let part = match slice {
        HeadSlice::BRows(rows) => Part {
            cols: 0..d.in_features,
            rows: rows.clone(),
        },
        HeadSlice::AColumns(cols) => Part {
            cols: cols.clone(),
            rows: 0..d.out_features,
        },
    };
    backward_part(x, dy, f, scale, part)
}

/// `h = x·A[:, col0..col0+k]ᵀ` for `x` `[s, k]` and `a` `[r, a_cols]`: `[s, r]`.
fn down(x: &[f32], k: usize, a: &[f32], a_cols: usize, col0: usize) -> Vec<f32> {
    let r = a.len() / a_cols;
    let s = x.len() / k;
    assert_eq!(x.len(), s * k, "x has {k} columns");
    let mut h = vec![0.0f32; s * r];
    for i in 0..s {
        let x_i = &x[i * k..(i + 1) * k];
        for j in 0..r {
            let a_j = &a[j * a_cols + col0..j * a_cols + col0 + k];
            h[i * r + j] = x_i.iter().zip(a_j).map(|(p, q)| p * q).sum();
        }
    }
    h
}

/// `scale · h·B[rows]ᵀ` for `h` `[s, r]` and `b` `[out, r]`: `[s, rows]`.
fn up(h: &[f32], b: &[f32], r: usize, rows: Range<usize>, scale: f32) -> Vec<f32> {
    let s = h.len() / r.max(1);
    let n = rows.len();
    let mut y = vec![0.0f32; s * n];
    for i in 0..s {
        let h_i = &h[i * r..(i + 1) * r];
        for (k, o) in rows.clone().enumerate() {
            let b_o = &b[o * r..(o + 1) * r];
            let dot: f32 = h_i.iter().zip(b_o).map(|(p, q)| p * q).sum();
            y[i * n + k] = scale * dot;
        }
    }
    y
}
