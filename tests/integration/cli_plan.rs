//! `upipe plan` through the real binary: its prediction equals what
//! `upipe train` measures, the search ranks UPipe above Ulysses, and bad
//! inputs are clear errors.

use serde_json::Value;
use std::process::Command;

fn upipe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `upipe train` of the tiny model, one step of 256 tokens with `flags`:
/// its last metrics line and its stderr.
fn train_tiny(flags: &[&str]) -> (Value, String) {
    let base = ["train", "--steps", "1", "--seq", "256", "--json"];
    let (ok, out, err) = upipe(&[&base[..], flags].concat());
    assert!(ok, "{err}");
    (json_lines(&out).pop().unwrap(), err)
}

/// `upipe plan` of that run on the mesh `train` picks for it (UPipe over
/// 2 × 2 ranks): its JSON row.
fn plan_tiny(flags: &[&str]) -> Value {
    let base =
        "plan --model tiny --gpus 4 --device cpu --seq 256 --attn upipe --ulysses 2 --ring 2";
    let base: Vec<&str> = base.split(' ').chain(["--json"]).collect();
    let (ok, out, err) = upipe(&[&base[..], flags].concat());
    assert!(ok, "{err}");
    json_lines(&out).pop().unwrap()
}

#[test]
fn plan_predicts_the_peak_that_train_measures() {
    let (last, _) = train_tiny(&["--checkpoint", "--offload", "--tiled-mlp"]);
    let measured = last["peak_bytes"].as_u64().unwrap();
    assert_eq!(last["predicted_peak_bytes"].as_u64().unwrap(), measured);
    let v = plan_tiny(&["--policies", "checkpoint,offload,tiled-mlp"]);
    assert_eq!(v["peak_bytes"].as_u64().unwrap(), measured);
    assert!(
        v["host_bytes"].as_u64().unwrap() > 0,
        "offloaded inputs on the host"
    );
    assert_eq!(v["fits"], Value::Bool(true));
    // `--save-attention auto` (the default of both) keeps both tiny blocks'
    // attention outputs; train and plan agree on any explicit setting too
    assert_eq!(v["save_attention"], 2);
    for save in ["none", "1"] {
        let (last, err) = train_tiny(&["--checkpoint", "--tiled-mlp", "--save-attention", save]);
        assert!(
            err.contains(&format!("--save-attention {save}: the last")),
            "{err}"
        );
        let measured = last["peak_bytes"].as_u64().unwrap();
        let v = plan_tiny(&[
            "--policies",
            "checkpoint,tiled-mlp",
            "--save-attention",
            save,
        ]);
        assert_eq!(
            v["peak_bytes"].as_u64().unwrap(),
            measured,
            "--save-attention {save}"
        );
    }
}

#[test]
fn plan_shows_what_save_attention_auto_keeps() {
    let plan = |seq: &str, save: &str| {
        let (ok, out, err) = upipe(&[
            "plan",
            "--model",
            "llama3.2-1b",
            "--gpus",
            "1",
            "--gpu-mem",
            "139",
            "--attn",
            "upipe",
            "--ulysses",
            "1",
            "--policies",
            "checkpoint",
            "--seq",
            seq,
            "--save-attention",
            save,
            "--json",
        ]);
        assert!(ok, "{err}");
        json_lines(&out).pop().unwrap()
    };
    // all 16 blocks' outputs fit beside a 128K step, some beside a 576K one
    let v = plan("131072", "auto");
    assert_eq!(v["save_attention"], 16);
    assert_eq!(v["peak_bytes"], plan("131072", "all")["peak_bytes"]);
    let v = plan("589824", "auto");
    let n = v["save_attention"].as_u64().unwrap();
    assert!(0 < n && n < 16, "{n}");
    assert_eq!(v["fits"], Value::Bool(true));
    assert_eq!(plan("589824", "all")["fits"], Value::Bool(false));
    assert!(plan("589824", "none")["peak_bytes"].as_u64() < v["peak_bytes"].as_u64());
}

