//! Every context-parallel strategy computes the same layer as the local
//! reference: output, input gradient and every weight gradient (f32, ≤ 1e-5).

use upipe::attention::rope::{Llama3Scaling, RopeConfig, RopeScaling};
use upipe::attention::trial::{TrialInputs, TrialResult, run_trial};
use upipe::attention::{AttnDims, CpPlan, Settle, Strategy};
use upipe::backend::cpu::CpuBackend;

fn dims(heads: usize, kv_heads: usize, head_dim: usize, qk_norm: bool) -> AttnDims {
    AttnDims {
        hidden: 48,
        heads,
        kv_heads,
        head_dim,
        qk_norm,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: RopeConfig {
            theta: 10000.0,
            scaling: Some(RopeScaling::Llama3(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            })),
        },
        softmax_scale: AttnDims::default_softmax_scale(head_dim),
        precision: upipe::backend::fp8::Precision::Bf16,
    }
}

fn reference(d: &AttnDims, inputs: &TrialInputs) -> TrialResult {
    let plan = CpPlan::new(Strategy::Local, d, inputs.seq, 1, 1, None).unwrap();
    run_trial(&plan, d, inputs, CpuBackend::new).unwrap()
}

/// Runs `strategy` on `pu x pr` ranks and checks it against `reference`.
fn check(
    d: &AttnDims,
    inputs: &TrialInputs,
    reference: &TrialResult,
    strategy: Strategy,
    pu: usize,
    pr: usize,
    chunk: Option<usize>,
) {
    let plan = CpPlan::new(strategy, d, inputs.seq, pu, pr, chunk)
        .unwrap_or_else(|e| panic!("{strategy} {pu}x{pr} U={chunk:?}: {e}"));
    check_plan(d, inputs, reference, plan);
}

fn check_plan(d: &AttnDims, inputs: &TrialInputs, reference: &TrialResult, plan: CpPlan) {
    let got = run_trial(&plan, d, inputs, CpuBackend::new).unwrap();
    for (name, err) in got.errors_against(reference) {
        assert!(
            err <= 1e-5,
            "{} {}x{} U={} H={} Hkv={} qk_norm={}: {name} rel err {err:e}",
            plan.strategy,
            plan.layout.pu,
            plan.layout.pr,
            plan.chunk_text(),
            d.heads,
            d.kv_heads,
            d.qk_norm
        );
    }
}

/// All strategies on C = pu * pr ranks, UPipe at U in {pu, 2pu, H} where valid.
fn check_all(d: &AttnDims, seq: usize, pu: usize, pr: usize) {
    let inputs = TrialInputs::random(d, seq, 42);
    let r = reference(d, &inputs);
    let c = pu * pr;
    if d.heads.is_multiple_of(c) && (d.kv_heads.is_multiple_of(c) || d.kv_heads < c) {
        check(d, &inputs, &r, Strategy::Ulysses, c, 1, None);
    }
    check(d, &inputs, &r, Strategy::Ring, 1, c, None);
    check(d, &inputs, &r, Strategy::Usp, pu, pr, None);
    for u in [pu, 2 * pu, d.heads] {
        if upipe::attention::schedule::valid_chunks(d.heads, d.kv_heads, pu).contains(&u) {
            check(d, &inputs, &r, Strategy::Upipe, pu, pr, Some(u));
        }
    }
    // UPipe at U = Pu with its forward in every wider stage size it allows
    let plan = CpPlan::new(Strategy::Upipe, d, seq, pu, pr, Some(pu)).unwrap();
    for uf in upipe::attention::schedule::valid_fwd_chunks(&plan.schedule)
        .into_iter()
        .skip(1)
    {
        let wide = plan.clone().with_fwd_chunk(Some(uf)).unwrap();
        check_plan(d, &inputs, &r, wide.clone());
        check_plan(d, &inputs, &r, wide.with_overlap(true));
    }
}

#[test]
fn one_rank_equals_local() {
    let d = dims(4, 2, 8, false);
    let inputs = TrialInputs::random(&d, 12, 1);
    let r = reference(&d, &inputs);
    for s in [
        Strategy::Ulysses,
        Strategy::Ring,
        Strategy::Usp,
        Strategy::Upipe,
    ] {
        check(&d, &inputs, &r, s, 1, 1, None);
    }
}

