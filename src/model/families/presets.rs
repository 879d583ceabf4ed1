//! Presets of published models by name, each the `config.json` Hugging
//! Face publishes for it (`presets/*.json`, copied field for field: token
//! ids, dtype, rope scaling and all), read through its family like any
//! other `config.json`, so `--model llama3.1-8b` needs no files and a
//! checkpoint of it writes that same `config.json`.

/// Name → the model's `config.json`, in the order they are listed to users.
const HF_PRESETS: &[(&str, &str)] = &[
    ("llama3.1-8b", include_str!("presets/llama3.1-8b.json")),
    ("llama3.1-70b", include_str!("presets/llama3.1-70b.json")),
    ("llama3.2-1b", include_str!("presets/llama3.2-1b.json")),
    ("llama3.2-3b", include_str!("presets/llama3.2-3b.json")),
    ("llama3.3-70b", include_str!("presets/llama3.3-70b.json")),
    ("qwen3-0.6b", include_str!("presets/qwen3-0.6b.json")),
    ("qwen3-1.7b", include_str!("presets/qwen3-1.7b.json")),
    ("qwen3-4b", include_str!("presets/qwen3-4b.json")),
    ("qwen3-8b", include_str!("presets/qwen3-8b.json")),
    ("qwen3-14b", include_str!("presets/qwen3-14b.json")),
    ("qwen3-32b", include_str!("presets/qwen3-32b.json")),
    (
        "qwen2.5-0.5b-instruct",
        include_str!("presets/qwen2.5-0.5b-instruct.json"),
    ),
    (
        "qwen2.5-1.5b-instruct",
        include_str!("presets/qwen2.5-1.5b-instruct.json"),
    ),
    (
        "qwen2.5-3b-instruct",
        include_str!("presets/qwen2.5-3b-instruct.json"),
    ),
    (
        "qwen2.5-7b-instruct",
        include_str!("presets/qwen2.5-7b-instruct.json"),
    ),
    (
        "qwen2.5-14b-instruct",
        include_str!("presets/qwen2.5-14b-instruct.json"),
    ),
    (
        "qwen2.5-32b-instruct",
        include_str!("presets/qwen2.5-32b-instruct.json"),
    ),
    (
        "qwen2.5-72b-instruct",
        include_str!("presets/qwen2.5-72b-instruct.json"),
    ),
    ("mistral-7b", include_str!("presets/mistral-7b-v0.1.json")),
    (
        "mistral-7b-v0.3",
        include_str!("presets/mistral-7b-v0.3.json"),
    ),
    (
        "mistral-nemo-12b",
        include_str!("presets/mistral-nemo-base-2407.json"),
    ),
    ("gemma3-1b", include_str!("presets/gemma3-1b.json")),
    ("gemma3-4b", include_str!("presets/gemma3-4b.json")),
    ("gemma3-12b", include_str!("presets/gemma3-12b.json")),
    ("gemma3-27b", include_str!("presets/gemma3-27b.json")),
];

/// The published `config.json` of the preset called `name`, if it is one.
pub fn hf_preset(name: &str) -> Option<&'static str> {
    HF_PRESETS.iter().find(|(n, _)| *n == name).map(|(_, j)| *j)
}

/// The names of the presets of published models.
#[cfg(test)]
pub fn hf_preset_names() -> impl Iterator<Item = &'static str> {
    HF_PRESETS.iter().map(|(n, _)| *n)
}

/// `"; did you mean A or B?"` for the `names` that `arg` starts (a preset
/// named without its suffix, such as `qwen2.5-7b`), or nothing.
pub fn did_you_mean(names: &[&str], arg: &str) -> String {
    let near: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| !arg.is_empty() && n.starts_with(arg))
        .collect();
    if near.is_empty() {
        String::new()
    } else {
        format!("; did you mean {}?", near.join(" or "))
    }
}

/// What a `--model` name that is neither a preset nor a file may have
/// meant: a Hugging Face Hub id (`org/Name`: download it, pass
/// `--init-from DIR`, or the matching preset for random weights), or
/// another tool's spelling of a preset (`llama-3.1-8b`, `Qwen3-8B`); else
/// [`did_you_mean`]'s names the argument starts. Empty when nothing fits.
pub fn model_hint(names: &[&str], arg: &str) -> String {
    let key = |s: &str| {
        s.to_ascii_lowercase()
            .replace(['-', '_', ' '], "")
            .trim_start_matches("meta")
            .to_string()
    };
    let tail = arg.rsplit('/').next().unwrap_or(arg);
    let nearest = names.iter().copied().find(|n| key(n) == key(tail));
    let parts: Vec<&str> = arg.split('/').collect();
    let hub_id = parts.len() == 2
        && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
        && !std::path::Path::new(parts[0]).exists();
    if hub_id {
        let random = match nearest {
            Some(n) => format!("--model {n}"),
            None => "--model with the nearest preset".to_string(),
        };
        return format!(
            "; '{arg}' looks like a Hugging Face Hub id, and upipe reads no Hub: download the \
             model directory (`huggingface-cli download {arg} --local-dir DIR`) and pass \
             --init-from DIR to start from its weights, or {random} for its architecture with \
             random weights"
        );
    }
    match nearest {
        Some(n) if n != arg => format!("; did you mean {n}? (upipe's name for it)"),
        _ => did_you_mean(names, arg),
    }
}

#[cfg(test)]
mod tests {
    use crate::model::ModelConfig;

    /// A name that starts a preset's name points at it.
    #[test]
    fn an_unknown_name_suggests_the_presets_it_starts() {
        let e = ModelConfig::resolve("qwen2.5-7b").unwrap_err().to_string();
        assert!(e.contains("did you mean qwen2.5-7b-instruct?"), "{e}");
        let e = ModelConfig::resolve("nope").unwrap_err().to_string();
        assert!(!e.contains("did you mean"), "{e}");
    }
}