/// `--offload-optimizer auto` keeps on the host the fewest units that
/// make the step fit beside the rest (fixed here): one fewer does not fit,
/// and a step too long for any unit's state on the GPU keeps every unit's
/// on the host.
#[test]
fn plan_shows_what_offload_optimizer_auto_keeps_on_the_host() {
    let plan = |seq: &str, units: &str| {
        let (ok, out, err) = upipe(&[
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            "1",
            "--gpu-mem",
            "139",
            "--attn",
            "local",
            "--policies",
            "checkpoint,tiled-mlp",
            "--save-attention",
            "all",
            "--seq",
            seq,
            "--offload-optimizer",
            units,
            "--host-mem",
            "inf",
            "--json",
        ]);
        assert!(ok, "{err}");
        json_lines(&out).pop().unwrap()
    };
    let v = plan("65536", "auto");
    let n = v["optimizer_host_units"].as_u64().unwrap();
    assert!(0 < n && n < 34, "{n} of 34 units on the host at 64K");
    assert_eq!(v["fits"], Value::Bool(true));
    assert_eq!(v["peak_bytes"], plan("65536", &n.to_string())["peak_bytes"]);
    assert_eq!(
        plan("65536", &(n - 1).to_string())["fits"],
        Value::Bool(false)
    );
    assert_eq!(plan("65536", "none")["fits"], Value::Bool(false));
    assert!(plan("65536", "all")["peak_bytes"].as_u64() < v["peak_bytes"].as_u64());
    // at 160K the kept attention outputs leave no room for any unit's state
    assert_eq!(plan("163840", "auto")["optimizer_host_units"], 34);
}

