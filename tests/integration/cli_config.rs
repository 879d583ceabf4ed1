//! Run files (`--config`, `--print-config`, `run.toml` in checkpoints),
//! metrics files and `upipe report` through the real binary.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `(success, stdout, stderr)` of `upipe args`.
fn upipe(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// stdout of `upipe args`, which must succeed.
fn ok(args: &[&str]) -> String {
    let (success, out, err) = upipe(args);
    assert!(success, "upipe {args:?} failed: {err}");
    out
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-cfg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_example_config_parses_and_plans() {
    let files = examples();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "tiny.toml",
        "llama3.2-1b-1gpu-128k.toml",
        "llama3-8b-8gpu-upipe.toml",
    ] {
        assert!(names.iter().any(|n| n == want), "configs/{want} is missing");
    }
    for f in &files {
        let f = f.to_str().unwrap();
        let resolved = ok(&["train", "--config", f, "--print-config"]);
        assert!(resolved.contains("[model]"), "{f}: {resolved}");
        let plan = ok(&["plan", "--config", f]);
        assert!(plan.contains("fits") || plan.contains("OOM"), "{f}: {plan}");
    }
    // the 8-GPU example plans what it says: UPipe on 8 GPUs, sharded
    let f = files
        .iter()
        .find(|p| p.ends_with("llama3-8b-8gpu-upipe.toml"))
        .unwrap();
    let plan = ok(&["plan", "--config", f.to_str().unwrap()]);
    assert!(
        plan.contains("on 8 GPUs") && plan.contains("fsdp") && plan.contains("tiled-mlp"),
        "{plan}"
    );
    assert!(plan.contains("upipe        1x8x1"), "{plan}");
}

/// `configs/tiny.toml` is `upipe train --print-config` under its opening
/// comment, word for word.
#[test]
fn the_tiny_example_is_the_embedded_default() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let text = std::fs::read_to_string(&tiny).unwrap();
    let body = &text[text.find("\n[model]\n").expect("a [model] section") + 1..];
    assert_eq!(
        body,
        ok(&["train", "--print-config"]),
        "configs/tiny.toml is out of date: write `upipe train --print-config` under its comment"
    );
    let from_file = ok(&[
        "train",
        "--config",
        tiny.to_str().unwrap(),
        "--print-config",
    ]);
    assert_eq!(from_file, body);
}

