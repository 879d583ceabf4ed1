//! Pre-tokenized data: `upipe train` from an HF checkpoint whose vocabulary
//! is larger than the byte tokenizer's, on `.u32` and `.bin` (uint16) ids up
//! to vocab - 1; memory-mapped windows equal in-memory ones; every bad file
//! or tokenizer is refused with an error naming the fix.

use std::path::{Path, PathBuf};
use std::process::Command;
use upipe::backend::DType;
use upipe::checkpoint::{HostTensor, save_hf_model};
use upipe::data::{SequenceSampler, TokenFormat, Tokens, write_u32_tokens};
use upipe::model::ModelConfig;
use upipe::rng::Rng;

const VOCAB: usize = 1000;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-data-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An HF model directory of the tiny model with a vocabulary of `VOCAB`.
fn hf_model(dir: &Path) -> ModelConfig {
    let mut cfg = ModelConfig::resolve("tiny").unwrap();
    cfg.vocab = VOCAB;
    cfg.validate().unwrap();
    let mut rng = Rng::new(1);
    let host = cfg
        .hf_param_shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let data = match name.ends_with("norm.weight") {
                true => vec![1.0; n],
                false => rng.normal_vec(n, 0.02),
            };
            (name, HostTensor::new(shape, data).unwrap())
        })
        .collect();
    save_hf_model(dir, &cfg, &host, DType::F32).unwrap();
    cfg
}

/// Ids over the whole vocabulary, the last one included.
fn ids(n: usize) -> Vec<u32> {
    let mut rng = Rng::new(2);
    let mut ids: Vec<u32> = (0..n).map(|_| rng.below(VOCAB as u64) as u32).collect();
    ids[n / 2] = VOCAB as u32 - 1;
    ids
}

fn write_u16(path: &Path, ids: &[u32]) {
    let mut bytes = Vec::new();
    TokenFormat::U16.encode_into(ids, &mut bytes).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn upipe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn losses(out: &std::process::Output) -> Vec<f64> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn train_args<'a>(model: &'a str, data: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--model",
        model,
        "--init-from",
        model,
        "--data",
        data,
        "--seq",
        "32",
        "--steps",
        "3",
        "--device",
        "cpu",
        "--json",
        "--ulysses",
        "2",
        "--ring",
        "1",
    ]
}

