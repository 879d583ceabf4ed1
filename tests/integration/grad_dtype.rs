//! BF16 gradients (`--grad-dtype bf16`): on the CPU oracle a step's
//! gradients are the F32 step's rounded once to BF16 (the weight matrices)
//! or the F32 step's themselves (norms, biases, embedding); through the
//! binary they train as F32 gradients do within a small margin, on every
//! store (replicated, FSDP, host optimizer), planned to the byte, and say
//! so in the metrics.

use std::collections::BTreeMap;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::cpu::CpuBackend;
use upipe::backend::narrow::{bf16_nearest, bf16_value};
use upipe::backend::{Backend, Category, DType};
use upipe::checkpoint::HostTensor;
use upipe::comm::MeshShape;
use upipe::comm::local::run_ranks;
use upipe::model::decoder::attn_dims;
use upipe::model::{Decoder, Freeze, GradSpec, MemoryPolicy, ModelConfig};
use upipe::rng::Rng;
use upipe::train::replicated::ReplicatedStore;
use upipe::train::trainer::weights_from_host;

use crate::common;

fn host_weights(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(seed);
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = match name.ends_with("norm.weight") {
                true => (0..n).map(|_| 1.0 + 0.1 * rng.normal() as f32).collect(),
                false => rng.normal_vec(n, 0.3),
            };
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect()
}

/// Every gradient of one forward and backward of `ids` (one rank, weights
/// in the device's compute dtype) kept as `matrices` says, by name, with
/// its dtype.
fn step_grads<B: Backend>(
    make: impl Fn() -> B + Sync,
    cfg: &ModelConfig,
    ids: &[u32],
    matrices: DType,
) -> BTreeMap<String, (DType, Vec<f32>)> {
    let seq = ids.len() - 1;
    let host = host_weights(cfg, 5);
    let plan = CpPlan::new(Strategy::Local, &attn_dims(cfg), seq, 1, 1, None).unwrap();
    let shape = MeshShape::new(1, 1, 1).unwrap();
    let out = run_ranks(shape, make, |_, b, mesh| {
        let b = b.as_ref();
        let policy = MemoryPolicy::default();
        let decoder = Decoder::new(b, cfg.clone(), plan.clone(), &mesh, policy)?;
        let w = weights_from_host(b, cfg, &host, b.compute_dtype(), Category::Weights)?;
        let none = Freeze::none();
        let spec = GradSpec {
            frozen: &none,
            matrices,
        };
        let mut store = ReplicatedStore::with_grads(b, cfg, w, mesh.world.as_ref(), spec)?;
        let (inputs, targets) = (&ids[..seq], &ids[1..]);
        decoder.forward_backward(b, &mesh, &mut store, inputs, targets, 1.0 / seq as f32)?;
        let mut grads = BTreeMap::new();
        for (name, t) in store.g.named() {
            grads.insert(name, (t.dtype(), b.to_host(t)?));
        }
        Ok(grads)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn tokens(cfg: &ModelConfig, n: usize) -> Vec<u32> {
    let mut rng = Rng::new(3);
    (0..n).map(|_| rng.below(cfg.vocab as u64) as u32).collect()
}

fn is_matrix(name: &str) -> bool {
    name.ends_with("proj.weight") || name == "lm_head.weight"
}

fn rounded(x: f32) -> f32 {
    bf16_value(bf16_nearest(x))
}

/// Each weight matrix's gradient is written once, by a GEMM into zeros:
/// the BF16 step's is the F32 step's rounded to nearest even, bit for bit,
/// and every other gradient (norms, embedding) is the F32 step's.
#[test]
fn bf16_gradients_are_the_f32_gradients_rounded_once() {
    let cfg = ModelConfig::resolve("tiny").unwrap();
    let ids = tokens(&cfg, 65);
    let exact = step_grads(CpuBackend::new, &cfg, &ids, DType::F32);
    let narrow = step_grads(CpuBackend::new, &cfg, &ids, DType::BF16);
    assert_eq!(exact.len(), narrow.len());
    let mut matrices = 0;
    for (name, (dtype, got)) in &narrow {
        let (_, want) = &exact[name];
        let matrix = is_matrix(name);
        assert_eq!(*dtype == DType::BF16, matrix, "{name}: {dtype:?}");
        matrices += usize::from(matrix);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let w = if matrix { rounded(*w) } else { *w };
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} against {w}");
        }
        assert!(got.iter().any(|g| *g != 0.0), "{name}: a gradient");
    }
    assert_eq!(matrices, 7 * cfg.layers + usize::from(!cfg.tie_embeddings));
    // rounding is in effect: some matrix value moved
    let moved = narrow
        .iter()
        .filter(|(_, (d, _))| *d == DType::BF16)
        .any(|(n, (_, g))| g.iter().zip(&exact[n].1).any(|(a, b)| a != b));
    assert!(moved, "BF16 gradients equal the F32 ones everywhere");
}

/// On a GPU the BF16 gradients are the F32 ones rounded, within one BF16
/// step of each value (cuBLASLt may pick another kernel for a BF16 output),
/// and the F32 ones are the F32 step's up to the order of the norms'
/// atomic sums, which differs from run to run.
#[test]
fn gpu_bf16_gradients_are_the_f32_gradients_rounded() {
    use upipe::backend::cuda::CudaBackend;
    if let Err(e) = CudaBackend::new(0) {
        eprintln!("SKIP grad_dtype on the GPU: no usable CUDA GPU ({e})");
        return;
    }
    let mut cfg = ModelConfig::resolve("tiny").unwrap();
    (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn) = (256, 4, 2, 64, 512);
    let ids = tokens(&cfg, 257);
    let make = || CudaBackend::new(0).expect("GPU was available a moment ago");
    let exact = step_grads(make, &cfg, &ids, DType::F32);
    let narrow = step_grads(make, &cfg, &ids, DType::BF16);
    for (name, (dtype, got)) in &narrow {
        let want = &exact[name].1;
        assert_eq!(*dtype == DType::BF16, is_matrix(name), "{name}");
        let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let close = match is_matrix(name) {
                true => (g - rounded(*w)).abs() <= w.abs() / 128.0 + scale * 1e-6,
                false => (g - w).abs() <= w.abs() * 1e-4 + scale * 1e-6,
            };
            assert!(close, "{name}[{i}]: {g} against {w}");
        }
    }
}

