//! FP8 attention (`--precision fp8-attention`): a call cuDNN takes runs its FP8
//! graphs ([`cudnn::sdpa_fp8`]) on quantized copies of the operands, and
//! the outputs come back in the call's own dtype.
//!
//! Forward: Q, K, V quantized to E4M3 with their own scales, the scale
//! array set on the device (`fp8_attn_scales`, the bounds of
//! [`crate::backend::fp8::attention`]), O₈ dequantized into `o`.
//! Backward: Q, K, V again (the same codes as the forward's), dO to E5M2,
//! O to E4M3 with the forward's scale of O (a power of two: the BF16 O
//! gives back the forward's codes), dQ₈, dK₈, dV₈ dequantized into the
//! gradients, added or overwritten as the call says. The buffers are
//! taken in the order [`fp8_scratch`] lists them, which the planner counts.

use super::backend::{BLOCK, CudaBackend, ptr};
use super::cudnn::{self, sdpa_fp8};
use super::kernels::{Args, grid_for, launch};
use crate::backend::fp8::{Fp8Format, Fp8Quantize};
use crate::backend::{Category, DType, GradWrite, MatLayout, Tensor};
use crate::error::Result;

/// Cells after the scale array: the amax that quantizes O with its scale,
/// and the descales of dQ, dK, dV.
const EXTRA_CELLS: usize = 4;

/// The buffers an FP8 call takes, in order (`bwd`: a backward), as
/// `(elements, dtype)`: the codes of Q, K, V, O (and dO), each operand's
/// inverse scale, the scale array with its extra cells, and in a backward
/// the codes of dQ, dK, dV.
pub fn fp8_scratch(s: &cudnn::SdpaShape, bwd: bool) -> Vec<(usize, DType)> {
    let (nq, nk) = (s.sq * s.hq * s.d, s.sk * s.hkv * s.d);
    let (e4, e5) = (DType::F8E4M3, DType::F8E5M2);
    let mut v = vec![(nq, e4), (nk, e4), (nk, e4), (nq, e4)];
    if bwd {
        v.push((nq, e5));
    }
    let operands = if bwd { 4 } else { 3 };
    v.extend(std::iter::repeat_n((1, DType::F32), operands));
    v.push((sdpa_fp8::SLOTS + EXTRA_CELLS, DType::F32));
    if bwd {
        v.extend([(nq, e5), (nk, e5), (nk, e5)]);
    }
    v
}

/// A block of dense token rows: device address of its first element and
/// its `[rows, cols]`.
#[derive(Clone, Copy)]
pub(super) struct RowsAt<'a> {
    pub t: &'a Tensor<CudaBackend>,
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> RowsAt<'a> {
    /// A call's rows of `cols` elements each.
    pub fn of(r: &crate::backend::Rows<'a, CudaBackend>, cols: usize) -> RowsAt<'a> {
        RowsAt {
            t: r.t,
            start: r.range.start,
            rows: r.len(),
            cols,
        }
    }

    fn layout(&self) -> MatLayout {
        MatLayout::block(self.start * self.cols, self.rows, self.cols, self.cols)
    }
}

/// An FP8 forward's operands and outputs.
pub(super) struct Fp8Fwd<'a> {
    pub q: RowsAt<'a>,
    pub k: RowsAt<'a>,
    pub v: RowsAt<'a>,
    /// O's address and dtype (dense rows like q).
    pub o: (u64, DType),
    pub lse: u64,
    pub shape: cudnn::SdpaShape,
    pub scale: f32,
}

/// An FP8 backward's operands and gradients: each gradient's address,
/// dtype and write.
pub(super) struct Fp8Bwd<'a> {
    pub q: RowsAt<'a>,
    pub k: RowsAt<'a>,
    pub v: RowsAt<'a>,
    pub o: RowsAt<'a>,
    pub d_o: RowsAt<'a>,
    pub lse: u64,
    pub grads: [(u64, DType, GradWrite); 3],
    pub shape: cudnn::SdpaShape,
    pub scale: f32,
}

