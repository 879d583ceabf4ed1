//! The memory planner against the allocator ledger: predictions of the
//! attention layer (every strategy, several U, meshes, QK-norm on/off) and of
//! whole tiny-model training steps (every policy combination) equal the
//! measured per-rank peaks on the CPU backend.

use std::sync::Arc;
use upipe::attention::rope::RopeConfig;
use upipe::attention::trial::{TrialInputs, run_trial};
use upipe::attention::{AttnDims, CpPlan, Settle, Strategy};
use upipe::backend::Category;
use upipe::backend::cpu::CpuBackend;
use upipe::model::decoder::attn_dims;
use upipe::model::{HostUpdate, MemoryPolicy, ModelConfig};
use upipe::optim::AdamWConfig;
use upipe::plan::{
    Budget, DeviceKind, Limit, StepSpec, longest_context, predict_attention_trial, predict_step,
    predict_step_rank, resolve_plan, widest_free_forward,
};
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, train_cpu};

use crate::common;
use common::tiny;

/// Relative difference of a prediction from a measurement.
fn rel(pred: usize, measured: usize) -> f64 {
    (pred as f64 - measured as f64).abs() / measured.max(1) as f64
}

#[test]
fn attention_layer_prediction_equals_ledger_peak() {
    // (heads, kv heads, strategy, Pu, Pr, U, forward U)
    type Case = (
        usize,
        usize,
        Strategy,
        usize,
        usize,
        Option<usize>,
        Option<usize>,
    );
    let cases: &[Case] = &[
        (8, 2, Strategy::Local, 1, 1, None, None),
        (8, 2, Strategy::Ulysses, 2, 1, None, None),
        (8, 2, Strategy::Ulysses, 4, 1, None, None), // kv heads replicated (Hkv < Pu)
        (8, 8, Strategy::Ulysses, 8, 1, None, None),
        (8, 2, Strategy::Ring, 1, 2, None, None),
        (8, 2, Strategy::Ring, 1, 3, None, None),
        (8, 2, Strategy::Usp, 2, 2, None, None),
        (8, 2, Strategy::Upipe, 2, 1, Some(2), None),
        (8, 2, Strategy::Upipe, 2, 1, Some(4), None),
        (8, 2, Strategy::Upipe, 2, 1, Some(8), None),
        (8, 2, Strategy::Upipe, 4, 1, Some(4), None),
        (16, 4, Strategy::Upipe, 4, 1, Some(8), None),
        (8, 2, Strategy::Upipe, 2, 2, Some(2), None),
        (8, 2, Strategy::Upipe, 2, 3, Some(4), None),
        (8, 4, Strategy::Upipe, 4, 2, Some(4), None),
        // forward in wider stages than the backward
        (8, 2, Strategy::Upipe, 2, 1, Some(2), Some(8)),
        (8, 2, Strategy::Upipe, 2, 1, Some(2), Some(4)),
        (16, 4, Strategy::Upipe, 4, 1, Some(4), Some(8)),
        (8, 2, Strategy::Upipe, 2, 3, Some(2), Some(8)),
    ];
    let seq = 48;
    let (stage, phase) = (Settle::Stages(1), Settle::Phase);
    for (qk, overlap, settle) in [
        (false, false, stage),
        (true, false, stage),
        (false, true, stage),
        (true, true, stage),
        (false, false, phase),
        (true, true, phase),
        (true, false, Settle::Stages(2)),
        (false, true, Settle::Stages(3)),
    ] {
        for &(h, hkv, s, pu, pr, u, uf) in cases {
            let d = common::tiny_attn_dims(h, hkv, qk);
            let plan = CpPlan::new(s, &d, seq, pu, pr, u)
                .unwrap()
                .with_fwd_chunk(uf)
                .unwrap()
                .with_overlap(overlap && s != Strategy::Local)
                .with_settle(settle);
            let inputs = TrialInputs::random(&d, seq, 3);
            let measured = run_trial(&plan, &d, &inputs, CpuBackend::new).unwrap();
            let pred = predict_attention_trial(&plan, &d, DeviceKind::Cpu, 1).unwrap();
            let what = format!(
                "{s} H={h} Hkv={hkv} {pu}x{pr} U={u:?} forward U={uf:?} qk_norm={qk} overlap={overlap} settle every {settle}"
            );
            let e = rel(pred.peak, measured.peak_bytes);
            assert!(
                e <= 0.05,
                "{what}: predicted {} vs measured {} ({:.1}%)",
                pred.peak,
                measured.peak_bytes,
                100.0 * e
            );
            // On the CPU backend the engine's planned step is its real one.
            assert_eq!(pred.peak, measured.peak_bytes, "{what}");
        }
    }
}