#[test]
fn mha_two_ranks() {
    let d = dims(4, 4, 8, false);
    // these dims take both projection paths of the engine: one GEMM per
    // destination (Ulysses' 2 heads per rank) and one GEMM over stacked
    // weights (UPipe's 1 head per rank per stage)
    let shapes = |u| {
        let plan = CpPlan::new(Strategy::Upipe, &d, 16, 2, 1, Some(u)).unwrap();
        upipe::plan::shapes::StageShapes::new(&plan, &d)
    };
    assert!(!shapes(4).merge_destinations(2));
    assert!(shapes(2).merge_destinations(1));
    check_all(&d, 16, 2, 1);
}

#[test]
fn gqa_llama_layout_eight_ranks() {
    check_all(&dims(32, 8, 4, false), 32, 8, 1);
}

#[test]
fn gqa_llama_layout_mesh_4x2_with_qk_norm() {
    check_all(&dims(32, 8, 4, true), 32, 4, 2);
}

#[test]
fn fewer_kv_heads_than_ulysses_ranks() {
    check_all(&dims(8, 2, 8, false), 16, 4, 1);
    check_all(&dims(8, 2, 8, true), 16, 4, 1);
}

#[test]
fn odd_head_counts_three_ranks() {
    check_all(&dims(12, 3, 8, false), 18, 3, 1);
    check_all(&dims(12, 3, 8, true), 18, 3, 1);
}

#[test]
fn mesh_2x2_and_four_rank_ring() {
    check_all(&dims(8, 4, 8, true), 16, 2, 2);
    check_all(&dims(8, 4, 8, false), 32, 1, 4);
}

#[test]
fn four_ranks_ulysses_gqa_qk_norm() {
    check_all(&dims(16, 4, 8, true), 16, 4, 1);
}

#[test]
fn overlap_schedule_gives_identical_results_within_a_stage_and_a_phase_of_extra_memory() {
    for (d, seq, pu, pr, u) in [
        (dims(32, 8, 4, true), 32, 4, 2, 4),
        (dims(8, 2, 8, false), 16, 4, 1, 4),
        (dims(16, 4, 8, true), 32, 2, 2, 2),
    ] {
        let inputs = TrialInputs::random(&d, seq, 8);
        // per stage, overlap settles the same groups of gradients in the same
        // order, so results are bit-identical (per phase it groups them
        // differently: see the settling test below)
        let plan = CpPlan::new(Strategy::Upipe, &d, seq, pu, pr, Some(u))
            .unwrap()
            .with_settle(Settle::Stages(1));
        let plain = run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap();
        let over = run_trial(
            &plan.clone().with_overlap(true),
            &d,
            &inputs,
            CpuBackend::new,
        )
        .unwrap();
        for (name, err) in over.errors_against(&plain) {
            assert_eq!(
                err, 0.0,
                "{name}: the prefetch order must not change any result"
            );
        }
        // Overlap holds at most: the next stage's O, dO and Q (6 buffers
        // with their exchange copies), the next phase's K and V (4), one
        // stage's output or dQ on its way back (2) and a phase's dK and dV on
        // theirs (4).
        let sh = upipe::plan::shapes::StageShapes::new(&plan, &d);
        let stage = sh.n * sh.u * d.head_dim * 4;
        let phase = sh.n * sh.m * d.head_dim * 4;
        let bound = 8 * stage + 8 * phase;
        let extra = over.act_bytes - plain.act_bytes.min(over.act_bytes);
        eprintln!(
            "overlap pu {pu} pr {pr} u {u}: {extra} more bytes (stage {stage}, phase {phase})"
        );
        assert!(
            over.act_bytes >= plain.act_bytes,
            "prefetch holds more, not less"
        );
        assert!(
            extra <= bound,
            "overlap costs {extra} > 8 stage + 8 phase buffers ({bound} bytes)"
        );
    }
}

