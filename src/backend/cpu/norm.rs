//! The CPU reference's RMSNorm over rows of `dim = w.len()`: forward,
//! backward, and the forms fused with a residual add
//! (`Backend::add_rms_norm_fwd`, `Backend::rms_norm_bwd_add`), which run the
//! unfused ops' arithmetic in the same order, so they equal them bit for bit.

use super::cells::dot;
use crate::backend::RmsNorm;
use rayon::prelude::*;

/// `ys = xs / rms(xs) * (ws + offset)` per row.
pub(super) fn forward(xs: &[f32], ws: &[f32], norm: RmsNorm, ys: &mut [f32]) {
    let dim = ws.len();
    ys.par_chunks_mut(dim)
        .zip(xs.par_chunks(dim))
        .for_each(|(yr, xr)| {
            let r = 1.0 / (dot(xr, xr) / dim as f32 + norm.eps).sqrt();
            for ((o, &a), &g) in yr.iter_mut().zip(xr).zip(ws) {
                *o = a * r * norm.weight(g);
            }
        });
}

/// `xs += ys`, rounded as `axpy` with alpha 1 rounds it.
pub(super) fn add(xs: &mut [f32], ys: &[f32]) {
    for (a, b) in xs.iter_mut().zip(ys) {
        *a += b;
    }
}

/// How the backward puts the input gradient into `dx`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum DxWrite {
    /// `dx = g` (`rms_norm_bwd`).
    Overwrite,
    /// `dx += g`, g rounded first (`rms_norm_bwd_add`: `axpy(dx, 1, g)`).
    Add,
}

