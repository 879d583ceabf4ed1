//! Packed documents through the attention layer: every strategy under a
//! documents mask equals `local` under the same mask (output, input
//! gradient, every weight gradient; f32 ≤ 1e-5), for documents that start
//! mid-chunk, span ring chunks and ranks, have length 1, and for a window
//! that is one document; and the mask is honoured (a packed layer differs
//! from the causal one).

use upipe::attention::trial::{TrialInputs, TrialResult, run_trial_masked};
use upipe::attention::{AttnDims, AttnMask, CpPlan, Strategy};
use upipe::backend::BoundedMask;
use upipe::backend::cpu::CpuBackend;

use crate::common;

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
        (Strategy::Ring, 1, 2, None),
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
        let d = common::tiny_attn_dims(heads, kv_heads, qk_norm);
        let inputs = TrialInputs::random(&d, 48, 11);
        every_strategy_equals_local(&d, &inputs, &documents(&STARTS, 48));
    }
}

/// A window that is one document is the causal layer, through the
/// documents path too.
#[test]
fn one_document_is_the_causal_layer() {
    let d = common::tiny_attn_dims(8, 2, true);
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
    let d = common::tiny_attn_dims(8, 2, true);
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

mod packing {
    use super::{STARTS, common};
    use std::collections::BTreeMap;
    use upipe::attention::{CpPlan, Strategy};
    use upipe::backend::IGNORE;
    use upipe::backend::cpu::CpuBackend;
    use upipe::data::PackedWindow;
    use upipe::model::decoder::attn_dims;
    use upipe::model::{MemoryPolicy, ModelConfig, ModelWeights};
    use upipe::rng::Rng;
    use upipe::train::trainer::{loss_and_grads_cpu, loss_and_grads_cpu_packed};

    use super::common::LossGrads;

    /// A window of `seq` tokens packing the documents of `STARTS`: each
    /// document's last target (the next document's first token) is not
    /// counted, nor are the first two targets of the document at 13 (an SFT
    /// prompt).
    fn window(seq: usize, vocab: usize) -> PackedWindow {
        let mut rng = Rng::new(21);
        let inputs: Vec<u32> = (0..seq).map(|_| rng.below(vocab as u64) as u32).collect();
        let mut targets: Vec<u32> = (0..seq).map(|_| rng.below(vocab as u64) as u32).collect();
        for &s in &STARTS[1..] {
            targets[s as usize - 1] = IGNORE;
        }
        targets[seq - 1] = IGNORE;
        targets[13] = IGNORE;
        targets[14] = IGNORE;
        PackedWindow {
            inputs,
            targets,
            doc_starts: STARTS.to_vec(),
        }
    }

    fn packed(cfg: &ModelConfig, w: &PackedWindow, s: Strategy, pu: usize, pr: usize) -> LossGrads {
        let plan = CpPlan::new(s, &attn_dims(cfg), w.len(), pu, pr, None).unwrap();
        let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
        loss_and_grads_cpu_packed(cfg, &plan, MemoryPolicy::default(), w, &init).unwrap()
    }

    /// Each document run alone (its own window, positions from 0), its
    /// summed loss and gradients weighted into the packed window's mean.
    fn documents_alone(cfg: &ModelConfig, w: &PackedWindow) -> LossGrads {
        let total = w.counted() as f64;
        let mut ends: Vec<usize> = w.doc_starts[1..].iter().map(|&s| s as usize).collect();
        ends.push(w.len());
        let mut loss = 0.0;
        let mut grads: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for (&start, end) in w.doc_starts.iter().zip(ends) {
            let rows = start as usize..end;
            let (ids, tg) = (&w.inputs[rows.clone()], &w.targets[rows.clone()]);
            let counted = tg.iter().filter(|&&t| t != IGNORE).count() as f64;
            let plan = CpPlan::new(Strategy::Local, &attn_dims(cfg), rows.len(), 1, 1, None);
            let init = |b: &CpuBackend| ModelWeights::random(b, cfg, 5);
            let policy = MemoryPolicy::default();
            let (l, g) = loss_and_grads_cpu(cfg, &plan.unwrap(), policy, ids, tg, &init).unwrap();
            // the run's mean over its counted targets, back to sums, over the window's
            let weight = counted / total;
            loss += l * weight;
            for (name, g) in g {
                let acc = grads.entry(name).or_insert_with(|| vec![0.0; g.len()]);
                for (a, x) in acc.iter_mut().zip(g) {
                    *a += x * weight as f32;
                }
            }
        }
        (loss, grads)
    }

    use super::common::assert_loss_grads_close as assert_close;

    /// The definition of correct packing: a packed window gives each
    /// document the loss and gradients it gets alone (whole model), on
    /// `local` and on context-parallel strategies; masked targets (document
    /// ends, an SFT prompt) count toward neither.
    #[test]
    fn a_packed_window_trains_each_document_as_if_alone() {
        let cfg = common::tiny(true);
        let w = window(48, cfg.vocab);
        let want = documents_alone(&cfg, &w);
        assert_close(&packed(&cfg, &w, Strategy::Local, 1, 1), &want, "local");
        assert_close(&packed(&cfg, &w, Strategy::Usp, 2, 2), &want, "usp 2x2");
        assert_close(&packed(&cfg, &w, Strategy::Ring, 1, 3), &want, "ring 3");
        // the mask matters: the same tokens as one stream differ
        let stream = PackedWindow::stream(w.inputs.clone(), w.targets.clone());
        let one = packed(&cfg, &stream, Strategy::Local, 1, 1);
        assert!((one.0 - want.0).abs() > 1e-4, "packing changed nothing");
    }
}

/// A block whose queries see none of its keys (a ring block of other
/// documents) gives them no output and an LSE of −∞, which the LSE merge
/// weighs zero; its backward adds no gradient.
#[test]
fn a_block_of_other_documents_adds_nothing() {
    use upipe::backend::{
        AttentionBwd, AttentionFwd, AttnGradWrites, Backend, Category, DType, LseMerge,
        RowPositions,
    };
    let b = CpuBackend::new();
    let seq_mask = BoundedMask::documents(&[0, 2], 4).unwrap();
    // queries at positions 2, 3 (second document) against keys at 0, 1 (first)
    let mask = AttnMask::Bounded(seq_mask.with_rows(
        RowPositions::contiguous(2, 2),
        RowPositions::contiguous(0, 2),
    ));
    assert!(mask.hides_all(2, 2));
    let vals: Vec<f32> = (0..8).map(|i| (i as f32 * 0.37).sin()).collect();
    let t = |shape: &[usize]| b.from_host(&vals, shape, DType::F32, Category::Activations);
    let (q, k, v) = (
        t(&[2, 1, 4]).unwrap(),
        t(&[2, 1, 4]).unwrap(),
        t(&[2, 1, 4]).unwrap(),
    );
    let mut o = b
        .zeros(&[2, 1, 4], DType::F32, Category::Workspace)
        .unwrap();
    let mut lse = b.zeros(&[2, 1], DType::F32, Category::Workspace).unwrap();
    let (qr, kr, vr) = (q.all_rows(), k.all_rows(), v.all_rows());
    b.attention_fwd(AttentionFwd {
        q: qr,
        k: kr,
        v: vr,
        mask: &mask,
        scale: 0.5,
        o: o.all_rows_mut(),
        lse: lse.all_rows_mut(),
    })
    .unwrap();
    assert!(b.to_host(&o).unwrap().iter().all(|&x| x == 0.0));
    assert!(
        b.to_host(&lse)
            .unwrap()
            .iter()
            .all(|&x| x == f32::NEG_INFINITY)
    );
    let mut o_acc = t(&[2, 1, 4]).unwrap();
    let mut lse_acc = b.from_host(&[0.5, -1.0], &[2, 1], DType::F32, Category::Workspace);
    let lse_acc = lse_acc.as_mut().unwrap();
    b.lse_merge(LseMerge {
        o_acc: o_acc.all_rows_mut(),
        lse_acc: lse_acc.all_rows_mut(),
        o_blk: o.all_rows(),
        lse_blk: lse.all_rows(),
    })
    .unwrap();
    assert_eq!(b.to_host(&o_acc).unwrap(), vals);
    assert_eq!(b.to_host(lse_acc).unwrap(), vec![0.5, -1.0]);
    let z = |shape: &[usize]| b.zeros(shape, DType::F32, Category::Grads).unwrap();
    let (mut dq, mut dk, mut dv) = (z(&[2, 1, 4]), z(&[2, 1, 4]), z(&[2, 1, 4]));
    let d_o = t(&[2, 1, 4]).unwrap();
    b.attention_bwd(AttentionBwd {
        q: q.all_rows(),
        k: k.all_rows(),
        v: v.all_rows(),
        o: o_acc.all_rows(),
        d_o: d_o.all_rows(),
        lse: lse_acc.all_rows(),
        mask: &mask,
        scale: 0.5,
        dq: dq.all_rows_mut(),
        dk: dk.all_rows_mut(),
        dv: dv.all_rows_mut(),
        writes: AttnGradWrites::ADD,
    })
    .unwrap();
    for g in [&dq, &dk, &dv] {
        assert!(b.to_host(g).unwrap().iter().all(|&x| x == 0.0));
    }
}