/// The codes of Q, K, V (and O, dO), the inverse scales and the scale array.
struct Operands {
    codes: Vec<Tensor<CudaBackend>>,
    inv: Vec<Tensor<CudaBackend>>,
    cells: Tensor<CudaBackend>,
}

impl CudaBackend {
    /// Allocates the first buffers of [`fp8_scratch`] (codes, inverse
    /// scales, scale array), in its order.
    fn fp8_operands(&self, s: &cudnn::SdpaShape, bwd: bool) -> Result<Operands> {
        let list = fp8_scratch(s, bwd);
        let operands = if bwd { 4 } else { 3 };
        let n_codes = list.len() - operands - 1 - if bwd { 3 } else { 0 };
        let take = |(n, dt): (usize, DType)| self.alloc(&[n], dt, Category::Workspace);
        // the codes as the quantizer writes them, [rows, h·d] (Q, K, V, O, dO)
        let (q, kv) = ((s.sq, s.hq * s.d), (s.sk, s.hkv * s.d));
        let rows = [q, kv, kv, q, q];
        let codes = (0..n_codes)
            .map(|i| {
                let (r, c) = rows[i];
                debug_assert_eq!(r * c, list[i].0);
                self.alloc(&[r, c], list[i].1, Category::Workspace)
            })
            .collect::<Result<Vec<_>>>()?;
        let inv = (0..operands)
            .map(|i| take(list[n_codes + i]))
            .collect::<Result<Vec<_>>>()?;
        let cells = take(list[n_codes + operands])?;
        Ok(Operands { codes, inv, cells })
    }

    /// `dst = encode(src · scale)` with the operand's own scale, its
    /// inverse into `inv`.
    fn fp8_quantize_rows(
        &self,
        f: Fp8Format,
        src: RowsAt<'_>,
        dst: &mut Tensor<Self>,
        inv: &mut Tensor<Self>,
    ) -> Result<()> {
        let q = Fp8Quantize {
            src: src.t.view(src.layout()),
            dst,
            dst_t: None,
            scale_inv: inv,
        };
        q.check()?;
        self.fp8_quantize_impl(f, q)
    }

    /// The scale array from the operands' inverse scales (`fp8_attn_scales`).
    fn fp8_attn_scales(&self, ops: &Operands, s: &cudnn::SdpaShape, scale: f32) -> Result<()> {
        let inv_do = ops.inv.get(3).map_or(0, ptr);
        let cells = ptr(&ops.cells);
        let args = Args::new()
            .ptr(ptr(&ops.inv[0]))
            .ptr(ptr(&ops.inv[1]))
            .ptr(ptr(&ops.inv[2]))
            .ptr(inv_do)
            .ptr(cells)
            .ptr(cells + 4 * sdpa_fp8::SLOTS as u64) // the extra cells
            .usize(s.sq)
            .i32(s.d as i32)
            .f32(scale);
        launch(
            &self.stream,
            self.kernels.fp8_attn_scales,
            (1, 1, 1),
            32,
            0,
            args,
        )
    }

    /// `dst` (`rows × cols` dense rows of `dt`) = (or +=) the codes `src`
    /// times the descale in `cells[slot]`.
    fn fp8_dequant(
        &self,
        (dst, dt, write): (u64, DType, GradWrite),
        (rows, cols): (usize, usize),
        src: &Tensor<Self>,
        descale: u64,
    ) -> Result<()> {
        let fmt = super::attention::dt_flag(src.dtype());
        let args = Args::new()
            .ptr(dst)
            .i32(super::attention::dt_flag(dt))
            .usize(rows)
            .usize(cols)
            .usize(cols)
            .ptr(ptr(src))
            .i32(fmt)
            .ptr(descale)
            .i32((write == GradWrite::Add) as i32);
        let grid = grid_for(rows * cols, BLOCK);
        launch(&self.stream, self.kernels.fp8_dequant, grid, BLOCK, 0, args)
    }

