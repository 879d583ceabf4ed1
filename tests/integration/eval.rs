//! `upipe eval`'s forward-only evaluation on the CPU equals the training
//! path's loss (`loss_and_grads_cpu`, what `upipe eval` computed before it
//! became forward-only) under every strategy and mesh; each position bucket
//! equals the mean per-token loss of its range; bad input is refused.

use std::collections::BTreeMap;
use std::ops::Range;
use std::process::Command;
use upipe::attention::{CpPlan, Strategy};
use upipe::backend::{Backend, Category, DType, IGNORE};
use upipe::checkpoint::{HostTensor, save_hf_model};
use upipe::data::{Tokens, write_u32_tokens};
use upipe::model::decoder::attn_dims;
use upipe::model::{MemoryPolicy, ModelConfig};
use upipe::rng::Rng;
use upipe::train::eval::{EvalConfig, eval_cpu};
use upipe::train::trainer::{loss_and_grads_cpu, weights_from_host};

/// The tiny model with a vocabulary larger than the byte tokenizer's.
fn model() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.vocab = 300;
    c.validate().unwrap();
    c
}

/// Weights large enough that losses differ clearly between positions.
fn host_weights(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(seed);
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = if name.ends_with("norm.weight") {
                vec![1.0; n]
            } else {
                rng.normal_vec(n, 0.3)
            };
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect()
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// The mean loss over targets `counted` of `tokens` taken as one sequence,
/// computed as `upipe eval` did before: padded to the layout's unit, one
/// forward and backward through `loss_and_grads_cpu`.
fn reference(
    cfg: &ModelConfig,
    host: &BTreeMap<String, HostTensor>,
    tokens: &[u32],
    (strategy, pu, pr, u): (Strategy, usize, usize, Option<usize>),
    counted: Range<usize>,
) -> f64 {
    let n = tokens.len() - 1;
    let unit = if pr > 1 { 2 * pr * pu } else { pu };
    let seq = n.div_ceil(unit) * unit;
    let mut ids = tokens[..n].to_vec();
    let mut targets: Vec<u32> = tokens[1..]
        .iter()
        .enumerate()
        .map(|(i, &t)| if counted.contains(&i) { t } else { IGNORE })
        .collect();
    ids.resize(seq, 0);
    targets.resize(seq, IGNORE);
    let plan = CpPlan::new(strategy, &attn_dims(cfg), seq, pu, pr, u).unwrap();
    let weights = |b: &upipe::backend::cpu::CpuBackend| {
        weights_from_host(b, cfg, host, DType::F32, Category::Weights)
    };
    loss_and_grads_cpu(
        cfg,
        &plan,
        MemoryPolicy::default(),
        &ids,
        &targets,
        &weights,
    )
    .unwrap()
    .0
}

fn eval_config(cfg: &ModelConfig, mesh: (Strategy, usize, usize, Option<usize>)) -> EvalConfig {
    EvalConfig {
        strategy: mesh.0,
        ulysses: mesh.1,
        ring: mesh.2,
        chunk_heads: mesh.3,
        ..EvalConfig::new(cfg.clone())
    }
}

fn rel(a: f64, b: f64) -> f64 {
    ((a - b) / b).abs()
}

const MESHES: [(Strategy, usize, usize, Option<usize>); 7] = [
    (Strategy::Local, 1, 1, None),
    (Strategy::Upipe, 2, 1, None),
    (Strategy::Upipe, 2, 2, None),
    (Strategy::Upipe, 4, 1, Some(4)),
    (Strategy::Ulysses, 2, 1, None),
    (Strategy::Ring, 1, 4, None),
    (Strategy::Usp, 2, 2, None),
];

#[test]
fn forward_only_eval_equals_the_training_path_loss() {
    let cfg = model();
    let host = host_weights(&cfg, 1);
    // 100 targets: padded to 104 under a zigzag ring of 2 x 2
    let ids = random_tokens(101, cfg.vocab, 2);
    let tokens = Tokens::from(ids.clone());
    let local = reference(&cfg, &host, &ids, MESHES[0], 0..100);
    for mesh in MESHES {
        let want = reference(&cfg, &host, &ids, mesh, 0..100);
        let got = eval_cpu(&eval_config(&cfg, mesh), &tokens, &host).unwrap();
        println!("{mesh:?}: eval {} training path {want}", got.loss);
        assert!(
            rel(got.loss, want) <= 1e-7,
            "{mesh:?}: {} vs {want}",
            got.loss
        );
        assert!(rel(got.loss, local) <= 1e-5, "{mesh:?} vs local");
        assert_eq!((got.tokens, got.windows), (100, 1));
        assert_eq!(got.by_position.len(), 1);
        assert_eq!((got.by_position[0].from, got.by_position[0].to), (0, 100));
        assert!(rel(got.by_position[0].loss, got.loss) <= 1e-12);
        assert!(got.peak_bytes > 0 && got.tokens_per_s > 0.0);
    }
}

#[test]
fn each_bucket_is_the_mean_loss_of_its_positions() {
    let cfg = model();
    let host = host_weights(&cfg, 3);
    // 3 windows of 24 and a tail of 4 tokens left out
    let ids = random_tokens(3 * 24 + 5, cfg.vocab, 4);
    let tokens = Tokens::from(ids.clone());
    let ranges = [0..4, 4..9, 9..14, 14..19, 19..24];
    let window = |w: usize| &ids[w * 24..(w + 1) * 24 + 1];
    let configs = [
        eval_config(&cfg, (Strategy::Upipe, 2, 2, None)),
        eval_config(&cfg, (Strategy::Local, 1, 1, None)),
        EvalConfig {
            data_parallel: 2,
            ..eval_config(&cfg, (Strategy::Upipe, 2, 1, None))
        },
        // windows of 21 are padded to 24 under a ring of 2 x 2
        eval_config(&cfg, (Strategy::Usp, 2, 2, None)),
    ];
    for (i, base) in configs.into_iter().enumerate() {
        let seq = if i == 3 { 21 } else { 24 };
        let c = EvalConfig {
            seq: Some(seq),
            buckets: 5,
            loss_chunk: 3,
            ..base
        };
        let got = eval_cpu(&c, &tokens, &host).unwrap();
        let windows = (ids.len() - 1) / seq;
        assert_eq!((got.windows, got.tokens), (windows, windows * seq), "{c:?}");
        let want_ranges = c.bucket_ranges(seq);
        if seq == 24 {
            assert_eq!(want_ranges, ranges);
        }
        let mesh = (Strategy::Local, 1, 1, None);
        for (b, r) in got.by_position.iter().zip(&want_ranges) {
            assert_eq!((b.from, b.to), (r.start, r.end));
            let want: f64 = (0..windows)
                .map(|w| {
                    reference(
                        &cfg,
                        &host,
                        &ids[w * seq..(w + 1) * seq + 1],
                        mesh,
                        r.clone(),
                    )
                })
                .sum::<f64>()
                / windows as f64;
            assert!(
                rel(b.loss, want) <= 1e-5,
                "{c:?} bucket {r:?}: {} vs {want}",
                b.loss
            );
        }
        if seq == 24 {
            let whole: f64 = (0..3)
                .map(|w| reference(&cfg, &host, window(w), mesh, 0..24))
                .sum::<f64>()
                / 3.0;
            assert!(rel(got.loss, whole) <= 1e-5, "{} vs {whole}", got.loss);
        }
        let spread = got.by_position.iter().map(|b| b.loss);
        let (lo, hi) = spread.fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(x), h.max(x)));
        assert!(
            hi - lo > 1e-3,
            "buckets should differ: {:?}",
            got.by_position
        );
    }
}

