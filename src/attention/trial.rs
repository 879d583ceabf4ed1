//! One attention layer, forward and backward, under one strategy on thread
//! ranks: the harness behind the equivalence tests and `upipe bench attn`.
//!
//! Activation bytes are measured by the ledger: the per-rank peak during
//! forward+backward above what was resident before (weights, gradients, x,
//! dy, RoPE tables), minus the tensors the layer must produce anyway (saved
//! O, output y, input gradient dx).

use super::{AttentionGrads, AttentionWeights, AttnDims, CpAttention, CpPlan, Strategy};
use crate::backend::{Backend, Category, DType};
use crate::comm::local::run_ranks;
use crate::error::Result;
use crate::rng::Rng;
use std::time::Instant;

/// Host inputs of a trial: global x and dy `[seq, hidden]` and the weights.
#[derive(Debug, Clone)]
pub struct TrialInputs {
    pub seq: usize,
    pub x: Vec<f32>,
    pub dy: Vec<f32>,
    /// `(name, shape, values)` in the order wq, wk, wv, wo[, q_norm, k_norm].
    pub weights: Vec<(&'static str, Vec<usize>, Vec<f32>)>,
}

impl TrialInputs {
    /// Seeded random inputs of realistic scale.
    pub fn random(dims: &AttnDims, seq: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (h, d) = (dims.hidden, dims.head_dim);
        let ws = 1.0 / (h as f32).sqrt();
        let mut weights = vec![
            (
                "wq",
                vec![dims.q_width(), h],
                rng.normal_vec(dims.q_width() * h, ws),
            ),
            (
                "wk",
                vec![dims.kv_width(), h],
                rng.normal_vec(dims.kv_width() * h, ws),
            ),
            (
                "wv",
                vec![dims.kv_width(), h],
                rng.normal_vec(dims.kv_width() * h, ws),
            ),
            (
                "wo",
                vec![h, dims.q_width()],
                rng.normal_vec(h * dims.q_width(), ws),
            ),
        ];
        if dims.qk_norm {
            for name in ["q_norm", "k_norm"] {
                let v = (0..d).map(|_| 1.0 + 0.2 * rng.normal() as f32).collect();
                weights.push((name, vec![d], v));
            }
        }
        TrialInputs {
            seq,
            x: rng.normal_vec(seq * h, 1.0),
            dy: rng.normal_vec(seq * h, 1.0),
            weights,
        }
    }
}

/// What one strategy produced, gathered to global order, plus its memory.
#[derive(Debug, Clone)]
pub struct TrialResult {
    pub strategy: Strategy,
    pub ranks: usize,
    /// Layer output `[seq, hidden]`.
    pub y: Vec<f32>,
    /// Input gradient `[seq, hidden]`.
    pub dx: Vec<f32>,
    /// Parameter gradients summed over ranks, same order as the weights.
    pub grads: Vec<(&'static str, Vec<f32>)>,
    /// Highest per-rank ledger peak.
    pub peak_bytes: usize,
    /// Highest per-rank activation bytes (see module docs).
    pub act_bytes: usize,
    /// Wall time of forward+backward (slowest rank).
    pub seconds: f64,
}

/// `max |a - b| / max |b|`: error relative to the reference's scale.
pub fn rel_err(a: &[f32], reference: &[f32]) -> f64 {
    let scale = reference.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(reference)
        .fold(0.0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    if scale == 0.0 { diff } else { diff / scale }
}

impl TrialResult {
    /// Relative error of every output against a reference trial: y, dx, then each gradient.
    pub fn errors_against(&self, reference: &TrialResult) -> Vec<(String, f64)> {
        let mut out = vec![
            ("y".to_string(), rel_err(&self.y, &reference.y)),
            ("dx".to_string(), rel_err(&self.dx, &reference.dx)),
        ];
        for ((name, g), (_, r)) in self.grads.iter().zip(&reference.grads) {
            out.push((format!("d{name}"), rel_err(g, r)));
        }
        out
    }
    /// The largest of [`errors_against`](Self::errors_against).
    pub fn max_rel_err(&self, reference: &TrialResult) -> f64 {
        self.errors_against(reference)
            .into_iter()
            .map(|(_, e)| e)
            .fold(0.0, f64::max)
    }
}

/// Runs forward+backward of one layer under `plan` on `plan.mesh_shape()` thread ranks.
pub fn run_trial<B: Backend>(
    plan: &CpPlan,
    dims: &AttnDims,
    inputs: &TrialInputs,
    make_backend: impl Fn() -> B + Sync,
) -> Result<TrialResult> {
    let shape = plan.mesh_shape();
    let layout = plan.layout;
    let hidden = dims.hidden;
    let per_rank = run_ranks(shape, make_backend, |_rank, b, mesh| {
        let b = b.as_ref();
        let act = b.compute_dtype();
        let (i, r) = (mesh.ring.rank(), mesh.ulysses.rank());
        let x = b.from_host(
            &layout.shard_rows(&inputs.x, hidden, i, r),
            &[layout.local_len(), hidden],
            act,
            Category::Activations,
        )?;
        let dy = b.from_host(
            &layout.shard_rows(&inputs.dy, hidden, i, r),
            &[layout.local_len(), hidden],
            act,
            Category::Grads,
        )?;
        let up = |k: usize| {
            b.from_host(
                &inputs.weights[k].2,
                &inputs.weights[k].1,
                act,
                Category::Weights,
            )
        };
        let w = AttentionWeights {
            wq: up(0)?,
            wk: up(1)?,
            wv: up(2)?,
            wo: up(3)?,
            q_norm: if dims.qk_norm { Some(up(4)?) } else { None },
            k_norm: if dims.qk_norm { Some(up(5)?) } else { None },
        };
        let mut g = AttentionGrads::zeros(b, dims)?;
        let layer = CpAttention::new(b, *dims, plan.clone(), &mesh)?;

        b.synchronize()?;
        let ledger = b.ledger();
        ledger.reset_peak();
        let resident = ledger.current();
        let start = Instant::now();
        let (y, saved) = layer.forward(b, &mesh, &w, &x)?;
        let o_bytes = saved.o.bytes();
        let dx = layer.backward(b, &mesh, &w, &x, saved, &dy, &mut g)?;
        b.synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        let peak = ledger.peak();
        let act_bytes = peak.saturating_sub(resident + o_bytes + y.bytes() + dx.bytes());

        let mut grads = Vec::new();
        for (name, t) in g.named() {
            let mut t32 = crate::backend::cast(b, t, DType::F32, Category::Grads)?;
            mesh.world.all_reduce(&mut t32)?;
            grads.push((name, b.to_host(&t32)?));
        }
        Ok((
            b.to_host(&y)?,
            b.to_host(&dx)?,
            grads,
            peak,
            act_bytes,
            seconds,
        ))
    })?;
    let ys: Vec<Vec<f32>> = per_rank.iter().map(|p| p.0.clone()).collect();
    let dxs: Vec<Vec<f32>> = per_rank.iter().map(|p| p.1.clone()).collect();
    Ok(TrialResult {
        strategy: plan.strategy,
        ranks: shape.world_size(),
        y: layout.unshard_rows(&ys, hidden),
        dx: layout.unshard_rows(&dxs, hidden),
        grads: per_rank[0].2.clone(),
        peak_bytes: per_rank.iter().map(|p| p.3).max().unwrap_or(0),
        act_bytes: per_rank.iter().map(|p| p.4).max().unwrap_or(0),
        seconds: per_rank.iter().map(|p| p.5).fold(0.0, f64::max),
    })
}