/// 30 steps of the default run (UPipe over 4 thread ranks) with BF16
/// gradients end within 2 % of the F32 run's loss (and not at it), hold
/// fewer gradient bytes, peak as planned, and say the format; FSDP and the
/// host optimizer train with them too, the host's update bit-identical to
/// the device's.
#[test]
fn bf16_gradients_train_as_f32_ones_do_on_every_store() {
    let base = ["--steps", "30", "--seq", "128"];
    let bf16 = [&base[..], &["--grad-dtype", "bf16"]].concat();
    let reference = common::train_steps(&base);
    let narrow = common::train_steps(&bf16);
    let (want, got) = (
        common::step_loss(reference.last().unwrap()),
        common::step_loss(narrow.last().unwrap()),
    );
    assert!(
        ((got - want) / want).abs() < 0.02 && got != want,
        "final loss {got} against F32 gradients' {want}"
    );
    let grads = |s: &serde_json::Value| s["peak_by_category"]["grads"].as_u64().unwrap();
    assert!(grads(&narrow[0]) < grads(&reference[0]) * 3 / 4);
    let first = &narrow[0];
    assert_eq!(first["peak_bytes"], first["predicted_peak_bytes"]);
    assert_eq!(first["optim_state"], "moments f32, master f32, grads bf16");
    assert!(reference[0].get("optim_state").is_none());

    let fsdp = common::train_steps(&[&bf16[..], &["--fsdp", "on"]].concat());
    let (f, n) = (common::step_loss(fsdp.last().unwrap()), got);
    assert!(
        ((f - n) / n).abs() < 0.01,
        "FSDP {f} against replicated {n}"
    );
    assert_eq!(fsdp[0]["peak_bytes"], fsdp[0]["predicted_peak_bytes"]);

    let host = common::train_steps(&[&bf16[..], &["--offload-optimizer", "all"]].concat());
    let losses = |s: &[serde_json::Value]| s.iter().map(common::step_loss).collect::<Vec<_>>();
    assert_eq!(
        losses(&host),
        losses(&narrow),
        "host AdamW against the device's"
    );
    assert_eq!(host[0]["peak_bytes"], host[0]["predicted_peak_bytes"]);
}

/// A bad value is refused before anything runs, naming the choices; the
/// plan holds two bytes less of gradient a matrix parameter (Llama3-8B on
/// one GPU: everything but the embedding and the norms), at the same peak
/// moment.
#[test]
fn a_bad_dtype_is_refused_and_the_plan_counts_bf16_gradients() {
    let (_, log, success) = common::upipe(&["train", "--steps", "1", "--grad-dtype", "fp8"]);
    assert!(
        !success && log.contains("--grad-dtype fp8") && log.contains("bf16"),
        "{log}"
    );
    let grads = |dtype: &str| {
        let args = [
            "plan",
            "--model",
            "llama3-8b",
            "--seq",
            "65536",
            "--gpus",
            "1",
            "--attn",
            "upipe",
            "--json",
            "--grad-dtype",
            dtype,
        ];
        let (stdout, log, success) = common::upipe(&args);
        assert!(success, "{log}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["peak_at"], "backward: mlp");
        v["by_category"]["grads"].as_u64().unwrap()
    };
    let cfg = ModelConfig::resolve("llama3-8b").unwrap();
    let f32_only = cfg.vocab * cfg.hidden + (2 * cfg.layers + 1) * cfg.hidden;
    let matrices = (cfg.param_count() - f32_only) as u64;
    assert_eq!(grads("f32") - grads("bf16"), 2 * matrices);
}