#[test]
fn training_from_an_hf_checkpoint_reads_ids_up_to_its_vocabulary() {
    let dir = temp_dir("train");
    hf_model(&dir);
    let ids = ids(4000);
    let u32_file = dir.join("train.u32");
    write_u32_tokens(&u32_file, &ids).unwrap();
    let bin_file = dir.join("train.bin");
    write_u16(&bin_file, &ids);
    let m = dir.to_str().unwrap();
    let from_u32 = losses(&upipe(&train_args(m, u32_file.to_str().unwrap())));
    assert_eq!(from_u32.len(), 3);
    // from (near) uniform predictions over 1000 ids
    let uniform = (VOCAB as f64).ln();
    assert!(
        (from_u32[0] - uniform).abs() < 0.1,
        "{from_u32:?} vs ln 1000 = {uniform}"
    );
    let from_bin = losses(&upipe(&train_args(m, bin_file.to_str().unwrap())));
    assert_eq!(from_bin, from_u32, "the same ids as uint16");
    // a tokenizer given with pre-tokenized data is ignored, with a warning
    let mut args = train_args(m, u32_file.to_str().unwrap());
    args.extend(["--tokenizer", "byte"]);
    let out = upipe(&args);
    assert_eq!(losses(&out), from_u32);
    let warn = String::from_utf8_lossy(&out.stderr);
    assert!(
        warn.contains("--tokenizer byte is ignored") && warn.contains("pre-tokenized"),
        "{warn}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn failure(args: &[&str]) -> String {
    let out = upipe(args);
    assert!(!out.status.success(), "upipe {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_data_and_tokenizers_are_refused_naming_the_fix() {
    let dir = temp_dir("bad");
    hf_model(&dir);
    let m = dir.to_str().unwrap();
    let mut bad = ids(4000);
    bad[1234] = VOCAB as u32;
    let file = dir.join("bad.u32");
    write_u32_tokens(&file, &bad).unwrap();
    let f = file.to_str().unwrap();
    let e = failure(&train_args(m, f));
    assert!(
        e.contains(&format!(
            "{f}: token id 1000 at position 1234 is outside the vocabulary of 1000"
        )),
        "{e}"
    );
    let empty = dir.join("empty.u32");
    std::fs::write(&empty, []).unwrap();
    let e = failure(&train_args(m, empty.to_str().unwrap()));
    assert!(
        e.contains("empty.u32 is empty") && e.contains("upipe tokenize"),
        "{e}"
    );
    let odd = dir.join("odd.u16");
    std::fs::write(&odd, [1u8, 0, 2]).unwrap();
    let e = failure(&train_args(m, odd.to_str().unwrap()));
    assert!(e.contains("3 bytes, not a multiple of 2"), "{e}");
    let short = dir.join("short.u32");
    write_u32_tokens(&short, &[1, 2, 3]).unwrap();
    let e = failure(&train_args(m, short.to_str().unwrap()));
    assert!(e.contains("3 tokens") && e.contains("--seq"), "{e}");
    // 16-bit ids cannot cover Llama 3's vocabulary
    let e = failure(&[
        "train",
        "--model",
        "llama3.2-1b",
        "--data",
        odd.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(
        e.contains("16-bit ids") && e.contains("128256") && e.contains(".u32"),
        "{e}"
    );
    // a tokenizer with more ids than the model's vocabulary
    let tok = dir.join("tokenizer.json");
    let vocab: serde_json::Map<String, serde_json::Value> = (0..300)
        .map(|i| (format!("w{i}"), serde_json::json!(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(&tok, json.to_string()).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "w1 w2 w3 ".repeat(100)).unwrap();
    let (t, x) = (tok.to_str().unwrap(), text.to_str().unwrap());
    let e = failure(&[
        "train",
        "--data",
        x,
        "--tokenizer",
        t,
        "--device",
        "cpu",
        "--seq",
        "32",
    ]);
    assert!(
        e.contains("has 300 ids but the model's vocabulary has 256"),
        "{e}"
    );
    // the same tokenizer fits the 1000-id model
    let mut args = train_args(m, x);
    args.extend(["--tokenizer", t]);
    assert_eq!(losses(&upipe(&args)).len(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mapped_files_give_the_samplers_windows_of_the_ids_in_memory() {
    let dir = temp_dir("sampler");
    let ids = ids(10_007);
    let u32_file = dir.join("ids.u32");
    write_u32_tokens(&u32_file, &ids).unwrap();
    let u16_file = dir.join("ids.u16");
    write_u16(&u16_file, &ids);
    let mapped = Tokens::open_checked(&u32_file, VOCAB).unwrap();
    let mapped16 = Tokens::open_checked(&u16_file, VOCAB).unwrap();
    assert!(mapped.is_mapped() && mapped16.is_mapped());
    for (rank, world) in [(0, 1), (1, 3)] {
        let mut a = SequenceSampler::sharded(ids.clone(), 64, 5, rank, world).unwrap();
        let mut b = SequenceSampler::sharded(mapped.clone(), 64, 5, rank, world).unwrap();
        let mut c = SequenceSampler::sharded(mapped16.clone(), 64, 5, rank, world).unwrap();
        // past the end of the first epoch too
        for _ in 0..200 {
            let (wa, wb, wc) = (a.next_window(), b.next_window(), c.next_window());
            assert_eq!(wb.start, wa.start);
            assert_eq!(wb.tokens, wa.tokens);
            assert_eq!(wc.tokens, wa.tokens);
            assert_eq!(wa.tokens, &ids[wa.start..wa.start + 65]);
        }
        assert_eq!(a.next_batch(3), b.next_batch(3));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