fn train_cfg(
    model: &ModelConfig,
    s: Strategy,
    pu: usize,
    pr: usize,
    u: Option<usize>,
    seq: usize,
    policy: MemoryPolicy,
) -> TrainConfig {
    TrainConfig {
        strategy: s,
        ulysses: pu,
        ring: pr,
        chunk_heads: u,
        policy,
        // two steps: the second runs the first's deferred host updates
        // (`--offload-optimizer`) in its forward, and the planner's peak
        // covers every step
        ..TrainConfig::new(
            model.clone(),
            seq,
            2,
            AdamWConfig {
                weight_decay: 0.0,
                ..AdamWConfig::schedule(1e-3, 1e-4, 0, 2)
            },
        )
    }
}

fn policies() -> Vec<MemoryPolicy> {
    let layers = tiny(false).layers;
    let mut out = Vec::new();
    let all = MemoryPolicy::optimizer_units(layers);
    // (checkpoint, blocks offloaded, units whose optimizer state is on the
    // host: every unit, the last block's, the blocks' and the embedding's)
    for (checkpoint, offload, offload_optimizer) in [
        (false, 0, 0),
        (true, 0, 0),
        (true, layers, 0),
        (true, 1, all),
        (false, 0, all),
        (true, 0, 1),
        (false, 0, layers + 1),
    ] {
        for tiled_mlp in [false, true] {
            for loss_chunk in [256, 7] {
                if offload_optimizer > 0 && (tiled_mlp || loss_chunk != 256) {
                    continue;
                }
                // under checkpointing, no block, the last one or every block
                // keeps its attention output (`--save-attention none|1|all`)
                let saves = if checkpoint && loss_chunk == 256 {
                    vec![0, 1, layers]
                } else {
                    vec![0]
                };
                for save_attention in saves {
                    let policy = MemoryPolicy {
                        checkpoint,
                        offload,
                        offload_optimizer,
                        tiled_mlp,
                        loss_chunk,
                        save_attention,
                        checkpoint_every: 1,
                        ..MemoryPolicy::default()
                    };
                    out.push(policy);
                    // the host's state paged through the device
                    if checkpoint && offload_optimizer > 0 && save_attention == 1 {
                        out.push(MemoryPolicy {
                            host_update: HostUpdate::Gpu,
                            ..policy
                        });
                    }
                }
            }
        }
    }
    out
}

#[test]
fn training_step_prediction_equals_ledger_peak_under_every_policy() {
    let mut rng = Rng::new(4);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let seq = 256; // 64 tokens per rank on 4 ranks: 2 MLP tiles of `hidden` rows
    // (the trainer runs stages back to back; `overlap` is covered by the layer test)
    // (QK-norm, strategy, Pu, Pr, U, forward U, data replicas)
    for (qk, s, pu, pr, u, uf, data_parallel) in [
        (false, Strategy::Upipe, 2, 2, None, None, 1),
        (true, Strategy::Upipe, 4, 1, Some(4), None, 1),
        (true, Strategy::Upipe, 2, 2, Some(2), None, 1),
        (true, Strategy::Upipe, 2, 2, Some(2), Some(8), 1),
        (false, Strategy::Ulysses, 4, 1, None, None, 1),
        (true, Strategy::Ring, 1, 4, None, None, 1),
        (false, Strategy::Local, 1, 1, None, None, 1),
        (false, Strategy::Upipe, 2, 1, None, None, 2),
    ] {
        // FSDP on every mesh; a tied embedding (Qwen3-style) where QK-norm is on
        for (policy, fsdp) in policies().into_iter().flat_map(|p| [(p, false), (p, true)]) {
            let mut model = tiny(qk);
            model.tie_embeddings = qk && fsdp;
            let mut cfg = train_cfg(&model, s, pu, pr, u, seq, policy);
            cfg.data_parallel = data_parallel;
            cfg.fwd_chunk_heads = uf;
            cfg.fsdp = fsdp;
            let plan = cfg.plan().unwrap();
            let measured = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap().memory;
            let spec = StepSpec {
                model: model.clone(),
                plan,
                data: data_parallel,
                policy,
                fsdp,
                fsdp_replicas: 1,
                grad_accum: 1,
                device: DeviceKind::Cpu,
                optimizer: true,
                state: Default::default(),
                precision: Default::default(),
                freeze: Default::default(),
                lora: None,
            };
            let pred = predict_step_rank(&spec, 0).unwrap();
            // on CPU every ring rank allocates the same
            assert_eq!(pred, predict_step(&spec).unwrap());
            let what = format!(
                "{s} {pu}x{pr} U={u:?} forward U={uf:?} qk={qk} data={data_parallel} fsdp={fsdp} {policy:?}"
            );
            let e = rel(pred.peak, measured.peak);
            assert!(
                e <= 0.05,
                "{what}: predicted {} vs measured {} ({:.1}%)",
                pred.peak,
                measured.peak,
                100.0 * e
            );
            assert_eq!(pred.peak, measured.peak, "{what}: device peak");
            assert_eq!(pred.host_peak, measured.host_peak, "{what}: host peak");
            for cat in Category::ALL.into_iter().filter(|c| c.on_device()) {
                assert_eq!(
                    pred.at(cat),
                    measured.at_peak(cat),
                    "{what}: {} at the peak",
                    cat.name()
                );
            }
        }
    }
}