#[test]
fn bad_windows_and_buckets_are_refused() {
    let cfg = model();
    let host = host_weights(&cfg, 5);
    let tokens = Tokens::from_ids(random_tokens(50, cfg.vocab, 6), "heldout.u32");
    let err = |c: EvalConfig, t: &Tokens| eval_cpu(&c, t, &host).unwrap_err().to_string();
    let base = EvalConfig::new(cfg.clone());
    let e = err(
        EvalConfig {
            seq: Some(50),
            ..base.clone()
        },
        &tokens,
    );
    assert!(
        e.contains("--seq 50 is longer than heldout.u32 allows")
            && e.contains("50 tokens")
            && e.contains("at most 49"),
        "{e}"
    );
    for buckets in [0, 50] {
        let e = err(
            EvalConfig {
                buckets,
                ..base.clone()
            },
            &tokens,
        );
        assert!(
            e.contains(&format!("--buckets {buckets}")) && e.contains("window length 49"),
            "{e}"
        );
    }
    let one = Tokens::from_ids(vec![3], "one.u32");
    let e = err(base.clone(), &one);
    assert!(e.contains("one.u32 holds 1 tokens"), "{e}");
    let outside = Tokens::from_ids(vec![1, 2, 300], "big.u32");
    let e = err(base.clone(), &outside);
    assert!(
        e.contains("big.u32: token id 300 at position 2") && e.contains("vocabulary of 300"),
        "{e}"
    );
    let e = err(
        EvalConfig {
            strategy: Strategy::Ulysses,
            ulysses: 3,
            ..base
        },
        &tokens,
    );
    assert!(e.contains("3 must divide the 4 query heads"), "{e}");
}

