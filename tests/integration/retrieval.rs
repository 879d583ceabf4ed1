//! Retrieval trials scored teacher-forced (`upipe eval --task`): exact on
//! a model whose every prediction is known (a trial passes and fails
//! exactly where it must, under every strategy and with data replicas),
//! the log-likelihood equal to the loss path's cross-entropy on a random
//! model, and the command line's outputs and refusals.

use std::collections::BTreeMap;
use upipe::attention::Strategy;
use upipe::checkpoint::HostTensor;
use upipe::data::doc_index::LossMask;
use upipe::data::retrieval::{Grid, Trial, TrialAt};
use upipe::data::{Dataset, Tokens};
use upipe::model::ModelConfig;
use upipe::rng::Rng;
use upipe::train::eval::{EvalConfig, eval_cpu};
use upipe::train::retrieval::{RetrievalRun, TrialResult, retrieval_cpu, summarize};

/// `(strategy, data replicas, ulysses, ring)`.
const MESHES: [(Strategy, usize, usize, usize); 6] = [
    (Strategy::Local, 1, 1, 1),
    (Strategy::Local, 3, 1, 1),
    (Strategy::Upipe, 1, 2, 1),
    (Strategy::Ulysses, 2, 2, 1),
    (Strategy::Ring, 1, 1, 2),
    (Strategy::Usp, 1, 2, 2),
];

fn eval_config(
    model: &ModelConfig,
    (s, dp, pu, pr): (Strategy, usize, usize, usize),
) -> EvalConfig {
    EvalConfig {
        strategy: s,
        data_parallel: dp,
        ulysses: pu,
        ring: pr,
        ..EvalConfig::new(model.clone())
    }
}

/// The tiny model with a vocabulary of its width, so one-hot embeddings fit.
fn successor_model() -> ModelConfig {
    let mut c = ModelConfig::resolve("tiny").unwrap();
    c.vocab = c.hidden;
    c.validate().unwrap();
    c
}

/// The head's scale: the logit of the one predicted id.
const SCALE: f32 = 0.5;

/// Weights whose argmax after id `x` is `x + 1` (mod vocab): one-hot
/// embeddings, every block weight 0 (attention and MLP add nothing), and
/// an LM head whose row `t` reads `t - 1`. The logits after `x` are `a` at
/// `x + 1` and 0 elsewhere, `a` = SCALE / rms(one-hot).
fn successor_weights(cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
    let v = cfg.vocab;
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let mut data = vec![0.0f32; n];
            if name.ends_with("norm.weight") {
                data.fill(1.0);
            } else if name == "model.embed_tokens.weight" {
                (0..v).for_each(|x| data[x * cfg.hidden + x] = 1.0);
            } else if name == "lm_head.weight" {
                (0..v).for_each(|t| data[t * cfg.hidden + (t + v - 1) % v] = SCALE);
            }
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect()
}

/// The logit of the predicted id, computed from the weights by hand.
fn successor_logit(cfg: &ModelConfig) -> f64 {
    let rms = (1.0 / cfg.hidden as f64 + f64::from(cfg.rms_norm_eps)).sqrt();
    f64::from(SCALE) / rms
}

/// A trial of random context ids ending in `c`, whose answer is by its
/// index: 0, `c+1 c+2 c+3` (passes); 1, `c+1 c+5 c+6` (the second token
/// fails); 2, `c+2` (fails); 3, `c+1` (passes).
fn successor_trial(at: &TrialAt, vocab: u32) -> Trial {
    let mut rng = Rng::new(at.seed);
    let mut ids: Vec<u32> = (0..at.length - 3)
        .map(|_| rng.below(u64::from(vocab)) as u32)
        .collect();
    let c = *ids.last().unwrap();
    let steps: &[u32] = match at.index % 4 {
        0 => &[1, 2, 3],
        1 => &[1, 5, 6],
        2 => &[2],
        _ => &[1],
    };
    let start = ids.len();
    ids.extend(steps.iter().map(|s| (c + s) % vocab));
    Trial {
        answer: start..ids.len(),
        ids,
        needle_at: 0,
        placed_depth: at.depth,
        key: String::new(),
        expected: String::new(),
    }
}

