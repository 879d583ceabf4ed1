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
use upipe::model::lora_params::{adapters_to_host, attach_adapter_grads, attach_adapters};
use upipe::model::{Freeze, GradSpec, ModelConfig, ModelGrads, ModelWeights, Param, Unit};

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
    let mut w = ModelWeights::random(&dev, &cfg, 1).unwrap();
    let base_bytes = dev.ledger().current_of(Category::Weights);
    attach_adapters(&dev, &mut w, &host, DType::F32).unwrap();
    let weights_bytes = dev.ledger().current_of(Category::Weights) - base_bytes;
    assert_eq!(weights_bytes, config.param_count(&cfg) * 4);
    assert_eq!(adapters_to_host(&dev, &w, &config).unwrap(), host);
    let pair = w.blocks[0].attn.lora.k.as_ref().unwrap();
    assert_eq!(pair.scale, 2.0);
    assert_eq!(pair.dims(), (2, cfg.hidden, cfg.kv_heads * cfg.head_dim));
    // every adapter factor is named as PEFT names it, after its block's weights
    let names: Vec<String> = w
        .unit_named(Unit::Block(1))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let q_a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";
    let base = cfg.family.block_params().len();
    assert_eq!(names[base], q_a, "{names:?}");
    assert_eq!(names.len(), base + 2 * LoraTarget::ALL.len());
    let mut g = ModelGrads::zeros(&dev, &cfg, GradSpec::f32(&Freeze::whole_base())).unwrap();
    let before = dev.ledger().current_of(Category::Grads);
    attach_adapter_grads(&dev, &w, &mut g).unwrap();
    let grad_bytes = dev.ledger().current_of(Category::Grads) - before;
    assert_eq!(grad_bytes, config.bytes_per_block(&cfg, 4) * cfg.layers);
    // a frozen base has no gradient: only the adapters' are held
    assert_eq!(g.named().len(), cfg.layers * 2 * LoraTarget::ALL.len());
    let dq = g.blocks[0].attn.lora.q.as_ref().unwrap();
    assert_eq!(dq.da.dtype(), DType::F32);
    assert!(dev.to_host(&dq.db).unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn the_lora_freeze_leaves_no_base_parameter_trainable() {
    for name in ["tiny", "qwen2.5-0.5b-instruct"] {
        let cfg = ModelConfig::resolve(name).unwrap();
        let freeze = Freeze::whole_base();
        for (p, _) in cfg.params() {
            assert!(freeze.is_frozen(&cfg, p), "{name}: {p:?} trains");
        }
        let (frozen, all) = freeze.frozen_elements(&cfg);
        assert_eq!(frozen, all, "{name}");
        assert!(freeze.is_frozen(&cfg, Param::Embed));
        // on its own (no adapters) nothing would train: check refuses it
        assert!(freeze.check(&cfg).is_err());
        // with adapters training, it is what the run means
        freeze.check_with_adapters(&cfg, true).unwrap();
        let beyond = upipe::model::Freeze::parse("blocks:99").unwrap();
        assert!(beyond.check_with_adapters(&cfg, true).is_err());
    }
}

use upipe::attention::lora_delta::{DeltaPart, lora_delta_bwd_part, lora_delta_fwd_part};
use upipe::model::lora_math::{HeadSlice, head_slice, lora_backward_heads, lora_forward_heads};

/// `m[rows, cols]` of a row-major `m` with `ld` columns.
fn block(
    m: &[f32],
    ld: usize,
    rows: std::ops::Range<usize>,
    cols: &std::ops::Range<usize>,
) -> Vec<f32> {
    rows.flat_map(|i| m[i * ld + cols.start..i * ld + cols.end].to_vec())
        .collect()
}

#[test]
fn a_head_range_part_equals_the_host_head_slice() {
    let dev = CpuBackend::new();
    let mut rng = Rng::new(13);
    let f = factors(&mut rng); // r 3, in 8, out 6
    let (s, r, scale) = (4, 3, 0.5f32);
    let shapes = [[3, 8], [6, 3]];
    let pair = LoraPair::upload(&dev, &f.a, &f.b, shapes, DType::F32, scale).unwrap();
    // head_dim 2: q heads 1..2 own B rows 2..4; o_proj heads 1..3 own A columns 2..6
    let slices = [
        head_slice(LoraTarget::Q, 2, 1..2).unwrap(),
        head_slice(LoraTarget::O, 2, 1..3).unwrap(),
    ];
    for slice in slices {
        let part = match &slice {
            HeadSlice::BRows(rows) => DeltaPart {
                cols: 0..8,
                rows: rows.clone(),
            },
            HeadSlice::AColumns(cols) => DeltaPart {
                cols: cols.clone(),
                rows: 0..6,
            },
        };
        let (k, n) = (part.cols.len(), part.rows.len());
        let x_h = random(s * k, &mut rng);
        let dy_h = random(s * n, &mut rng);
        let x = dev
            .from_host(&x_h, &[s, k], DType::F32, Category::Activations)
            .unwrap();
        let mut y = dev
            .zeros(&[s, n], DType::F32, Category::Activations)
            .unwrap();
        lora_delta_fwd_part(&dev, &pair, &part, &x, &mut y).unwrap();
        let want = lora_forward_heads(&x_h, &f, scale, &slice);
        assert_close(&dev.to_host(&y).unwrap(), &want, &format!("{slice:?} y"));

        let dy = dev
            .from_host(&dy_h, &[s, n], DType::F32, Category::Grads)
            .unwrap();
        let mut dx = dev.zeros(&[s, k], DType::F32, Category::Grads).unwrap();
        let mut grads = LoraPairGrads::zeros(&dev, &pair).unwrap();
        lora_delta_bwd_part(&dev, &pair, &part, &x, &dy, &mut grads, &mut dx).unwrap();
        let want = lora_backward_heads(&x_h, &dy_h, &f, scale, &slice);
        let da = dev.to_host(&grads.da).unwrap();
        let db = dev.to_host(&grads.db).unwrap();
        assert_close(
            &block(&da, 8, 0..r, &part.cols),
            &want.da,
            &format!("{slice:?} dA"),
        );
        assert_close(
            &block(&db, r, part.rows.clone(), &(0..r)),
            &want.db,
            &format!("{slice:?} dB"),
        );
        assert_close(
            &dev.to_host(&dx).unwrap(),
            &want.dx,
            &format!("{slice:?} dx"),
        );
        // nothing outside the part is written
        let outside = (0..r * 8).filter(|i| !part.cols.contains(&(i % 8)));
        assert!(
            outside.clone().all(|i| da[i] == 0.0),
            "{slice:?}: dA outside"
        );
        let outside = (0..6 * r).filter(|i| !part.rows.contains(&(i / r)));
        assert!(
            outside.clone().all(|i| db[i] == 0.0),
            "{slice:?}: dB outside"
        );
    }
}

#[test]
fn a_part_outside_the_adapter_is_an_error() {
    let dev = CpuBackend::new();
    let shapes = [[2, 4], [6, 2]];
    let pair = LoraPair::upload(&dev, &[0.0; 8], &[0.0; 12], shapes, DType::F32, 1.0).unwrap();
    let part = DeltaPart {
        cols: 0..4,
        rows: 4..8,
    };
    let x = dev
        .zeros(&[2, 4], DType::F32, Category::Activations)
        .unwrap();
    let mut y = dev
        .zeros(&[2, 4], DType::F32, Category::Activations)
        .unwrap();
    let err = lora_delta_fwd_part(&dev, &pair, &part, &x, &mut y).unwrap_err();
    assert!(err.to_string().contains("rows 4..8"), "{err}");
}

/// `upipe train` of the tiny model on the CPU with `extra`: its status,
/// stdout and stderr.
fn train_cli(extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "train", "--json", "--device", "cpu", "--seq", "64", "--attn", "local",
    ];
    if !extra.contains(&"--steps") {
        args.extend(["--steps", "2"]);
    }
    args.extend(extra);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(&args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// A failure before any step ran, its message holding every one of `parts`.
fn refused_before_training(extra: &[&str], parts: &[&str]) {
    let (ok, stdout, stderr) = train_cli(extra);
    assert!(!ok, "{extra:?} ran: {stdout}");
    assert!(
        !stdout.contains("\"loss\""),
        "{extra:?} trained first: {stdout}"
    );
    for p in parts {
        assert!(stderr.contains(p), "{extra:?}: '{stderr}' lacks '{p}'");
    }
}

/// LoRA flags that would be ignored are errors before anything runs,
/// naming the fix; a `--resume` of a LoRA checkpoint without LoRA flags
/// continues its adapters and says so.
#[test]
fn lora_flags_that_would_be_ignored_are_refused_before_training() {
    let dir = std::env::temp_dir().join(format!("upipe-lora-flags-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ckpt = dir.join("ckpt");
    let (c, merged) = (ckpt.to_str().unwrap(), dir.join("merged"));
    refused_before_training(
        &["--lora-alpha", "32", "--lora-targets", "q_proj,v_proj"],
        &[
            "--lora-alpha, --lora-targets",
            "--lora-rank",
            "full fine-tune",
        ],
    );
    refused_before_training(
        &["--lora-rank", "4", "--merge-lora", c, "--save-dir", c],
        &["is the --save-dir"],
    );
    refused_before_training(
        &[
            "--lora-rank",
            "4",
            "--lora-targets",
            "none",
            "--merge-lora",
            merged.to_str().unwrap(),
            "--save-dir",
            c,
        ],
        &["--lora-targets none adapts nothing", "--merge-lora"],
    );
    let (ok, _, e) = train_cli(&["--lora-rank", "4", "--lora-alpha", "8", "--save-dir", c]);
    assert!(ok, "{e}");
    refused_before_training(
        &["--lora-from", c, "--lora-alpha", "3", "--lora-rslora"],
        &[
            "--lora-alpha 3 (the adapter's 8)",
            "--lora-rslora",
            "leave them out",
        ],
    );
    let (ok, stdout, e) = train_cli(&["--steps", "3", "--save-dir", c, "--resume"]);
    assert!(ok, "{e}");
    assert!(
        e.contains("holds LoRA adapters") && e.contains("r 4, alpha 8"),
        "{e}"
    );
    assert_eq!(
        stdout.matches("\"loss\"").count(),
        1,
        "step 3 only: {stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
