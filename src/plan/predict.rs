//! The predictions: one training step's peak (on the rank that needs the
//! most, or on one ring rank) and an attention trial's, each the engine's
//! own run on the counting backend ([`engine`](super::engine)).

use super::device::DeviceKind;
use super::engine;
use super::step::{Prediction, StepSpec};
use crate::attention::{AttnDims, CpPlan};
use crate::error::Result;

/// The highest of `f(ring_rank)` over the ring ranks (they differ only in
/// which ring blocks their backward runs, which matters on the CUDA flash
/// path), the first of equals: run on [`distinct_ring_ranks`] only.
fn max_over_ring_ranks(pr: usize, f: impl Fn(usize) -> Result<Prediction>) -> Result<Prediction> {
    let mut best: Option<Prediction> = None;
    for i in distinct_ring_ranks(pr) {
        let p = f(i)?;
        if best.as_ref().is_none_or(|b| p.peak > b.peak) {
            best = Some(p);
        }
    }
    Ok(best.expect("at least one ring rank"))
}

/// The ring ranks whose steps can differ, one of each kind (the first):
/// after step 0, ring rank i's steps `1..=i` take a block of the full
/// queries and half the keys (`ring::ring_block`), and the rest `p - 1 - i`
/// half the queries and all keys; a ring step repeats one of the kind
/// before it exactly (its kept buffers already grown), so only which kind
/// comes first and last, and whether the last is the first of its kind,
/// tell the ranks apart: 0, 1 (standing for `1..p-2`), p - 2 and p - 1.
/// Running these instead of all p keeps a prediction linear in the ring
/// degree (`ring_rank_tests` holds it to every rank).
fn distinct_ring_ranks(pr: usize) -> Vec<usize> {
    let mut ranks: Vec<usize> = [0, 1, pr.saturating_sub(2), pr.saturating_sub(1)]
        .into_iter()
        .filter(|&i| i < pr.max(1))
        .collect();
    ranks.dedup();
    ranks
}

/// Predicts the peak of one training step (`train_threads` /
/// `loss_and_grads_cpu`) on the rank that needs the most: the engine's own
/// step on each distinct ring rank ([`engine::engine_step_rank`]). The
/// planner's searches (the longest context, the `auto` choices) call this
/// many times; it costs the same at any length (`plan::engine`).
pub fn predict_step(spec: &StepSpec) -> Result<Prediction> {
    max_over_ring_ranks(spec.plan.layout.pr, |i| engine::engine_step_rank(spec, i))
}

/// Predicts the peak of one training step on ring rank `ring_rank` (the
/// trainer reports ring rank 0's ledger) by running the engine's own step
/// ([`engine::engine_step_rank`]): what `train`'s preflight and
/// `--rehearse` hold a run against, at the run's own length.
pub fn predict_step_rank(spec: &StepSpec, ring_rank: usize) -> Result<Prediction> {
    engine::engine_step_rank(spec, ring_rank)
}

/// Predicts the peak of one evaluation (`upipe eval`'s loss, or an
/// `upipe eval --task` trial) on the rank that needs the most: the
/// evaluation's own forward on each distinct ring rank
/// ([`engine::engine_eval_rank`]).
pub fn predict_eval(spec: &engine::EvalSpec) -> Result<Prediction> {
    let pr = spec.cfg.plan(spec.length)?.layout.pr;
    max_over_ring_ranks(pr, |i| engine::engine_eval_rank(spec, i))
}

/// Predicts what `attention::trial::run_trial` measures (the highest rank):
/// the ledger peak of one layer's forward+backward with the trial's resident
/// tensors (x, dy, weights, f32 gradients, RoPE tables), over `passes`
/// passes (`run_trial`: 1; `bench attn --device cuda`: warm-up + timed), by
/// running the trial itself on the counting backend
/// ([`engine::engine_attention_trial_rank`]).
pub fn predict_attention_trial(
    plan: &CpPlan,
    dims: &AttnDims,
    device: DeviceKind,
    passes: usize,
) -> Result<Prediction> {
    dims.validate()?;
    max_over_ring_ranks(plan.layout.pr, |i| {
        engine::engine_attention_trial_rank(plan, dims, device, i, passes)
    })
}

#[cfg(test)]
mod ring_rank_tests {
    use super::*;
    use crate::attention::Strategy;
    use crate::model::decoder::attn_dims;
    use crate::model::{MemoryPolicy, ModelConfig};

    /// Walking one ring rank of each kind finds the prediction that walking
    /// every ring rank finds (the same rank's, so the same categories).
    #[test]
    fn distinct_ring_ranks_find_the_highest_of_all() {
        for (name, prs) in [("tiny", 1..=9), ("llama3.2-1b", 1..=5)] {
            let model = ModelConfig::preset(name).unwrap();
            check_ring_ranks(&model, prs);
        }
    }

    fn check_ring_ranks(model: &ModelConfig, prs: std::ops::RangeInclusive<usize>) {
        let dims = attn_dims(model);
        for device in [DeviceKind::Cpu, DeviceKind::CUDA, DeviceKind::CudaNative] {
            for (strategy, pu) in [
                (Strategy::Ring, 1),
                (Strategy::Upipe, 2),
                (Strategy::Usp, 2),
            ] {
                for pr in prs.clone() {
                    for seq in [2 * pu * pr * 64, 2 * pu * pr * 200] {
                        let plan = CpPlan::new(strategy, &dims, seq, pu, pr, None).unwrap();
                        let spec = StepSpec {
                            model: model.clone(),
                            plan: plan.clone(),
                            data: 1,
                            policy: MemoryPolicy::default(),
                            fsdp: false,
                            fsdp_replicas: 1,
                            grad_accum: 1,
                            device,
                            optimizer: true,
                            state: Default::default(),
                            precision: Default::default(),
                            freeze: Default::default(),
                            lora: None,
                        };
                        let all = (0..pr)
                            .map(|i| predict_step_rank(&spec, i).unwrap())
                            .fold(None::<Prediction>, |best, p| match best {
                                Some(b) if p.peak <= b.peak => Some(b),
                                _ => Some(p),
                            })
                            .unwrap();
                        let got = predict_step(&spec).unwrap();
                        let why = format!("{device:?} {strategy} pr {pr} seq {seq}");
                        assert_eq!((got.peak, got.peak_at), (all.peak, all.peak_at), "{why}");
                        assert_eq!(got.at_peak, all.at_peak, "{why}");
                        let trial = |i| {
                            engine::engine_attention_trial_rank(&plan, &dims, device, i, 2)
                                .unwrap()
                                .peak
                        };
                        let want = (0..pr).map(trial).max().unwrap();
                        let got = predict_attention_trial(&plan, &dims, device, 2)
                            .unwrap()
                            .peak;
                        assert_eq!(got, want, "trial: {why}");
                    }
                }
            }
        }
    }
}