/// RMSNorm backward per row: `g = r·dy·w' − (r³·Σ(dy·w'·x)/dim)·x` into
/// `dxs` as `write` says, `w'` the weight with the norm's offset;
/// `dw += dy·x·r` when given.
pub(super) fn backward(
    xs: &[f32],
    ws: &[f32],
    dys: &[f32],
    norm: RmsNorm,
    dxs: &mut [f32],
    mut dw: Option<&mut [f32]>,
    write: DxWrite,
) {
    let dim = ws.len();
    for ((dxr, xr), dyr) in dxs.chunks_mut(dim).zip(xs.chunks(dim)).zip(dys.chunks(dim)) {
        let r = 1.0 / (dot(xr, xr) / dim as f32 + norm.eps).sqrt();
        let mut s = 0.0f32;
        for j in 0..dim {
            s += dyr[j] * norm.weight(ws[j]) * xr[j];
        }
        let c = r * r * r * s / dim as f32;
        for j in 0..dim {
            let g = r * dyr[j] * norm.weight(ws[j]) - c * xr[j];
            match write {
                DxWrite::Overwrite => dxr[j] = g,
                DxWrite::Add => dxr[j] += g,
            }
        }
        if let Some(dw) = dw.as_deref_mut() {
            for j in 0..dim {
                dw[j] += dyr[j] * xr[j] * r;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{
        AddRmsNormFwd, Backend, Category, DType, RmsNorm, RmsNormBwd, RmsNormFwd, Tensor,
    };
    use crate::rng::Rng;

    fn random(b: &CpuBackend, rng: &mut Rng, shape: &[usize], scale: f32) -> Tensor<CpuBackend> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale)
            .collect();
        b.from_host(&v, shape, DType::F32, Category::Workspace)
            .unwrap()
    }

    fn bits(b: &CpuBackend, t: &Tensor<CpuBackend>) -> Vec<u32> {
        b.to_host(t).unwrap().iter().map(|x| x.to_bits()).collect()
    }

    fn copy(b: &CpuBackend, t: &Tensor<CpuBackend>) -> Tensor<CpuBackend> {
        crate::backend::cast(b, t, DType::F32, Category::Workspace).unwrap()
    }

    /// `add_rms_norm_fwd` equals `axpy` then `rms_norm_fwd`, and
    /// `rms_norm_bwd_add` equals `rms_norm_bwd` into a temporary then
    /// `axpy`, bit for bit (dx, dw, and dx with a frozen weight).
    #[test]
    fn fused_residual_norms_equal_the_unfused_ops() {
        let b = CpuBackend::new();
        let mut rng = Rng::new(11);
        let gemma = RmsNorm {
            eps: 1e-5,
            weight_offset: 1.0,
        };
        for ((n, dim), norm) in [(1, 8), (5, 64), (3, 1001)]
            .into_iter()
            .flat_map(|d| [(d, RmsNorm::plain(1e-5)), (d, gemma)])
        {
            let x = random(&b, &mut rng, &[n, dim], 3.0);
            let y = random(&b, &mut rng, &[n, dim], 2.0);
            let w = random(&b, &mut rng, &[dim], 1.0);
            let (mut x1, mut out1) = (
                copy(&b, &x),
                b.zeros(&[n, dim], DType::F32, Category::Workspace).unwrap(),
            );
            b.axpy(&mut x1, 1.0, &y).unwrap();
            b.rms_norm_fwd(RmsNormFwd {
                x: &x1,
                w: &w,
                norm,
                y: &mut out1,
            })
            .unwrap();
            let (mut x2, mut out2) = (
                copy(&b, &x),
                b.empty(&[n, dim], DType::F32, Category::Workspace).unwrap(),
            );
            b.add_rms_norm_fwd(AddRmsNormFwd {
                x: &mut x2,
                y: &y,
                w: &w,
                norm,
                out: &mut out2,
            })
            .unwrap();
            assert_eq!(bits(&b, &x1), bits(&b, &x2), "{n}x{dim}: the sum");
            assert_eq!(bits(&b, &out1), bits(&b, &out2), "{n}x{dim}: the norm");

            let dy = random(&b, &mut rng, &[n, dim], 1.0);
            let res = random(&b, &mut rng, &[n, dim], 1.0);
            let dw0 = random(&b, &mut rng, &[dim], 1.0);
            for with_dw in [true, false] {
                let (mut dw1, mut dw2) = (copy(&b, &dw0), copy(&b, &dw0));
                let mut t = b.empty(&[n, dim], DType::F32, Category::Workspace).unwrap();
                b.rms_norm_bwd(RmsNormBwd {
                    x: &x,
                    w: &w,
                    dy: &dy,
                    norm,
                    dx: &mut t,
                    dw: with_dw.then_some(&mut dw1),
                })
                .unwrap();
                let mut dx1 = copy(&b, &res);
                b.axpy(&mut dx1, 1.0, &t).unwrap();
                let mut dx2 = copy(&b, &res);
                b.rms_norm_bwd_add(RmsNormBwd {
                    x: &x,
                    w: &w,
                    dy: &dy,
                    norm,
                    dx: &mut dx2,
                    dw: with_dw.then_some(&mut dw2),
                })
                .unwrap();
                assert_eq!(bits(&b, &dx1), bits(&b, &dx2), "{n}x{dim}: dx");
                assert_eq!(bits(&b, &dw1), bits(&b, &dw2), "{n}x{dim}: dw");
                // the fused op's dx is not the residual alone
                assert_ne!(bits(&b, &dx2), bits(&b, &res), "{n}x{dim}: nothing added");
            }
        }
    }

    /// A norm with a weight offset (Gemma's `1 + w`) equals, bit for bit,
    /// the plain norm of the weights plus the offset: forward, dx and dw.
    #[test]
    fn an_offset_norm_is_the_plain_norm_of_the_offset_weights() {
        let b = CpuBackend::new();
        let mut rng = Rng::new(5);
        let (n, dim) = (4, 48);
        let x = random(&b, &mut rng, &[n, dim], 2.0);
        let dy = random(&b, &mut rng, &[n, dim], 1.0);
        let w = random(&b, &mut rng, &[dim], 0.5);
        let w1: Vec<f32> = b.to_host(&w).unwrap().iter().map(|v| v + 1.0).collect();
        let w1 = b
            .from_host(&w1, &[dim], DType::F32, Category::Workspace)
            .unwrap();
        let gemma = RmsNorm {
            eps: 1e-6,
            weight_offset: 1.0,
        };
        let plain = RmsNorm::plain(1e-6);
        let run = |w: &Tensor<CpuBackend>, norm: RmsNorm| {
            let mut y = b.empty(&[n, dim], DType::F32, Category::Workspace).unwrap();
            b.rms_norm_fwd(RmsNormFwd {
                x: &x,
                w,
                norm,
                y: &mut y,
            })
            .unwrap();
            let mut dx = b.empty(&[n, dim], DType::F32, Category::Workspace).unwrap();
            let mut dw = b.zeros(&[dim], DType::F32, Category::Workspace).unwrap();
            b.rms_norm_bwd(RmsNormBwd {
                x: &x,
                w,
                dy: &dy,
                norm,
                dx: &mut dx,
                dw: Some(&mut dw),
            })
            .unwrap();
            [bits(&b, &y), bits(&b, &dx), bits(&b, &dw)]
        };
        assert_eq!(run(&w, gemma), run(&w1, plain));
        assert_ne!(run(&w, gemma)[0], run(&w, plain)[0]);
    }

    /// A weight that does not divide the rows is an error, not a panic.
    #[test]
    fn a_weight_that_is_not_the_row_width_is_an_error() {
        let b = CpuBackend::new();
        let mut rng = Rng::new(3);
        let mut x = random(&b, &mut rng, &[3, 10], 1.0);
        let y = random(&b, &mut rng, &[3, 10], 1.0);
        let w = random(&b, &mut rng, &[4], 1.0);
        let mut out = b.zeros(&[3, 10], DType::F32, Category::Workspace).unwrap();
        let norm = RmsNorm::plain(1e-5);
        let e = b
            .add_rms_norm_fwd(AddRmsNormFwd {
                x: &mut x,
                y: &y,
                w: &w,
                norm,
                out: &mut out,
            })
            .unwrap_err();
        assert!(
            e.to_string().contains("not rows of the norm weight's 4"),
            "{e}"
        );
        let e = b
            .rms_norm_bwd_add(RmsNormBwd {
                x: &x,
                w: &w,
                dy: &y,
                norm,
                dx: &mut out,
                dw: None,
            })
            .unwrap_err();
        assert!(e.to_string().contains("not rows"), "{e}");
    }
}
