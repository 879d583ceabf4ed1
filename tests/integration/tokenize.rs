//! `upipe tokenize`: text and JSONL documents through a byte-level BPE
//! tokenizer (built here) to a token file that decodes back to the
//! documents, each ending with the end-of-sequence id, with a document
//! index that matches them; chat and prompt/completion data with a loss
//! mask on the answers only; the same bytes for
//! any number of threads and batch size; the EOS found from the tokenizer's
//! files; bad input refused with errors naming the fix.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use upipe::data::doc_index::{DocIndex, LossMask, index_path, mask_path};
use upipe::data::limits::Limits;
use upipe::data::tokenize::{Encoding, Eos, resolve_eos, tokenize_files};
use upipe::data::{Tokenizer, Tokens};

/// A byte-level BPE `tokenizer.json`: the 256 byte symbols, one token per
/// merge, then the special tokens.
fn byte_level_json(merges: &[(&str, &str)], specials: &[&str]) -> String {
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    alphabet.sort_unstable();
    let mut vocab = serde_json::Map::new();
    for c in alphabet {
        let id = vocab.len();
        vocab.insert(c.to_string(), json!(id));
    }
    for (a, b) in merges {
        let id = vocab.len();
        vocab.insert(format!("{a}{b}"), json!(id));
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": vocab.len() + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
                  "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
    .to_string()
}

const MERGES: [(&str, &str); 5] = [
    ("t", "h"),
    ("th", "e"),
    ("\u{120}", "the"),
    ("a", "n"),
    ("\u{120}", "an"),
];

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-tok-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The corpus: one text file, one JSONL file (with a blank line and an empty document).
fn corpus(dir: &Path) -> (Vec<PathBuf>, Vec<String>) {
    let docs: Vec<String> = [
        "The cat and the hat.\nÜber naïve — 東京, then the end.\n",
        "the answer",
        "an other\nline  with  spaces",
        "",
        "last one: the",
    ]
    .map(String::from)
    .to_vec();
    let txt = dir.join("a.txt");
    std::fs::write(&txt, &docs[0]).unwrap();
    let jsonl = dir.join("b.jsonl");
    let lines: Vec<String> = docs[1..]
        .iter()
        .map(|d| json!({"text": d, "meta": 1}).to_string())
        .collect();
    std::fs::write(
        &jsonl,
        format!("{}\n{}\n\n{}\n{}\n", lines[0], lines[1], lines[2], lines[3]),
    )
    .unwrap();
    (vec![txt, jsonl], docs)
}

fn encoding(tok: &Tokenizer, eos: u32) -> Encoding<'_> {
    Encoding {
        tok,
        eos,
        chat: None,
        tokenizer: "tokenizer.json",
    }
}

/// The default limits with batches of `batch_bytes`.
fn limits(batch_bytes: usize) -> Limits {
    Limits {
        batch_bytes,
        ..Limits::default()
    }
}

fn split_on(ids: &[u32], eos: u32) -> Vec<Vec<u32>> {
    ids.split(|&t| t == eos).map(<[u32]>::to_vec).collect()
}