#[test]
fn settling_every_n_stages_or_per_phase_gives_the_same_layer_for_at_most_a_phase_of_query_gradients()
 {
    for (d, seq, pu, pr, u, overlap) in [
        (dims(32, 8, 4, true), 32, 4, 2, 4, false),
        (dims(32, 8, 4, true), 32, 4, 2, 4, true),
        (dims(8, 2, 8, false), 16, 4, 1, 4, false),
        (dims(16, 4, 8, true), 32, 2, 2, 2, true),
        (dims(16, 2, 8, false), 32, 2, 1, 2, false),
    ] {
        let inputs = TrialInputs::random(&d, seq, 9);
        let reference = reference(&d, &inputs);
        let plan = CpPlan::new(Strategy::Upipe, &d, seq, pu, pr, Some(u))
            .unwrap()
            .with_overlap(overlap)
            .with_settle(Settle::Stages(1));
        let per_stage = run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap();
        let what = format!("pu {pu} pr {pr} u {u} overlap {overlap}");
        for every in [Settle::Stages(2), Settle::Stages(3)] {
            let got = run_trial(
                &plan.clone().with_settle(every),
                &d,
                &inputs,
                CpuBackend::new,
            )
            .unwrap();
            for (name, err) in got.errors_against(&reference) {
                assert!(err <= 1e-5, "{what} every {every}: {name} rel err {err:e}");
            }
        }
        let per_phase = run_trial(
            &plan.clone().with_settle(Settle::Phase),
            &d,
            &inputs,
            CpuBackend::new,
        )
        .unwrap();
        for (name, err) in per_phase.errors_against(&reference) {
            assert!(err <= 1e-5, "{what}: {name} rel err {err:e}");
        }
        // The phase's query gradients wait for its end (one [n, u, d] f32
        // buffer per stage before the exchange, bf16/f32 packed after it),
        // and the settlement's gathered blocks and weight rows grow with them.
        let sh = upipe::plan::shapes::StageShapes::new(&plan, &d);
        let stages = plan.schedule.phases[0].stages.len();
        let stage = sh.n * sh.u * d.head_dim * 4;
        let bound = 3 * stages * stage + stages * sh.u * pu * d.head_dim * d.hidden * 4;
        let extra = per_phase.act_bytes.saturating_sub(per_stage.act_bytes);
        eprintln!("{what}: {extra} more bytes ({stages} stages per phase of {stage})");
        assert!(
            extra <= bound,
            "{what}: settling per phase costs {extra} > {bound} bytes"
        );
    }
}

/// A full (bidirectional) mask over the sequence goes through every
/// strategy as the causal one does: each equals `local` under the same
/// mask, and the mask is honoured (the full layer differs from the causal).
#[test]
fn a_full_mask_gives_every_strategy_the_local_layer() {
    use upipe::attention::AttnMask;
    use upipe::attention::trial::run_trial_masked;
    let d = dims(8, 4, 8, true);
    let inputs = TrialInputs::random(&d, 24, 9);
    let run = |plan: &CpPlan, mask| run_trial_masked(plan, &d, &inputs, mask, CpuBackend::new);
    let local = CpPlan::new(Strategy::Local, &d, inputs.seq, 1, 1, None).unwrap();
    let reference = run(&local, AttnMask::Full).unwrap();
    let causal = run(&local, AttnMask::Causal).unwrap();
    let differs = causal
        .errors_against(&reference)
        .iter()
        .any(|(_, e)| *e > 1e-3);
    assert!(differs, "the full mask's layer equals the causal one");
    for (strategy, pu, pr, u) in [
        (Strategy::Ulysses, 2, 1, None),
        (Strategy::Ring, 1, 3, None),
        (Strategy::Usp, 2, 2, None),
        (Strategy::Upipe, 2, 2, Some(2)),
    ] {
        let plan = CpPlan::new(strategy, &d, inputs.seq, pu, pr, u).unwrap();
        let got = run(&plan, AttnMask::Full).unwrap();
        for (name, err) in got.errors_against(&reference) {
            assert!(
                err <= 1e-5,
                "{strategy} {pu}x{pr} U={u:?}: {name} rel err {err:e}"
            );
        }
    }
}
