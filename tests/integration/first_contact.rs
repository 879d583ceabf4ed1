//! A user's first runs: `train --help` in groups, hints for the names other
//! tools use, `upipe eval`'s readable line, the closing loss over windows
//! of steps, windows per epoch and `--epochs`, and the report's eval-loss
//! and learning-rate curves.

use clap::CommandFactory;
use std::path::PathBuf;
use std::process::{Command, Output};

fn upipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `upipe args`, which must succeed: its stdout.
fn ok(args: &[&str]) -> String {
    let out = upipe(args);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "upipe {args:?} failed: {log}");
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `upipe args`, which must fail (exit 2, no panic): its stderr.
fn fails(args: &[&str]) -> String {
    let out = upipe(args);
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "upipe {args:?}: {log}");
    assert!(!log.contains("panicked"), "{log}");
    log
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-first-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every flag of `train` is under a heading and says what it does.
#[test]
fn train_help_groups_every_flag_with_a_description() {
    let cmd = upipe::cli::Cli::command();
    let train = cmd.find_subcommand("train").unwrap();
    let mut headings = std::collections::BTreeSet::new();
    for arg in train.get_arguments() {
        let id = arg.get_id().as_str();
        if arg.is_hide_set() || id == "help" {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(!help.trim().is_empty(), "--{id} has no description");
        let heading = arg.get_help_heading();
        assert!(heading.is_some(), "--{id} is in no group");
        headings.extend(heading.map(str::to_string));
    }
    for group in [
        "Model",
        "Data",
        "Mesh",
        "Memory",
        "Optimizer",
        "Checkpoints",
        "Logging",
    ] {
        assert!(headings.contains(group), "no group {group}: {headings:?}");
    }
    let help = ok(&["train", "--help"]);
    assert!(help.contains("Optimizer:") && help.contains("--steps <STEPS>"));
}

/// Flags other tools spell differently name upipe's.
#[test]
fn other_tools_flags_get_a_hint() {
    for (flag, wanted) in [
        ("--max-steps", "--steps N"),
        ("--max_steps", "--steps N"),
        ("--output-dir", "--save-dir DIR"),
        ("--batch-size", "--grad-accum N"),
        ("--num-train-epochs", "--epochs N"),
    ] {
        let e = fails(&["train", flag, "8"]);
        assert!(
            e.contains("unexpected argument") && e.contains(wanted),
            "{flag}: {e}"
        );
    }
    let e = fails(&["eval", "--data", "x.u32"]);
    assert!(e.contains("--tokens FILE"), "{e}");
    // clap's own suggestion stays
    let e = fails(&["train", "--learning-rate", "1e-3"]);
    assert!(e.contains("--lr"), "{e}");
}

/// Model names as other tools and the Hub write them point at the preset,
/// and a Hub id at --init-from.
#[test]
fn model_names_from_elsewhere_point_at_the_preset() {
    let e = fails(&["train", "--model", "llama-3.1-8b", "--device", "cpu"]);
    assert!(e.contains("did you mean llama3.1-8b?"), "{e}");
    let e = fails(&["train", "--model", "Qwen3-8B", "--device", "cpu"]);
    assert!(e.contains("did you mean qwen3-8b?"), "{e}");
    let e = fails(&[
        "train",
        "--model",
        "meta-llama/Llama-3.1-8B",
        "--device",
        "cpu",
    ]);
    assert!(
        e.contains("Hugging Face Hub id")
            && e.contains("--init-from DIR")
            && e.contains("--model llama3.1-8b"),
        "{e}"
    );
}

/// `eval --tokens x.jsonl` names `upipe tokenize`; `train --data x.jsonl`
/// with --init-from a directory holding its tokenizer names that tokenizer,
/// not the byte one.
#[test]
fn documents_given_as_ids_name_the_tokenize_command_with_the_right_tokenizer() {
    let dir = scratch("jsonl");
    let jsonl = dir.join("x.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"hello\"}\n").unwrap();
    let j = jsonl.to_str().unwrap();
    let e = fails(&["eval", "--model-dir", "tiny", "--tokens", j]);
    assert!(e.contains("upipe tokenize") && e.contains("x.u32"), "{e}");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("tokenizer.json"), "{}").unwrap();
    let m = model.to_str().unwrap();
    let e = fails(&["train", "--init-from", m, "--data", j, "--device", "cpu"]);
    let own = format!("--tokenizer {}", model.join("tokenizer.json").display());
    assert!(e.contains(&own) && !e.contains("--tokenizer byte"), "{e}");
    // without --init-from, bytes
    let e = fails(&["train", "--data", j, "--device", "cpu"]);
    assert!(e.contains("--tokenizer byte --eos 0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `upipe eval` prints one readable line; `--json` the object.
#[test]
fn eval_prints_a_line_and_json_on_request() {
    let dir = scratch("eval");
    let save = dir.join("ckpt");
    let s = save.to_str().unwrap();
    ok(&[
        "train",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--save-dir",
        s,
        "--json",
    ]);
    let tokens = dir.join("t.u32");
    let ids: Vec<u8> = (0..65u32).flat_map(|i| (i % 200).to_le_bytes()).collect();
    std::fs::write(&tokens, ids).unwrap();
    let t = tokens.to_str().unwrap();
    let eval = [
        "eval",
        "--model-dir",
        s,
        "--tokens",
        t,
        "--seq",
        "32",
        "--device",
        "cpu",
    ];
    let line = ok(&eval);
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        line.starts_with("loss ")
            && line.contains("perplexity")
            && line.contains("over 64 tokens (2 windows of 32)"),
        "{line}"
    );
    let json = ok(&[&eval[..], &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let loss = v["loss"].as_f64().unwrap();
    assert!(
        line.contains(&format!("loss {loss:.4}")),
        "{line} vs {json}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The closing loss compares the means of windows of steps, and says which;
/// a resumed run's throughput names the steps it ran.
#[test]
fn the_closing_lines_name_their_steps() {
    let dir = scratch("closing");
    let s = dir.join("ckpt");
    let s = s.to_str().unwrap();
    let run = ["train", "--device", "cpu", "--seq", "64", "--save-dir", s];
    let out = ok(&[&run[..], &["--steps", "20"]].concat());
    assert!(
        out.contains("(mean of steps 1-2 -> mean of steps 19-20)"),
        "{out}"
    );
    assert!(out.contains("over steps 2..20"), "{out}");
    let out = ok(&[&run[..], &["--steps", "30", "--resume"]].concat());
    assert!(out.contains("over steps 22..30"), "{out}");
    assert!(out.contains("(step 21 -> step 30)") || out.contains("mean of steps 21-"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The header says how many windows an epoch gives; `--epochs N` trains
/// N of them (divided by --grad-accum); beside --steps it is an error.
#[test]
fn epochs_derive_the_steps_from_the_windows_per_epoch() {
    let dir = scratch("epochs");
    let data = dir.join("d.txt");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/corpus.txt"));
    std::fs::write(&data, &text.unwrap()[..1500]).unwrap();
    let metrics = dir.join("m.jsonl");
    let (d, m) = (data.to_str().unwrap(), metrics.to_str().unwrap());
    let base = [
        "train", "--device", "cpu", "--data", d, "--seq", "64", "--warmup", "1",
    ];
    let out = ok(&[
        &base[..],
        &["--epochs", "2", "--grad-accum", "2", "--metrics", m],
    ]
    .concat());
    let header = out
        .lines()
        .find(|l| l.contains("windows per epoch"))
        .unwrap();
    let windows: usize = header.split(' ').next().unwrap().parse().unwrap();
    assert!(windows > 5, "{header}");
    let steps = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert_eq!(steps, (2 * windows).div_ceil(2), "{header}");
    assert!(header.contains("are 2.00 epochs"), "{header}");
    let e = fails(&[&base[..], &["--epochs", "1", "--steps", "5"]].concat());
    assert!(e.contains("--steps") && e.contains("--epochs") && e.contains("keep one"));
    let e = fails(&[&base[..], &["--epochs", "0"]].concat());
    assert!(e.contains("--epochs / [run] epochs is 0"), "{e}");
    // a run file's key too, and the resolved run file keeps the epochs
    let file = dir.join("run.toml");
    std::fs::write(&file, "[run]\nsteps = 3\n").unwrap();
    let f = file.to_str().unwrap();
    let e = fails(&[&base[..], &["--config", f, "--epochs", "1"]].concat());
    assert!(
        e.contains("[run] steps") && e.contains("[run] epochs"),
        "{e}"
    );
    let printed = ok(&[&base[..], &["--epochs", "3", "--print-config"]].concat());
    assert!(
        printed.contains("epochs = 3") && !printed.contains("\nsteps = "),
        "{printed}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The report draws the held-out loss of the steps that evaluated and the
/// learning rate.
#[test]
fn the_report_draws_eval_loss_and_learning_rate() {
    let dir = scratch("report");
    let held = dir.join("held.txt");
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/corpus.txt"));
    std::fs::write(&held, &text.unwrap()[..600]).unwrap();
    let metrics = dir.join("m.jsonl");
    let (h, m) = (held.to_str().unwrap(), metrics.to_str().unwrap());
    ok(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "4",
        "--seq",
        "64",
        "--eval-data",
        h,
        "--eval-every",
        "2",
        "--metrics",
        m,
        "--json",
    ]);
    ok(&["report", m]);
    let svg = std::fs::read_to_string(metrics.with_extension("svg")).unwrap();
    for title in [
        "<title>loss</title>",
        "<title>eval loss</title>",
        "<title>learning rate</title>",
    ] {
        assert!(svg.contains(title), "{title} missing");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
