//! `--grad-accum N`: N sequences per optimizer step. The step's loss and
//! gradient equal one pass over the same N sequences (mean over their
//! tokens), with FSDP and without, and the planner predicts it exactly.

use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::backend::cpu::CpuBackend;
use upipe::data::SequenceSampler;
use upipe::model::{MemoryPolicy, ModelConfig, ModelWeights};
use upipe::optim::AdamWConfig;
use upipe::plan::{DeviceKind, StepSpec, predict_step_rank};
use upipe::rng::Rng;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu, train_cpu};

fn model() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.heads = 8;
    c.kv_heads = 2;
    c.head_dim = 8;
    c.hidden = 32;
    c.ffn = 48;
    c.layers = 2;
    c.validate().unwrap();
    c
}

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(3);
    (0..4096)
        .map(|_| rng.below(vocab as u64) as u32)
        .collect::<Vec<_>>()
        .into()
}

fn cfg(m: &ModelConfig, accum: usize, fsdp: bool, steps: u32) -> TrainConfig {
    TrainConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        ring: 1,
        seed: 4,
        fsdp,
        grad_accum: accum,
        ..TrainConfig::new(
            m.clone(),
            32,
            steps,
            AdamWConfig::schedule(3e-3, 3e-4, 1, steps),
        )
    }
}

#[test]
fn accumulated_step_equals_one_pass_over_its_sequences() {
    let m = model();
    let run = train_cpu(&cfg(&m, 3, false, 2), tokens(m.vocab), &|_| {}).unwrap();
    assert_eq!(run.reports[0].tokens, 3 * 32);
    // the step's three windows, and each one's loss and gradients at the initial weights
    let mut sampler = SequenceSampler::sharded(tokens(m.vocab), 32, 4, 0, 1).unwrap();
    let plan = cfg(&m, 3, false, 2).plan().unwrap();
    let init = |b: &CpuBackend| ModelWeights::random(b, &m, 4);
    let (mut loss, mut sum): (f64, Vec<f64>) = (0.0, Vec::new());
    for _ in 0..3 {
        let w = sampler.next_window();
        let (l, g) = loss_and_grads_cpu(
            &m,
            &plan,
            MemoryPolicy::default(),
            w.inputs(),
            w.targets(),
            &init,
        )
        .unwrap();
        loss += l / 3.0;
        let flat: Vec<f64> = g.values().flatten().map(|&x| x as f64 / 3.0).collect();
        if sum.is_empty() {
            sum = flat;
        } else {
            sum.iter_mut().zip(flat).for_each(|(a, b)| *a += b);
        }
    }
    let norm = sum.iter().map(|x| x * x).sum::<f64>().sqrt();
    let r = &run.reports[0];
    assert!(
        ((r.loss - loss) / loss).abs() <= 1e-6,
        "loss {} vs {loss}",
        r.loss
    );
    assert!(
        ((r.grad_norm - norm) / norm).abs() <= 1e-5,
        "grad norm {} vs {norm}",
        r.grad_norm
    );
    // FSDP accumulates into its shards: the same steps
    let sharded = train_cpu(&cfg(&m, 3, true, 2), tokens(m.vocab), &|_| {}).unwrap();
    for (a, b) in sharded.reports.iter().zip(&run.reports) {
        assert!(
            ((a.loss - b.loss) / b.loss).abs() <= 1e-6,
            "step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        assert!(
            ((a.grad_norm - b.grad_norm) / b.grad_norm).abs() <= 1e-6,
            "step {}",
            a.step
        );
    }
    let e = train_cpu(&cfg(&m, 0, false, 1), tokens(m.vocab), &|_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("--grad-accum"), "{e}");
}

#[test]
fn planner_predicts_accumulated_steps_exactly() {
    let m = model();
    for fsdp in [false, true] {
        let c = cfg(&m, 2, fsdp, 1);
        let measured = train_cpu(&c, tokens(m.vocab), &|_| {}).unwrap().memory;
        let pred = predict_step_rank(
            &StepSpec {
                model: m.clone(),
                plan: c.plan().unwrap(),
                data: 1,
                policy: c.policy,
                fsdp,
                fsdp_replicas: 1,
                grad_accum: 2,
                device: DeviceKind::Cpu,
                optimizer: true,
                state: Default::default(),
                precision: Default::default(),
                freeze: Default::default(),
                lora: None,
            },
            0,
        )
        .unwrap();
        assert_eq!(pred.peak, measured.peak, "fsdp {fsdp}");
    }
}
