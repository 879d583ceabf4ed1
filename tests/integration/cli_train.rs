//! `upipe train`, `upipe eval` and checkpoints through the real binary.

use std::process::Command;

fn upipe(args: &[&str]) -> String {
    upipe_with_log(args).0
}

/// Runs `upipe args`, which must succeed: its stdout and stderr.
fn upipe_with_log(args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "upipe {args:?} failed: {log}");
    (String::from_utf8(out.stdout).unwrap(), log)
}

/// Runs `upipe args`, which must fail, and returns its stderr.
fn upipe_error(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "upipe {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn losses(stdout: &str) -> Vec<f64> {
    json_field(stdout, "loss")
}

/// `key` of every JSON line of `stdout` (a number in each).
fn json_field(stdout: &str, key: &str) -> Vec<f64> {
    stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()[key]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// Two steps on the CPU, 128 tokens, Ulysses 2 (JSON lines).
const TWO_STEPS_ULYSSES_2: [&str; 12] = [
    "train",
    "--steps",
    "2",
    "--json",
    "--device",
    "cpu",
    "--seq",
    "128",
    "--ulysses",
    "2",
    "--ring",
    "1",
];

#[test]
fn default_model_learns_and_its_checkpoint_evaluates_the_same_under_every_strategy() {
    let dir = std::env::temp_dir().join(format!("upipe-train-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let l = losses(&upipe(&[
        "train",
        "--steps",
        "40",
        "--json",
        "--save-dir",
        d,
    ]));
    assert_eq!(l.len(), 40);
    let tail = l[35..].iter().sum::<f64>() / 5.0;
    assert!(
        tail < l[0] - 1.5,
        "loss must fall clearly: {} -> {tail}",
        l[0]
    );

    // evaluate the saved checkpoint on a token file under several strategies
    let toks: Vec<u8> = "the quick brown fox jumps over the lazy dog, said Alice."
        .bytes()
        .flat_map(|b| (b as u32).to_le_bytes())
        .collect();
    let tf = dir.join("eval.u32");
    std::fs::write(&tf, toks).unwrap();
    let eval = |extra: &[&str]| -> f64 {
        let mut args = vec![
            "eval",
            "--json",
            "--model-dir",
            d,
            "--tokens",
            tf.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let v: serde_json::Value = serde_json::from_str(upipe(&args).trim()).unwrap();
        assert_eq!(v["tokens"].as_u64(), Some(55));
        v["loss"].as_f64().unwrap()
    };
    let reference = eval(&["--attn", "local"]);
    assert!(reference.is_finite() && reference > 0.0);
    for extra in [
        &["--attn", "upipe", "--ulysses", "2", "--ring", "2"][..],
        &["--attn", "ring", "--ring", "4"][..],
        &["--attn", "ulysses", "--ulysses", "2"][..],
    ] {
        let got = eval(extra);
        assert!(
            ((got - reference) / reference).abs() < 1e-5,
            "{extra:?}: {got} vs {reference}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn resume_continues_exactly() {
    let base = std::env::temp_dir().join(format!("upipe-resume-{}", std::process::id()));
    let (a, b) = (base.join("a"), base.join("b"));
    let common = [
        "--steps", "4", "--json", "--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "0", "--seq",
        "64",
    ];
    let full = losses(&upipe(
        &[
            &["train"][..],
            &common,
            &["--save-dir", a.to_str().unwrap()],
        ]
        .concat(),
    ));
    let mut first_half: Vec<&str> = vec!["train", "--save-dir", b.to_str().unwrap()];
    first_half.extend_from_slice(&common);
    first_half[4] = "2"; // --steps 2
    assert_eq!(first_half[3], "--steps");
    upipe(&first_half);
    let resumed = losses(&upipe(
        &[
            &["train"][..],
            &common,
            &["--save-dir", b.to_str().unwrap(), "--resume"],
        ]
        .concat(),
    ));
    assert_eq!(resumed.len(), 2, "steps 3 and 4 only");
    for (x, y) in resumed.iter().zip(&full[2..]) {
        assert!(
            (x - y).abs() <= 1e-6 * y.abs(),
            "resumed {x} vs uninterrupted {y}"
        );
    }
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bad_configurations_name_the_fix() {
    let err = upipe_error(&[
        "bench",
        "attn",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--ulysses",
        "4",
        "--methods",
        "upipe",
        "--chunk-heads",
        "6",
    ]);
    assert!(
        err.contains("multiple of the Ulysses degree 4") && err.contains("[4, 8, 16, 32]"),
        "{err}"
    );
    let err = upipe_error(&["train", "--model", "no-such-model"]);
    assert!(err.contains("tiny"), "lists the presets");
    let err = upipe_error(&["train", "--attn-kernel", "fastest", "--steps", "1"]);
    assert!(err.contains("auto, cudnn or native"), "{err}");
    // cuDNN asked for where no GPU runs the attention: said before anything starts
    let err = upipe_error(&["train", "--device", "cpu", "--attn-kernel", "cudnn"]);
    assert!(
        err.contains("--attn-kernel cudnn") && err.contains("--device cpu"),
        "{err}"
    );
    let no_gpu = upipe::backend::cuda::device::gpus().map_or(true, |g| g.is_empty());
    if no_gpu {
        let err = upipe_error(&["train", "--attn-kernel", "cudnn", "--steps", "1"]);
        assert!(err.contains("no GPU is visible"), "{err}");
    }
    let err = upipe_error(&["train", "--lr", "1e-4", "--min-lr", "3e-4", "--steps", "1"]);
    assert!(err.contains("lower --min-lr"), "{err}");
}

#[test]
fn the_schedule_decays_to_a_tenth_of_lr_unless_min_lr_is_given() {
    let lrs = |extra: &[&str]| -> Vec<f64> {
        let mut args = vec!["train", "--steps", "3", "--warmup", "1", "--json"];
        args.extend_from_slice(&["--device", "cpu", "--seq", "64", "--lr", "1e-4"]);
        args.extend_from_slice(extra);
        upipe(&args)
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let tenth = lrs(&[]);
    assert!(
        (tenth[0] - 1e-4).abs() < 1e-9 && (tenth[2] - 1e-5).abs() < 1e-9,
        "{tenth:?}"
    );
    let given = lrs(&["--min-lr", "5e-5"]);
    assert!((given[2] - 5e-5).abs() < 1e-9, "{given:?}");
}

/// Each `--schedule` reaches the run's metrics: the lr of every step (a
/// warm-up of 1 step, 5 steps, 1e-4 down to 1e-5) as its formula gives it.
#[test]
fn each_schedule_sets_the_lr_of_every_step() {
    let lrs = |extra: &[&str]| -> Vec<f64> {
        let mut args = vec!["train", "--steps", "5", "--warmup", "1", "--json"];
        args.extend_from_slice(&["--device", "cpu", "--seq", "32", "--lr", "1e-4"]);
        args.extend_from_slice(&["--data-parallel", "1", "--ulysses", "1", "--ring", "1"]);
        args.extend_from_slice(extra);
        upipe(&args)
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let pi = std::f64::consts::PI;
    // after the warm-up, t = (step - 1) / 4
    let cosine: Vec<f64> = (1..=5)
        .map(|s| 1e-5 + 0.5 * 9e-5 * (1.0 + (pi * (s - 1) as f64 / 4.0).cos()))
        .collect();
    let linear: Vec<f64> = (1..=5)
        .map(|s| 1e-5 + 9e-5 * (1.0 - (s - 1) as f64 / 4.0))
        .collect();
    // wsd over the last 0.4 of 5 steps: 2 decay steps after step 3
    let wsd = vec![1e-4, 1e-4, 1e-4, 1e-5 + 9e-5 * 0.5, 1e-5];
    for (flags, want) in [
        (&["--schedule", "cosine"][..], cosine),
        (&["--schedule", "linear"][..], linear),
        (&["--schedule", "constant"][..], vec![1e-4; 5]),
        (&["--schedule", "wsd", "--decay-fraction", "0.4"][..], wsd),
    ] {
        let got = lrs(flags);
        assert_eq!(got.len(), 5);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-10, "{flags:?}: {got:?} vs {want:?}");
        }
    }
}

/// Each bad optimizer input fails before the run, naming the flag and the fix.
#[test]
fn bad_optimizer_flags_name_the_flag_and_the_fix() {
    let cases: [(&[&str], &[&str]); 6] = [
        (
            &["--schedule", "step"],
            &["--schedule step", "cosine, linear, constant or wsd"],
        ),
        (
            &["--schedule", "wsd", "--decay-fraction", "1.5"],
            &["--decay-fraction 1.5 is outside [0, 1]"],
        ),
        (
            &[
                "--schedule",
                "wsd",
                "--decay-fraction",
                "0.9",
                "--warmup",
                "20",
                "--steps",
                "100",
            ],
            &["sum past --steps 100", "lower --warmup or --decay-fraction"],
        ),
        (&["--decay-fraction", "0.2"], &["add --schedule wsd"]),
        (
            &["--betas", "1.0,0.9"],
            &["beta1 is 1, outside [0, 1)", "[optim] betas"],
        ),
        (&["--eps", "0"], &["--eps / [optim] eps is 0", "above 0"]),
    ];
    for (flags, want) in cases {
        let err = upipe_error(&[&["train", "--device", "cpu"], flags].concat());
        for w in want {
            assert!(err.contains(w), "{flags:?}: {err}");
        }
    }
}

#[test]
fn upipe_forward_in_wider_stages_trains_the_same() {
    let upipe_on_2 = ["train", "--attn", "upipe", "--ulysses", "2", "--ring", "1"];
    let run = |extra: &[&str]| {
        let mut args = upipe_on_2.to_vec();
        args.extend_from_slice(&[
            "--chunk-heads",
            "2",
            "--steps",
            "3",
            "--json",
            "--device",
            "cpu",
        ]);
        args.extend_from_slice(extra);
        losses(&upipe(&args))
    };
    let plain = run(&["--fwd-chunk-heads", "2"]);
    assert_eq!(plain.len(), 3);
    // 4 heads, and `auto` (the default)
    for wide in [run(&["--fwd-chunk-heads", "4"]), run(&[])] {
        for (a, b) in plain.iter().zip(&wide) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{plain:?} vs {wide:?}");
        }
    }
    // a forward stage that is not a multiple of U names the valid values
    let mut args = upipe_on_2.to_vec();
    args.extend_from_slice(&[
        "--chunk-heads",
        "4",
        "--fwd-chunk-heads",
        "2",
        "--steps",
        "1",
    ]);
    let err = upipe_error(&args);
    assert!(
        err.contains("--fwd-chunk-heads 2") && err.contains("[4]"),
        "{err}"
    );
}

/// `--chunk-heads auto`, the default, takes the widest stages that fit (all
/// 4 heads of the tiny model, on a CPU's memory) and trains exactly as that U
/// given; `upipe plan` shows the same pick; a command that cannot choose
/// refuses it, naming `train`.
#[test]
fn chunk_heads_auto_takes_the_widest_stages_that_fit() {
    let upipe_on_2 = ["--attn", "upipe", "--ulysses", "2", "--ring", "1"];
    let run = |chunk: &[&str]| {
        let mut args = vec!["train"];
        args.extend_from_slice(&upipe_on_2);
        args.extend_from_slice(chunk);
        args.extend_from_slice(&["--steps", "2", "--json", "--device", "cpu"]);
        let (stdout, log) = upipe_with_log(&args);
        (losses(&stdout), log)
    };
    for flags in [&["--chunk-heads", "auto"][..], &[]] {
        let (auto, log) = run(flags);
        assert!(
            log.contains("--chunk-heads auto: stages of 4 of 4 heads"),
            "{flags:?}: {log}"
        );
        let (four, _) = run(&["--chunk-heads", "4"]);
        assert_eq!(auto, four, "same U, same arithmetic");
    }
    let (two, log) = run(&["--chunk-heads", "2"]);
    assert_eq!(two.len(), 2);
    assert!(!log.contains("--chunk-heads auto"), "{log}");
    let plan_u = |chunk: &[&str]| {
        let mut args = vec!["plan", "--gpus", "2", "--seq", "4096", "--json"];
        args.extend_from_slice(&upipe_on_2);
        args.extend_from_slice(chunk);
        let out = upipe(&args);
        let line: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
        line["mesh"]["chunk_heads"].as_u64().unwrap()
    };
    assert_eq!(plan_u(&[]), 4);
    assert_eq!(plan_u(&["--chunk-heads", "auto"]), 4);
    assert_eq!(plan_u(&["--chunk-heads", "2"]), 2);
    let err = upipe_error(&["bench", "attn", "--chunk-heads", "auto"]);
    assert!(err.contains("chosen by `upipe train`"), "{err}");
}

/// What a run decides for itself is logged as the flags that repeat it
/// (process ranks compare these before they train): given back, they train
/// the same bits and decide nothing new.
#[test]
fn decided_flags_repeat_the_run() {
    let run = |extra: &[&str]| {
        let mut args = TWO_STEPS_ULYSSES_2.to_vec();
        args.push("--checkpoint");
        args.extend_from_slice(extra);
        let (stdout, log) = upipe_with_log(&args);
        let prefix = "decided from this machine's memory: ";
        let at = log.find(prefix).unwrap_or_else(|| panic!("{log}")) + prefix.len();
        let decided = log[at..].lines().next().unwrap().trim().to_string();
        (losses(&stdout), decided)
    };
    let (auto, decided) = run(&["--offload", "auto", "--offload-optimizer", "auto"]);
    assert!(
        decided.starts_with("--fsdp off --chunk-heads 4 --fwd-chunk-heads")
            && decided.contains("--save-attention 2")
            && decided.ends_with("--offload-optimizer 0"),
        "{decided}"
    );
    let flags: Vec<&str> = decided.split_whitespace().collect();
    let (again, decided_again) = run(&flags);
    assert_eq!(again, auto);
    assert_eq!(decided_again, decided);
}

/// `--offload-optimizer` takes all, a number of units or auto; on the CPU
/// auto keeps every unit's state where it is (moving it to host memory
/// frees nothing there), and every choice trains the same bits.
#[test]
fn offload_optimizer_takes_units_or_auto() {
    let run = |opt: &[&str]| {
        let mut args = vec![
            "train", "--steps", "2", "--json", "--device", "cpu", "--seq", "128",
        ];
        args.extend_from_slice(opt);
        let (stdout, log) = upipe_with_log(&args);
        (losses(&stdout), log)
    };
    let (none, _) = run(&[]);
    let (auto, log) = run(&["--offload-optimizer", "auto"]);
    assert!(
        log.contains(
            "--offload-optimizer auto: 0 of 4 units keep their optimizer state in host memory"
        ),
        "{log}"
    );
    assert_eq!(auto, none);
    for given in [&["--offload-optimizer"][..], &["--offload-optimizer", "1"]] {
        let (got, _) = run(given);
        assert_eq!(got, none, "{given:?}");
    }
    let err = upipe_error(&["train", "--device", "cpu", "--offload-optimizer", "5"]);
    assert!(
        err.contains("--offload-optimizer 5") && err.contains("4 units"),
        "{err}"
    );
    let err = upipe_error(&["train", "--device", "cpu", "--offload-optimizer", "some"]);
    assert!(err.contains("a number of units"), "{err}");
}

/// `--fsdp on` trains the default model sharded with the same losses as
/// `--fsdp off`; one rank has nothing to shard (said on stderr); a replica
/// count that does not divide the mesh is refused naming the choices.
#[test]
fn fsdp_flags() {
    let common = [
        "train", "--steps", "3", "--json", "--seq", "64", "--device", "cpu",
    ];
    let on = losses(&upipe(&[&common[..], &["--fsdp", "on"]].concat()));
    let off = losses(&upipe(&[&common[..], &["--fsdp", "off"]].concat()));
    for (a, b) in on.iter().zip(&off) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "fsdp on {a} vs off {b}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(
            [
                &common[..],
                &[
                    "--attn",
                    "local",
                    "--ulysses",
                    "1",
                    "--ring",
                    "1",
                    "--fsdp",
                    "on",
                ],
            ]
            .concat(),
        )
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nothing to shard"), "{err}");
    let e = upipe_error(&[&common[..], &["--fsdp", "on", "--fsdp-replicate", "3"]].concat());
    assert!(
        e.contains("--fsdp-replicate 3") && e.contains("[1, 2, 4]"),
        "{e}"
    );
    let e = upipe_error(&[&common[..], &["--fsdp", "maybe"]].concat());
    assert!(e.contains("auto, on or off"), "{e}");
}

/// A run the planner says cannot fit is refused before anything is
/// allocated, with the per-category breakdown and what to change.
#[test]
fn a_run_that_cannot_fit_is_refused_before_it_allocates() {
    let e = upipe_error(&[
        "train",
        "--model",
        "llama3-70b",
        "--tokenizer",
        "byte",
        "--seq",
        "65536",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]);
    assert!(
        e.contains("cannot fit") && e.contains("nothing was allocated"),
        "{e}"
    );
    assert!(e.contains("optim_state") && e.contains("weights"), "{e}");
    let e = upipe_error(&["train", "--steps", "1", "--device", "cpu", "--host-mem=0"]);
    assert!(e.contains("--host-mem"), "{e}");
}

/// A sharded checkpoint of 2 ranks resumes on one rank (its shards
/// gathered into one) and that one-rank checkpoint on 2 ranks again.
#[test]
fn sharded_checkpoint_resumes_on_one_rank_and_back() {
    let dir = std::env::temp_dir().join(format!("upipe-cli-one-rank-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let run = |steps: &str, mesh: &[&str], resume: bool| {
        let mut args = vec![
            "train",
            "--device",
            "cpu",
            "--seq",
            "64",
            "--json",
            "--fsdp",
            "on",
            "--save-dir",
            d,
            "--steps",
            steps,
        ];
        args.extend_from_slice(mesh);
        if resume {
            args.push("--resume");
        }
        Command::new(env!("CARGO_BIN_EXE_upipe"))
            .args(&args)
            .output()
            .unwrap()
    };
    let two = ["--attn", "ulysses", "--ulysses", "2", "--ring", "1"];
    let one = ["--attn", "local", "--ulysses", "1", "--ring", "1"];
    assert!(run("2", &two, false).status.success());
    let out = run("4", &one, true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("gathered into one"), "{err}");
    assert_eq!(
        losses(&String::from_utf8_lossy(&out.stdout)).len(),
        2,
        "steps 3 and 4"
    );
    let back = run("6", &two, true);
    assert!(
        back.status.success(),
        "{}",
        String::from_utf8_lossy(&back.stderr)
    );
    assert_eq!(
        losses(&String::from_utf8_lossy(&back.stdout)).len(),
        2,
        "steps 5 and 6"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A thread mesh beyond the cap is refused before anything is allocated
/// (128 thread ranks took 2.7 GB of host memory outside the plan, 512
/// aborted), for train, eval and bench alike.
#[test]
fn thread_meshes_beyond_the_cap_are_refused_with_the_fix() {
    let mesh = ["--ulysses", "4", "--ring", "4", "--data-parallel", "8"];
    let tokens = std::env::temp_dir().join(format!("upipe-mesh-cap-{}.u32", std::process::id()));
    std::fs::write(&tokens, [1u8, 0, 0, 0].repeat(4096)).unwrap();
    let tokens = tokens.to_str().unwrap();
    let eval = ["eval", "--json", "--model-dir", "tiny", "--tokens", tokens];
    for command in [&["train", "--steps", "1"][..], &eval[..]] {
        let args = [command, &["--device", "cpu"][..], &mesh[..]].concat();
        let err = upipe_error(&args);
        assert!(
            err.contains("mesh of 128 ranks") && err.contains("at most 64"),
            "{command:?}: {err}"
        );
        assert!(err.contains("upipe launch --nproc-per-node N"), "{err}");
    }
    let _ = std::fs::remove_file(tokens);
    let err = upipe_error(&["bench", "attn", "--ulysses", "16", "--ring", "8"]);
    assert!(err.contains("mesh of 128 ranks"), "{err}");
}

/// Mesh degrees of many digits are errors naming the flags, not panics
/// (2 x ring x Ulysses overflowed into a division by zero).
#[test]
fn mesh_degrees_beyond_counting_are_errors() {
    let tokens = std::env::temp_dir().join(format!("upipe-mesh-huge-{}.u32", std::process::id()));
    std::fs::write(&tokens, [1u8, 0, 0, 0].repeat(4096)).unwrap();
    let tokens = tokens.to_str().unwrap();
    let huge = (1usize << 63).to_string();
    let eval = ["eval", "--json", "--model-dir", "tiny", "--tokens", tokens];
    for command in [&["train", "--steps", "1"][..], &eval[..]] {
        for mesh in [
            ["--ring", huge.as_str(), "--ulysses", "1"],
            ["--ulysses", "4294967296", "--ring", "4294967296"],
        ] {
            let args = [command, &["--device", "cpu"][..], &mesh[..]].concat();
            let err = upipe_error(&args);
            assert!(!err.contains("panicked"), "{args:?}: {err}");
            assert!(err.contains("invalid configuration"), "{args:?}: {err}");
        }
    }
    let _ = std::fs::remove_file(tokens);
}

#[test]
fn train_refuses_lengths_beyond_the_planner() {
    // 2^40 tokens hung in the preflight's prediction before
    let seq = (1usize << 40).to_string();
    let err = upipe_error(&["train", "--device", "cpu", "--steps", "1", "--seq", &seq]);
    assert!(
        err.contains("--seq") && err.contains("at most 4294967296"),
        "{err}"
    );
}

/// Token ids as a `.u32` file in a fresh directory.
fn u32_file(name: &str, ids: impl IntoIterator<Item = u32>) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("upipe-evalduring-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("heldout.u32");
    let bytes: Vec<u8> = ids.into_iter().flat_map(u32::to_le_bytes).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `--eval-data --eval-every` evaluates after every N steps and the last,
/// and gives the numbers `upipe eval` gives on the checkpoint of that step
/// (same mesh and stages: the run file the checkpoint holds).
#[test]
fn eval_during_training_equals_upipe_eval_of_the_checkpoint() {
    eval_during_equals_eval_of_the_checkpoint("off");
}

/// The same under FSDP: the evaluation's forward gathers each unit as the
/// training forward does (no rank holds the whole model).
#[test]
fn eval_during_an_fsdp_run_equals_upipe_eval_of_the_checkpoint() {
    eval_during_equals_eval_of_the_checkpoint("on");
}

fn eval_during_equals_eval_of_the_checkpoint(fsdp: &str) {
    let text = "Alice was beginning to get very tired of sitting by her sister on the bank, \
                and of having nothing to do: once or twice she had peeped into the book her \
                sister was reading, but it had no pictures or conversations in it.";
    let data = u32_file(&format!("same-{fsdp}"), text.bytes().map(u32::from));
    let dir = data.parent().unwrap();
    let save = dir.join("ckpt");
    let (d, s) = (data.to_str().unwrap(), save.to_str().unwrap());
    let out = upipe(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "3",
        "--seq",
        "64",
        "--json",
        "--eval-data",
        d,
        "--eval-every",
        "2",
        "--eval-buckets",
        "2",
        // the checkpoint holds the weights the run evaluated (not rounded to bf16)
        "--save-dtype",
        "f32",
        "--save-dir",
        s,
        "--fsdp",
        fsdp,
    ]);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evaluated: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("eval").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2, 3], "every 2 steps and after the last");
    let during = &lines[2]["eval"];
    let run = save.join("run.toml");
    let after = upipe(&[
        "eval",
        "--json",
        "--config",
        run.to_str().unwrap(),
        "--tokens",
        d,
        "--seq",
        "64",
        "--buckets",
        "2",
    ]);
    let after: serde_json::Value = serde_json::from_str(after.trim()).unwrap();
    let close = |a: &serde_json::Value, b: &serde_json::Value| {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        (a - b).abs() <= 1e-5 * b.abs()
    };
    assert!(
        close(&during["loss"], &after["loss"]),
        "{during} vs {after}"
    );
    assert_eq!(during["windows"], after["windows"]);
    assert_eq!(during["tokens"], after["tokens"]);
    for (x, y) in during["by_position"]
        .as_array()
        .unwrap()
        .iter()
        .zip(after["by_position"].as_array().unwrap())
    {
        assert_eq!((&x["from"], &x["to"]), (&y["from"], &y["to"]));
        assert!(close(&x["loss"], &y["loss"]), "{during} vs {after}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_eval_flags_name_the_flag_and_the_fix() {
    let data = u32_file("bad", (0..200).map(|i| i % 256));
    let d = data.to_str().unwrap();
    let base = ["train", "--device", "cpu", "--steps", "2", "--seq", "64"];
    let err = upipe_error(&[&base[..], &["--eval-data", d, "--eval-every", "0"]].concat());
    assert!(
        err.contains("--eval-every / [eval] eval-every is 0"),
        "{err}"
    );
    let err = upipe_error(&[&base[..], &["--eval-every", "2"]].concat());
    assert!(err.contains("does nothing without --eval-data"), "{err}");
    // ids of a larger vocabulary than the tiny model's 256
    let other = u32_file("vocab", (0..200).map(|i| 1000 + i));
    let err = upipe_error(&[&base[..], &["--eval-data", other.to_str().unwrap()]].concat());
    assert!(
        err.contains("--eval-data") && err.contains("vocabulary"),
        "{err}"
    );
    // shorter than one window of --seq
    let short = u32_file("short", 0..10);
    let err = upipe_error(&[&base[..], &["--eval-data", short.to_str().unwrap()]].concat());
    assert!(
        err.contains("--eval-data at --seq 64") && err.contains("shorter --seq"),
        "{err}"
    );
    for f in [&data, &other, &short] {
        let _ = std::fs::remove_dir_all(f.parent().unwrap());
    }
}

/// One mesh flag alone on the CPU: the others are 1 (not the CPU default's
/// 2 x 2), so `--data-parallel 2` runs 2 thread ranks.
#[test]
fn one_mesh_flag_on_the_cpu_leaves_the_others_at_one() {
    let out = upipe(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--seq",
        "64",
        "--data-parallel",
        "2",
    ]);
    assert!(
        out.contains("on 2 CPU thread ranks (data 2 x ulysses 1 x ring 1"),
        "{out}"
    );
    let out = upipe(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--seq",
        "64",
        "--ulysses",
        "2",
    ]);
    assert!(
        out.contains("on 2 CPU thread ranks (data 1 x ulysses 2 x ring 1"),
        "{out}"
    );
}

/// `--lora-targets none` adapts nothing: the run trains every parameter, bit
/// for bit as the run without LoRA flags (losses and gradient norms), and
/// beside `--lora-from` it is an error naming both.
#[test]
fn lora_targets_none_trains_as_without_adapters() {
    let base = TWO_STEPS_ULYSSES_2;
    let plain = upipe(&base);
    let none = upipe(&[&base[..], &["--lora-rank", "4", "--lora-targets", "none"]].concat());
    assert_eq!(losses(&none), losses(&plain));
    let norms = |stdout: &str| json_field(stdout, "grad_norm");
    assert_eq!(norms(&none), norms(&plain));
    assert_eq!(losses(&plain).len(), 2);
    let e = upipe_error(
        &[
            &base[..],
            &["--lora-targets", "none", "--lora-from", "/nonexistent"],
        ]
        .concat(),
    );
    assert!(
        e.contains("--lora-targets none") && e.contains("--lora-from"),
        "{e}"
    );
}