/// Every key of `train` is in its printed run file: with its value, or
/// (a flag without a default, left out) as a comment saying what it does.
#[test]
fn print_config_lists_every_key_and_reads_back() {
    use upipe::cli::train::TrainArgs;
    let printed = ok(&["train", "--print-config"]);
    let mut section = String::new();
    let mut seen = Vec::new();
    for line in printed.lines() {
        if let Some(s) = line.strip_prefix('[') {
            section = s.trim_end_matches(']').to_string();
        } else if let Some((key, _)) = line.split_once(" = ") {
            let key = key.trim_start_matches("# ");
            seen.push((section.clone(), key.to_string()));
        }
    }
    for (id, sec, key) in TrainArgs::all_keys().iter().flat_map(|k| k.iter()) {
        let key = key.replace('_', "-");
        assert!(
            seen.contains(&(sec.to_string(), key.clone())),
            "--{id} ([{sec}] {key}) is missing from\n{printed}"
        );
    }
    // an unset key is commented with its meaning
    assert!(
        printed.contains("# min-lr = (unset) The learning rate the schedule ends at"),
        "{printed}"
    );
    // every key set reads back to the same file
    let dir = scratch("every-key");
    let data = dir.join("held.txt");
    std::fs::write(&data, "held out").unwrap();
    let all = [
        "train",
        "--min-lr",
        "1e-4",
        "--schedule",
        "wsd",
        "--decay-fraction",
        "0.3",
        "--betas",
        "0.8,0.9",
        "--eps",
        "1e-6",
        "--eval-data",
        data.to_str().unwrap(),
        "--eval-every",
        "5",
        "--ulysses",
        "2",
        "--ring",
        "1",
        "--data-parallel",
        "1",
        "--chunk-heads",
        "2",
        "--host-mem",
        "4",
        "--save-dir",
        "runs/x",
        "--metrics",
        "m.jsonl",
        "--print-config",
    ];
    let full = ok(&all);
    assert!(
        full.contains("schedule = \"wsd\"\n") && full.contains("betas = \"0.8,0.9\"\n"),
        "{full}"
    );
    let file = dir.join("full.toml");
    std::fs::write(&file, &full).unwrap();
    assert_eq!(
        ok(&[
            "train",
            "--config",
            file.to_str().unwrap(),
            "--print-config"
        ]),
        full
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn printed_config_reads_back_to_the_same_config_and_flags_win() {
    let dir = scratch("roundtrip");
    let flags = [
        "train",
        "--seq",
        "512",
        "--checkpoint",
        "--ulysses",
        "2",
        "--ring",
        "1",
        "--lr",
        "1e-4",
        "--fwd-chunk-heads",
        "2",
        "--save-dir",
        "runs/x",
        "--print-config",
    ];
    let printed = ok(&flags);
    let file = dir.join("run.toml");
    std::fs::write(&file, &printed).unwrap();
    let f = file.to_str().unwrap();
    assert_eq!(ok(&["train", "--config", f, "--print-config"]), printed);
    // a flag given wins over its key; `--checkpoint=false` over `checkpoint = true`
    let over = ok(&[
        "train",
        "--config",
        f,
        "--seq",
        "128",
        "--checkpoint=false",
        "--print-config",
    ]);
    assert!(
        over.contains("seq = 128\n") && over.contains("checkpoint = false\n"),
        "{over}"
    );
    assert!(
        over.contains("lr = 0.0001\n"),
        "the file's other keys stay: {over}"
    );
    // plan reads the same file
    let plan = ok(&["plan", "--config", f, "--device", "cpu"]);
    assert!(plan.contains("seq 512") && plan.contains("1x2x1"), "{plan}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `[memory]` section of a printed run file.
fn memory_section(text: &str) -> String {
    let start = text.find("[memory]\n").expect("a [memory] section");
    let rest = &text[start..];
    let end = rest[1..].find("\n[").map_or(rest.len(), |e| e + 1);
    rest[..end].trim_end().to_string()
}

#[test]
fn train_and_plan_share_the_memory_flags_and_their_section() {
    let dir = scratch("memory");
    let memory = [
        "--checkpoint",
        "--offload=1",
        "--offload-optimizer",
        "--tiled-mlp",
        "--loss-chunk",
        "64",
        "--save-attention",
        "1",
    ];
    let printed = ok(&[&["train", "--print-config"], &memory[..]].concat());
    assert_eq!(
        memory_section(&printed),
        "[memory]\ncheckpoint = true\noffload = 1\noffload-optimizer = \"all\"\n\
         host-update = \"auto\"\ntiled-mlp = true\nloss-chunk = 64\nsave-attention = 1",
        "{printed}"
    );
    // `plan` (no --print-config of its own) plans the same policy from the
    // flags as from the section `train` wrote
    let file = dir.join("memory.toml");
    std::fs::write(&file, memory_section(&printed) + "\n").unwrap();
    let at = ["--device", "cpu", "--gpus", "4", "--seq", "4096", "--json"];
    let from_flags = ok(&[&["plan"], &memory[..], &at[..]].concat());
    let from_file = ok(&[&["plan", "--config", file.to_str().unwrap()], &at[..]].concat());
    assert_eq!(from_flags, from_file);
    assert!(
        from_flags.contains("\"offload_blocks\":1") && from_flags.contains("\"save_attention\":1"),
        "{from_flags}"
    );
    // both subcommands list every memory flag
    for cmd in ["train", "plan"] {
        let help = ok(&[cmd, "--help"]);
        for flag in memory.iter().filter(|f| f.starts_with("--")) {
            let name = flag.split('=').next().unwrap();
            assert!(help.contains(name), "{cmd} --help lacks {name}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_file_printed_by_an_earlier_train_resolves_the_same() {
    // `upipe train --print-config --checkpoint --offload 3 --tiled-mlp
    // --save-attention 2 --loss-chunk 64 --offload-optimizer`, as printed
    // before the memory flags were one group shared with `plan`
    let earlier = "[model]\nmodel = \"tiny\"\n\n[data]\nseq = 256\ngrad-accum = 1\n\n\
        [parallel]\nattn = \"upipe\"\nfwd-chunk-heads = \"auto\"\nfsdp = \"auto\"\nfsdp-replicate = 1\n\n\
        [memory]\ncheckpoint = true\noffload = 3\noffload-optimizer = true\ntiled-mlp = true\n\
        loss-chunk = 64\nsave-attention = 2\n\n\
        [optim]\nlr = 0.003\nmin-lr = 0.0003\nwarmup = 20\nweight-decay = 0.1\nclip = 1.0\n\n\
        [checkpoint]\nsave-every = 0\nresume = false\n\n\
        [run]\nsteps = 300\nseed = 0\ndevice = \"auto\"\nattn-kernel = \"auto\"\njson = false\n\
        profile = false\nrehearse = false\n";
    let dir = scratch("earlier");
    let file = dir.join("run.toml");
    std::fs::write(&file, earlier).unwrap();
    let f = file.to_str().unwrap();
    // the same run as the flags it was printed from; keys added since
    // print their defaults
    let flags = [
        "train",
        "--print-config",
        "--checkpoint",
        "--offload",
        "3",
        "--tiled-mlp",
        "--save-attention",
        "2",
        "--loss-chunk",
        "64",
        "--offload-optimizer",
        "--min-lr",
        "0.0003",
    ];
    assert_eq!(ok(&["train", "--config", f, "--print-config"]), ok(&flags));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_config_files_fail_naming_the_key() {
    let dir = scratch("bad");
    let cases = [
        ("[data]\nsq = 512\n", vec!["`sq`", "`seq`"]),
        ("[data]\nseq = \"long\"\n", vec!["data.seq", "usize"]),
        ("[run]\nsteps = 0\n", vec!["[run] steps", "at least 1"]),
        (
            "[parallel]\nfsdp = \"maybe\"\n",
            vec!["[parallel] fsdp", "auto, on or off"],
        ),
        ("[optim]\nlr = -1.0\n", vec!["[optim] lr", "at least 0"]),
        ("[trainer]\nsteps = 1\n", vec!["unknown section `trainer`"]),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let file = dir.join(format!("bad{i}.toml"));
        std::fs::write(&file, text).unwrap();
        let f = file.to_str().unwrap();
        for cmd in [
            &["train", "--config", f][..],
            &["plan", "--config", f, "--gpus", "2"][..],
        ] {
            if cmd[0] == "plan" && (text.contains("steps") || text.contains("lr")) {
                continue; // keys plan has no flag for are only checked for type
            }
            let (success, _, err) = upipe(cmd);
            assert!(!success, "{cmd:?} on {text:?} succeeded");
            for w in want {
                assert!(err.contains(w), "{cmd:?} on {text:?}: {err}");
            }
        }
    }
    let (success, _, err) = upipe(&["train", "--config", "/nonexistent/run.toml"]);
    assert!(!success && err.contains("/nonexistent/run.toml"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_holds_the_run_file_that_repeats_the_run() {
    let dir = scratch("repeat");
    let save = dir.join("run");
    let s = save.to_str().unwrap();
    let losses = |out: &str| -> Vec<f64> {
        out.lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let first = losses(&ok(&[
        "train",
        "--steps",
        "3",
        "--seq",
        "128",
        "--json",
        "--save-dir",
        s,
    ]));
    let stored = save.join("run.toml");
    let text = std::fs::read_to_string(&stored).unwrap();
    // the run's own decisions are written out: mesh, sharding, forward stages
    for key in [
        "ulysses = 2\n",
        "ring = 2\n",
        "data-parallel = 1\n",
        "fsdp = \"off\"\n",
        "steps = 3\n",
    ] {
        assert!(text.contains(key), "{key:?} missing from {text}");
    }
    let f = stored.to_str().unwrap();
    assert_eq!(ok(&["train", "--config", f, "--print-config"]), text);
    // the same run again, replacing the checkpoint it saved
    let again = losses(&ok(&["train", "--config", f, "--json", "--overwrite"]));
    assert_eq!(first, again, "the stored run file repeats the run");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The run file a checkpoint holds records what the run's `auto` choices
/// decided (kept attention, host optimizer units, stage widths), so a run
/// from it makes the same memory choices on any machine.
#[test]
fn a_run_from_run_toml_makes_the_same_memory_choices() {
    let dir = scratch("choices");
    let save = dir.join("run");
    let decided = |args: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_upipe"))
            .args(args)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {log}");
        let line = log
            .lines()
            .find(|l| l.contains("decided from this machine's memory"));
        line.expect("the decided flags are logged")
            .split(": ")
            .last()
            .unwrap()
            .to_string()
    };
    let first = decided(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--seq",
        "64",
        "--checkpoint",
        "--save-attention",
        "auto",
        "--offload-optimizer",
        "auto",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    let stored = save.join("run.toml");
    let text = std::fs::read_to_string(&stored).unwrap();
    for key in [
        "save-attention",
        "offload-optimizer",
        "chunk-heads",
        "offload",
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap();
        assert!(
            !line.contains("auto"),
            "{key} is decided in run.toml: {line}\n{text}"
        );
    }
    let again_dir = dir.join("again");
    let again = decided(&[
        "train",
        "--config",
        stored.to_str().unwrap(),
        "--save-dir",
        again_dir.to_str().unwrap(),
    ]);
    assert_eq!(first, again);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Elements named `name` in an SVG document.
fn count(doc: &roxmltree::Document, name: &str) -> usize {
    doc.descendants().filter(|n| n.has_tag_name(name)).count()
}

#[test]
fn report_draws_a_metrics_file_of_a_short_run() {
    let dir = scratch("report");
    let m = dir.join("m.jsonl");
    ok(&["train", "--steps", "5", "--metrics", m.to_str().unwrap()]);
    let text = std::fs::read_to_string(&m).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i as u64 + 1);
        for key in [
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "tflops",
            "tflops_per_rank",
        ] {
            assert!(l[key].as_f64().unwrap().is_finite(), "{key} in {l}");
        }
        assert_eq!(l["tokens"], 256);
        assert_eq!(l["peak_by_category"].as_object().unwrap().len(), 7, "{l}");
        assert_eq!(
            l["peak_bytes"], l["predicted_peak_bytes"],
            "the planner is exact here: {l}"
        );
    }
    let svg = dir.join("r.svg");
    ok(&[
        "report",
        m.to_str().unwrap(),
        "--out",
        svg.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the report is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    // one curve per series: loss, tokens/s, model TFLOP/s per rank, learning rate
    assert_eq!(count(&doc, "polyline"), 4);
    for p in doc.descendants().filter(|n| n.has_tag_name("polyline")) {
        assert_eq!(p.attribute("points").unwrap().split(' ').count(), 5);
    }
    // the memory at the peak: every category of the measured and the predicted bar
    let tips: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(
        tips.iter().filter(|t| t.starts_with("measured: ")).count(),
        7
    );
    assert_eq!(
        tips.iter().filter(|t| t.starts_with("predicted: ")).count(),
        7
    );
    // a file that is not a metrics file is an error naming its line
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"step\": 1}\n").unwrap();
    let (success, _, err) = upipe(&["report", bad.to_str().unwrap()]);
    assert!(!success && err.contains("line 1"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_writes_a_metrics_line() {
    let dir = scratch("eval");
    let save = dir.join("ckpt");
    ok(&[
        "train",
        "--steps",
        "2",
        "--save-dir",
        save.to_str().unwrap(),
        "--json",
    ]);
    let toks: Vec<u8> = "the quick brown fox"
        .bytes()
        .flat_map(|b| (b as u32).to_le_bytes())
        .collect();
    let tf = dir.join("t.u32");
    std::fs::write(&tf, toks).unwrap();
    let m = dir.join("eval.jsonl");
    // the model directory comes from the run file's [checkpoint] save-dir
    let run = save.join("run.toml");
    ok(&[
        "eval",
        "--config",
        run.to_str().unwrap(),
        "--tokens",
        tf.to_str().unwrap(),
        "--metrics",
        m.to_str().unwrap(),
    ]);
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&m).unwrap().trim()).unwrap();
    assert_eq!(line["tokens"], 18);
    assert!(line["loss"].as_f64().unwrap() > 0.0 && line["tflops"].as_f64().unwrap() > 0.0);
    assert_eq!(line["ranks"], 4, "the run file's mesh: 2 x 2");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_svg_draws_one_bar_of_categories_per_strategy() {
    let dir = scratch("plansvg");
    let svg = dir.join("p.svg");
    let out = ok(&[
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "8",
        "--seq",
        "131072",
        "--attn",
        "ulysses,upipe",
        "--checkpoint",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(out.contains("ulysses") && out.contains("upipe"), "{out}");
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    let tips: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter_map(|n| n.text())
        .collect();
    // six device categories per strategy (offload is host memory)
    assert_eq!(
        tips.iter().filter(|t| t.starts_with("ulysses ")).count(),
        6,
        "{tips:?}"
    );
    assert_eq!(
        tips.iter().filter(|t| t.starts_with("upipe ")).count(),
        6,
        "{tips:?}"
    );
    let (success, _, err) = upipe(&["plan", "--model", "tiny", "--gpus", "2", "--svg", "x.svg"]);
    assert!(!success && err.contains("--seq"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
