//! Hints for the flag names users bring from other tools (Hugging Face's
//! `Trainer`, torchtune, axolotl, nanoGPT): when clap reports an unknown
//! argument, the upipe flag that does that job, or why there is none.

/// (commands the entry is for, `*` for all; the flags, with dashes; the hint)
const FLAG_HINTS: &[(&[&str], &[&str], &str)] = &[
    (
        &["train"],
        &[
            "--max-steps",
            "--num-steps",
            "--total-steps",
            "--train-steps",
            "--iters",
            "--max-iters",
        ],
        "upipe's is --steps N (optimizer steps); or --epochs N for passes over the data",
    ),
    (
        &["train"],
        &["--num-train-epochs", "--num-epochs", "--epoch"],
        "upipe's is --epochs N (the steps are derived from the windows the data gives)",
    ),
    (
        &["train"],
        &[
            "--output-dir",
            "--out-dir",
            "--output",
            "--checkpoint-dir",
            "--ckpt-dir",
            "--out",
        ],
        "upipe's is --save-dir DIR (checkpoints and the run file run.toml)",
    ),
    (
        &["train", "eval", "plan"],
        &[
            "--batch-size",
            "--per-device-train-batch-size",
            "--train-batch-size",
            "--micro-batch-size",
            "--global-batch-size",
            "--bs",
        ],
        "upipe has no batch size: each rank group takes one sequence of --seq tokens at a \
         time; --grad-accum N accumulates N sequences per optimizer step (and --data-parallel \
         R multiplies them by R replicas)",
    ),
    (
        &["train"],
        &["--learning-rate"],
        "upipe's is --lr (peak learning rate; --min-lr, --warmup and --schedule shape it)",
    ),
    (
        &["train"],
        &[
            "--gradient-accumulation-steps",
            "--gradient-accumulation",
            "--accum-steps",
        ],
        "upipe's is --grad-accum N (sequences per optimizer step)",
    ),
    (
        &["train", "plan", "eval"],
        &[
            "--max-seq-length",
            "--max-seq-len",
            "--seq-len",
            "--seq-length",
            "--sequence-len",
            "--max-length",
            "--context-length",
            "--block-size",
        ],
        "upipe's is --seq N (tokens per sequence)",
    ),
    (
        &["train"],
        &[
            "--model-name-or-path",
            "--model-name",
            "--base-model",
            "--model-path",
            "--pretrained",
        ],
        "upipe's are --init-from DIR (an HF model directory: its weights and architecture) \
         and --model NAME (a built-in architecture, random weights)",
    ),
    (
        &["train"],
        &[
            "--dataset",
            "--train-file",
            "--train-data",
            "--dataset-path",
            "--data-path",
        ],
        "upipe's is --data FILE (token ids from `upipe tokenize`, or plain text)",
    ),
    (
        &["train"],
        &["--warmup-steps"],
        "upipe's is --warmup N (steps)",
    ),
    (
        &["train"],
        &["--lr-scheduler-type", "--lr-scheduler", "--scheduler"],
        "upipe's is --schedule cosine|linear|constant|wsd",
    ),
    (
        &["train"],
        &["--gradient-checkpointing", "--activation-checkpointing"],
        "upipe's is --checkpoint (full activation checkpointing per block)",
    ),
    (&["train"], &["--save-steps"], "upipe's is --save-every N"),
    (&["train"], &["--eval-steps"], "upipe's is --eval-every N"),
    (
        &["train"],
        &["--validation-file", "--eval-file", "--val-data"],
        "upipe's is --eval-data FILE",
    ),
    (
        &["train"],
        &["--logging-dir", "--report-to", "--log-dir", "--wandb"],
        "upipe writes --metrics FILE (JSON lines; `upipe report` draws them) and \
         --tensorboard DIR",
    ),
    (
        &["train", "plan"],
        &["--lora-r"],
        "upipe's is --lora-rank R",
    ),
    (
        &["eval"],
        &["--data", "--eval-data", "--dataset"],
        "upipe eval's is --tokens FILE (token ids: `upipe tokenize` makes them)",
    ),
    (
        &["eval"],
        &["--model", "--init-from", "--model-name-or-path"],
        "upipe eval's is --model-dir DIR (an HF model directory or a upipe checkpoint)",
    ),
];

/// The hint for `flag` (as typed: `--max_steps=10` finds `--max-steps`),
/// unknown to `command`, or `None`.
pub fn flag_hint(command: &str, flag: &str) -> Option<&'static str> {
    let name = flag.split('=').next().unwrap_or(flag).replace('_', "-");
    let name = name.to_ascii_lowercase();
    FLAG_HINTS
        .iter()
        .find(|(cmds, flags, _)| {
            (cmds.contains(&command) || cmds.contains(&"*")) && flags.contains(&name.as_str())
        })
        .map(|(_, _, hint)| *hint)
}

/// The unknown argument of a clap error and its hint, if it has one.
pub fn error_hint(command: &str, e: &clap::Error) -> Option<&'static str> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => flag_hint(command, arg),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::flag_hint;

    #[test]
    fn other_tools_flags_find_upipes() {
        assert!(
            flag_hint("train", "--max-steps")
                .unwrap()
                .contains("--steps")
        );
        assert!(
            flag_hint("train", "--max_steps=5")
                .unwrap()
                .contains("--steps")
        );
        assert!(
            flag_hint("train", "--output-dir")
                .unwrap()
                .contains("--save-dir")
        );
        assert!(
            flag_hint("train", "--batch-size")
                .unwrap()
                .contains("--grad-accum")
        );
        assert!(flag_hint("eval", "--data").unwrap().contains("--tokens"));
        assert_eq!(flag_hint("train", "--data"), None);
        assert_eq!(flag_hint("train", "--nothing-like-it"), None);
    }
}
