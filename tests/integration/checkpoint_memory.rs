//! A checkpoint's save and resume hold one tensor at a time in host memory:
//! the real binary trains a 50M-parameter model one step and saves, then
//! resumes from that checkpoint, and each run's peak resident memory is
//! held against the same run without the checkpoint. A save that first
//! copied the whole state to the host (weights, masters and both moments)
//! or a resume that read the whole checkpoint before uploading it grows the
//! peak by about the state's size; streamed, by about one tensor.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A fresh directory for one test, removed on drop.
struct Tmp(PathBuf);

impl Tmp {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("upipe-ckptmem-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Tmp(dir)
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Hidden size, MLP width and layers of the measured model: 50.6M
/// parameters, whose largest tensor (an MLP matrix, 4.2M values) is a
/// twelfth of the model.
const HIDDEN: usize = 1024;
const MLP: usize = 4096;
const LAYERS: usize = 3;
const VOCAB: usize = 256;

/// Parameters of the measured model (untied embeddings, no biases).
fn params() -> usize {
    let block = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP + 2 * HIDDEN;
    LAYERS * block + 2 * VOCAB * HIDDEN + HIDDEN
}

/// Writes the measured model's `config.json` (a Llama of the byte
/// tokenizer's 256 ids) into `dir`.
fn model_dir(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": LAYERS,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": false,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model
}

/// Runs `upipe train` on one CPU rank with `args` to its end and returns
/// its peak resident memory in bytes (`wait4`'s `ru_maxrss`: the child's
/// own peak, or the test process's if that was larger when the child
/// started, far below the model's state here).
fn peak_rss(cwd: &Path, model: &Path, args: &[&str]) -> u64 {
    let log = cwd.join("stderr.txt");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_upipe"));
    cmd.current_dir(cwd)
        .args(["train", "--device", "cpu", "--model"])
        .arg(model)
        .args(["--attn", "local", "--ulysses", "1", "--ring", "1"])
        .args(["--fsdp", "off", "--seq", "16", "--warmup", "0", "--json"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    // reaped by wait4 below, which returns the child's resource usage
    let pid = cmd.spawn().unwrap().id() as i32;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it and `status`.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `child` is this process's child, not yet waited for.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(rc, pid, "wait4 failed");
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "upipe {args:?} failed ({status}): {stderr}"
    );
    usage.ru_maxrss as u64 * 1024
}

#[test]
fn saves_and_resumes_hold_one_tensor_at_a_time_in_host_memory() {
    let t = Tmp::new("stream");
    let model = model_dir(&t.0);
    let save = t.0.join("ckpt");
    let save = save.to_str().unwrap();
    // weights, first and second moments in F32
    let state = 3 * 4 * params() as u64;
    let plain = peak_rss(&t.0, &model, &["--steps", "1"]);
    let saved = peak_rss(&t.0, &model, &["--steps", "1", "--save-dir", save]);
    assert!(Path::new(save).join("state.json").is_file());
    let resumed = peak_rss(
        &t.0,
        &model,
        &["--steps", "2", "--save-dir", save, "--resume"],
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "peak RSS: one step {:.0} MiB, with a save {:.0} MiB, resumed and saved {:.0} MiB \
         (state {:.0} MiB)",
        mib(plain),
        mib(saved),
        mib(resumed),
        mib(state)
    );
    // On a 2-core CPU development machine (2026-12-06), from a peak of
    // 799 MiB for the step alone: with the state copied to the host whole,
    // the save grew it by 796 MiB and the resume (and its save) by 794 MiB;
    // streamed, by 19 MiB and 21 MiB (the largest tensor is 16 MiB).
    let bound = state / 3;
    for (what, peak) in [("a save", saved), ("a resume", resumed)] {
        let grown = peak.saturating_sub(plain);
        assert!(
            grown < bound,
            "{what} grew the peak resident memory by {:.0} MiB, over {:.0} MiB (a third of the \
             {:.0} MiB of F32 weights and moments): the state went through host memory whole",
            mib(grown),
            mib(bound),
            mib(state)
        );
    }
}