/// A Qwen2 step (q/k/v biases, tied embeddings): the planner's prediction
/// equals the CPU ledger to the byte, with and without FSDP.
#[test]
fn qwen2_step_prediction_equals_ledger_peak() {
    let mut rng = Rng::new(4);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let model = common::tiny_qwen2();
    for (s, pu, pr, u) in [
        (Strategy::Upipe, 2, 2, Some(2)),
        (Strategy::Local, 1, 1, None),
    ] {
        for (policy, fsdp) in policies().into_iter().flat_map(|p| [(p, false), (p, true)]) {
            let mut cfg = train_cfg(&model, s, pu, pr, u, 256, policy);
            cfg.fsdp = fsdp;
            let plan = cfg.plan().unwrap();
            let measured = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap().memory;
            let spec = StepSpec {
                model: model.clone(),
                plan,
                data: 1,
                policy,
                fsdp,
                fsdp_replicas: 1,
                grad_accum: 1,
                device: DeviceKind::Cpu,
                optimizer: true,
                state: Default::default(),
                precision: Default::default(),
                freeze: Default::default(),
                lora: None,
            };
            let pred = predict_step_rank(&spec, 0).unwrap();
            assert_eq!(pred, predict_step(&spec).unwrap());
            let what = format!("qwen2 {s} {pu}x{pr} U={u:?} fsdp={fsdp} {policy:?}");
            assert_eq!(pred.peak, measured.peak, "{what}: device peak");
            assert_eq!(pred.host_peak, measured.host_peak, "{what}: host peak");
        }
    }
}

#[test]
fn policies_and_fsdp_lower_the_predicted_peak() {
    let model = ModelConfig::resolve("llama3-8b").unwrap();
    let d = attn_dims(&model);
    let seq = 1 << 20;
    let (plan, data) = resolve_plan(Strategy::Upipe, &d, seq, 8, None, None, None).unwrap();
    let spec = |policy, fsdp| StepSpec {
        model: model.clone(),
        plan: plan.clone(),
        data,
        policy,
        fsdp,
        fsdp_replicas: 1,
        grad_accum: 1,
        device: DeviceKind::CUDA,
        optimizer: true,
        state: Default::default(),
        precision: Default::default(),
        freeze: Default::default(),
        lora: None,
    };
    let plain = predict_step(&spec(MemoryPolicy::default(), false)).unwrap();
    let all = MemoryPolicy {
        checkpoint: true,
        offload: model.layers,
        offload_optimizer: 0,
        tiled_mlp: true,
        loss_chunk: 256,
        save_attention: 0,
        checkpoint_every: 1,
        ..MemoryPolicy::default()
    };
    let ckpt = predict_step(&spec(MemoryPolicy { offload: 0, ..all }, true)).unwrap();
    let best = predict_step(&spec(all, true)).unwrap();
    assert!(ckpt.peak < plain.peak && best.peak < ckpt.peak);
    assert!(best.host_peak > 0 && ckpt.host_peak == 0);
    // FSDP over 8 ranks: each unit's shard is 1/8 of it (padded), bf16
    // weights plus at most two gathered units, f32 master and moments
    let layouts = upipe::train::fsdp::model_layouts(&model, 8);
    let shard: usize = layouts.iter().map(|u| u.shard).sum();
    assert!(8 * shard >= model.param_count() && 8 * shard < model.param_count() + 8 * 34);
    assert_eq!(best.at(Category::OptimState), shard * 12);
    assert_eq!(best.at(Category::Grads) % 4, 0);
    let largest = layouts.iter().map(|u| u.numel).max().unwrap();
    let w = best.at(Category::Weights);
    assert!(w >= shard * 2 && w <= shard * 2 + 2 * largest * 2, "{w}");
}