fn upipe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn eval_command_reports_windows_and_buckets() {
    let cfg = model();
    let host = host_weights(&cfg, 7);
    let dir = std::env::temp_dir().join(format!("upipe-eval-{}", std::process::id()));
    save_hf_model(&dir, &cfg, &host, DType::F32).unwrap();
    let ids = random_tokens(2 * 32 + 1, cfg.vocab, 8);
    let file = dir.join("heldout.u32");
    write_u32_tokens(&file, &ids).unwrap();
    let (d, f) = (dir.to_str().unwrap(), file.to_str().unwrap());
    let args = [
        "eval",
        "--json",
        "--model-dir",
        d,
        "--tokens",
        f,
        "--seq",
        "32",
        "--buckets",
        "4",
        "--device",
        "cpu",
        "--ulysses",
        "2",
    ];
    let out = upipe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["tokens"].as_u64(), v["windows"].as_u64()),
        (Some(64), Some(2))
    );
    let buckets = v["by_position"].as_array().unwrap();
    let bounds: Vec<(u64, u64)> = buckets
        .iter()
        .map(|b| (b["from"].as_u64().unwrap(), b["to"].as_u64().unwrap()))
        .collect();
    assert_eq!(bounds, [(0, 8), (8, 16), (16, 24), (24, 32)]);
    let c = EvalConfig {
        strategy: Strategy::Upipe,
        ulysses: 2,
        seq: Some(32),
        buckets: 4,
        ..EvalConfig::new(cfg.clone())
    };
    let lib = eval_cpu(&c, Tokens::open(&file).unwrap(), &host).unwrap();
    assert_eq!(v["loss"].as_f64().unwrap(), lib.loss);
    let mean: f64 = buckets
        .iter()
        .map(|b| b["loss"].as_f64().unwrap())
        .sum::<f64>()
        / 4.0;
    assert!(rel(mean, lib.loss) <= 1e-9);

    let out = upipe(&[
        "eval",
        "--json",
        "--model-dir",
        d,
        "--tokens",
        f,
        "--seq",
        "65",
        "--device",
        "cpu",
    ]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--seq 65 is longer than"),
        "{e}"
    );
    let bad = dir.join("bad.u32");
    write_u32_tokens(&bad, &[1, 2, 3, 300]).unwrap();
    let out = upipe(&["eval", "--model-dir", d, "--tokens", bad.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("token id 300 at position 3") && e.contains("bad.u32"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The forward-only pass allocates no gradient, keeps nothing once it
/// returns, and peaks well below a training pass's forward and backward.
#[test]
fn forward_only_pass_keeps_no_gradients_or_saved_activations() {
    use upipe::comm::MeshShape;
    use upipe::comm::local::run_ranks;
    use upipe::model::Decoder;
    use upipe::train::replicated::ReplicatedStore;
    let cfg = model();
    let host = host_weights(&cfg, 9);
    let seq = 512;
    let ids = random_tokens(seq + 1, cfg.vocab, 10);
    let (inputs, targets) = (&ids[..seq], &ids[1..]);
    let plan = CpPlan::new(Strategy::Local, &attn_dims(&cfg), seq, 1, 1, None).unwrap();
    let shape = MeshShape::new(1, 1, 1).unwrap();
    let peaks = run_ranks(shape, upipe::backend::cpu::CpuBackend::new, |_, b, mesh| {
        let b = b.as_ref();
        let policy = MemoryPolicy::default();
        let decoder = Decoder::new(b, cfg.clone(), plan.clone(), &mesh, policy)?;
        let w = weights_from_host(b, &cfg, &host, DType::F32, Category::Weights)?;
        let weights = b.ledger().current();
        let groups = vec![0; seq];
        let rows = upipe::model::forward::LossRows {
            ids: inputs,
            targets,
            group_of_row: &groups,
            groups: 1,
        };
        let sums = decoder.forward_loss(b, &mesh, &w, rows)?;
        let eval = b.ledger().stats();
        assert_eq!(
            eval.current, weights,
            "nothing outlives the forward-only pass"
        );
        for cat in [Category::Grads, Category::OptimState] {
            assert_eq!(eval.at_peak(cat), 0, "{cat:?}");
        }
        b.ledger().reset_peak();
        let mut store = ReplicatedStore::new(b, &cfg, w, mesh.world.as_ref())?;
        let held = b.ledger().current();
        let loss = decoder.forward_backward(b, &mesh, &mut store, inputs, targets, 1.0)?;
        assert!(rel(sums[0], loss) <= 1e-6, "{} vs {loss}", sums[0]);
        Ok((eval.peak - weights, b.ledger().peak() - held))
    })
    .unwrap();
    let (eval, train) = peaks[0];
    println!("above the weights: forward only {eval} B, training pass {train} B (grads aside)");
    assert!(4 * eval < train, "forward only {eval} vs training {train}");
}

/// Documents of `lengths` (ids random) as a dataset with its document index.
fn documents(lengths: &[usize], vocab: usize, seed: u64) -> (Vec<u32>, Vec<u64>) {
    let n: usize = lengths.iter().sum();
    let ids = random_tokens(n, vocab, seed);
    let mut starts = Vec::new();
    let mut at = 0u64;
    for &l in lengths {
        starts.push(at);
        at += l as u64;
    }
    (ids, starts)
}

/// Eval of packed documents (`--pack documents`, `bfd`) gives each
/// document the loss it has evaluated alone: positions restart and
/// attention is per document, and no target across a boundary counts.
#[test]
fn packed_documents_evaluate_as_each_document_alone() {
    use std::sync::Arc;
    use upipe::data::doc_index::DocIndex;
    use upipe::data::{Dataset, PackMode};
    let cfg = model();
    let host = host_weights(&cfg, 8);
    // documents mode cuts windows of 24 from the stream: these documents
    // each lie inside one window (one fills a window; the last, of one id,
    // is only the last window's last target, across a boundary)
    let lengths = [5, 9, 10, 24, 1, 6, 17, 1];
    let (ids, starts) = documents(&lengths, cfg.vocab, 21);
    let mut data = Dataset::from(ids.clone());
    data.docs = Some(Arc::new(
        DocIndex::new(starts.clone(), ids.len() as u64, "test").unwrap(),
    ));
    // each document alone: its summed loss over its own targets
    let mut want_sum = 0.0;
    let mut want_counted = 0;
    for (&s, &l) in starts.iter().zip(&lengths) {
        if l < 2 {
            continue; // one id predicts nothing
        }
        let doc = ids[s as usize..s as usize + l].to_vec();
        let alone = eval_cpu(&EvalConfig::new(cfg.clone()), Tokens::from(doc), &host).unwrap();
        want_sum += alone.loss * alone.counted_tokens as f64;
        want_counted += alone.counted_tokens;
    }
    for pack in [PackMode::Documents, PackMode::Bfd] {
        for mesh in [
            (Strategy::Local, 1, 1, None),
            (Strategy::Upipe, 2, 2, None),
            (Strategy::Ulysses, 2, 1, None),
        ] {
            let c = EvalConfig {
                seq: Some(24),
                buckets: 3,
                pack,
                ..eval_config(&cfg, mesh)
            };
            let got = eval_cpu(&c, data.clone(), &host).unwrap();
            let what = format!("{pack} {mesh:?}");
            assert_eq!(got.counted_tokens, want_counted, "{what}");
            let got_sum = got.loss * got.counted_tokens as f64;
            assert!(
                rel(got_sum, want_sum) <= 1e-5,
                "{what}: {got_sum} vs {want_sum}"
            );
        }
    }
    // the same windows as one stream are another evaluation
    let stream = EvalConfig {
        seq: Some(24),
        ..EvalConfig::new(cfg.clone())
    };
    let s = eval_cpu(&stream, data, &host).unwrap();
    assert!(s.counted_tokens > want_counted);
    // bfd needs the index
    let bfd = EvalConfig {
        pack: PackMode::Bfd,
        ..stream
    };
    let e = eval_cpu(&bfd, Tokens::from(ids), &host)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--pack bfd") && e.contains("upipe tokenize"),
        "{e}"
    );
}

/// `upipe eval --pack` reads the document index beside `--tokens` and
/// gives what the library gives on the same dataset; `bfd` without an
/// index is refused naming `upipe tokenize`.
#[test]
fn eval_command_packs_with_the_index_beside_the_tokens() {
    use std::sync::Arc;
    use upipe::data::doc_index::{DocIndex, IndexWriter, index_path};
    use upipe::data::{Dataset, PackMode};
    let cfg = model();
    let host = host_weights(&cfg, 9);
    let dir = std::env::temp_dir().join(format!("upipe-eval-pack-{}", std::process::id()));
    save_hf_model(&dir, &cfg, &host, DType::F32).unwrap();
    let (ids, starts) = documents(&[7, 20, 3, 30, 12, 9], cfg.vocab, 10);
    let (plain, indexed) = (dir.join("plain.u32"), dir.join("docs.u32"));
    write_u32_tokens(&plain, &ids).unwrap();
    write_u32_tokens(&indexed, &ids).unwrap();
    let mut w = IndexWriter::create(&index_path(&indexed)).unwrap();
    starts.iter().for_each(|&s| w.push(s).unwrap());
    w.finish(ids.len() as u64).unwrap();
    let mut data = Dataset::from(ids.clone());
    data.docs = Some(Arc::new(
        DocIndex::new(starts, ids.len() as u64, "t").unwrap(),
    ));
    let d = dir.to_str().unwrap();
    let eval = |file: &std::path::Path, pack: &str| {
        upipe(&[
            "eval",
            "--json",
            "--model-dir",
            d,
            "--tokens",
            file.to_str().unwrap(),
            "--seq",
            "16",
            "--device",
            "cpu",
            "--attn",
            "local",
            "--pack",
            pack,
        ])
    };
    for (pack, mode) in [("documents", PackMode::Documents), ("bfd", PackMode::Bfd)] {
        let out = eval(&indexed, pack);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let c = EvalConfig {
            seq: Some(16),
            pack: mode,
            ..EvalConfig::new(cfg.clone())
        };
        let lib = eval_cpu(&c, data.clone(), &host).unwrap();
        assert_eq!(v["loss"].as_f64().unwrap(), lib.loss, "{pack}");
        assert_eq!(
            v["counted_tokens"].as_u64(),
            Some(lib.counted_tokens as u64),
            "{pack}"
        );
    }
    let out = eval(&plain, "bfd");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no document index"),
        "{err}"
    );
    assert!(err.contains("upipe tokenize"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// An evaluation whose loss mask counts no target is an error naming the
/// mask, not a loss of 0: refused before the weights load when the mask
/// counts nothing at all, after the windows when none of theirs counts.
#[test]
fn eval_with_no_counted_target_is_an_error() {
    use upipe::data::doc_index::{MaskWriter, mask_path};
    let cfg = model();
    let host = host_weights(&cfg, 11);
    let dir = std::env::temp_dir().join(format!("upipe-eval-nothing-{}", std::process::id()));
    save_hf_model(&dir, &cfg, &host, DType::F32).unwrap();
    let ids = random_tokens(2 * 16 + 1, cfg.vocab, 12);
    let file = dir.join("prompts.u32");
    write_u32_tokens(&file, &ids).unwrap();
    // nothing counted at all; then only id 0, which no window targets
    for first in [false, true] {
        let mut m = MaskWriter::create(&mask_path(&file)).unwrap();
        let mut flags = vec![false; ids.len()];
        flags[0] = first;
        m.push(&flags).unwrap();
        m.finish().unwrap();
        let out = upipe(&[
            "eval",
            "--model-dir",
            dir.to_str().unwrap(),
            "--tokens",
            file.to_str().unwrap(),
            "--seq",
            "16",
            "--device",
            "cpu",
        ]);
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && e.contains("counts no target") && e.contains("prompts.u32"),
            "mask counting id 0: {first}: {e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
