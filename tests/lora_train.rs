//! LoRA adapters in training, on the CPU reference backend: the device
//! adapter delta (`attention/lora_delta.rs`: forward, backward, gradient
//! accumulation) against the host reference `model/lora_math.rs`.

use upipe::attention::lora_delta::{LoraPair, LoraPairGrads, lora_delta_bwd, lora_delta_fwd};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::{Backend, Category, DType};
use upipe::model::lora::{LoraDims, LoraFactors, LoraTarget};
use upipe::model::lora_math::{lora_backward, lora_forward};
use upipe::rng::Rng;

fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// A random adapter (B non-zero, so every gradient path is exercised).
fn factors(rng: &mut Rng) -> LoraFactors {
    let dims = LoraDims {
        rank: 3,
        in_features: 8,
        out_features: 6,
    };
    let mut f = LoraFactors::init(dims, 7, 0, LoraTarget::Q);
    f.b = random(dims.out_features * dims.rank, rng);
    f
}

#[test]
fn device_delta_equals_host_reference() {
    let dev = CpuBackend::new();
    let mut rng = Rng::new(11);
    let f = factors(&mut rng);
    let (s, scale) = (5, 2.0f32);
    let x_h = random(s * 8, &mut rng);
    let y0 = random(s * 6, &mut rng);
    let dy_h = random(s * 6, &mut rng);
    let dx0 = random(s * 8, &mut rng);
    let shapes = [[3, 8], [6, 3]];
    let pair = LoraPair::upload(&dev, &f.a, &f.b, shapes, DType::F32, scale).unwrap();
    let x = dev
        .from_host(&x_h, &[s, 8], DType::F32, Category::Activations)
        .unwrap();
    let mut y = dev
        .from_host(&y0, &[s, 6], DType::F32, Category::Activations)
        .unwrap();
    lora_delta_fwd(&dev, &pair, &x, &mut y).unwrap();
    let delta = lora_forward(&x_h, &f, scale);
    let want: Vec<f32> = y0.iter().zip(&delta).map(|(a, b)| a + b).collect();
    assert_close(&dev.to_host(&y).unwrap(), &want, "y");

    let dy = dev
        .from_host(&dy_h, &[s, 6], DType::F32, Category::Grads)
        .unwrap();
    let mut dx = dev
        .from_host(&dx0, &[s, 8], DType::F32, Category::Grads)
        .unwrap();
    let mut grads = LoraPairGrads::zeros(&dev, &pair).unwrap();
    // twice: the gradients accumulate like every weight gradient of a step
    for _ in 0..2 {
        lora_delta_bwd(&dev, &pair, &x, &dy, &mut grads, &mut dx).unwrap();
    }
    let r = lora_backward(&x_h, &dy_h, &f, scale);
    let twice = |v: &[f32]| v.iter().map(|a| 2.0 * a).collect::<Vec<f32>>();
    assert_close(&dev.to_host(&grads.da).unwrap(), &twice(&r.da), "dA");
    assert_close(&dev.to_host(&grads.db).unwrap(), &twice(&r.db), "dB");
    let want_dx: Vec<f32> = dx0.iter().zip(&r.dx).map(|(a, b)| a + 2.0 * b).collect();
    assert_close(&dev.to_host(&dx).unwrap(), &want_dx, "dx");
}

#[test]
fn mismatched_shapes_are_an_error() {
    let dev = CpuBackend::new();
    let shapes = [[2, 4], [3, 2]];
    let pair = LoraPair::upload(&dev, &[0.0; 8], &[0.0; 6], shapes, DType::F32, 1.0).unwrap();
    let x = dev
        .zeros(&[2, 5], DType::F32, Category::Activations)
        .unwrap();
    let mut y = dev
        .zeros(&[2, 3], DType::F32, Category::Activations)
        .unwrap();
    let err = lora_delta_fwd(&dev, &pair, &x, &mut y).unwrap_err();
    assert!(err.to_string().contains("LoRA delta"), "{err}");
}

use upipe::model::lora::{LoraConfig, LoraWeights};
use upipe::model::lora_params::{lora_base_freeze, upload_adapters};
use upipe::model::{ModelConfig, Param};

fn tiny() -> ModelConfig {
    ModelConfig::resolve("tiny").unwrap()
}

#[test]
fn adapters_upload_round_trip_and_their_gradients_are_f32_zeros() {
    let cfg = tiny();
    let config = LoraConfig::new(2, 4.0, false, LoraTarget::ALL.to_vec()).unwrap();
    let mut host = LoraWeights::init(&cfg, &config, 5).unwrap();
    let mut rng = Rng::new(3);
    for f in host.layers.iter_mut().flatten() {
        f.b = random(f.b.len(), &mut rng);
    }
    let dev = CpuBackend::new();
    let blocks = upload_adapters(&dev, &cfg, &host, DType::F32).unwrap();
    assert_eq!(blocks.len(), cfg.layers);
    let weights_bytes = dev.ledger().current_of(Category::Weights);
    assert_eq!(weights_bytes, config.param_count(&cfg) * 4);
    for (l, block) in blocks.iter().enumerate() {
        assert_eq!(block.to_host(&dev).unwrap(), host.layers[l], "block {l}");
        let pair = block.get(LoraTarget::K).unwrap();
        assert_eq!(pair.scale, 2.0);
        assert_eq!(pair.dims(), (2, cfg.hidden, cfg.kv_heads * cfg.head_dim));
    }
    let mut grads = blocks[0].zero_grads(&dev).unwrap();
    let grad_bytes = dev.ledger().current_of(Category::Grads);
    assert_eq!(grad_bytes, config.bytes_per_block(&cfg, 4));
    let dq = grads.get_mut(LoraTarget::Q).unwrap();
    assert_eq!(dq.da.dtype(), DType::F32);
    assert!(dev.to_host(&dq.db).unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn the_lora_freeze_leaves_no_base_parameter_trainable() {
    for name in ["tiny", "qwen2.5-0.5b-instruct"] {
        let cfg = ModelConfig::resolve(name).unwrap();
        let freeze = lora_base_freeze();
        for (p, _) in cfg.params() {
            assert!(freeze.is_frozen(&cfg, p), "{name}: {p:?} trains");
        }
        let (frozen, all) = freeze.frozen_elements(&cfg);
        assert_eq!(frozen, all, "{name}");
        assert!(freeze.is_frozen(&cfg, Param::Embed));
        // on its own (no adapters) nothing would train: check refuses it
        assert!(freeze.check(&cfg).is_err());
    }
}