#[test]
fn documents_round_trip_each_ending_with_eos_for_any_thread_count() {
    let dir = temp_dir("round");
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(&tok_path, byte_level_json(&MERGES, &["<|endoftext|>"])).unwrap();
    let tok = Tokenizer::from_hf_file(&tok_path).unwrap();
    let eos = resolve_eos(&tok, &tok_path, Eos::Auto).unwrap();
    assert_eq!(eos, 261, "the special token after 256 bytes and 5 merges");
    let (inputs, docs) = corpus(&dir);
    let mut outputs = Vec::new();
    for (threads, batch) in [(1, 1 << 20), (3, 1 << 20), (3, 8), (1, 1)] {
        let out = dir.join(format!("t{threads}-{batch}.u32"));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let s = pool
            .install(|| {
                tokenize_files(
                    &inputs,
                    "text",
                    &encoding(&tok, eos),
                    &out,
                    &limits(batch),
                    &|_| {},
                )
            })
            .unwrap();
        assert_eq!(s.documents, 5);
        assert_eq!(s.eos, eos);
        assert!(!dir.join(format!("t{threads}-{batch}.u32.partial")).exists());
        outputs.push((std::fs::read(&out).unwrap(), s, out));
    }
    for (bytes, s, _) in &outputs[1..] {
        assert_eq!(
            bytes, &outputs[0].0,
            "output independent of threads and batches"
        );
        assert_eq!(s, &outputs[0].1);
    }
    let (_, summary, path) = &outputs[0];
    let ids = Tokens::open(path).unwrap();
    let ids = ids.read(0..ids.len());
    assert_eq!(summary.tokens, ids.len() as u64);
    assert!(
        ids.iter().any(|&t| (256..261).contains(&t)),
        "merges were used"
    );
    let mut pieces = split_on(&ids, eos);
    assert_eq!(
        pieces.pop(),
        Some(vec![]),
        "the last document ends with EOS too"
    );
    assert_eq!(pieces.len(), 5, "one EOS at the end of each document");
    // the index: each document starts after the EOS of the one before
    let index = DocIndex::open(&index_path(path), ids.len() as u64).unwrap();
    assert_eq!(index.len(), 5);
    for (d, piece) in pieces.iter().enumerate() {
        let span = index.span(d);
        assert_eq!(span.end - span.start, piece.len() as u64 + 1);
        assert_eq!(ids[span.end as usize - 1], eos);
    }
    assert!(!mask_path(path).exists(), "text data has no loss mask");
    let mut lengths: Vec<usize> = pieces.iter().map(|p| p.len() + 1).collect();
    for (piece, doc) in pieces.iter().zip(&docs) {
        assert_eq!(&tok.decode(piece).unwrap(), doc);
        assert_eq!(piece, &tok.encode(doc).unwrap());
    }
    lengths.sort_unstable();
    assert_eq!(summary.max, lengths[4]);
    assert_eq!(summary.p50, lengths[2]);
    assert_eq!((summary.p90, summary.p99), (lengths[4], lengths[4]));
    // a 16-bit output holds the same ids
    let out16 = dir.join("t.u16");
    tokenize_files(
        &inputs,
        "text",
        &encoding(&tok, eos),
        &out16,
        &limits(64),
        &|_| {},
    )
    .unwrap();
    let t16 = Tokens::open(&out16).unwrap();
    assert_eq!(t16.read(0..t16.len()), ids);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eos_comes_from_the_files_beside_the_tokenizer() {
    let dir = temp_dir("eos");
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(
        &tok_path,
        byte_level_json(&MERGES, &["<|endoftext|>", "<|im_end|>"]),
    )
    .unwrap();
    let tok = Tokenizer::resolve(dir.to_str().unwrap()).unwrap();
    assert_eq!(resolve_eos(&tok, &dir, Eos::Auto).unwrap(), 261);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "<|im_end|>"}}"#,
    )
    .unwrap();
    assert_eq!(resolve_eos(&tok, &tok_path, Eos::Auto).unwrap(), 262);
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": [100, 262]}"#).unwrap();
    assert_eq!(resolve_eos(&tok, &tok_path, Eos::Auto).unwrap(), 100);
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 7}"#).unwrap();
    assert_eq!(resolve_eos(&tok, &tok_path, Eos::Auto).unwrap(), 7);
    assert_eq!(resolve_eos(&tok, &tok_path, Eos::Id(5)).unwrap(), 5);
    let e = resolve_eos(&tok, &tok_path, Eos::Id(263))
        .unwrap_err()
        .to_string();
    assert!(e.contains("263") && e.contains("vocabulary of 263"), "{e}");
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 9999}"#).unwrap();
    let e = resolve_eos(&tok, &tok_path, Eos::Auto)
        .unwrap_err()
        .to_string();
    assert!(e.contains("9999") && e.contains("config.json"), "{e}");

    let bare = temp_dir("eos-none");
    let bare_path = bare.join("tokenizer.json");
    std::fs::write(&bare_path, byte_level_json(&MERGES, &["<pad>"])).unwrap();
    let tok = Tokenizer::from_hf_file(&bare_path).unwrap();
    let e = resolve_eos(&tok, &bare_path, Eos::Auto)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no end-of-sequence token found")
            && e.contains("<|endoftext|>")
            && e.contains("pass --eos ID"),
        "{e}"
    );
    let e = resolve_eos(&Tokenizer::byte(), Path::new("byte"), Eos::Auto)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pass --eos ID"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&bare).unwrap();
}

