//! The CPU reference's attention: softmax(q·kᵀ·scale) v per query row over
//! the keys its mask lets it see, the exact backward from the saved LSE, and
//! the LSE merge of ring blocks. F32 throughout, rows in parallel.

use super::cells::{data, data_mut, dot};
use super::device::CpuBackend;
use crate::backend::{AttnGradWrites, AttnMask, AttnShape, GradWrite, Rows, RowsMut};
use rayon::prelude::*;

/// Geometry of one attention call (checked by the call's descriptor) and
/// its softmax scale.
pub(super) struct AttnGeom {
    hq: usize,
    hkv: usize,
    d: usize,
    group: usize,
    scale: f32,
}

pub(super) fn geometry(g: &AttnShape, scale: f32) -> AttnGeom {
    AttnGeom {
        hq: g.hq,
        hkv: g.hkv,
        d: g.d,
        group: g.group(),
        scale,
    }
}

/// `o`, `lse` `[sq, hq, d]`, `[sq, hq]` of one call; `q` `[sq, hq, d]`,
/// `k`, `v` `[sk, hkv, d]`.
pub(super) fn forward(
    g: &AttnGeom,
    q: Rows<'_, CpuBackend>,
    k: Rows<'_, CpuBackend>,
    v: Rows<'_, CpuBackend>,
    mask: &AttnMask,
    o: RowsMut<'_, CpuBackend>,
    lse: RowsMut<'_, CpuBackend>,
) {
    let (qs, ks, vs) = (data(q.t), data(k.t), data(v.t));
    let (q0, k0, sk) = (q.range.start, k.range.start, k.len());
    let (o_range, l_range) = (o.range.clone(), lse.range.clone());
    let o_rows = &mut data_mut(o.t)[o_range.start * g.hq * g.d..o_range.end * g.hq * g.d];
    let l_rows = &mut data_mut(lse.t)[l_range.start * g.hq..l_range.end * g.hq];
    o_rows
        .par_chunks_mut(g.hq * g.d)
        .zip(l_rows.par_chunks_mut(g.hq))
        .enumerate()
        .for_each(|(i, (orow, lrow))| {
            let keys = mask.visible_keys(i, sk);
            if keys.is_empty() {
                // a row that sees no key of this block (a ring block of
                // other documents): nothing, with weight 0 in an LSE merge
                orow.fill(0.0);
                lrow.fill(f32::NEG_INFINITY);
                return;
            }
            let mut p = vec![0.0f32; keys.len()];
            for h in 0..g.hq {
                let kh = h / g.group;
                let qv = &qs[((q0 + i) * g.hq + h) * g.d..][..g.d];
                let mut m = f32::NEG_INFINITY;
                for (pj, j) in p.iter_mut().zip(keys.clone()) {
                    let kv = &ks[((k0 + j) * g.hkv + kh) * g.d..][..g.d];
                    *pj = g.scale * dot(qv, kv);
                    m = m.max(*pj);
                }
                let mut l = 0.0f32;
                for pj in p.iter_mut() {
                    *pj = (*pj - m).exp();
                    l += *pj;
                }
                let out = &mut orow[h * g.d..(h + 1) * g.d];
                out.fill(0.0);
                for (pj, j) in p.iter().zip(keys.clone()) {
                    let vv = &vs[((k0 + j) * g.hkv + kh) * g.d..][..g.d];
                    for (x, y) in out.iter_mut().zip(vv) {
                        *x += pj * y;
                    }
                }
                for x in out.iter_mut() {
                    *x /= l;
                }
                lrow[h] = m + l.ln();
            }
        });
}

