//! Memory and time stay bounded on inputs a long-context user has: a long
//! document through an HF tokenizer, a Parquet file of long rows, a
//! compressed line or text that expands past the document limit, a chat
//! template that loops or writes without end, an absurd thread count, a
//! bench length beyond the host. Each runs the real binary with small
//! limits (`--max-doc-mb`, `--batch-mb`) and, where memory is the point,
//! under a cap on the child's heap (`RLIMIT_DATA`) that the unbounded
//! reading exceeded.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-bounds-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What a finished `upipe` run left: its exit code (`None`: killed by a
/// signal, as a failed allocation aborts) and its stderr.
struct Finished {
    code: Option<i32>,
    stderr: String,
}

/// Runs `upipe args` to its end (a hang of 120 s fails the test) with at most `data_limit` bytes of heap
/// and anonymous memory (`RLIMIT_DATA`): beyond it an allocation fails and
/// the process aborts. (The child's own peak cannot be read back: `wait4`'s
/// `ru_maxrss` counts the memory of the test process it was spawned from.)
fn run_bounded(args: &[&str], dir: &Path, data_limit: usize) -> Finished {
    use std::os::unix::process::CommandExt;
    let err_path = dir.join("stderr.txt");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_upipe"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let limit = libc::rlimit {
        rlim_cur: data_limit as libc::rlim_t,
        rlim_max: data_limit as libc::rlim_t,
    };
    // SAFETY: setrlimit is async-signal-safe and touches only `limit`,
    // copied into the closure.
    unsafe {
        cmd.pre_exec(move || match libc::setrlimit(libc::RLIMIT_DATA, &limit) {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        });
    }
    let mut child = cmd.spawn().unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("upipe {args:?} still running after 120 s: killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Finished {
        code: status.code(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}

/// A word-level tokenizer (whitespace-split words, all unknown but none):
/// few ids for much text. `<|endoftext|>` is id 1.
fn word_level(dir: &Path) -> PathBuf {
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "<|endoftext|>": 1},
                  "unk_token": "[UNK]"}
    });
    let path = dir.join("words.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

const MIB: usize = 1 << 20;

#[test]
fn a_long_document_is_tokenized_in_pieces_in_bounded_memory() {
    let dir = temp_dir("long-doc");
    // 4 MiB of words through the bundled byte-level BPE tokenizer.json
    let tokenizer = dir.join("tokenizer.json");
    std::fs::write(&tokenizer, include_str!("../../assets/tokenizer.json")).unwrap();
    let corpus = include_str!("../../assets/corpus.txt");
    let text: String = corpus.chars().cycle().take(4 * MIB).collect();
    let doc = dir.join("book.txt");
    std::fs::write(&doc, &text).unwrap();
    let out = dir.join("book.u32");
    let (doc, tok, out_s) = (
        doc.to_str().unwrap(),
        tokenizer.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let args = [
        "tokenize",
        doc,
        "--tokenizer",
        tok,
        "--out",
        out_s,
        "--threads",
        "1",
    ];
    // encoded whole it held about 200 times the text (1.86 GB for 8 MiB);
    // in 256 KiB pieces, the text, its ids and one piece's working memory
    let done = run_bounded(&args, &dir, 384 * MIB);
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let ids = std::fs::metadata(&out).unwrap().len() as usize / 4;
    assert_eq!(
        ids,
        text.len() + 1,
        "every byte an id, and the end of sequence"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Parquet file of `rows` rows of one text column, each `row_bytes` of `x`.
fn parquet_of_long_rows(path: &Path, rows: usize, row_bytes: usize) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let schema = "message schema { REQUIRED BYTE_ARRAY text (UTF8); }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema).unwrap());
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, Arc::new(props)).unwrap();
    let mut group = w.next_row_group().unwrap();
    let one = ByteArray::from(vec![b'x'; row_bytes]);
    let values = vec![one; rows]; // clones share the one buffer
    let mut col = group.next_column().unwrap().unwrap();
    (col.typed::<ByteArrayType>())
        .write_batch(&values, None, None)
        .unwrap();
    col.close().unwrap();
    group.close().unwrap();
    w.close().unwrap();
}

#[test]
fn a_parquet_file_of_long_rows_is_read_a_few_rows_at_a_time() {
    let dir = temp_dir("parquet");
    let pq = dir.join("rows.parquet");
    parquet_of_long_rows(&pq, 300, MIB);
    assert!(
        std::fs::metadata(&pq).unwrap().len() < MIB as u64,
        "compressed"
    );
    let tok = word_level(&dir);
    let out = dir.join("rows.u32");
    let args = [
        "tokenize",
        pq.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--eos",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--threads",
        "1",
        "--batch-mb",
        "2",
    ];
    // read 1,024 rows at once it held all 300 MiB of them
    let done = run_bounded(&args, &dir, 192 * MIB);
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    // a row of 1 MiB longer than --max-doc-mb is refused naming it
    let mut args = args.to_vec();
    args.extend(["--max-doc-mb", "1"]);
    parquet_of_long_rows(&pq, 3, MIB + 1);
    let done = run_bounded(&args, &dir, 192 * MIB);
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("rows.parquet row 1") && done.stderr.contains("--max-doc-mb 1"),
        "{}",
        done.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `text` gzip-compressed into `path`.
fn gzip(path: &Path, text: impl Fn(&mut dyn Write)) {
    let file = std::fs::File::create(path).unwrap();
    let mut enc = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    text(&mut enc);
    enc.finish().unwrap();
}

#[test]
fn compressed_lines_and_texts_past_the_document_limit_are_refused_unread() {
    let dir = temp_dir("gz");
    let tok = word_level(&dir);
    let out = dir.join("out.u32");
    let run = |input: &Path, max_doc_mb: &str| {
        let args = [
            "tokenize",
            input.to_str().unwrap(),
            "--tokenizer",
            tok.to_str().unwrap(),
            "--eos",
            "1",
            "--out",
            out.to_str().unwrap(),
            "--max-doc-mb",
            max_doc_mb,
            "--threads",
            "1",
        ];
        run_bounded(&args, &dir, 128 * MIB)
    };
    // a JSONL line of 64 MiB after a short one, with a limit of 4 MiB
    let jsonl = dir.join("one-line.jsonl.gz");
    gzip(&jsonl, |w| {
        w.write_all(b"{\"text\": \"short\"}\n{\"text\": \"")
            .unwrap();
        let chunk = vec![b'a'; MIB];
        for _ in 0..64 {
            w.write_all(&chunk).unwrap();
        }
        w.write_all(b"\"}\n").unwrap();
    });
    let done = run(&jsonl, "4");
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    let named = format!("{} line 2 is longer than 4 MiB", jsonl.display());
    assert!(
        done.stderr.contains(&named) && done.stderr.contains("--max-doc-mb"),
        "{}",
        done.stderr
    );
    // a text of 512 MiB once decompressed (2 MB of gzip): read no further
    // than the limit, within a heap of 128 MiB
    let txt = dir.join("bomb.txt.gz");
    gzip(&txt, |w| {
        let chunk = vec![b'a'; MIB];
        for _ in 0..512 {
            w.write_all(&chunk).unwrap();
        }
    });
    let done = run(&txt, "4");
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(
        done.stderr
            .contains("bomb.txt.gz (one document, decompressed) is longer than 4 MiB"),
        "{}",
        done.stderr
    );
    // within the limit it is read
    let small = dir.join("small.txt.gz");
    gzip(&small, |w| w.write_all(&vec![b'a'; 3 * MIB]).unwrap());
    let done = run(&small, "4");
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_templates_that_loop_or_write_without_end_stop_naming_the_file() {
    let dir = temp_dir("chat");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("tokenizer.json"),
        include_str!("../../assets/tokenizer.json"),
    )
    .unwrap();
    let chat = dir.join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, \
         {\"role\": \"assistant\", \"content\": \"hello\"}]}\n",
    )
    .unwrap();
    let out = dir.join("chat.u32");
    let cases = [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "ran out of fuel",
        ),
        (
            "{% for i in range(1000000) %}{{ 'x' * 100000000 }}{% endfor %}",
            "chat_template.jinja",
        ),
        (
            "{% for i in range(3000) %}{{ 'x' * 1000 }}{% endfor %}",
            "longer than 1 MiB (--max-doc-mb 1)",
        ),
    ];
    for (template, want) in cases {
        std::fs::write(model.join("chat_template.jinja"), template).unwrap();
        let args = [
            "tokenize",
            chat.to_str().unwrap(),
            "--tokenizer",
            model.to_str().unwrap(),
            "--eos",
            "255",
            "--out",
            out.to_str().unwrap(),
            "--max-doc-mb",
            "1",
        ];
        let done = run_bounded(&args, &dir, 512 * MIB);
        assert_eq!(done.code, Some(2), "{template}: {}", done.stderr);
        assert!(
            done.stderr.contains(want) && done.stderr.contains("chat_template.jinja"),
            "{template}: {}",
            done.stderr
        );
        assert!(!out.exists(), "nothing written");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn absurd_thread_counts_and_bench_lengths_are_refused_before_they_start() {
    let dir = temp_dir("threads");
    let text = dir.join("a.txt");
    std::fs::write(&text, "some text").unwrap();
    let out = dir.join("a.u32");
    let args = [
        "tokenize",
        text.to_str().unwrap(),
        "--tokenizer",
        "byte",
        "--eos",
        "0",
        "--out",
        out.to_str().unwrap(),
        "--threads",
        "100000",
    ];
    let done = run_bounded(&args, &dir, 512 * MIB);
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("--threads 100000: at most") && done.stderr.contains("per CPU"),
        "{}",
        done.stderr
    );
    // 2^28 tokens of the default layer: terabytes, refused with the numbers
    let done = run_bounded(
        &["bench", "attn", "--device", "cpu", "--seq", "268435456"],
        &dir,
        256 * MIB,
    );
    assert_eq!(done.code, Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("nothing was allocated")
            && done.stderr.contains("GiB of host memory")
            && done.stderr.contains("is available"),
        "{}",
        done.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