#[test]
fn longest_context_is_the_boundary_of_the_budget() {
    let model = ModelConfig::resolve("llama3-8b").unwrap();
    let d = attn_dims(&model);
    let policy = MemoryPolicy {
        checkpoint: true,
        offload: model.layers,
        offload_optimizer: 0,
        tiled_mlp: true,
        loss_chunk: 256,
        save_attention: 0,
        checkpoint_every: 1,
        ..MemoryPolicy::default()
    };
    let budget = Budget {
        device: 80 << 30,
        host: None,
    };
    let predict = |strategy: Strategy| {
        let model = model.clone();
        move |seq: usize| {
            let (plan, data) = resolve_plan(strategy, &d, seq, 8, None, None, None)?;
            predict_step(&StepSpec {
                model: model.clone(),
                plan,
                data,
                policy,
                fsdp: true,
                fsdp_replicas: 1,
                grad_accum: 1,
                device: DeviceKind::CUDA,
                optimizer: true,
                state: Default::default(),
                precision: Default::default(),
                freeze: Default::default(),
                lora: None,
            })
        }
    };
    let step = 8192;
    let uly = longest_context(step, 1 << 30, budget, predict(Strategy::Ulysses)).unwrap();
    let up = longest_context(step, 1 << 30, budget, predict(Strategy::Upipe)).unwrap();
    for fit in [&uly, &up] {
        assert!(fit.seq > 0);
        assert!(fit.at_fit.as_ref().unwrap().peak <= budget.device);
        let (next, limit, p) = fit.limit.clone().unwrap();
        assert_eq!(next, fit.seq + step, "the next step up does not fit");
        assert!(p.peak > budget.device);
        assert!(matches!(limit, Limit::Device(..)));
    }
    assert!(up.seq > uly.seq, "UPipe fits a longer context than Ulysses");
}

