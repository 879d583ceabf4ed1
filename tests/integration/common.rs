//! Shared by the integration tests: the tiny model the CPU tests build
//! ([`tiny`]), and for the multi-process GPU tests, this test binary re-run
//! as two ranks (one per GPU) with torchrun-style variables, and what they
//! printed.

use std::collections::BTreeMap;
use std::process::Command;
use upipe::model::{Family, ModelConfig};

/// A loss and the gradients of every parameter by name.
pub type LossGrads = (f64, BTreeMap<String, Vec<f32>>);

/// `got` equals `want` to 1e-5 relative: the loss and every gradient.
pub fn assert_loss_grads_close(got: &LossGrads, want: &LossGrads, what: &str) {
    let loss_err = ((got.0 - want.0) / want.0).abs();
    assert!(loss_err <= 1e-5, "{what}: loss {} vs {}", got.0, want.0);
    assert_eq!(got.1.len(), want.1.len());
    for (name, g) in &got.1 {
        let err = upipe::attention::trial::rel_err(g, &want.1[name]);
        assert!(err <= 1e-5, "{what}: {name} rel err {err:e}");
    }
}

/// The tiny model the CPU tests share: 8 query heads over 2 kv heads of
/// dim 8, hidden 32, ffn 48; Qwen3 (QK-norm) with `qk_norm`, else Llama.
pub fn tiny(qk_norm: bool) -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.family = if qk_norm {
        Family::Qwen3
    } else {
        Family::Llama
    };
    c.heads = 8;
    c.kv_heads = 2;
    c.head_dim = 8;
    c.hidden = 32;
    c.ffn = 48;
    c.validate().unwrap();
    c
}
use std::time::{Duration, Instant};

/// A random window of `seq + 1` tokens below `vocab` (seed 9): the inputs
/// and their next-token targets.
pub fn random_window(seq: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut rng = upipe::rng::Rng::new(9);
    let t: Vec<u32> = (0..=seq).map(|_| rng.below(vocab as u64) as u32).collect();
    (t[..seq].to_vec(), t[1..].to_vec())
}

/// [`tiny`] as a Qwen2: biases on the q/k/v projections, tied embeddings
/// and YaRN RoPE scaling (factor 4 over an original context of 8).
pub fn tiny_qwen2() -> ModelConfig {
    use upipe::model::config::{RopeScaling, YarnScaling};
    let mut c = tiny(false);
    c.family = Family::Qwen2;
    c.tie_embeddings = true;
    c.rope_scaling = Some(RopeScaling::Yarn(YarnScaling {
        factor: 4.0,
        original_max_position_embeddings: 8,
        original_given: true,
        beta_fast: None,
        beta_slow: None,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
        truncate: None,
    }));
    c.validate().unwrap();
    c
}

