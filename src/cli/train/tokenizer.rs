//! Which tokenizer turns a run's text into ids when `--tokenizer` is not
//! given: the model's own `tokenizer.json` where the model comes from a
//! directory (`--init-from DIR`, or `--model DIR`); bytes for a model whose
//! vocabulary is the 256 bytes, or for a built-in model (`--model
//! llama3.2-1b`) that starts from random weights, whose ids mean nothing
//! yet (said in the run header); otherwise an error naming `--tokenizer`. A
//! pretrained model of 128K ids trained on byte ids would train on garbage
//! without a word, so nothing is guessed beyond this.

use super::TrainArgs;
use crate::data::{ByteTokenizer, TokenFormat};
use crate::error::Result;
use std::path::{Path, PathBuf};

/// The tokenizer a run uses, and how the run header names it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerUse {
    /// What `--tokenizer` resolves to (`None`: no text to tokenize).
    pub arg: Option<String>,
    /// The header's words for it.
    pub said: String,
}

/// The text inputs of the run: `--data`'s (the bundled corpus when it is
/// not given) and `--eval-data`'s that are not pre-tokenized ids.
fn text_inputs(a: &TrainArgs) -> Result<Vec<String>> {
    let mut paths: Vec<PathBuf> = match &a.data {
        None => vec![],
        Some(spec) => match crate::data::mixture::parse_data_spec(spec)? {
            Some(parts) => parts.into_iter().map(|(p, _)| p).collect(),
            None => vec![spec.clone()],
        },
    };
    paths.extend(a.eval_data.iter().cloned());
    let mut texts: Vec<String> = (paths.iter())
        .filter(|p| TokenFormat::of_path(p).is_none())
        .map(|p| p.display().to_string())
        .collect();
    if a.data.is_none() {
        texts.insert(0, "the bundled corpus".into());
    }
    Ok(texts)
}

/// The directory the model comes from: `--init-from`, else `--model` when
/// it names a directory.
fn model_dir(a: &TrainArgs) -> Option<&Path> {
    let model = Path::new(&a.model);
    a.init_from.as_deref().or(model.is_dir().then_some(model))
}

/// Decides the tokenizer of the run whose model has `vocab` ids.
pub fn decide(a: &TrainArgs, vocab: usize) -> Result<TokenizerUse> {
    let texts = text_inputs(a)?;
    if let Some(t) = &a.tokenizer {
        let said = match texts.is_empty() {
            true => "none (pre-tokenized ids)".into(),
            false => format!("{t} (--tokenizer)"),
        };
        return Ok(TokenizerUse {
            arg: Some(t.clone()),
            said,
        });
    }
    if texts.is_empty() {
        return Ok(TokenizerUse {
            arg: None,
            said: "none (pre-tokenized ids)".into(),
        });
    }
    let dir = model_dir(a);
    if let Some(file) = dir
        .map(|d| d.join("tokenizer.json"))
        .filter(|f| f.is_file())
    {
        let shown = file.display().to_string();
        return Ok(TokenizerUse {
            said: format!("{shown}, the model's own (--tokenizer sets another)"),
            arg: Some(shown),
        });
    }
    if dir.is_none() && a.lora.lora_from.is_none() && vocab >= ByteTokenizer::VOCAB {
        return Ok(TokenizerUse {
            arg: Some("byte".into()),
            said: "bytes: the built-in model starts from random weights, so its ids mean \
                   nothing yet (--tokenizer sets another)"
                .into(),
        });
    }
    if vocab == ByteTokenizer::VOCAB {
        return Ok(TokenizerUse {
            arg: Some("byte".into()),
            said: "bytes, the model's vocabulary of 256 ids (--tokenizer sets another)".into(),
        });
    }
    let whence = match dir {
        Some(d) => format!("its directory {} holds no tokenizer.json", d.display()),
        None => "it comes from no directory with a tokenizer.json".into(),
    };
    crate::config_err!(
        "{} is text, and the model's vocabulary has {vocab} ids but {whence}: upipe will not \
         guess its tokenizer (byte ids would train the model on garbage); give --tokenizer \
         PATH, the model's tokenizer.json (or a directory holding it), or --tokenizer byte for \
         a model trained on bytes, or pre-tokenized ids (`upipe tokenize`)",
        texts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Train {
        #[command(flatten)]
        a: TrainArgs,
    }

    fn decided(args: &[&str], vocab: usize) -> Result<TokenizerUse> {
        let t = Train::try_parse_from(std::iter::once("train").chain(args.iter().copied()));
        decide(&t.unwrap().a, vocab)
    }

    #[test]
    fn a_built_in_model_from_random_weights_takes_bytes_and_a_pretrained_one_does_not() {
        let u = decided(&["--model", "llama3.2-1b"], 128_256).unwrap();
        assert_eq!(u.arg.as_deref(), Some("byte"));
        assert!(u.said.contains("random weights"), "{}", u.said);
        // pretrained weights from a directory without its tokenizer: refused
        let dir = std::env::temp_dir().join(format!("upipe-tok-decide-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let from = dir.to_str().unwrap();
        let e = decided(&["--model", "llama3.2-1b", "--init-from", from], 128_256).unwrap_err();
        assert!(e.to_string().contains("--tokenizer"), "{e}");
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        let u = decided(&["--init-from", from], 128_256).unwrap();
        assert_eq!(
            u.arg,
            Some(dir.join("tokenizer.json").display().to_string())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