    /// Q, K, V quantized (codes 0..3, inverse scales 0..3).
    fn fp8_qkv(&self, ops: &mut Operands, rows: [RowsAt<'_>; 3]) -> Result<()> {
        let (codes, inv) = (&mut ops.codes, &mut ops.inv);
        for (i, r) in rows.into_iter().enumerate() {
            self.fp8_quantize_rows(Fp8Format::E4M3, r, &mut codes[i], &mut inv[i])?;
        }
        Ok(())
    }

    /// The FP8 forward of a call cuDNN takes.
    pub(super) fn attention_fwd_fp8(&self, c: &cudnn::CudnnSdpa, a: Fp8Fwd<'_>) -> Result<()> {
        let s = cudnn::SdpaShape {
            fp8: true,
            ..a.shape
        };
        let mut ops = self.fp8_operands(&s, false)?;
        self.fp8_qkv(&mut ops, [a.q, a.k, a.v])?;
        self.fp8_attn_scales(&ops, &s, a.scale)?;
        let cells = ptr(&ops.cells);
        let p = |i: usize| ptr(&ops.codes[i]);
        c.run_fp8(
            self,
            &cudnn::SdpaFp8 {
                bwd: false,
                q: p(0),
                k: p(1),
                v: p(2),
                o: p(3),
                d_o: 0,
                lse: a.lse,
                dq: 0,
                dk: 0,
                dv: 0,
                scales: cells,
                shape: s.clone(),
                scale: a.scale,
            },
        )?;
        let descale_o = cells + 4 * sdpa_fp8::Slot::DescaleO as u64;
        let o = (a.o.0, a.o.1, GradWrite::Overwrite);
        self.fp8_dequant(o, (s.sq, s.hq * s.d), &ops.codes[3], descale_o)
    }

    /// The FP8 backward of a call cuDNN takes.
    pub(super) fn attention_bwd_fp8(&self, c: &cudnn::CudnnSdpa, a: Fp8Bwd<'_>) -> Result<()> {
        let s = cudnn::SdpaShape {
            fp8: true,
            ..a.shape
        };
        let mut ops = self.fp8_operands(&s, true)?;
        self.fp8_qkv(&mut ops, [a.q, a.k, a.v])?;
        let (codes, inv) = (&mut ops.codes, &mut ops.inv);
        self.fp8_quantize_rows(Fp8Format::E5M2, a.d_o, &mut codes[4], &mut inv[3])?;
        self.fp8_attn_scales(&ops, &s, a.scale)?;
        let cells = ptr(&ops.cells);
        // O with the forward's scale: fp8_cast reads max / scale_o as its amax
        let o_amax = cells + 4 * sdpa_fp8::SLOTS as u64;
        self.fp8_cast_with_amax(
            Fp8Format::E4M3,
            a.o.t.view(a.o.layout()),
            &ops.codes[3],
            o_amax,
        )?;
        let take = |n: usize| self.alloc(&[n], DType::F8E5M2, Category::Workspace);
        let (nq, nk) = (s.sq * s.hq * s.d, s.sk * s.hkv * s.d);
        let grads = [take(nq)?, take(nk)?, take(nk)?];
        let p = |i: usize| ptr(&ops.codes[i]);
        c.run_fp8(
            self,
            &cudnn::SdpaFp8 {
                bwd: true,
                q: p(0),
                k: p(1),
                v: p(2),
                o: p(3),
                d_o: p(4),
                lse: a.lse,
                dq: ptr(&grads[0]),
                dk: ptr(&grads[1]),
                dv: ptr(&grads[2]),
                scales: cells,
                shape: s.clone(),
                scale: a.scale,
            },
        )?;
        let shapes = [(s.sq, s.hq * s.d), (s.sk, s.hkv * s.d), (s.sk, s.hkv * s.d)];
        for i in 0..3 {
            let descale = o_amax + 4 * (1 + i as u64);
            self.fp8_dequant(a.grads[i], shapes[i], &grads[i], descale)?;
        }
        Ok(())
    }
}