/// One finished rank.
pub struct RankOutput {
    pub success: bool,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

/// A free loopback port for a rendezvous.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Why two NCCL ranks cannot run here, if they cannot.
pub fn two_gpus_missing() -> Option<String> {
    let n = match upipe::backend::cuda::device::gpus() {
        Ok(g) => g.len(),
        Err(e) => return Some(format!("no CUDA driver ({e})")),
    };
    if n < 2 {
        return Some(format!("needs 2 GPUs, found {n}"));
    }
    upipe::comm::nccl::library().err().map(|e| e.to_string())
}

/// Runs test `test` of module `module` (its `module_path!()`) of this
/// binary as ranks 0 and 1 (`role_var` set to the test's name, plus `env`),
/// draining their output while they run; stops both when one fails or after
/// `timeout`. Prints each rank's output.
pub fn run_two_ranks(
    module: &str,
    test: &str,
    role_var: &str,
    env: &[(&str, String)],
    timeout: Duration,
) -> Vec<RankOutput> {
    let port = free_port().to_string();
    let exe = std::env::current_exe().unwrap();
    // libtest names a test by its path below the crate root
    let module = module.split_once("::").map_or("", |(_, m)| m);
    let full_name = format!("{module}::{test}");
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args([
                full_name.as_str(),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(role_var, test)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    // a rank that fills a pipe nobody reads blocks on its next write
    let drains: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let (out, err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
            let read = |mut r: Box<dyn std::io::Read + Send>| {
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = r.read_to_string(&mut s);
                    s
                })
            };
            (read(Box::new(out)), read(Box::new(err)))
        })
        .collect();
    let deadline = Instant::now() + timeout;
    let mut done = [None, None];
    while done.iter().any(Option::is_none) {
        for (i, c) in children.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = c.try_wait().unwrap();
            }
        }
        if done.iter().any(|s| s.is_some_and(|s| !s.success())) || Instant::now() > deadline {
            for c in children.iter_mut() {
                let _ = c.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children
        .into_iter()
        .zip(drains)
        .enumerate()
        .map(|(rank, (mut c, (o, e)))| {
            let status = c.wait().unwrap();
            let (stdout, stderr) = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
            println!("--- rank {rank} ({status:?})\n{stdout}{stderr}");
            RankOutput {
                success: status.success(),
                status: format!("{status:?}"),
                stdout,
                stderr,
            }
        })
        .collect()
}

/// A fresh directory for one test, removed on drop; unique within the test
/// binary (a counter) and across runs (the process id), `tag` naming it.
pub struct Tmp(pub std::path::PathBuf);

impl Tmp {
    pub fn new(tag: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("upipe-test-{}-{n}-{tag}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tmp(dir)
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }

    /// [`path`](Tmp::path) as a string (for command lines).
    pub fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `upipe args`: its stdout, stderr and whether it succeeded.
pub fn upipe(args: &[&str]) -> (String, String, bool) {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

/// Every JSON step line of a successful `upipe train --json args`.
pub fn train_steps(args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["train", "--json"];
    all.extend_from_slice(args);
    let (stdout, log, success) = upipe(&all);
    assert!(success, "upipe {all:?} failed: {log}");
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["step"].as_u64().is_some())
        .collect()
}

/// A step line's loss.
pub fn step_loss(s: &serde_json::Value) -> f64 {
    s["loss"].as_f64().unwrap()
}

/// Elements in each slot of [`three_adamw_steps`].
pub const ADAMW_SLOT: usize = 3 * 256 + 40;

/// AdamW over four BF16 slots of [`ADAMW_SLOT`] elements (the embedding, a
/// block of two slots, one of a norm piece and a matrix piece, and the
/// head) trained 3 steps with BF16 gradients on `b`, with `host_units`
/// units' state on the host updated as `host_update` says: the parameters
/// and each moment's values after them, as bits, and the most optimizer
/// state the device held at once while the host's was updated. Each step's
/// host updates are settled at once.
pub fn three_adamw_steps<B: upipe::backend::Backend>(
    b: &B,
    state: upipe::optim::StateFormat,
    host_units: usize,
    host_update: upipe::model::HostUpdate,
) -> (Vec<Vec<u32>>, usize) {
    adamw_steps(b, state, (host_units, host_update), false)
}

/// [`three_adamw_steps`], settling each step's host updates unit by unit
/// in update order (as the next forward does) where `by_unit` says so.
pub fn adamw_steps<B: upipe::backend::Backend>(
    b: &B,
    state: upipe::optim::StateFormat,
    (host_units, host_update): (usize, upipe::model::HostUpdate),
    by_unit: bool,
) -> (Vec<Vec<u32>>, usize) {
    use upipe::backend::{Category, DType, Tensor};
    use upipe::model::Unit;
    use upipe::optim::settling::update_order;
    use upipe::optim::{
        AdamW, AdamWConfig, Lent, Optimizer, Piece, Slot, StateKind, slots_through,
    };
    let n = ADAMW_SLOT;
    let piece = |name: &str, at| Piece {
        name: name.into(),
        at,
    };
    let slots = vec![
        Slot::whole(Unit::Embed, "embed.weight".into(), n),
        Slot {
            unit: Unit::Block(0),
            pieces: vec![piece("b.norm.weight", 0..300), piece("b.w.weight", 300..n)],
        },
        Slot::whole(Unit::Block(0), "b.v.weight".into(), n),
        Slot::whole(Unit::Head, "head.weight".into(), n),
    ];
    let wave = |k: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + k * 131) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let bf16 = |v: &[f32], cat| b.from_host(v, &[n], DType::BF16, cat).unwrap();
    let mut params: Vec<Tensor<B>> = (0..slots.len())
        .map(|k| bf16(&wave(k), Category::Weights))
        .collect();
    let cfg = AdamWConfig {
        state,
        ..AdamWConfig::schedule(1e-2, 1e-2, 0, 3)
    }
    .placed(host_units, host_update, 11);
    let refs: Vec<&Tensor<B>> = params.iter().collect();
    let mut opt = AdamW::new(b, cfg, slots, &refs, 1).unwrap();
    let mut settling = 0;
    for step in 1..=3u32 {
        let mut grads: Vec<_> = (0..params.len())
            .map(|k| bf16(&wave(10 * step as usize + k), Category::Grads))
            .collect();
        let mut lent = Lent {
            params: params.iter_mut().map(Some).collect(),
            grads: grads.iter_mut().map(Some).collect(),
        };
        opt.step(b, &mut lent, 0.5, step, true).unwrap();
        let state_before = b.ledger().current_of(Category::OptimState);
        b.ledger().reset_peak();
        let mut through: Vec<usize> = match by_unit {
            true => (update_order(1).into_iter())
                .map(|u| slots_through(opt.slots(), u, 1))
                .collect(),
            false => Vec::new(),
        };
        through.push(usize::MAX);
        for upto in through {
            opt.settle(b, &mut lent, upto).unwrap();
        }
        let stats = b.ledger().stats();
        let held = stats.peak_by_category.iter();
        let most = held
            .filter(|(c, _)| *c == Category::OptimState)
            .map(|(_, n)| *n);
        settling = settling.max(most.sum::<usize>() - state_before);
    }
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let mut out: Vec<Vec<u32>> = params.iter().map(|p| bits(b.to_host(p).unwrap())).collect();
    for k in 0..params.len() {
        for kind in [StateKind::EXP_AVG, StateKind::EXP_AVG_SQ] {
            out.push(bits(opt.state_values(b, k, kind).unwrap().unwrap()));
        }
    }
    (out, settling)
}

/// The attention layer's dimensions of the tiny CPU tests: hidden 32, head
/// dim 8, plain RoPE, BF16 precision.
pub fn tiny_attn_dims(heads: usize, kv_heads: usize, qk_norm: bool) -> upipe::attention::AttnDims {
    use upipe::attention::AttnDims;
    AttnDims {
        hidden: 32,
        heads,
        kv_heads,
        head_dim: 8,
        qk_norm,
        norm: upipe::backend::RmsNorm::plain(1e-6),
        rope: upipe::attention::rope::RopeConfig {
            theta: 10000.0,
            scaling: None,
        },
        softmax_scale: AttnDims::default_softmax_scale(8),
        precision: upipe::backend::fp8::Precision::Bf16,
    }
}
