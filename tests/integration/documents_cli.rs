//! `upipe train` on documents: ids with their document index and loss mask
//! train under every `--pack`; bad index and mask files, `--pack bfd`
//! without an index, and documents that are not ids (JSONL, directories)
//! are refused before anything trains, naming the file and the fix.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use upipe::data::doc_index::{IndexWriter, MaskWriter, index_path, mask_path};
use upipe::data::write_u32_tokens;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("upipe-documents-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn upipe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_upipe"))
        .args(args)
        .output()
        .unwrap()
}

fn train(data: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--data", data.to_str().unwrap()];
    args.extend([
        "--steps", "1", "--seq", "32", "--attn", "local", "--device", "cpu",
    ]);
    args.extend(extra);
    upipe(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// 600 byte ids in documents of 1 to 97 ids, the index beside them.
fn ids_with_index(dir: &Path) -> (PathBuf, Vec<u64>) {
    let ids: Vec<u32> = (0..600).map(|i| (i * 7 % 251) as u32).collect();
    let path = dir.join("train.u32");
    write_u32_tokens(&path, &ids).unwrap();
    let mut starts = vec![0u64];
    while let Some(&s) = starts.last() {
        let next = s + 1 + (s * 13 % 97);
        if next >= 600 {
            break;
        }
        starts.push(next);
    }
    write_index(&path, &starts, 600);
    (path, starts)
}

fn write_index(ids: &Path, starts: &[u64], tokens: u64) {
    let mut w = IndexWriter::create(&index_path(ids)).unwrap();
    for &s in starts {
        w.push(s).unwrap();
    }
    w.finish(tokens).unwrap();
}

#[test]
fn every_packing_trains_on_indexed_ids_with_a_mask() {
    let dir = scratch("train");
    let (path, _) = ids_with_index(&dir);
    let mut m = MaskWriter::create(&mask_path(&path)).unwrap();
    let flags: Vec<bool> = (0..600).map(|i| i % 3 != 0).collect();
    m.push(&flags).unwrap();
    m.finish().unwrap();
    for pack in ["stream", "documents", "bfd"] {
        let out = train(&path, &["--pack", pack, "--json"]);
        assert!(out.status.success(), "--pack {pack}: {}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        let loss = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|v| v["loss"].as_f64());
        assert!(loss.is_some_and(f64::is_finite), "--pack {pack}: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_index_and_mask_files_are_refused_naming_the_file() {
    let dir = scratch("bad");
    let (path, starts) = ids_with_index(&dir);
    let index = index_path(&path).display().to_string();
    // wrong length: the index was written for other ids
    write_index(&path, &starts, 601);
    let e = stderr(&train(&path, &[]));
    assert!(
        e.contains(&index) && e.contains("601") && e.contains("upipe tokenize"),
        "{e}"
    );
    // offsets out of order, and past the end
    let mut swapped = starts.clone();
    swapped.swap(1, 2);
    write_index(&path, &swapped, 600);
    let e = stderr(&train(&path, &[]));
    assert!(e.contains(&index) && e.contains("out of order"), "{e}");
    write_index(&path, &[0, 700], 600);
    let e = stderr(&train(&path, &[]));
    assert!(e.contains("past the end"), "{e}");
    // a loss mask of the wrong length
    write_index(&path, &starts, 600);
    let mut m = MaskWriter::create(&mask_path(&path)).unwrap();
    m.push(&[true; 599]).unwrap();
    m.finish().unwrap();
    let e = stderr(&train(&path, &[]));
    assert!(
        e.contains(&mask_path(&path).display().to_string()) && e.contains("599"),
        "{e}"
    );
    // --pack bfd on ids without an index
    std::fs::remove_file(mask_path(&path)).unwrap();
    std::fs::remove_file(index_path(&path)).unwrap();
    let e = stderr(&train(&path, &["--pack", "bfd"]));
    assert!(
        e.contains("no document index") && e.contains("--pack stream"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn documents_that_are_not_ids_name_the_tokenize_command() {
    let dir = scratch("raw");
    let jsonl = dir.join("chat.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"hello\"}\n").unwrap();
    for data in [&jsonl, &dir] {
        let out = train(data, &["--tokenizer", "byte"]);
        assert!(!out.status.success());
        let e = stderr(&out);
        let want = format!(
            "`upipe tokenize {} --tokenizer byte --eos 0 --out",
            data.display()
        );
        assert!(
            e.contains(&want) && e.contains("never trains on raw JSON"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// 39 short SFT examples (4 prompt ids, 6 answer ids each) and one whose
/// prompt of 990 ids is longer than any `--seq` below: its windows under
/// `--pack bfd --seq 64` hold no counted target.
fn sft_with_a_long_prompt(dir: &Path) -> PathBuf {
    let (mut ids, mut starts, mut flags) = (Vec::new(), Vec::new(), Vec::new());
    for d in 0..40u32 {
        starts.push(ids.len() as u64);
        let (prompt, answer) = if d == 20 { (990, 8) } else { (4, 6) };
        for q in 0..prompt + answer {
            ids.push((d * 31 + q * 7) % 250 + 1);
            flags.push(q >= prompt);
        }
    }
    let path = dir.join("sft.u32");
    write_u32_tokens(&path, &ids).unwrap();
    write_index(&path, &starts, ids.len() as u64);
    let mut m = MaskWriter::create(&mask_path(&path)).unwrap();
    m.push(&flags).unwrap();
    m.finish().unwrap();
    path
}

/// Each metrics line's `loss` (bits) and `skipped_windows` (0 when absent).
fn losses_and_skips(o: &Output) -> Vec<(u64, u64)> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let loss = v["loss"].as_f64()?;
            Some((loss.to_bits(), v["skipped_windows"].as_u64().unwrap_or(0)))
        })
        .collect()
}

/// A window with nothing to train on (inside a prompt longer than `--seq`)
/// is passed over and counted in the metrics; the run trains every step,
/// and a resumed run draws the same windows (losses equal to the bit) and
/// goes on counting.
#[test]
fn sft_windows_with_no_counted_target_are_skipped_counted_and_resume_exactly() {
    let dir = scratch("sft-skip");
    let path = sft_with_a_long_prompt(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let run = |steps: &str, save: &Path, resume: bool| {
        let mut args = vec![
            "--pack",
            "bfd",
            "--seq",
            "64",
            "--json",
            "--steps",
            steps,
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-3",
            "--warmup",
            "0",
            "--save-dir",
            save.to_str().unwrap(),
        ];
        if resume {
            args.push("--resume");
        }
        let mut full = vec!["train", "--data", path.to_str().unwrap()];
        full.extend(args);
        full.extend(["--attn", "local", "--device", "cpu"]);
        let out = upipe(&full);
        assert!(out.status.success(), "{}", stderr(&out));
        losses_and_skips(&out)
    };
    let whole = run("12", &a, false);
    assert_eq!(whole.len(), 12, "every step trains");
    let skipped = whole.last().unwrap().1;
    assert!(
        skipped > 0,
        "the long prompt's windows were skipped: {whole:?}"
    );
    run("5", &b, false);
    let resumed = run("12", &b, true);
    assert_eq!(resumed, whole[5..], "resumed steps equal the whole run's");
    std::fs::remove_dir_all(&dir).unwrap();
}