#[test]
fn a_trial_passes_and_fails_exactly_where_the_model_predicts() {
    let cfg = successor_model();
    let host = successor_weights(&cfg);
    let v = cfg.vocab as u32;
    let grid = Grid {
        lengths: vec![37, 64],
        depths: vec![0.0, 1.0],
        trials: 4,
        seed: 3,
    };
    let make = |at: &TrialAt| Ok(successor_trial(at, v));
    let a = successor_logit(&cfg);
    let lse = (a.exp() + (cfg.vocab - 1) as f64).ln();
    let (right, wrong) = (a - lse, -lse);
    for mesh in MESHES {
        let ecfg = eval_config(&cfg, mesh);
        let run = RetrievalRun {
            cfg: &ecfg,
            grid: &grid,
            make: &make,
        };
        let results = retrieval_cpu(&run, &host).unwrap().trials;
        assert_eq!(results.len(), 16, "{mesh:?}");
        for r in &results {
            let t = successor_trial(
                &grid.at(
                    usize::from(r.length == 64),
                    r.index + 4 * (r.depth as usize),
                ),
                v,
            );
            let predicted: Vec<u32> = t.answer.clone().map(|p| (t.ids[p - 1] + 1) % v).collect();
            assert_eq!(r.predicted_ids, predicted, "{mesh:?} {r:?}");
            let (passed, correct, logprob) = match r.index {
                0 => (true, 3, right),
                1 => (false, 2, (2.0 * right + wrong) / 3.0),
                2 => (false, 0, wrong),
                _ => (true, 1, right),
            };
            assert_eq!(
                (r.passed, r.correct_tokens),
                (passed, correct),
                "{mesh:?} {r:?}"
            );
            assert!(
                (r.mean_logprob - logprob).abs() < 1e-4,
                "{mesh:?} {} vs {logprob}",
                r.mean_logprob
            );
        }
        let s = summarize(&grid, &results);
        assert_eq!((s.passed, s.trials, s.cells.len()), (8, 16, 4));
        assert!(s.cells.iter().all(|c| c.accuracy == 0.5 && c.trials == 4));
    }
}