/// One kv head's gradients: dq of its query heads `[group, sq, d]`, its
/// dk and dv `[sk, d]`.
pub(super) type KvHeadGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Every kv head's gradients of one call, in parallel over kv heads
/// (`io`: q, k, v, o, dO, LSE).
pub(super) fn grads_by_kv_head(
    g: &AttnGeom,
    io: [Rows<'_, CpuBackend>; 6],
    mask: &AttnMask,
) -> Vec<KvHeadGrads> {
    let [q, k, v, o, d_o, lse] = io;
    let (qs, ks, vs, os, dos, ls) = (
        data(q.t),
        data(k.t),
        data(v.t),
        data(o.t),
        data(d_o.t),
        data(lse.t),
    );
    let (sq, sk) = (q.len(), k.len());
    let (q0, k0, o0, do0, l0) = (
        q.range.start,
        k.range.start,
        o.range.start,
        d_o.range.start,
        lse.range.start,
    );
    let d = g.d;
    // Per kv head: its own dq (for its query heads), dk and dv, then scattered.
    (0..g.hkv)
        .into_par_iter()
        .map(|kh| {
            let mut dq_l = vec![0.0f32; g.group * sq * d];
            let mut dk_l = vec![0.0f32; sk * d];
            let mut dv_l = vec![0.0f32; sk * d];
            let mut p = vec![0.0f32; sk];
            for hg in 0..g.group {
                let h = kh * g.group + hg;
                for i in 0..sq {
                    let keys = mask.visible_keys(i, sk);
                    let qv = &qs[((q0 + i) * g.hq + h) * d..][..d];
                    let ov = &os[((o0 + i) * g.hq + h) * d..][..d];
                    let dov = &dos[((do0 + i) * g.hq + h) * d..][..d];
                    let l = ls[(l0 + i) * g.hq + h];
                    let delta = dot(dov, ov);
                    let dqr = &mut dq_l[(hg * sq + i) * d..][..d];
                    for (pj, j) in p[keys.clone()].iter_mut().zip(keys.clone()) {
                        let kv = &ks[((k0 + j) * g.hkv + kh) * d..][..d];
                        *pj = (g.scale * dot(qv, kv) - l).exp();
                    }
                    for (&pj, j) in p[keys.clone()].iter().zip(keys.clone()) {
                        let kv = &ks[((k0 + j) * g.hkv + kh) * d..][..d];
                        let vv = &vs[((k0 + j) * g.hkv + kh) * d..][..d];
                        let ds = pj * (dot(dov, vv) - delta) * g.scale;
                        let dkr = &mut dk_l[j * d..(j + 1) * d];
                        for t in 0..d {
                            dqr[t] += ds * kv[t];
                            dkr[t] += ds * qv[t];
                        }
                        let dvr = &mut dv_l[j * d..(j + 1) * d];
                        for t in 0..d {
                            dvr[t] += pj * dov[t];
                        }
                    }
                }
            }
            (dq_l, dk_l, dv_l)
        })
        .collect()
}

/// Writes (adds or overwrites, as `writes` says) the kv heads' gradients
/// into `dq` `[sq, hq, d]`, `dk`, `dv` `[sk, hkv, d]`.
pub(super) fn write_grads(
    g: &AttnGeom,
    per_kv: &[KvHeadGrads],
    grads: [RowsMut<'_, CpuBackend>; 3],
    writes: AttnGradWrites,
) {
    let [dq, dk, dv] = grads;
    let (sq, sk, d) = (dq.len(), dk.len(), g.d);
    let (dq0, dk0, dv0) = (dq.range.start, dk.range.start, dv.range.start);
    let (dqd, dkd, dvd) = (data_mut(dq.t), data_mut(dk.t), data_mut(dv.t));
    // every element of the rows is written once per call, so overwriting
    // it leaves nothing of what was there
    let put = |w: GradWrite| -> fn(&mut f32, f32) {
        match w {
            GradWrite::Add => |a, b| *a += b,
            GradWrite::Overwrite => |a, b| *a = b,
        }
    };
    let (put_q, put_kv) = (put(writes.dq), put(writes.dkv));
    for (kh, (dq_l, dk_l, dv_l)) in per_kv.iter().enumerate() {
        for hg in 0..g.group {
            let h = kh * g.group + hg;
            for i in 0..sq {
                let dst = &mut dqd[((dq0 + i) * g.hq + h) * d..][..d];
                for (a, b) in dst.iter_mut().zip(&dq_l[(hg * sq + i) * d..][..d]) {
                    put_q(a, *b);
                }
            }
        }
        for j in 0..sk {
            let base = ((dk0 + j) * g.hkv + kh) * d;
            for (a, b) in dkd[base..base + d].iter_mut().zip(&dk_l[j * d..][..d]) {
                put_kv(a, *b);
            }
            let base = ((dv0 + j) * g.hkv + kh) * d;
            for (a, b) in dvd[base..base + d].iter_mut().zip(&dv_l[j * d..][..d]) {
                put_kv(a, *b);
            }
        }
    }
}

/// `o_acc`, `lse_acc` become the softmax-weighted merge of themselves and
/// a block's `o_blk`, `lse_blk` (rows `[n, h, d]` and `[n, h]`).
pub(super) fn lse_merge(
    o_acc: RowsMut<'_, CpuBackend>,
    lse_acc: RowsMut<'_, CpuBackend>,
    o_blk: Rows<'_, CpuBackend>,
    lse_blk: Rows<'_, CpuBackend>,
) {
    let (h, d) = (o_acc.heads(), o_acc.head_dim());
    let (ob, lb) = (data(o_blk.t), data(lse_blk.t));
    let (ob0, lb0) = (o_blk.range.start, lse_blk.range.start);
    let (oa0, la0) = (o_acc.range.start, lse_acc.range.start);
    let la = data_mut(lse_acc.t);
    let oa = data_mut(o_acc.t);
    for i in 0..o_blk.len() {
        for hh in 0..h {
            let a = la[(la0 + i) * h + hh];
            let b = lb[(lb0 + i) * h + hh];
            let m = a.max(b);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let l = m + ((a - m).exp() + (b - m).exp()).ln();
            let (wa, wb) = ((a - l).exp(), (b - l).exp());
            let oa_r = &mut oa[((oa0 + i) * h + hh) * d..][..d];
            let ob_r = &ob[((ob0 + i) * h + hh) * d..][..d];
            for (x, y) in oa_r.iter_mut().zip(ob_r) {
                *x = wa * *x + wb * y;
            }
            la[(la0 + i) * h + hh] = l;
        }
    }
}
