//! LoRA adapters in a training step, on the CPU reference backend: the
//! adapted model's loss is the merged model's and its adapter gradients
//! follow from the merged weights' gradients exactly (`dB = s·G·Aᵀ`,
//! `dA = s·Bᵀ·G`); every strategy equals `local`; a new adapter (B = 0)
//! leaves the first loss bit-identical; training moves the adapters only,
//! saves a PEFT adapter directory and resumes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use upipe::attention::Strategy;
use upipe::checkpoint::peft::read_adapter;
use upipe::data::PackedWindow;
use upipe::model::lora::{Factor, LoraConfig, LoraTarget, LoraWeights, tensor_name};
use upipe::model::lora_params::attach_adapters;
use upipe::model::{Freeze, MemoryPolicy, ModelConfig, ModelWeights, Param, RandomInit};
use upipe::optim::AdamWConfig;
use upipe::rng::Rng;
use upipe::train::lora_run::LoraRun;
use upipe::train::trainer::{TrainConfig, loss_and_grads_cpu_frozen, train_cpu};

use crate::common;
use common::{LossGrads, assert_loss_grads_close, tiny, tiny_qwen2};

/// (strategy, Pu, Pr)
type Mesh = (Strategy, usize, usize);

fn lora_config(targets: &[LoraTarget]) -> LoraConfig {
    LoraConfig::new(2, 3.0, false, targets.to_vec()).unwrap()
}

/// An adapter with every factor random (B too, so every path is exercised).
fn random_adapter(m: &ModelConfig, config: &LoraConfig) -> LoraWeights {
    let mut w = LoraWeights::init(m, config, 9).unwrap();
    let mut rng = Rng::new(4);
    for f in w.layers.iter_mut().flatten() {
        for v in f.a.iter_mut().chain(f.b.iter_mut()) {
            *v = (rng.normal() * 0.3) as f32;
        }
    }
    w
}

fn run_config(m: &ModelConfig, mesh: Mesh, lora: Option<&LoraConfig>) -> TrainConfig {
    let (strategy, ulysses, ring) = mesh;
    TrainConfig {
        strategy,
        ulysses,
        ring,
        seed: 5,
        freeze: match lora {
            Some(_) => Freeze::whole_base(),
            None => Freeze::none(),
        },
        lora: lora.map(|c| LoraRun {
            config: c.clone(),
            from: None,
        }),
        ..TrainConfig::new(m.clone(), 32, 3, AdamWConfig::schedule(3e-3, 3e-4, 1, 3))
    }
}

/// A LoRA checkpoint in `dir` holds PEFT's adapter (naming `base`), its
/// optimizer state and `state.json`, and no base weights nor config.json.
fn assert_adapter_only(dir: &std::path::Path, base: &str, what: &str) {
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ] {
        assert!(dir.join(f).is_file(), "{what}: no {f}");
    }
    for f in [
        "model.safetensors",
        "model.safetensors.index.json",
        "config.json",
    ] {
        assert!(
            !dir.join(f).exists(),
            "{what}: {f} saved beside the adapter"
        );
    }
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["base_model_name_or_path"], base, "{what}");
}

fn window(m: &ModelConfig) -> PackedWindow {
    let mut rng = Rng::new(3);
    let ids: Vec<u32> = (0..33).map(|_| rng.below(m.vocab as u64) as u32).collect();
    PackedWindow::stream(ids[..32].to_vec(), ids[1..].to_vec())
}

/// Loss and gradients of the base model (seed 7) with `adapter`, on `mesh`.
fn adapted(m: &ModelConfig, mesh: Mesh, adapter: &LoraWeights) -> LossGrads {
    let cfg = run_config(m, mesh, Some(&adapter.config));
    let plan = cfg.plan().unwrap();
    let weights = |b: &_| {
        let mut w = ModelWeights::random(b, m, 7)?;
        attach_adapters(b, &mut w, adapter, upipe::backend::DType::F32)?;
        Ok(w)
    };
    let policy = MemoryPolicy::default();
    let frozen = Freeze::whole_base();
    loss_and_grads_cpu_frozen(m, &plan, policy, &window(m), &weights, &frozen).unwrap()
}

