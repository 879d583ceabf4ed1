//! Hostile but realistic inputs through the real binary: special files,
//! checkpoints with extra or non-finite tensors, run files with bad
//! values, resumes past the end, absurd model configs. Each must fail
//! fast with an error naming the input and the fix (or, where the input is
//! harmless, succeed saying so), never hang or panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use upipe::backend::DType;
use upipe::checkpoint::{HostTensor, load_safetensors, save_safetensors};

/// Runs `upipe args`: whether it succeeded, its stdout and stderr. A run
/// longer than a minute is a hang: killed, and the test fails.
fn upipe(args: &[&str]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("upipe {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Runs `upipe args`, which must fail without a panic: its stderr.
fn failure(args: &[&str]) -> String {
    let (ok, _, err) = upipe(args);
    assert!(!ok, "upipe {args:?} succeeded");
    assert!(!err.contains("panicked"), "upipe {args:?} panicked: {err}");
    err
}

/// Runs `upipe args`, which must succeed: its stdout and stderr.
fn success(args: &[&str]) -> (String, String) {
    let (ok, out, err) = upipe(args);
    assert!(ok, "upipe {args:?} failed: {err}");
    (out, err)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("upipe-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A checkpoint of the tiny model, trained one step, in `dir`.
fn checkpoint(dir: &Path) {
    success(&[
        "train",
        "--steps",
        "1",
        "--seq",
        "32",
        "--device",
        "cpu",
        "--save-dir",
        s(dir),
    ]);
}

/// Rewrites `dir/model.safetensors` with `edit` applied to its tensors.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, HostTensor)>)) {
    let path = dir.join("model.safetensors");
    let mut tensors: Vec<(String, HostTensor)> =
        load_safetensors(&path).unwrap().into_iter().collect();
    edit(&mut tensors);
    let list: Vec<(String, &HostTensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&path, &list, DType::F32).unwrap();
}

/// `upipe train` of `steps` steps of 32 tokens on the CPU, with `extra`.
fn train_steps(steps: &str, extra: &[&str]) -> Vec<String> {
    let base = ["train", "--steps", steps, "--seq", "32", "--device", "cpu"];
    base.iter().chain(extra).map(|a| a.to_string()).collect()
}

fn train_with(extra: &[&str]) -> Vec<String> {
    train_steps("1", extra)
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn special_files_are_refused_before_they_are_opened() {
    let dir = scratch("fifo");
    let (fifo_ids, fifo_text) = (dir.join("fifo.u32"), dir.join("fifo.txt"));
    for f in [&fifo_ids, &fifo_text] {
        assert!(Command::new("mkfifo").arg(f).status().unwrap().success());
    }
    let cases: Vec<Vec<String>> = vec![
        train_with(&["--data", s(&fifo_ids)]),
        train_with(&["--data", s(&fifo_text)]),
        train_with(&["--tokenizer", s(&fifo_text)]),
        train_with(&["--model", s(&fifo_text)]),
        train_with(&["--init-from", s(&fifo_text)]),
        vec!["train".into(), "--config".into(), s(&fifo_text).into()],
        vec!["plan".into(), "--config".into(), s(&fifo_text).into()],
        [
            "tokenize",
            s(&fifo_text),
            "--tokenizer",
            "byte",
            "--eos",
            "0",
            "--out",
        ]
        .iter()
        .map(|a| a.to_string())
        .chain([s(&dir.join("out.u32")).to_string()])
        .collect(),
        vec!["report".into(), s(&fifo_text).into()],
    ];
    for args in &cases {
        let e = failure(&strs(args));
        assert!(e.contains("FIFO") && e.contains("fifo."), "{args:?}: {e}");
    }
    let e = failure(&strs(&train_with(&["--data", "/dev/zero"])));
    assert!(e.contains("--data /dev/zero is a character device"), "{e}");
    // a directory holds documents: the error names the command that tokenizes them
    let e = failure(&strs(&train_with(&["--data", s(&dir)])));
    assert!(
        e.contains("holds documents to tokenize") && e.contains("`upipe tokenize"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn extra_tensors_are_refused_unless_allowed_and_then_named() {
    let dir = scratch("extra");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let bias = "model.layers.0.self_attn.q_proj.bias";
    edit_weights(&ckpt, |t| {
        t.push((bias.into(), HostTensor::zeros(vec![64])));
        // written by older transformers, no parameter: accepted silently
        let inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq";
        t.push((inv_freq.into(), HostTensor::zeros(vec![8])));
    });
    let tokens = dir.join("t.u32");
    upipe::data::write_u32_tokens(&tokens, &[7; 200]).unwrap();
    for fsdp in ["off", "on"] {
        let args = train_with(&["--init-from", s(&ckpt), "--fsdp", fsdp]);
        let e = failure(&strs(&args));
        assert!(
            e.contains(bias) && e.contains("1 tensor") && e.contains("--allow-extra-tensors"),
            "{e}"
        );
        assert!(!e.contains("inv_freq"), "{e}");
        let allowed = train_with(&[
            "--init-from",
            s(&ckpt),
            "--fsdp",
            fsdp,
            "--allow-extra-tensors",
        ]);
        let (_, log) = success(&strs(&allowed));
        assert!(log.contains("WARN") && log.contains(bias), "{log}");
    }
    let eval = [
        "eval",
        "--json",
        "--model-dir",
        s(&ckpt),
        "--tokens",
        s(&tokens),
        "--device",
        "cpu",
    ];
    let e = failure(&eval);
    assert!(e.contains(bias), "{e}");
    let allowed: Vec<&str> = eval
        .iter()
        .copied()
        .chain(["--allow-extra-tensors"])
        .collect();
    let (out, log) = success(&allowed);
    assert!(out.contains("\"loss\"") && log.contains(bias), "{log}");
    // the flag is a run-file key, and needs --init-from
    let run = dir.join("run.toml");
    std::fs::write(&run, "[model]\nallow-extra-tensors = true\n").unwrap();
    let e = failure(&strs(&train_with(&["--config", s(&run)])));
    assert!(
        e.contains("[model] allow-extra-tensors") && e.contains("--init-from"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_non_finite_weight_is_refused_at_load() {
    let dir = scratch("nan");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let name = "model.layers.1.mlp.up_proj.weight";
    edit_weights(&ckpt, |t| {
        let w = t.iter_mut().find(|(n, _)| n == name).unwrap();
        w.1.data[77] = f32::NAN;
    });
    for fsdp in ["off", "on"] {
        let e = failure(&strs(&train_with(&[
            "--init-from",
            s(&ckpt),
            "--fsdp",
            fsdp,
        ])));
        assert!(
            e.contains(name) && e.contains("model.safetensors") && e.contains("element 77"),
            "{e}"
        );
    }
    // what --resume loads too
    let args = train_steps("3", &["--save-dir", s(&ckpt), "--resume"]);
    let e = failure(&strs(&args));
    assert!(e.contains(name) && e.contains("element 77"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn print_config_validates_values_as_train_does() {
    let dir = scratch("print");
    let run = dir.join("c.toml");
    for (text, key) in [
        ("[optim]\nlr = nan\n", "[optim] lr"),
        ("[optim]\nclip = -1.0\n", "[optim] clip"),
        ("[checkpoint]\nsave-every = 5\n", "[checkpoint] save-every"),
    ] {
        std::fs::write(&run, text).unwrap();
        let e = failure(&["train", "--print-config", "--config", s(&run)]);
        assert!(e.contains(key), "{text}: {e}");
    }
    std::fs::write(&run, "[optim]\nlr = 1e-3\n").unwrap();
    let (out, _) = success(&["train", "--print-config", "--config", s(&run)]);
    assert!(out.contains("lr = 0.001"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_resume_at_or_past_the_last_step_says_so() {
    let dir = scratch("resume");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let (out, _) = success(&strs(&train_with(&["--save-dir", s(&ckpt), "--resume"])));
    assert!(out.contains("nothing is left to train"), "{out}");
    let state = ckpt.join("state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&state, text.replace("\"step\": 1", "\"step\": 500")).unwrap();
    let args = train_steps("10", &["--save-dir", s(&ckpt), "--resume"]);
    let e = failure(&strs(&args));
    assert!(e.contains("step 500, past --steps 10"), "{e}");
    let e = failure(&strs(&train_with(&["--resume"])));
    assert!(e.contains("--resume") && e.contains("--save-dir"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_text_data_names_what_is_wrong() {
    let dir = scratch("text");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let e = failure(&strs(&train_with(&["--data", s(&empty)])));
    assert!(e.contains("empty.txt is empty"), "{e}");
    let binary = dir.join("ids.dat");
    std::fs::write(&binary, [0x41, 0x42, 0xff, 0xfe, 0]).unwrap();
    let e = failure(&strs(&train_with(&["--data", s(&binary)])));
    assert!(
        e.contains("not UTF-8 text (byte 2") && e.contains(".u32"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tokenize_refuses_pre_tokenized_inputs_and_keeps_them() {
    let dir = scratch("tokenize");
    let ids = dir.join("ids.u32");
    upipe::data::write_u32_tokens(&ids, &[65, 66, 67, 10]).unwrap();
    let before = std::fs::read(&ids).unwrap();
    let args = [
        "tokenize",
        s(&ids),
        "--tokenizer",
        "byte",
        "--eos",
        "0",
        "--out",
        s(&ids),
    ];
    let e = failure(&args);
    assert!(e.contains("is the same file as the input"), "{e}");
    let other = dir.join("other.u32");
    let e = failure(&[&args[..7], &[s(&other)]].concat());
    assert!(e.contains("pre-tokenized") && e.contains("--data"), "{e}");
    assert_eq!(
        std::fs::read(&ids).unwrap(),
        before,
        "the input is untouched"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn absurd_model_configs_fail_fast_without_a_panic() {
    let dir = scratch("config");
    let ckpt = dir.join("ckpt");
    checkpoint(&ckpt);
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    for (key, value, says) in [
        (
            "num_hidden_layers",
            serde_json::json!(100_000_000u64),
            "1024",
        ),
        (
            "intermediate_size",
            serde_json::json!(u64::MAX),
            "too many to count",
        ),
        ("num_attention_heads", serde_json::json!(0), "heads is 0"),
    ] {
        let mut cfg = base.clone();
        cfg[key] = value;
        let path = dir.join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        let e = failure(&strs(&train_with(&["--model", s(&path)])));
        assert!(e.contains(says), "{key}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stage_flags_without_upipe_name_what_they_need() {
    let bench = [
        "bench",
        "attn",
        "--device",
        "cpu",
        "--methods",
        "ring",
        "--iters",
        "1",
        "--warmup",
        "0",
    ];
    for flag in [["--chunk-heads", "2"], ["--fwd-chunk-heads", "2"]] {
        let args: Vec<&str> = bench.iter().chain(&flag).copied().collect();
        let e = failure(&args);
        assert!(e.contains(flag[0]) && e.contains("no upipe"), "{e}");
    }
    let e = failure(&strs(&train_with(&["--save-every", "5"])));
    assert!(
        e.contains("--save-every") && e.contains("add --save-dir"),
        "{e}"
    );
}
