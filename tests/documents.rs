//! Packed documents through the attention layer: every strategy under a
//! documents mask equals `local` under the same mask (output, input
//! gradient, every weight gradient; f32 ≤ 1e-5), for documents that start
//! mid-chunk, span ring chunks and ranks, have length 1, and for a window
//! that is one document; and the mask is honoured (a packed layer differs
//! from the causal one).

use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, TrialResult, run_trial_masked};
use upipe::attention::{AttnDims, AttnMask, CpPlan, Strategy};
use upipe::backend::BoundedMask;
use upipe::backend::cpu::CpuBackend;

fn dims(heads: usize, kv_heads: usize, qk_norm: bool) -> AttnDims {
    AttnDims {
        hidden: 32,
        heads,
        kv_heads,
        head_dim: 8,
        qk_norm,
        norm_eps: 1e-6,
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
    }
}

fn documents(starts: &[u32], seq: usize) -> AttnMask {
    AttnMask::Bounded(BoundedMask::documents(starts, seq).unwrap())
}

fn run(d: &AttnDims, inputs: &TrialInputs, plan: &CpPlan, mask: &AttnMask) -> TrialResult {
    run_trial_masked(plan, d, inputs, mask.clone(), CpuBackend::new)
        .unwrap_or_else(|e| panic!("{} under {mask}: {e}", plan.strategy))
}

/// Every strategy (GQA with fewer kv heads than Ulysses ranks, UPipe with
/// U < H) against `local`, under `mask`.
fn every_strategy_equals_local(d: &AttnDims, inputs: &TrialInputs, mask: &AttnMask) {
    let local = CpPlan::new(Strategy::Local, d, inputs.seq, 1, 1, None).unwrap();
    let reference = run(d, inputs, &local, mask);
    for (strategy, pu, pr, u) in [
        (Strategy::Ulysses, 4, 1, None),
        (Strategy::Ring, 1, 3, None),
        (Strategy::Ring, 1, 4, None),
        (Strategy::Usp, 2, 2, None),
        (Strategy::Upipe, 4, 1, Some(4)),
        (Strategy::Upipe, 2, 2, Some(2)),
        (Strategy::Upipe, 4, 2, Some(4)),
    ] {
        let plan = CpPlan::new(strategy, d, inputs.seq, pu, pr, u).unwrap();
        let got = run(d, inputs, &plan, mask);
        for (name, err) in got.errors_against(&reference) {
            assert!(
                err <= 1e-5,
                "{strategy} {pu}x{pr} U={u:?} Hkv={} under {mask}: {name} rel err {err:e}",
                d.kv_heads
            );
        }
    }
}

/// 48 tokens: with ring degree 3 the zigzag chunks are 8 tokens, with 4
/// they are 6. Documents start mid-chunk (3, 13), three have length 1
/// (5, 6, 47), one spans several chunks and ranks (13..30); with ring
/// degree 4, rank 3's queries (positions 18..30) see none of rank 0's
/// first chunk, so that block is skipped.
const STARTS: [u32; 8] = [0, 3, 5, 6, 7, 13, 30, 47];

#[test]
fn every_strategy_equals_local_under_packed_documents() {
    for (heads, kv_heads, qk_norm) in [(8, 2, true), (8, 8, false)] {
        let d = dims(heads, kv_heads, qk_norm);
        let inputs = TrialInputs::random(&d, 48, 11);
        every_strategy_equals_local(&d, &inputs, &documents(&STARTS, 48));
    }
}

/// A window that is one document is the causal layer, through the
/// documents path too.
#[test]
fn one_document_is_the_causal_layer() {
    let d = dims(8, 2, true);
    let inputs = TrialInputs::random(&d, 48, 12);
    let one = documents(&[0], 48);
    every_strategy_equals_local(&d, &inputs, &one);
    let local = CpPlan::new(Strategy::Local, &d, 48, 1, 1, None).unwrap();
    let causal = run(&d, &inputs, &local, &AttnMask::Causal);
    for (name, err) in run(&d, &inputs, &local, &one).errors_against(&causal) {
        assert!(
            err <= 1e-6,
            "one document vs causal: {name} rel err {err:e}"
        );
    }
    let packed = run(&d, &inputs, &local, &documents(&STARTS, 48));
    let differs = packed
        .errors_against(&causal)
        .iter()
        .any(|(_, e)| *e > 1e-3);
    assert!(differs, "the documents mask changed nothing");
}

/// Each document's rows of a packed layer are the layer run on that
/// document alone (positions restart, nothing crosses a boundary).
#[test]
fn a_packed_layer_gives_each_document_its_own_output() {
    let d = dims(8, 2, true);
    let seq = 48;
    let inputs = TrialInputs::random(&d, seq, 13);
    let local = CpPlan::new(Strategy::Local, &d, seq, 1, 1, None).unwrap();
    let packed = run(&d, &inputs, &local, &documents(&STARTS, seq));
    let h = d.hidden;
    let mut ends: Vec<usize> = STARTS[1..].iter().map(|&s| s as usize).collect();
    ends.push(seq);
    for (&start, end) in STARTS.iter().zip(ends) {
        let start = start as usize;
        let len = end - start;
        let alone = TrialInputs {
            seq: len,
            x: inputs.x[start * h..end * h].to_vec(),
            dy: inputs.dy[start * h..end * h].to_vec(),
            weights: inputs.weights.clone(),
        };
        let plan = CpPlan::new(Strategy::Local, &d, len, 1, 1, None).unwrap();
        let own = run(&d, &alone, &plan, &AttnMask::Causal);
        for (what, got, want) in [
            ("y", &packed.y[start * h..end * h], &own.y[..]),
            ("dx", &packed.dx[start * h..end * h], &own.dx[..]),
        ] {
            let err = upipe::attention::trial::rel_err(got, want);
            assert!(
                err <= 1e-5,
                "document {start}..{end}: {what} rel err {err:e}"
            );
        }
    }
}