#[test]
fn bad_meshes_are_clear_errors() {
    let d = attn_dims(&ModelConfig::resolve("llama3-8b").unwrap());
    let e = resolve_plan(Strategy::Upipe, &d, 1 << 20, 12, Some(8), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a multiple of the context mesh"), "{e}");
    // with no degree given, 6 GPUs are 3 replicas of Ulysses 2 (as `train`
    // fits them); a Ulysses degree of 6 given is refused
    let e = resolve_plan(Strategy::Ulysses, &d, 1 << 20, 6, Some(6), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("must divide the 32 query heads"), "{e}");
    let e = resolve_plan(Strategy::Upipe, &d, 1 << 20, 8, None, None, Some(3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--chunk-heads 3"), "{e}");
    // a forward stage size that splits backward stages names the valid ones
    let plan = CpPlan::new(Strategy::Upipe, &d, 1 << 20, 2, 1, Some(4)).unwrap();
    let e = plan
        .clone()
        .with_fwd_chunk(Some(2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--fwd-chunk-heads 2") && e.contains("[4, 8, 16, 32]"),
        "{e}"
    );
    let ulysses = CpPlan::new(Strategy::Ulysses, &d, 1 << 20, 2, 1, None).unwrap();
    let e = ulysses.with_fwd_chunk(Some(32)).unwrap_err().to_string();
    assert!(e.contains("upipe only"), "{e}");
    assert_eq!(plan.with_fwd_chunk(Some(8)).unwrap().chunk_text(), "4f8");
}

#[test]
fn auto_forward_stages_are_the_widest_that_keep_the_peak() {
    let d = attn_dims(&ModelConfig::resolve("llama3-8b").unwrap());
    let plan = CpPlan::new(Strategy::Upipe, &d, 131072, 2, 1, Some(2)).unwrap();
    let trial = |p: &CpPlan| Ok(predict_attention_trial(p, &d, DeviceKind::CUDA, 2)?.peak);
    // the layer's peak is in the backward: a forward of all heads at once
    // (as Ulysses runs it) is free
    let wide = widest_free_forward(plan.clone(), trial).unwrap();
    assert_eq!(wide.fwd_schedule.chunk, 32);
    assert_eq!(trial(&wide).unwrap(), trial(&plan).unwrap());
    // a peak that grows with the forward's width keeps the backward's stages
    let grows = |p: &CpPlan| Ok(p.fwd_schedule.chunk);
    assert_eq!(widest_free_forward(plan.clone(), grows).unwrap(), plan);
    // and one that is free up to 4 heads stops there
    let up_to_4 = |p: &CpPlan| Ok(usize::from(p.fwd_schedule.chunk > 4));
    let four = widest_free_forward(plan, up_to_4).unwrap();
    assert_eq!(four.fwd_schedule.chunk, 4);
    // other strategies have no stages to widen
    let uly = CpPlan::new(Strategy::Ulysses, &d, 131072, 2, 1, None).unwrap();
    assert_eq!(widest_free_forward(uly.clone(), grows).unwrap(), uly);
}

/// The CUDA predictions against what the 2×H200 ledger measured for the
/// Llama3-8B attention layer (hidden 4096, H 32, Hkv 8, d 128, Pu 2, 256K
/// tokens, bf16, cuDNN 9.14; `bench attn --device cuda`, 2026-11-30,
/// RESULTS.md). With cuDNN the plan counts its gradient scratch, dQ
/// accumulator, softmax sums and cuDNN's plan workspace as measured there
/// (`estimated_bwd_plan_workspace`: 2 GiB for Ulysses' GQA calls, none for
/// UPipe's one-head calls).
#[test]
fn cuda_predictions_against_the_h200_ledger() {
    let d = AttnDims {
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        qk_norm: false,
        norm: upipe::backend::RmsNorm::plain(1e-5),
        rope: RopeConfig {
            theta: 500000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(128),
        precision: upipe::backend::fp8::Precision::Bf16,
    };
    let seq = 262144;
    let ulysses = CpPlan::new(Strategy::Ulysses, &d, seq, 2, 1, None).unwrap();
    let plain = CpPlan::new(Strategy::Upipe, &d, seq, 2, 1, Some(2))
        .unwrap()
        .with_settle(Settle::Stages(1));
    let upipe = plain.clone().with_overlap(true);
    // measured by `bench attn --device cuda` (a warm-up and a timed pass, or more)
    let passes = 2;
    let peak = |plan: &CpPlan, device| {
        predict_attention_trial(plan, &d, device, passes)
            .unwrap()
            .peak
    };
    // measured 2026-11-30 on 2×H200 (gradients a single attention call makes
    // whole are overwritten in bf16; Ulysses' peak is now its second pass's
    // forward, beside the cuDNN workspace its first backward grew)
    let (uly_measured, up_measured) = (17_632_854_272usize, 7_550_796_032usize);
    let plain_measured = 6_745_489_664usize;
    // our own kernels' model (no GPU run behind these: a change detector)
    assert_eq!(peak(&ulysses, DeviceKind::CudaNative), 13_857_980_416);
    assert_eq!(peak(&upipe, DeviceKind::CudaNative), 7_349_469_184);
    let up = peak(&upipe, DeviceKind::CUDA);
    assert!(rel(up, up_measured) < 1e-6, "UPipe: {up} vs {up_measured}");
    let pl = peak(&plain, DeviceKind::CUDA);
    assert!(
        rel(pl, plain_measured) < 1e-6,
        "UPipe without overlap: {pl} vs {plain_measured}"
    );
    let uly = peak(&ulysses, DeviceKind::CUDA);
    assert!(
        rel(uly, uly_measured) < 1e-6,
        "Ulysses: {uly} vs {uly_measured}"
    );
    // one H200 (Pu 1, so the staged engine's compute alone): UPipe U=1
    // settling per stage and per phase, and U=H (measured 2026-11-30 on 1×H200)
    for (seq, u, settle, measured) in [
        (65536, 32, Settle::Stages(1), 7_851_737_344usize),
        (65536, 1, Settle::Stages(1), 3_246_653_696),
        (65536, 1, Settle::Phase, 3_296_985_344),
        (131072, 1, Settle::Stages(1), 6_208_094_464),
        (131072, 1, Settle::Phase, 6_308_757_760),
    ] {
        let plan = CpPlan::new(Strategy::Upipe, &d, seq, 1, 1, Some(u))
            .unwrap()
            .with_settle(settle);
        let got = peak(&plan, DeviceKind::CUDA);
        eprintln!("one GPU seq {seq} U={u} settle every {settle}: {got} vs {measured}");
        assert!(
            rel(got, measured) < 1e-6,
            "seq {seq} U={u} {settle}: {got} vs {measured}"
        );
    }
    // 2×H200 (Pu 2, U 2), every settling (measured 2026-11-30)
    for (seq, settle, measured) in [
        (131072, Settle::Stages(1), 3_515_351_296usize),
        (131072, Settle::Stages(2), 3_582_460_160),
        (131072, Settle::Phase, 3_716_677_888),
        (262144, Settle::Stages(1), 6_745_489_664),
        (262144, Settle::Stages(2), 6_879_707_392),
        (262144, Settle::Phase, 7_148_142_848),
    ] {
        let plan = CpPlan::new(Strategy::Upipe, &d, seq, 2, 1, Some(2))
            .unwrap()
            .with_settle(settle);
        let got = peak(&plan, DeviceKind::CUDA);
        assert!(
            rel(got, measured) < 1e-6,
            "2 GPUs seq {seq} settle every {settle}: {got} vs {measured}"
        );
    }
    // tests/integration/gpu_plan.rs's local layer (hidden 512, H 8, Hkv 2, d 64, 1536
    // tokens) on cuDNN measured 61,571,328 B (one H200, the same day)
    let d = AttnDims {
        hidden: 512,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        rope: RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(64),
        precision: upipe::backend::fp8::Precision::Bf16,
        ..d
    };
    let local = CpPlan::new(Strategy::Local, &d, 1536, 1, 1, None).unwrap();
    let got = predict_attention_trial(&local, &d, DeviceKind::CUDA, 1)
        .unwrap()
        .peak;
    assert_eq!(
        predict_attention_trial(&local, &d, DeviceKind::CudaNative, 1)
            .unwrap()
            .peak,
        52_920_320
    );
    assert!(rel(got, 61_571_328) < 1e-5, "local d64: {got} vs 61571328");
}

/// Segment checkpointing (`--checkpoint-every`) on every strategy, with
/// offloaded inputs and kept attention, replicated and FSDP: the planner's
/// prediction equals the CPU ledger to the byte, and keeps less than one
/// checkpoint per block.
#[test]
fn training_step_prediction_equals_ledger_peak_under_segments() {
    let mut rng = Rng::new(4);
    let tokens: Arc<[u32]> = (0..4096).map(|_| rng.below(256) as u32).collect();
    let mut model = tiny(true);
    model.layers = 6;
    model.validate().unwrap();
    for (s, pu, pr, u) in [
        (Strategy::Upipe, 2, 2, Some(2)),
        (Strategy::Ulysses, 4, 1, None),
        (Strategy::Ring, 1, 4, None),
        (Strategy::Usp, 2, 2, None),
        (Strategy::Local, 1, 1, None),
    ] {
        for (offload, save_attention, fsdp) in [(0, 0, false), (6, 2, true), (2, 6, false)] {
            let at = |k: usize| {
                let policy = MemoryPolicy {
                    checkpoint: true,
                    offload,
                    save_attention,
                    checkpoint_every: k,
                    ..MemoryPolicy::default()
                };
                let mut cfg = train_cfg(&model, s, pu, pr, u, 256, policy);
                cfg.fsdp = fsdp;
                let plan = cfg.plan().unwrap();
                let measured = train_cpu(&cfg, tokens.clone(), &|_| {}).unwrap().memory;
                let pred = predict_step(&StepSpec::of_run(&cfg, &plan, DeviceKind::Cpu)).unwrap();
                let what = format!("{s} {pu}x{pr} fsdp={fsdp} {policy:?}");
                assert_eq!(pred.peak, measured.peak, "{what}: device peak");
                assert_eq!(pred.host_peak, measured.host_peak, "{what}: host peak");
                pred
            };
            let one = at(1);
            for k in [2, 4] {
                let seg = at(k);
                assert!(
                    seg.peak + seg.host_peak < one.peak + one.host_peak,
                    "{s}: segments of {k} keep less"
                );
            }
        }
    }
}