/// `W + s·B·A` of every adapted weight; the rest as seed 7 draws it.
fn merged_weights(m: &ModelConfig, adapter: &LoraWeights) -> BTreeMap<String, Vec<f32>> {
    let init = RandomInit::new(m, 7);
    let s = adapter.config.scale();
    let mut out = BTreeMap::new();
    for (p, shape) in m.params() {
        let name = m.hf_name(p);
        let mut w = init.values(&name, 0..shape.iter().product());
        if let Param::Block(l, bp) = p
            && let Some(t) = LoraTarget::ALL.into_iter().find(|t| t.base_param() == bp)
            && let Some(f) = adapter.get(l, t)
        {
            let (r, n_in, n_out) = (f.dims.rank, f.dims.in_features, f.dims.out_features);
            for o in 0..n_out {
                for i in 0..n_in {
                    let ba: f64 = (0..r)
                        .map(|k| f.b[o * r + k] as f64 * f.a[k * n_in + i] as f64)
                        .sum();
                    w[o * n_in + i] += (s as f64 * ba) as f32;
                }
            }
        }
        out.insert(name, w);
    }
    out
}

/// `rel_err` over a vector, as the strategy tests measure it.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
    upipe::attention::trial::rel_err(got, &want32)
}

/// The adapted model is the merged model: the same loss, and with `G` the
/// merged weight's gradient, `dB = s·G·Aᵀ` and `dA = s·Bᵀ·G` (f64
/// products; to 5e-5: the merged weights are rounded to f32), for Llama,
/// Qwen3 (QK-norm) and Qwen2 (biases, tied head).
#[test]
fn adapter_gradients_follow_from_the_merged_models_gradients() {
    for m in [tiny(false), tiny(true), tiny_qwen2()] {
        let adapter = random_adapter(&m, &lora_config(&LoraTarget::ALL));
        let (loss, grads) = adapted(&m, (Strategy::Local, 1, 1), &adapter);
        let merged = merged_weights(&m, &adapter);
        let cfg = run_config(&m, (Strategy::Local, 1, 1), None);
        let plan = cfg.plan().unwrap();
        let weights = |b: &upipe::backend::cpu::CpuBackend| {
            upipe::train::host_weights::weights_from_host(
                b,
                &m,
                &merged
                    .iter()
                    .map(|(n, v)| {
                        let p = m.params().into_iter().find(|(p, _)| m.hf_name(*p) == *n);
                        let shape = p.unwrap().1;
                        (
                            n.clone(),
                            upipe::checkpoint::HostTensor::new(shape, v.clone()).unwrap(),
                        )
                    })
                    .collect(),
                upipe::backend::DType::F32,
                upipe::backend::Category::Weights,
            )
        };
        let none = Freeze::none();
        let policy = MemoryPolicy::default();
        let (want_loss, base) =
            loss_and_grads_cpu_frozen(&m, &plan, policy, &window(&m), &weights, &none).unwrap();
        let what = format!("{:?}", m.family);
        assert!(
            ((loss - want_loss) / want_loss).abs() <= 1e-6,
            "{what}: {loss} vs {want_loss}"
        );
        assert_eq!(grads.len(), m.layers * 2 * LoraTarget::ALL.len(), "{what}");
        let s = adapter.config.scale() as f64;
        for l in 0..m.layers {
            for t in LoraTarget::ALL {
                let f = adapter.get(l, t).unwrap();
                let (r, n_in, n_out) = (f.dims.rank, f.dims.in_features, f.dims.out_features);
                let g = &base[&m.hf_name(Param::Block(l, t.base_param()))]; // [out, in]
                let mut db = vec![0.0f64; n_out * r];
                let mut da = vec![0.0f64; r * n_in];
                for o in 0..n_out {
                    for i in 0..n_in {
                        let gi = g[o * n_in + i] as f64;
                        for k in 0..r {
                            db[o * r + k] += s * gi * f.a[k * n_in + i] as f64;
                            da[k * n_in + i] += s * f.b[o * r + k] as f64 * gi;
                        }
                    }
                }
                let got_a = &grads[&tensor_name(l, t, Factor::A)];
                let got_b = &grads[&tensor_name(l, t, Factor::B)];
                // two f32 computations of one function (the merged weights are
                // W + s·B·A rounded to f32): equal to f32 rounding, not bit for bit
                let (ea, eb) = (rel_err(got_a, &da), rel_err(got_b, &db));
                assert!(
                    ea <= 5e-5 && eb <= 5e-5,
                    "{what} layer {l} {t:?}: dA {ea:e} dB {eb:e}"
                );
            }
        }
    }
}

/// Ulysses, UPipe (head chunks, GQA with Hkv < Pu), the zigzag ring and
/// USP give `local`'s loss and adapter gradients with LoRA on every
/// target, and on a subset.
#[test]
fn every_strategy_equals_local_with_adapters() {
    let meshes: [Mesh; 4] = [
        (Strategy::Ulysses, 4, 1),
        (Strategy::Upipe, 4, 1),
        (Strategy::Ring, 1, 2),
        (Strategy::Upipe, 2, 2),
    ];
    for targets in [
        &LoraTarget::ALL[..],
        &[LoraTarget::Q, LoraTarget::V, LoraTarget::Down],
    ] {
        for m in [tiny(true), tiny_qwen2()] {
            let adapter = random_adapter(&m, &lora_config(targets));
            let want = adapted(&m, (Strategy::Local, 1, 1), &adapter);
            for mesh in meshes {
                let got = adapted(&m, mesh, &adapter);
                let what = format!("{:?} {mesh:?} {targets:?}", m.family);
                assert_loss_grads_close(&got, &want, &what);
            }
        }
    }
}