fn upipe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr_of_failure(args: &[&str]) -> String {
    let out = upipe(args);
    assert!(!out.status.success(), "upipe {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A WordLevel tokenizer.json of `n` ids.
fn word_level_json(n: usize) -> String {
    let vocab: serde_json::Map<String, Value> =
        (0..n).map(|i| (format!("w{i}"), json!(i))).collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    })
    .to_string()
}

#[test]
fn tokenize_command_writes_and_summarises_or_names_the_fix() {
    let dir = temp_dir("cli");
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(&tok_path, byte_level_json(&MERGES, &["<|endoftext|>"])).unwrap();
    let (inputs, _) = corpus(&dir);
    let (a, b, t) = (
        inputs[0].to_str().unwrap(),
        inputs[1].to_str().unwrap(),
        tok_path.to_str().unwrap(),
    );
    let out = dir.join("corpus.u32");
    let o = out.to_str().unwrap();
    let run = upipe(&[
        "tokenize",
        a,
        b,
        "--tokenizer",
        t,
        "--out",
        o,
        "--threads",
        "2",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(
        text.contains("5 documents") && text.contains("p50") && text.contains("p99"),
        "{text}"
    );
    let run = upipe(&[
        "tokenize",
        a,
        b,
        "--tokenizer",
        t,
        "--out",
        o,
        "--json",
        "--eos",
        "3",
    ]);
    assert!(run.status.success());
    let v: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(
        (v["documents"].as_u64(), v["eos"].as_u64()),
        (Some(5), Some(3))
    );
    let len = Tokens::open(&out).unwrap().len() as u64;
    assert_eq!(v["tokens"].as_u64(), Some(len));

    std::fs::write(
        &inputs[1],
        "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n",
    )
    .unwrap();
    let e = stderr_of_failure(&["tokenize", b, "--tokenizer", t, "--out", o]);
    assert!(
        e.contains(&format!("{b} line 2")) && e.contains("no field \"text\""),
        "{e}"
    );
    assert!(
        !dir.join("corpus.u32.partial").exists(),
        "the partial output is removed"
    );
    let e = stderr_of_failure(&["tokenize", a, "--tokenizer", t, "--out", "x.txt"]);
    assert!(e.contains("--out x.txt") && e.contains(".u32"), "{e}");
    let e = stderr_of_failure(&["tokenize", a, "--tokenizer", t, "--out", o, "--eos", "end"]);
    assert!(e.contains("--eos end"), "{e}");
    let e = stderr_of_failure(&["tokenize", "/no/such.txt", "--tokenizer", t, "--out", o]);
    assert!(e.contains("/no/such.txt"), "{e}");
    let big = dir.join("big.json");
    std::fs::write(&big, word_level_json(70_000)).unwrap();
    let big = big.to_str().unwrap();
    let e = stderr_of_failure(&[
        "tokenize",
        a,
        "--tokenizer",
        big,
        "--out",
        "x.u16",
        "--eos",
        "1",
    ]);
    assert!(e.contains("70000 ids") && e.contains(".u32"), "{e}");
    let e = stderr_of_failure(&["tokenize", a, "--tokenizer", big, "--out", o]);
    assert!(e.contains("pass --eos ID"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ChatML, as Qwen's tokenizer_config.json writes it.
const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
    {{ '<|im_start|>assistant\\n' }}{% endif %}";

#[test]
fn chat_and_prompt_completion_count_only_the_answers() {
    let dir = temp_dir("chat");
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(
        &tok_path,
        byte_level_json(&MERGES, &["<|im_start|>", "<|im_end|>"]),
    )
    .unwrap();
    let config = json!({"chat_template": CHATML, "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    // the data in a directory of its own (the tokenizer's files would be documents too)
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let data = dir.join("data/sft.jsonl.gz");
    let lines = [
        json!({"text": "plain"}),
        json!({"messages": [{"role": "user", "content": "the q"},
                            {"role": "assistant", "content": "an a"}]}),
        json!({"prompt": "2+2=", "completion": "4"}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, text.as_bytes()).unwrap();
    std::fs::write(&data, gz.finish().unwrap()).unwrap();
    let out = dir.join("sft.u32");
    let run = upipe(&[
        "tokenize",
        dir.join("data").to_str().unwrap(),
        "--tokenizer",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(
        (v["documents"].as_u64(), v["masked_documents"].as_u64()),
        (Some(3), Some(2))
    );
    let tok = Tokenizer::from_hf_file(&tok_path).unwrap();
    let ids = Tokens::open(&out).unwrap();
    let n = ids.len() as u64;
    let ids = ids.read(0..ids.len());
    let index = DocIndex::open(&index_path(&out), n).unwrap();
    let mask = LossMask::open(&mask_path(&out), n).unwrap();
    let counted = |d: usize| -> String {
        let span = index.span(d);
        let kept: Vec<u32> = span
            .filter(|&i| mask.counts(i))
            .map(|i| ids[i as usize])
            .collect();
        tok.decode(&kept).unwrap()
    };
    assert_eq!(counted(0), "plain<|im_end|>", "text counts whole");
    let chat = index.span(1);
    let rendered = tok
        .decode(&ids[chat.start as usize..chat.end as usize])
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>user\nthe q<|im_end|>\n<|im_start|>assistant\nan a<|im_end|>\n"
    );
    assert_eq!(
        counted(1),
        "an a<|im_end|>\n",
        "only the assistant's turn counts"
    );
    assert_eq!(counted(2), "4<|im_end|>", "only the completion counts");
    // a role the template is not known to render, and a template that fails
    std::fs::remove_file(&data).unwrap();
    let plain = dir.join("data/sft.jsonl");
    std::fs::write(
        &plain,
        "{\"messages\": [{\"role\": \"bard\", \"content\": \"x\"}]}\n",
    )
    .unwrap();
    let data_dir = dir.join("data");
    let args = [
        "tokenize",
        data_dir.to_str().unwrap(),
        "--tokenizer",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let e = stderr_of_failure(&args);
    assert!(e.contains("role \"bard\""), "{e}");
    std::fs::write(
        &plain,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
    )
    .unwrap();
    let bad = json!({"chat_template": "{{ raise_exception('no system role') }}", "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), bad.to_string()).unwrap();
    let e = stderr_of_failure(&args);
    assert!(
        e.contains("no system role") && e.contains("tokenizer_config.json"),
        "{e}"
    );
    // a corrupt gzip stream names the file and the check
    std::fs::remove_file(&plain).unwrap();
    std::fs::write(&data, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 1, 2]).unwrap();
    let e = stderr_of_failure(&args);
    assert!(e.contains("sft.jsonl.gz") && e.contains("gzip -t"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `tokenize` arguments for `inputs` into `out` with the tokenizer of `dir`, as JSON.
fn tokenize_json(inputs: &[&Path], tokenizer: &str, out: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["tokenize".to_string()];
    args.extend(inputs.iter().map(|p| p.display().to_string()));
    args.extend(["--tokenizer", tokenizer, "--out"].map(String::from));
    args.push(out.display().to_string());
    args.push("--json".into());
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = upipe(&args);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_slice(&run.stdout).unwrap()
}

/// `tokenize DIR --out DIR/out.u32` is refused before anything is read (an
/// output inside an input directory); an earlier run's ids, index and mask
/// found in an input directory are left out, not read as text; and an ids
/// or index file named as an input is refused.
#[test]
fn tokenize_never_reads_its_own_output() {
    let dir = temp_dir("own-out");
    std::fs::write(dir.join("a.txt"), "the only document").unwrap();
    let inside = dir.join("out.u32");
    let (d, i) = (dir.to_str().unwrap(), inside.to_str().unwrap());
    let e = stderr_of_failure(&[
        "tokenize",
        d,
        "--tokenizer",
        "byte",
        "--eos",
        "0",
        "--out",
        i,
    ]);
    assert!(e.contains("--out") && e.contains("inside the input"), "{e}");
    assert!(!inside.exists());
    let dst = temp_dir("own-out-dst");
    let out = dst.join("out.u32");
    let v = tokenize_json(&[&dir], "byte", &out, &["--eos", "0"]);
    assert_eq!(v["documents"], json!(1), "{v}");
    // the first run's files put beside the text: left out of the second
    for f in [out.clone(), index_path(&out)] {
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let again = dst.join("again.u32");
    let v = tokenize_json(&[&dir], "byte", &again, &["--eos", "0"]);
    assert_eq!(v["documents"], json!(1), "{v}");
    let docs = index_path(&out);
    let e = stderr_of_failure(&[
        "tokenize",
        docs.to_str().unwrap(),
        "--tokenizer",
        "byte",
        "--eos",
        "0",
        "--out",
        dst.join("third.u32").to_str().unwrap(),
    ]);
    assert!(
        e.contains("out.u32.docs") && e.contains("pre-tokenized"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

/// The index and mask carry a stamp of the ids they were written with: the
/// files of two tokenize runs put together (what a run killed between its
/// renames leaves) are refused by name, even where the lengths agree; a
/// run with no mask removes an earlier run's.
#[test]
fn index_and_mask_of_other_ids_are_refused() {
    use upipe::data::Dataset;
    let dir = temp_dir("stamp");
    let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    std::fs::write(&a, "{\"prompt\": \"ab\", \"completion\": \"cd\"}\n").unwrap();
    std::fs::write(&b, "{\"prompt\": \"cd\", \"completion\": \"ab\"}\n").unwrap();
    let (out_a, out_b) = (dir.join("a.u32"), dir.join("b.u32"));
    tokenize_json(&[&a], "byte", &out_a, &["--eos", "0"]);
    tokenize_json(&[&b], "byte", &out_b, &["--eos", "0"]);
    let load = |p: &Path| Dataset::with_files_beside(Tokens::open(p).unwrap(), p);
    assert!(load(&out_a).unwrap().mask.is_some());
    // b's mask beside a's ids: the same length, other ids
    std::fs::copy(mask_path(&out_b), mask_path(&out_a)).unwrap();
    let e = load(&out_a).unwrap_err().to_string();
    assert!(
        e.contains("a.u32.mask") && e.contains("other ids") && e.contains("upipe tokenize"),
        "{e}"
    );
    // a text corpus tokenized over a: the old mask goes
    let text = dir.join("t.txt");
    std::fs::write(&text, "abcd").unwrap();
    tokenize_json(&[&text], "byte", &out_a, &["--eos", "0"]);
    assert!(!mask_path(&out_a).exists());
    assert!(load(&out_a).unwrap().mask.is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A byte-level tokenizer with ChatML's specials in `dir`, its template in
/// `chat_template.jinja` and, when given, another in tokenizer_config.json.
fn chat_tokenizer_dir(dir: &Path, jinja: &str, config_template: Option<&str>) {
    std::fs::write(
        dir.join("tokenizer.json"),
        byte_level_json(&MERGES, &["<|im_start|>", "<|im_end|>"]),
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), jinja).unwrap();
    if let Some(t) = config_template {
        let config = json!({"chat_template": t, "eos_token": "<|im_end|>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
}

/// `chat_template.jinja` is read (before tokenizer_config.json's
/// template); ShareGPT's `conversations` are conversations; a conversation
/// rendered as nothing or with no assistant turn is left out, counted and
/// named; the summary says conversations do not end with the EOS id.
#[test]
fn chat_templates_from_jinja_and_sharegpt_with_left_out_documents_named() {
    let dir = temp_dir("jinja");
    let tok = dir.join("tok");
    std::fs::create_dir_all(&tok).unwrap();
    // renders nothing for a conversation of one message
    let jinja = format!("{{% if messages|length > 1 %}}{CHATML}{{% endif %}}");
    chat_tokenizer_dir(&tok, &jinja, Some("{{ raise_exception('the config') }}"));
    let data = dir.join("chat.jsonl");
    let lines = [
        json!({"conversations": [{"from": "human", "value": "the q"},
                                 {"from": "gpt", "value": "an a"}]}),
        json!({"messages": [{"role": "user", "content": "alone"}]}),
        json!({"messages": [{"role": "system", "content": "s"},
                            {"role": "user", "content": "no answer"}]}),
        json!({"text": "plain"}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&data, text).unwrap();
    let out = dir.join("chat.u32");
    let v = tokenize_json(&[&data], tok.to_str().unwrap(), &out, &[]);
    assert_eq!(
        (&v["documents"], &v["conversations"]),
        (&json!(2), &json!(1)),
        "{v}"
    );
    assert_eq!(
        (&v["empty_documents"], &v["unanswered_documents"]),
        (&json!(1), &json!(1))
    );
    let left_out = v["left_out"].to_string();
    assert!(
        left_out.contains("chat.jsonl line 2") && left_out.contains("chat.jsonl line 3"),
        "{left_out}"
    );
    let run = upipe(&[
        "tokenize",
        data.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(
        said.contains("conversations as their chat template ends them"),
        "{said}"
    );
    assert!(String::from_utf8_lossy(&run.stderr).contains("left out 2 documents"));
    // errors name the file and line: an unknown role, content as parts
    std::fs::write(
        &data,
        "{\"text\": \"ok\"}\n{\"conversations\": [{\"from\": \"narrator\", \"value\": \"x\"}]}\n",
    )
    .unwrap();
    let args = [
        "tokenize",
        data.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let e = stderr_of_failure(&args);
    assert!(
        e.contains("chat.jsonl line 2") && e.contains("narrator"),
        "{e}"
    );
    let parts = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]},
                                    {"role": "assistant", "content": "y"}]});
    std::fs::write(&data, format!("{parts}\n")).unwrap();
    let e = stderr_of_failure(&args);
    assert!(
        e.contains("chat.jsonl line 1") && e.contains("list of parts"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Chat data mixes with text data of the same tokenizer: a conversation
/// ends as its template ends it (ChatML: a newline), which is no sign of
/// another tokenizer.
#[test]
fn chat_and_text_corpora_of_one_tokenizer_mix() {
    use upipe::data::mixture::load_mixture;
    let dir = temp_dir("mix-chat");
    chat_tokenizer_dir(&dir, CHATML, None);
    let (chat, text) = (dir.join("chat.jsonl"), dir.join("text.jsonl"));
    let convo = json!({"messages": [{"role": "user", "content": "the q"},
                                    {"role": "assistant", "content": "an a"}]});
    // 20 conversations and one text (which ends with the EOS id)
    let lines = format!("{convo}\n").repeat(20) + "{\"text\": \"an other\"}\n";
    std::fs::write(&chat, lines).unwrap();
    std::fs::write(&text, "{\"text\": \"the answer\"}\n".repeat(20)).unwrap();
    let (chat_ids, text_ids) = (dir.join("chat.u32"), dir.join("text.u32"));
    let tok = dir.to_str().unwrap();
    let eos = ["--eos", "262"];
    tokenize_json(&[&chat], tok, &chat_ids, &eos);
    tokenize_json(&[&text], tok, &text_ids, &eos);
    let spec = format!("{}:0.5,{}:0.5", chat_ids.display(), text_ids.display());
    let mix = load_mixture(Some(Path::new(&spec)), None, 300);
    assert!(mix.is_ok(), "{}", mix.err().unwrap());
    // another EOS is still another tokenizer
    tokenize_json(&[&text], tok, &text_ids, &["--eos", "261"]);
    let e = load_mixture(Some(Path::new(&spec)), None, 300).unwrap_err();
    assert!(e.to_string().contains("different tokenizers"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