/// Weights large enough that the answer's log-likelihood is far from chance.
fn random_weights(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, HostTensor> {
    let mut rng = Rng::new(seed);
    cfg.hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = match name.ends_with("norm.weight") {
                true => vec![1.0; n],
                false => rng.normal_vec(n, 0.3),
            };
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect()
}

fn random_trial(at: &TrialAt, vocab: u64) -> Trial {
    let mut rng = Rng::new(at.seed);
    let ids: Vec<u32> = (0..at.length).map(|_| rng.below(vocab) as u32).collect();
    Trial {
        answer: at.length - 5..at.length,
        ids,
        needle_at: 0,
        placed_depth: 0.0,
        key: String::new(),
        expected: String::new(),
    }
}

/// The mean cross-entropy `upipe eval` computes over the answer's tokens
/// alone (a loss mask counting only them).
fn loss_over_answer(cfg: &ModelConfig, host: &BTreeMap<String, HostTensor>, t: &Trial) -> f64 {
    let flags: Vec<bool> = (0..t.ids.len()).map(|i| t.answer.contains(&i)).collect();
    let data = Dataset {
        tokens: Tokens::from_ids(t.ids.clone(), "trial"),
        docs: None,
        mask: Some(LossMask::from_flags(&flags)),
    };
    eval_cpu(&EvalConfig::new(cfg.clone()), data, host)
        .unwrap()
        .loss
}

#[test]
fn the_answer_log_likelihood_is_the_loss_paths_cross_entropy_under_every_mesh() {
    let cfg = upipe::model::ModelConfig::resolve("tiny").unwrap();
    let host = random_weights(&cfg, 11);
    let grid = Grid {
        lengths: vec![45],
        depths: vec![0.5],
        trials: 3,
        seed: 5,
    };
    let make = |at: &TrialAt| Ok(random_trial(at, cfg.vocab as u64));
    let want: Vec<f64> = (0..3)
        .map(|i| -loss_over_answer(&cfg, &host, &random_trial(&grid.at(0, i), cfg.vocab as u64)))
        .collect();
    let mut local: Option<Vec<TrialResult>> = None;
    for mesh in MESHES {
        let ecfg = eval_config(&cfg, mesh);
        let run = RetrievalRun {
            cfg: &ecfg,
            grid: &grid,
            make: &make,
        };
        let results = retrieval_cpu(&run, &host).unwrap().trials;
        for (r, w) in results.iter().zip(&want) {
            assert!(
                ((r.mean_logprob - w) / w).abs() < 1e-5,
                "{mesh:?}: {} vs {w}",
                r.mean_logprob
            );
            assert!(*w < -1.0, "far from certain: {w}");
        }
        match &local {
            None => local = Some(results),
            Some(l) => {
                for (r, q) in results.iter().zip(l) {
                    assert_eq!(
                        (&r.predicted_ids, r.passed),
                        (&q.predicted_ids, q.passed),
                        "{mesh:?}"
                    );
                }
            }
        }
    }
}

fn upipe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

/// A directory holding the tiny model with random weights.
fn tiny_model_dir(name: &str) -> std::path::PathBuf {
    let cfg = ModelConfig::resolve("tiny").unwrap();
    let dir = std::env::temp_dir().join(format!("upipe-retrieval-{name}-{}", std::process::id()));
    let host = random_weights(&cfg, 2);
    upipe::checkpoint::save_hf_model(&dir, &cfg, &host, upipe::backend::DType::F32).unwrap();
    dir
}

#[test]
fn eval_task_writes_trials_summary_and_heatmap_alike_on_every_mesh() {
    let dir = tiny_model_dir("cli");
    let d = dir.to_str().unwrap();
    let mut outputs = Vec::new();
    for (i, mesh) in [["--ulysses", "1"], ["--ulysses", "2"]].iter().enumerate() {
        let out_dir = dir.join(format!("out{i}"));
        let args = [
            "eval",
            "--task",
            "multikey",
            "--model-dir",
            d,
            "--lengths",
            "400,1K",
            "--depths",
            "3",
            "--trials",
            "2",
            "--device",
            "cpu",
            mesh[0],
            mesh[1],
            "--out",
            out_dir.to_str().unwrap(),
        ];
        let out = upipe(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            stdout.contains("multikey: ") && stdout.contains("1K"),
            "{stdout}"
        );
        let trials = std::fs::read_to_string(out_dir.join("trials.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = trials
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2 * 3 * 2);
        assert_eq!(lines[11]["length"], 1024);
        assert_eq!(lines[11]["depth"], 1.0);
        assert_eq!(lines[0]["answer_tokens"], 8);
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
                .unwrap();
        assert_eq!(summary["cells"].as_array().unwrap().len(), 6);
        assert_eq!(summary["trials"], 12);
        let svg = std::fs::read_to_string(out_dir.join("heatmap.svg")).unwrap();
        assert!(
            svg.starts_with("<?xml") && svg.contains(">1K</text>") && svg.contains(">50 %</text>")
        );
        // what depends on the trials alone, not on the mesh
        let keep = |v: &serde_json::Value| {
            (
                v["seed"].clone(),
                v["expected"].clone(),
                v["predicted"].clone(),
                v["passed"].clone(),
            )
        };
        outputs.push(lines.iter().map(keep).collect::<Vec<_>>());
    }
    assert_eq!(outputs[0], outputs[1]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_task_refuses_what_a_user_can_get_wrong_naming_the_fix() {
    let dir = tiny_model_dir("refusals");
    let d = dir.to_str().unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "Only a line. And another.").unwrap();
    let s = short.to_str().unwrap();
    let cases: [(&[&str], &str); 9] = [
        (&["--task", "passkey", "--lengths", "4X"], "4K,32K,128K,1M"),
        (
            &["--task", "passkey", "--lengths", "2M"],
            "give --lengths up to 1048576",
        ),
        (
            &["--task", "passkey", "--lengths", "100"],
            "give lengths above",
        ),
        (
            &[
                "--task",
                "passkey",
                "--lengths",
                "1K",
                "--needle-template",
                "hidden",
            ],
            "{value}",
        ),
        (
            &["--task", "passkey", "--lengths", "1K", "--haystack", s],
            "leave out --haystack",
        ),
        (
            &["--task", "passkey", "--lengths", "1K", "--tokens", s],
            "leave out one of them",
        ),
        (&["--lengths", "1K"], "add --task"),
        (&["--chat-template", "none"], "add --task"),
        (
            &["--task", "needle", "--lengths", "1K"],
            "passkey, multikey, multivalue, kv",
        ),
    ];
    for (args, want) in cases {
        let mut all = vec!["eval", "--model-dir", d, "--device", "cpu"];
        all.extend_from_slice(args);
        let out = upipe(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Trains the tiny model 4 steps (`--fsdp fsdp`) with trials after steps
/// 2 and 4, then scores the saved model with `upipe eval --task` on the
/// same grid: the same scores as the run's last.
fn train_then_eval(dir: &std::path::Path, fsdp: &str, chat: Option<&str>) {
    let tag = format!("{fsdp}{}", if chat.is_some() { "-chat" } else { "" });
    let (save, metrics) = (
        dir.join(format!("run-{tag}")),
        dir.join(format!("m-{tag}.jsonl")),
    );
    let mut args = vec![
        "train",
        "--device",
        "cpu",
        "--steps",
        "4",
        "--seq",
        "256",
        "--eval-task",
        "passkey",
        "--eval-every",
        "2",
        "--eval-task-lengths",
        "200,256",
        "--eval-task-depths",
        "3",
        "--eval-task-trials",
        "2",
        "--save-dir",
        save.to_str().unwrap(),
        "--save-dtype",
        "f32",
        "--metrics",
        metrics.to_str().unwrap(),
        "--fsdp",
        fsdp,
    ];
    if let Some(file) = chat {
        args.extend(["--eval-task-chat-template", file]);
    }
    let out = upipe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let scored: Vec<u64> = (lines.iter())
        .filter(|l| l.get("retrieval").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(scored, vec![2, 4], "--fsdp {fsdp}");
    let last = &lines.last().unwrap()["retrieval"];
    assert_eq!(
        (last["task"].as_str(), last["trials"].as_u64()),
        (Some("passkey"), Some(12))
    );
    let mut args = vec![
        "eval",
        "--task",
        "passkey",
        "--json",
        "--device",
        "cpu",
        "--model-dir",
        save.to_str().unwrap(),
        "--lengths",
        "200,256",
        "--depths",
        "3",
        "--trials",
        "2",
    ];
    if let Some(file) = chat {
        args.extend(["--chat-template", file]);
    }
    let out = upipe(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["chat_template"].as_str(), chat);
    assert_eq!(v["passed"], last["passed"], "--fsdp {fsdp}");
    let (a, b) = (
        v["mean_logprob"].as_f64().unwrap(),
        last["mean_logprob"].as_f64().unwrap(),
    );
    assert!(((a - b) / b).abs() < 1e-5, "--fsdp {fsdp}: {a} vs {b}");
}

#[test]
fn trials_during_training_score_as_eval_task_does_on_the_saved_model() {
    let dir = std::env::temp_dir().join(format!("upipe-retrieval-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // the parameters replicated, and sharded (each unit gathered for the forward)
    train_then_eval(&dir, "off", None);
    train_then_eval(&dir, "on", None);
    // trials framed by a chat template, during training and after
    let file = dir.join("chat.jinja");
    let template = "{% for m in messages %}[{{ m.content }}]{% endfor %}\
                    {% if add_generation_prompt %}>{% endif %}";
    std::fs::write(&file, template).unwrap();
    train_then_eval(&dir, "off", Some(file.to_str().unwrap()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--chat-template`: `auto` on a tokenizer without a template keeps plain
/// text and says so; a template file, or `auto` finding the model's
/// `chat_template.jinja`, frames each trial (stderr names the file, the
/// summary records it, the answer starts the assistant's turn).
#[test]
fn eval_task_frames_trials_with_the_chat_template_it_names() {
    let dir = tiny_model_dir("chat");
    let d = dir.to_str().unwrap();
    let template = "{% for m in messages %}<u>{{ m.content }}</u>{% endfor %}\
                    {% if add_generation_prompt %}<a>{% endif %}";
    let file = dir.join("mine.jinja");
    std::fs::write(&file, template).unwrap();
    let run = |chat: &str, out: &str| {
        let out = dir.join(out);
        let o = upipe(&[
            "eval",
            "--task",
            "passkey",
            "--model-dir",
            d,
            "--lengths",
            "400",
            "--depths",
            "1",
            "--trials",
            "1",
            "--device",
            "cpu",
            "--chat-template",
            chat,
            "--out",
            out.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{stderr}");
        let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&read("summary.json")).unwrap();
        let trial: serde_json::Value = serde_json::from_str(read("trials.jsonl").trim()).unwrap();
        (stderr, summary, trial)
    };
    let (stderr, summary, trial) = run("auto", "plain");
    assert!(
        stderr.contains("no chat template, so trials are plain text"),
        "{stderr}"
    );
    assert!(summary["chat_template"].is_null());
    // " 1234567": the space before the digits is a token of its own
    assert_eq!(trial["answer_tokens"], 8);
    let (stderr, summary, trial) = run(file.to_str().unwrap(), "file");
    assert!(
        stderr.contains("user's turn of") && stderr.contains("mine.jinja"),
        "{stderr}"
    );
    assert_eq!(summary["chat_template"], file.to_str().unwrap());
    assert_eq!(trial["answer_tokens"], 7);
    assert_eq!(trial["tokens"], 400);
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    let (stderr, summary, _) = run("auto", "auto");
    assert!(stderr.contains("chat_template.jinja"), "{stderr}");
    assert!(
        summary["chat_template"]
            .as_str()
            .unwrap()
            .ends_with("chat_template.jinja")
    );
    let (_, summary, _) = run("none", "none");
    assert!(summary["chat_template"].is_null());
    std::fs::remove_dir_all(&dir).unwrap();
}