#[test]
fn search_finds_longer_contexts_for_upipe_and_names_the_limit() {
    let (ok, out, err) = upipe(&[
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--gpu-mem",
        "80",
        "--policies",
        "checkpoint,offload,tiled-mlp,fsdp",
        "--attn",
        "ulysses,upipe",
        "--host-mem",
        "inf",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v = json_lines(&out);
    let longest = |i: usize| v[i]["longest_seq"].as_u64().unwrap();
    assert_eq!(v[0]["strategy"], "ulysses");
    assert!(longest(1) > longest(0), "upipe beyond ulysses: {out}");
    for x in &v {
        let limit = &x["limit"];
        assert!(limit["peak_bytes"].as_u64().unwrap() > x["peak_bytes"].as_u64().unwrap());
        assert!(limit["reason"].as_str().unwrap().starts_with("gpu: "));
    }
    // a host that cannot hold the offloaded block inputs limits the length
    let (ok, out, _) = upipe(&[
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--policies",
        "checkpoint,offload,tiled-mlp,fsdp",
        "--attn",
        "upipe",
        "--host-mem",
        "256",
        "--json",
    ]);
    assert!(ok);
    let v = json_lines(&out).pop().unwrap();
    assert_eq!(v["limit"]["reason"], "host: offload_host");
    assert!(v["longest_seq"].as_u64().unwrap() < longest(1));
}

#[test]
fn bad_inputs_are_clear_errors() {
    for (args, want) in [
        (
            vec!["plan", "--model", "nope", "--gpus", "8"],
            "unknown model 'nope'",
        ),
        (
            vec![
                "plan",
                "--model",
                "llama3-8b",
                "--gpus",
                "12",
                "--ulysses",
                "8",
            ],
            "not a product of the mesh",
        ),
        (
            vec![
                "plan",
                "--model",
                "llama3-8b",
                "--gpus",
                "6",
                "--attn",
                "ulysses",
                "--ulysses",
                "6",
            ],
            "must divide the 32 query heads",
        ),
        (
            vec![
                "plan",
                "--model",
                "llama3-8b",
                "--gpus",
                "8",
                "--policies",
                "zero",
            ],
            "unknown policy 'zero'",
        ),
        (
            vec![
                "plan",
                "--model",
                "tiny",
                "--gpus",
                "4",
                "--save-attention",
                "all",
            ],
            "--save-attention all keeps the attention outputs of checkpointed blocks",
        ),
        (
            vec![
                "plan",
                "--model",
                "tiny",
                "--gpus",
                "4",
                "--policies",
                "checkpoint",
                "--save-attention",
                "3",
            ],
            "the model has 2 blocks",
        ),
        (
            vec!["train", "--steps", "1", "--save-attention", "1"],
            "add --checkpoint",
        ),
        (
            vec!["plan", "--host-mem", "nan"],
            "--host-mem must be a non-negative number of GiB",
        ),
    ] {
        let (ok, _, err) = upipe(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `upipe args` within `limit` (killed after it): (success, stdout, stderr, seconds).
fn upipe_within(args: &[&str], limit: std::time::Duration) -> (bool, String, String, f64) {
    use std::process::Stdio;
    let started = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("upipe {args:?} still running after {limit:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
        started.elapsed().as_secs_f64(),
    )
}

/// Nothing to plan is an error (every strategy skipped, or a length of 0),
/// and the search on many GPUs ends in seconds: a ring beyond the planner's
/// limit is refused with the fix instead of being walked for minutes.
#[test]
fn plan_fails_when_nothing_can_be_planned_and_stays_bounded() {
    let limit = std::time::Duration::from_secs(60);
    let (ok, _, err, _) = upipe_within(&["plan", "--seq", "0"], limit);
    assert!(
        !ok && err.contains("--seq") && err.contains("at least 1"),
        "{err}"
    );
    // a ring of 10^6 GPUs: every strategy's ring (or Ulysses degree) is refused
    let (ok, out, err, _) =
        upipe_within(&["plan", "--gpus", "1000000", "--ring", "1000000"], limit);
    assert!(!ok, "{out}");
    assert!(err.contains("nothing to plan"), "{err}");
    assert!(
        out.contains("longer than the 4096 the planner plans"),
        "{out}"
    );
    let (ok, _, err, _) = upipe_within(&["plan", "--gpus", "8192", "--attn", "ring"], limit);
    assert!(!ok && err.contains("--data-parallel"), "{err}");
    // mesh flags of 0 or of many digits name the flag
    for (args, want) in [
        (
            &["plan", "--data-parallel", "0"][..],
            "--data-parallel / [parallel] data-parallel is 0",
        ),
        (
            &["plan", "--ring", "0", "--gpus", "4"][..],
            "--ring / [parallel] ring is 0",
        ),
        (
            &["plan", "--gpus", "4611686018427387904"][..],
            "plan at most 16777216 GPUs",
        ),
        (
            &["plan", "--ring", "4611686018427387904"][..],
            "--ring is 4611686018427387904",
        ),
        // lengths whose walk takes minutes (or forever, doubling towards 2^64)
        (
            &["plan", "--seq", "1099511627776"][..],
            "at most 4294967296",
        ),
        (
            &[
                "plan",
                "--max-seq",
                "18446744073709551615",
                "--gpu-mem",
                "1e12",
            ][..],
            "--max-seq",
        ),
    ] {
        let (ok, _, err, _) = upipe_within(args, limit);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
    // a ring of 4096 is planned (it took minutes before the planner walked
    // one ring rank of each kind)
    let (ok, out, err, _) = upipe_within(&["plan", "--gpus", "4096", "--attn", "ring"], limit);
    assert!(ok, "{err}");
    assert!(out.contains("1x1x4096"), "{out}");
}

#[test]
fn plan_without_policies_resolves_fsdp_as_train_does() {
    // `train` on 8 GPUs of 80 GiB shards Llama3-8B by itself (--fsdp auto,
    // the default of both): so does `plan`, and UPipe fits a context
    let (ok, out, err) = upipe(&[
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--attn",
        "upipe",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v = json_lines(&out).pop().unwrap();
    assert_eq!(v["strategy"], "upipe", "{out}");
    assert!(v["longest_seq"].as_u64().unwrap() > 0, "{out}");
}

#[test]
fn typed_choices_refuse_bad_values_naming_the_valid_ones() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["plan", "--attn", "bogus"],
            "use one of local, ulysses, ring, usp, upipe",
        ),
        (&["plan", "--fsdp", "maybe"], "use auto, on or off"),
        (
            &["bench", "attn", "--data-parallel", "2"],
            "leave --data-parallel out",
        ),
    ];
    for (args, fix) in cases {
        let (ok, _, err) = upipe(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(fix), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `plan --gpus N` with only some mesh flags plans the mesh `train` resolves
/// from the same flags on N GPUs (one function, `plan::mesh::resolve_mesh`).
#[test]
fn plan_fills_a_partial_mesh_as_train_does() {
    use upipe::attention::Strategy;
    use upipe::model::ModelConfig;
    use upipe::plan::mesh::{MeshFlags, resolve_mesh};
    let tiny = ModelConfig::resolve("tiny").unwrap();
    let cases: [(&[&str], MeshFlags); 3] = [
        (
            &["--data-parallel", "2"],
            MeshFlags {
                data: Some(2),
                ..MeshFlags::default()
            },
        ),
        (
            &["--ulysses", "2"],
            MeshFlags {
                ulysses: Some(2),
                ..MeshFlags::default()
            },
        ),
        (
            &["--ring", "4"],
            MeshFlags {
                ring: Some(4),
                ..MeshFlags::default()
            },
        ),
    ];
    for (flags, mesh_flags) in cases {
        let train = resolve_mesh(mesh_flags, Strategy::Upipe, &tiny, 4096, None, Some(8));
        assert_eq!(train.world_size(), 8, "{flags:?}: {train:?}");
        let args = [
            &["plan", "--device", "cpu", "--gpus", "8", "--seq", "4096"],
            flags,
        ]
        .concat();
        let (ok, out, err) = upipe(&args);
        assert!(ok, "{err}");
        let want = format!("{}x{}x{}", train.data, train.ulysses, train.ring);
        let row = format!("{:<8} {:>9}", "upipe", want);
        assert!(out.contains(&row), "{flags:?}: want {want}\n{out}");
    }
    // `--data-parallel 2` on 8 GPUs: 2 replicas of Pu 2 x Pr 2 (the tiny model's 2 kv heads)
    let d2 = MeshFlags {
        data: Some(2),
        ..MeshFlags::default()
    };
    let m = resolve_mesh(d2, Strategy::Upipe, &tiny, 4096, None, Some(8));
    assert_eq!((m.data, m.ulysses, m.ring), (2, 2, 2));
}

/// `upipe plan` says which cuDNN it plans: `--cudnn-version` (or `[plan]
/// cudnn-version`), else the one that loads here, else 9.14; a version it
/// cannot read, or one given where no attention runs on cuDNN, is an error.
#[test]
fn plan_names_the_cudnn_version_it_plans() {
    let at = [
        "plan",
        "--model",
        "llama3.2-1b",
        "--gpus",
        "1",
        "--attn",
        "local",
        "--seq",
        "1000",
    ];
    let plan = |extra: &[&str]| {
        let (ok, out, err) = upipe(&[&at[..], extra].concat());
        assert!(ok, "{extra:?}: {err}");
        out
    };
    for (given, want) in [
        ("9.19", "9.19.0"),
        ("9.10.1", "9.10.1"),
        ("91900", "9.19.0"),
    ] {
        let out = plan(&["--cudnn-version", given]);
        let line = format!("planned for cuDNN {want} (--cudnn-version)");
        assert!(out.contains(&line), "{given}: {out}");
        assert!(out.contains(&format!("cuDNN {want} attention where it applies")));
        let v = json_lines(&plan(&["--cudnn-version", given, "--json"]))
            .pop()
            .unwrap();
        assert_eq!(v["cudnn_version"], want, "{given}");
    }
    // no flag: the loaded cuDNN, or (none loading, as in CI) the default
    let out = plan(&[]);
    assert!(
        out.contains("planned for cuDNN 9.14.0 (no cuDNN loads here")
            || out.contains("(the cuDNN loaded here)"),
        "{out}"
    );
    let native = json_lines(&plan(&["--attn-kernel", "native", "--json"]))
        .pop()
        .unwrap();
    assert_eq!(native["cudnn_version"], Value::Null);
    let dir = std::env::temp_dir().join(format!("upipe-cudnn-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("run.toml");
    let from_file = |text: &str| {
        std::fs::write(&file, text).unwrap();
        upipe(&[&at[..], &["--config", file.to_str().unwrap()]].concat())
    };
    let (ok, out, err) = from_file("[plan]\ncudnn-version = \"9.10\"\n");
    assert!(
        ok && out.contains("planned for cuDNN 9.10.0 (--cudnn-version)"),
        "{err}"
    );
    let (ok, _, err) = from_file("[plan]\ncudnn-version = 9.10\n");
    assert!(!ok && err.contains("cannot tell 9.1 from 9.10"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    for (extra, want) in [
        (
            &["--cudnn-version", "9.x"][..],
            "give a cuDNN version as 9.19, 9.19.0 or 91900",
        ),
        (&["--cudnn-version", "8.9"][..], "older than 9.0"),
        (
            &["--cudnn-version", "9.19", "--device", "cpu"][..],
            "where no attention runs on cuDNN",
        ),
    ] {
        let (ok, _, err) = upipe(&[&at[..], extra].concat());
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
    }
}

/// Each row of the longest-context table names the `upipe train` command
/// that runs it, and that command, run, peaks where `upipe plan --seq`
/// predicts the resolved run at that length (the search holds the `auto`
/// choices it resolves after, within the same budget). On one GPU the
/// default table has UPipe beside `local`.
#[test]
fn each_row_prints_the_train_command_that_reproduces_it() {
    let flags = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--gpus",
        "1",
        "--gpu-mem",
        "0.008",
        "--reserve",
        "0",
        "--policies",
        "checkpoint,tiled-mlp",
        "--json",
    ];
    let (ok, out, err) = upipe(&[&["plan"], &flags[..]].concat());
    assert!(ok, "{err}");
    let rows = json_lines(&out);
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["local", "upipe"]);
    for row in rows {
        let command = row["train_command"]
            .as_str()
            .expect("a row that fits names its command");
        let args: Vec<&str> = command.split_whitespace().collect();
        assert_eq!(args[..2], ["upipe", "train"], "{command}");
        let extra = ["--steps", "1", "--device", "cpu", "--json"];
        let (ok, out, err) = upipe(&[&args[1..], &extra[..]].concat());
        assert!(ok, "{command}: {err}");
        let step = json_lines(&out)
            .into_iter()
            .find(|l| l.get("peak_bytes").is_some())
            .expect("a step line");
        let seq = row["longest_seq"].to_string();
        let at = ["--seq", &seq, "--attn", row["strategy"].as_str().unwrap()];
        let (ok, out, err) = upipe(&[&["plan"], &flags[..], &at[..]].concat());
        assert!(ok, "{err}");
        let planned = json_lines(&out).pop().unwrap();
        assert_eq!(planned["train_command"], row["train_command"]);
        assert_eq!(step["peak_bytes"], planned["peak_bytes"], "{command}");
        assert!(
            step["peak_bytes"].as_u64().unwrap() <= 8_589_934,
            "{command}"
        );
    }
}