fn tokens(vocab: usize) -> Arc<[u32]> {
    let mut rng = Rng::new(11);
    (0..2048).map(|_| rng.below(vocab as u64) as u32).collect()
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-lora-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A new adapter (B = 0) leaves the first step's loss bit-identical to the
/// base model's; three steps move the adapters and nothing else; the save
/// holds a PEFT adapter directory with the trained factors and no base
/// weights; `--resume` continues from them bit for bit (the base read
/// again from the seed), and a resume without `--lora-rank` is refused.
#[test]
fn training_moves_only_the_adapters_and_saves_and_resumes_them() {
    let m = tiny(false);
    let config = lora_config(&[LoraTarget::Q, LoraTarget::K, LoraTarget::O, LoraTarget::Up]);
    for mesh in [(Strategy::Local, 1, 1), (Strategy::Upipe, 2, 1)] {
        let dir = temp(&format!("{:?}", mesh.0));
        let base = train_cpu(&run_config(&m, mesh, None), tokens(m.vocab), &|_| {}).unwrap();
        let mut cfg = run_config(&m, mesh, Some(&config));
        cfg.save_dir = Some(dir.clone());
        let run = train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
        let what = format!("{mesh:?}");
        assert_eq!(
            run.reports[0].loss.to_bits(),
            base.reports[0].loss.to_bits(),
            "{what}"
        );
        assert_ne!(run.reports[2].loss, base.reports[2].loss, "{what}");
        assert_adapter_only(&dir, "tiny", &what);
        let adapter = read_adapter(&dir, &m).unwrap().weights;
        assert_eq!(adapter.config, config);
        let fresh = LoraWeights::init(&m, &config, cfg.seed).unwrap();
        for (l, (now, then)) in adapter.layers.iter().zip(&fresh.layers).enumerate() {
            for (f, f0) in now.iter().zip(then) {
                assert!(
                    f.b != f0.b && f.a != f0.a,
                    "{what}: layer {l} did not train"
                );
            }
        }
        let mut more = run_config(&m, mesh, Some(&config));
        (more.save_dir, more.resume, more.steps) = (Some(dir.clone()), true, 4);
        let resumed = train_cpu(&more, tokens(m.vocab), &|_| {}).unwrap();
        assert_eq!(resumed.reports.len(), 1, "{what}: one more step");
        // the resume reads the base again (the seed's) and continues bit for bit
        let mut whole = run_config(&m, mesh, Some(&config));
        whole.steps = 4;
        let whole = train_cpu(&whole, tokens(m.vocab), &|_| {}).unwrap();
        assert_eq!(
            resumed.reports[0].loss.to_bits(),
            whole.reports[3].loss.to_bits(),
            "{what}: resumed loss"
        );
        let mut full = run_config(&m, mesh, None);
        (full.save_dir, full.resume, full.steps) = (Some(dir.clone()), true, 5);
        assert!(
            train_cpu(&full, tokens(m.vocab), &|_| {}).is_err(),
            "{what}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Bad LoRA inputs are refused before anything trains, naming the fix.
#[test]
fn bad_lora_settings_are_refused() {
    let m = tiny(false);
    let e = LoraConfig::new(0, 1.0, false, vec![LoraTarget::Q]).unwrap_err();
    assert!(e.to_string().contains("rank"), "{e}");
    let too_big = LoraConfig::new(1000, 1.0, false, vec![LoraTarget::K]).unwrap();
    let e = run_config(&m, (Strategy::Local, 1, 1), Some(&too_big))
        .plan()
        .unwrap_err();
    assert!(e.to_string().contains("k_proj"), "{e}");
    let mut partial = run_config(
        &m,
        (Strategy::Local, 1, 1),
        Some(&lora_config(&[LoraTarget::Q])),
    );
    partial.freeze = Freeze::parse("embeddings").unwrap();
    let e = partial.plan().unwrap_err().to_string();
    assert!(e.contains("--freeze"), "{e}");
}

/// A trained LoRA checkpoint evaluated as base + adapter (`upipe eval
/// --lora-from`) and its `--merge-lora` model evaluated alone give one
/// loss (f32, to 1e-5: the merge rounds W + s·B·A once); the merged
/// directory is a plain HF model that loads without extras, with a
/// config.json; loading the LoRA checkpoint (the adapter only) as a plain
/// model is refused, naming --lora-from and `upipe merge`.
#[test]
fn a_merged_model_evaluates_as_base_plus_adapter() {
    use upipe::checkpoint::lora_merge::{BaseModel, MergeJob, merge_adapter_dir};
    use upipe::checkpoint::{SaveDtype, load_hf_model};
    use upipe::train::eval::{EvalConfig, eval_cpu};
    let m = tiny(true);
    let dir = temp("merge");
    let out = temp("merged");
    let mut cfg = run_config(
        &m,
        (Strategy::Local, 1, 1),
        Some(&lora_config(&LoraTarget::ALL)),
    );
    cfg.save_dir = Some(dir.clone());
    train_cpu(&cfg, tokens(m.vocab), &|_| {}).unwrap();
    let random = BaseModel::Random { seed: cfg.seed };
    let job = MergeJob {
        base: &random,
        adapter: &dir,
        out: &out,
        cfg: &m,
        dtype: SaveDtype::F32,
    };
    merge_adapter_dir(&job).unwrap();
    let e = load_hf_model(&dir, &m).unwrap_err().to_string();
    assert!(
        e.contains("--lora-from") && e.contains("upipe merge"),
        "{e}"
    );
    let base = random.tensors(&m).unwrap();
    let merged = load_hf_model(&out, &m).unwrap();
    let config = ModelConfig::resolve(&out.to_string_lossy()).unwrap();
    assert_eq!(config.param_count(), m.param_count());
    let data = upipe::data::Tokens::from(tokens(m.vocab)[..97].to_vec());
    let eval = EvalConfig {
        seq: Some(32),
        ..EvalConfig::new(m.clone())
    };
    let adapter = read_adapter(&dir, &m).unwrap().weights;
    let with_adapter = EvalConfig {
        lora: Some(adapter),
        ..eval.clone()
    };
    let got = eval_cpu(&with_adapter, &data, &base).unwrap().loss;
    let want = eval_cpu(&eval, &data, &merged).unwrap().loss;
    let plain = eval_cpu(&eval, &data, &base).unwrap().loss;
    assert!(((got - want) / want).abs() <= 1e-5, "{got} vs {want}");
    assert!(
        (plain - want).abs() > 1e-4,
        "the adapter changed nothing: {plain}"
    );
    // a directory with files in it is not merged into
    let e = merge_adapter_dir(&job).unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&out);
}

/// A LoRA run from `--init-from` saves the adapter alone, naming the base's
/// directory; with the base moved away, `--resume` is refused naming
/// `--init-from` (and the old place); with `--init-from` at the new place
/// it reads the base again and continues bit for bit.
#[test]
fn a_lora_resume_reads_its_base_again() {
    use upipe::checkpoint::lora_merge::BaseModel;
    use upipe::checkpoint::{SaveDtype, save_hf_model};
    let m = tiny(false);
    let config = lora_config(&[LoraTarget::Q, LoraTarget::Down]);
    let base = temp("base");
    let tensors = BaseModel::Random { seed: 21 }.tensors(&m).unwrap();
    save_hf_model(&base, &m, &tensors, SaveDtype::F32).unwrap();
    let run = |steps: u32, from: Option<&PathBuf>| {
        let mut c = run_config(&m, (Strategy::Local, 1, 1), Some(&config));
        (c.steps, c.init_from) = (steps, from.cloned());
        c
    };
    let whole = train_cpu(&run(4, Some(&base)), tokens(m.vocab), &|_| {}).unwrap();
    let dir = temp("resume-base");
    let mut first = run(3, Some(&base));
    first.save_dir = Some(dir.clone());
    train_cpu(&first, tokens(m.vocab), &|_| {}).unwrap();
    let named = std::fs::canonicalize(&base).unwrap();
    assert_adapter_only(&dir, &named.display().to_string(), "--init-from");
    let moved = temp("base-moved");
    std::fs::rename(&base, &moved).unwrap();
    let mut again = run(4, None);
    (again.save_dir, again.resume) = (Some(dir.clone()), true);
    let e = train_cpu(&again, tokens(m.vocab), &|_| {}).unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("--init-from") && e.contains(&*named.to_string_lossy()),
        "{e}"
    );
    again.init_from = Some(moved.clone());
    let rest = train_cpu(&again, tokens(m.vocab), &|_| {}).unwrap();
    assert_eq!(rest.reports.len(), 1, "one more step");
    assert_eq!(
        rest.reports[0].loss.to_bits(),
        whole.reports[3].loss.to_bits()
    );
    for d in [dir, moved] {
        let _ = std::fs::remove_dir_all(d);
    }
}
