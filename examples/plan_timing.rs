//! Times the memory planner's two paths on one long step: the hand-written
//! walk (`plan::predict_step`) and the engine's own step on a counting
//! backend (`plan::engine::engine_step`), and checks they agree.
//!
//! `plan_timing [model] [gpus] [seq] [policies]` (defaults: llama3-8b, 8,
//! 1048576, checkpoint,offload,tiled-mlp,fsdp) plans UPipe and Ulysses on
//! CUDA (bf16, cuDNN where it applies), as `upipe plan --seq` does, then
//! times the longest-context search (`plan::longest_context` over 80 GiB
//! less the 1 GiB reserve, stages of 8192 tokens, up to 2^28) by each path.

use std::time::Instant;
use upipe::attention::Strategy;
use upipe::model::decoder::attn_dims;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::plan::engine::engine_step;
use upipe::plan::{
    Budget, DeviceKind, GPU_RESERVE_BYTES, Prediction, StepSpec, longest_context, predict_step,
    resolve_plan,
};

fn main() -> upipe::error::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let model = ModelConfig::resolve(&arg(0, "llama3-8b"))?;
    let gpus: usize = arg(1, "8").parse().expect("gpus");
    let seq: usize = arg(2, "1048576").parse().expect("seq");
    let policies = arg(3, "checkpoint,offload,tiled-mlp,fsdp");
    let has = |p: &str| policies.split(',').any(|x| x == p);
    let policy = MemoryPolicy {
        checkpoint: has("checkpoint"),
        offload: if has("offload") { model.layers } else { 0 },
        tiled_mlp: has("tiled-mlp"),
        ..MemoryPolicy::default()
    };
    let d = attn_dims(&model);
    for strategy in [Strategy::Upipe, Strategy::Ulysses] {
        let spec_at = |seq: usize| -> upipe::error::Result<StepSpec> {
            let (plan, data) = resolve_plan(strategy, &d, seq, gpus, None, None, None)?;
            Ok(StepSpec {
                model: model.clone(),
                plan,
                data,
                policy,
                fsdp: has("fsdp"),
                fsdp_replicas: 1,
                grad_accum: 1,
                device: DeviceKind::CUDA,
                optimizer: true,
                freeze: Default::default(),
                lora: None,
            })
        };
        let budget = Budget {
            device: (80 << 30) - GPU_RESERVE_BYTES,
            host: None,
        };
        let search = |predict: &dyn Fn(&StepSpec) -> upipe::error::Result<Prediction>| {
            let t = Instant::now();
            let fit = longest_context(8192, 1 << 28, budget, |s| predict(&spec_at(s)?));
            (fit.map(|f| f.seq), t.elapsed().as_secs_f64())
        };
        let (walk_fit, walk_s) = search(&predict_step);
        let (engine_fit, engine_s) = search(&engine_step);
        println!(
            "{strategy} longest context: walk {:?} in {walk_s:.2} s, engine {:?} in {engine_s:.2} s",
            walk_fit.ok(),
            engine_fit.ok()
        );
        let (plan, data) = resolve_plan(strategy, &d, seq, gpus, None, None, None)?;
        let spec = StepSpec {
            model: model.clone(),
            plan,
            data,
            policy,
            fsdp: has("fsdp"),
            fsdp_replicas: 1,
            grad_accum: 1,
            device: DeviceKind::CUDA,
            optimizer: true,
            freeze: Default::default(),
            lora: None,
        };
        let t = Instant::now();
        let walk = predict_step(&spec)?;
        let walk_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let engine = engine_step(&spec)?;
        let engine_s = t.elapsed().as_secs_f64();
        let same = walk.peak == engine.peak && walk.host_peak == engine.host_peak;
        println!(
            "{strategy} {gpus} GPUs seq {seq}: walk {walk_s:.3} s, engine {engine_s:.3} s; peak {} / {} bytes ({})",
            walk.peak,
            engine.peak,
            if same { "equal" } else { "DIFFERENT" }
        );
    }
    Ok(())
}
