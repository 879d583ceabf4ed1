//! Every shell block (```bash, ```sh, ```console) of README.md,
//! ARCHITECTURE.md and docs/*.md runs as written, unless a marker line right
//! above it says why not (the convention is in docs/extending.md, "Docs that
//! run"):
//!
//! - `<!-- doc-test: gpu -->`: needs one or more GPUs;
//! - `<!-- doc-test: skip (why) -->`: cannot run here for another reason;
//! - `<!-- doc-test: continues -->`: runs after the shell block above it, in
//!   its directory (a new shell: variables do not carry over);
//! - `<!-- doc-test: fails -->`: must exit non-zero; a `# error: ...` comment
//!   in it is the message expected on stderr (`...` stands for any text).
//!
//! Each block runs under `bash -euo pipefail` in a fresh directory holding
//! links to the repository's files (`assets/`, `configs/`, `docs/`, ...), so
//! relative paths read the repository and outputs (`runs/...`) stay in the
//! scratch directory; the newcomer's pages ([`FROM_ANYWHERE`]: README.md and
//! docs/getting-started.md) run in an empty one instead, as a user who
//! installed the binary runs them, so no command of theirs may read the
//! repository. `upipe` on PATH is the binary cargo built for this
//! test, and so is `cargo run --release --` (a `cargo` on PATH that runs it;
//! `cargo build --release` does nothing, as the binary is built). A code
//! block without a language is an error: commands are ```bash, output is
//! ```text.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest a block may run.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Languages of the blocks that run.
const SHELLS: [&str; 4] = ["bash", "sh", "shell", "console"];

/// The pages whose blocks run in an empty directory, not beside the
/// repository's files: what a newcomer runs, from wherever they are.
const FROM_ANYWHERE: [&str; 2] = ["README.md", "docs/getting-started.md"];

/// Repository entries not linked into a block's directory.
const NOT_LINKED: [&str; 3] = ["target", "runs", "gpu-bundle"];

#[derive(Debug, Clone, PartialEq)]
enum Mark {
    Run,
    Gpu,
    Skip(String),
}

/// One fenced code block of a Markdown file.
#[derive(Debug, Clone)]
struct Block {
    file: String,
    /// 1-based line of the opening fence.
    fence: usize,
    lang: String,
    mark: Mark,
    continues: bool,
    fails: bool,
    /// The commands bash runs, one entry per script line, with its 1-based
    /// line in the file.
    lines: Vec<(usize, String)>,
}

impl Block {
    fn is_shell(&self) -> bool {
        SHELLS.contains(&self.lang.as_str())
    }
    fn script(&self) -> String {
        self.lines.iter().map(|(_, l)| format!("{l}\n")).collect()
    }
    fn at(&self) -> String {
        format!("{}:{}", self.file, self.fence)
    }
}

/// The items of a marker line, `None` when `line` is not one.
fn marker(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("<!--")?
        .strip_suffix("-->")?
        .trim()
        .strip_prefix("doc-test:")
        .map(str::trim)
}

/// Splits marker items at the commas outside parentheses.
fn items(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim());
    out
}

/// The code blocks of `text` (file `file`) and the errors in their markup.
fn parse(file: &str, text: &str) -> (Vec<Block>, Vec<String>) {
    let lines: Vec<&str> = text.lines().collect();
    let (mut blocks, mut errors) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if marker(t).is_some()
            && !lines
                .get(i + 1)
                .is_some_and(|l| l.trim_start().starts_with("```"))
        {
            errors.push(format!(
                "{file}:{}: a doc-test marker must be the line right above a code block",
                i + 1
            ));
        }
        let Some(info) = t.strip_prefix("```") else {
            i += 1;
            continue;
        };
        let indent = lines[i].len() - t.len();
        let fence = i + 1;
        let Some(end) = (i + 1..lines.len()).find(|&j| lines[j].trim() == "```") else {
            errors.push(format!("{file}:{fence}: code block never closed"));
            break;
        };
        let lang = info.split_whitespace().next().unwrap_or("").to_string();
        let mut block = Block {
            file: file.to_string(),
            fence,
            lang,
            mark: Mark::Run,
            continues: false,
            fails: false,
            lines: Vec::new(),
        };
        if block.lang.is_empty() {
            errors.push(format!(
                "{file}:{fence}: a code block without a language: ```bash for commands \
                 (run by this test unless marked), ```text for output"
            ));
        }
        if let Some(m) = i.checked_sub(1).and_then(|p| marker(lines[p])) {
            if !block.is_shell() {
                errors.push(format!(
                    "{file}:{fence}: a doc-test marker above a ```{} block: only shell blocks run",
                    block.lang
                ));
            }
            for item in items(m) {
                match item {
                    "gpu" if block.mark == Mark::Run => block.mark = Mark::Gpu,
                    "continues" => block.continues = true,
                    "fails" => block.fails = true,
                    s if s.starts_with("skip") && block.mark == Mark::Run => {
                        let why = s["skip".len()..].trim();
                        match why.strip_prefix('(').and_then(|w| w.strip_suffix(')')) {
                            Some(w) if !w.trim().is_empty() => {
                                block.mark = Mark::Skip(w.trim().to_string())
                            }
                            _ => errors.push(format!(
                                "{file}:{}: `skip` needs its reason: skip (why)",
                                fence - 1
                            )),
                        }
                    }
                    other => errors.push(format!(
                        "{file}:{}: doc-test marker item `{other}`: use gpu, skip (why), \
                         continues or fails (gpu and skip exclude each other)",
                        fence - 1
                    )),
                }
            }
        }
        let body = lines[i + 1..end].iter().enumerate().map(|(k, l)| {
            let l = if l.len() >= indent && l[..indent].trim().is_empty() {
                &l[indent..]
            } else {
                l.trim_start()
            };
            (fence + 1 + k, l.to_string())
        });
        if block.lang == "console" {
            // `$ ` lines are commands (with their `\` continuations); the rest is output
            let mut open = false;
            for (n, l) in body {
                if let Some(cmd) = l.strip_prefix("$ ").or(open.then_some(l.as_str())) {
                    open = cmd.trim_end().ends_with('\\');
                    block.lines.push((n, cmd.to_string()));
                }
            }
        } else {
            block.lines = body.collect();
        }
        if block.is_shell() && block.mark == Mark::Run {
            for (n, l) in &block.lines {
                let l = l.trim_start();
                if l.starts_with('#') && l.contains("needs") && l.contains("GPU") {
                    errors.push(format!(
                        "{file}:{n}: the block says it needs GPUs: mark it \
                         <!-- doc-test: gpu --> (or skip (why))"
                    ));
                }
            }
        }
        blocks.push(block);
        i = end + 1;
    }
    (blocks, errors)
}

/// The Markdown files whose blocks run: README.md, ARCHITECTURE.md, docs/*.md.
fn doc_files(root: &Path) -> Vec<String> {
    let mut docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    let mut files = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    files.extend(docs);
    files
}

/// Groups the runnable blocks into chains: a block and the `continues`
/// blocks after it, run one after the other in one directory.
fn chains(blocks: &[Block], errors: &mut Vec<String>) -> Vec<Vec<Block>> {
    let mut out: Vec<Vec<Block>> = Vec::new();
    let mut prev_ran: Option<&str> = None; // file of the previous shell block, if it ran
    let mut prev_file = "";
    for b in blocks.iter().filter(|b| b.is_shell()) {
        let ran = b.mark == Mark::Run;
        if b.continues {
            if prev_file != b.file || prev_ran != Some(b.file.as_str()) {
                errors.push(format!(
                    "{}: `continues`, but the shell block above it in this file does not run",
                    b.at()
                ));
            } else if ran {
                out.last_mut().unwrap().push(b.clone());
            }
        } else if ran {
            out.push(vec![b.clone()]);
        }
        prev_file = &b.file;
        prev_ran = ran.then_some(b.file.as_str());
    }
    out
}

/// A scratch directory for chain `n`: `work/` (links to the repository's
/// entries, or nothing when `empty`) and `bin/` (`upipe`, and a `cargo`
/// that runs it).
fn scratch(base: &Path, n: usize, root: &Path, empty: bool) -> PathBuf {
    let dir = base.join(format!("{n:03}"));
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    if empty {
        return dir;
    }
    for e in std::fs::read_dir(root).unwrap() {
        let name = e.unwrap().file_name();
        let s = name.to_string_lossy();
        if s.starts_with('.') || NOT_LINKED.contains(&s.as_ref()) {
            continue;
        }
        std::os::unix::fs::symlink(root.join(&name), work.join(&name)).unwrap();
    }
    dir
}

/// The `bin/` put first on PATH: `upipe`, and `cargo` standing for it.
fn bin_dir(base: &Path) -> PathBuf {
    let bin = base.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_upipe"), bin.join("upipe")).unwrap();
    let cargo = bin.join("cargo");
    std::fs::write(
        &cargo,
        "#!/usr/bin/env bash\n\
         # docs/ tests: `cargo run --release -- ARGS` is the binary cargo built\n\
         if [ \"${1-} ${2-} ${3-}\" = 'run --release --' ]; then shift 3; exec upipe \"$@\"; fi\n\
         if [ \"$*\" = 'build --release' ]; then exit 0; fi\n\
         echo \"doc test: 'cargo $*' does not run here: mark the block <!-- doc-test: skip (why) -->\" >&2\n\
         exit 2\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// The last `n` lines of `s`.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn squash(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The message a `fails` block's `# error: ...` comment expects, in pieces
/// (`...` stands for any text).
fn expected_error(b: &Block) -> Vec<String> {
    let mut text = String::new();
    let mut inside = false;
    for (_, l) in &b.lines {
        let l = l.trim_start();
        if let Some(rest) = l.strip_prefix("# error:") {
            inside = true;
            text.push_str(rest);
        } else if inside && l.starts_with('#') {
            text.push(' ');
            text.push_str(&l[1..]);
        } else {
            inside = false;
        }
    }
    text.split("...")
        .map(squash)
        .filter(|p| !p.is_empty())
        .collect()
}

/// Runs block `b` in `dir/work`; its time, or why it failed.
fn run_block(b: &Block, dir: &Path, bin: &Path, k: usize) -> Result<Duration, String> {
    // line 1 of the script is the trap; block line j is script line j + 2
    let script = dir.join(format!("block{k}.sh"));
    std::fs::write(
        &script,
        format!(
            "trap 'echo \"doc-test: script line $LINENO: $BASH_COMMAND\" >&2' ERR\n{}",
            b.script()
        ),
    )
    .unwrap();
    let (out, err) = (
        dir.join(format!("block{k}.out")),
        dir.join(format!("block{k}.err")),
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let start = Instant::now();
    let mut child = {
        use std::os::unix::process::CommandExt;
        Command::new("bash")
            .args(["-euo", "pipefail"])
            .arg(&script)
            .current_dir(dir.join("work"))
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > TIMEOUT {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = start.elapsed();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    // where it stopped: the trap's line, as a line of the file
    let failed_at = stderr
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("doc-test: script line "))
        .and_then(|l| {
            let (n, cmd) = l.split_once(": ")?;
            let n: usize = n.parse().ok()?;
            let line = b.lines.get(n.checked_sub(2)?)?.0;
            Some(format!("{}:{line}: `{cmd}`", b.file))
        })
        .unwrap_or_else(|| format!("{} (block)", b.at()));
    let report = |what: String| {
        format!(
            "{what}\n--- the block ({}) ---\n{}--- stderr (tail) ---\n{}\n--- stdout (tail) ---\n{}\n",
            b.at(),
            b.script(),
            tail(&stderr, 25),
            tail(&stdout, 10)
        )
    };
    match status {
        None => Err(report(format!(
            "{failed_at}: still running after {} s, killed",
            TIMEOUT.as_secs()
        ))),
        Some(s) if b.fails && s.success() => {
            Err(report(format!("{}: marked `fails` but exited 0", b.at())))
        }
        Some(_) if b.fails => {
            let have = squash(&stderr);
            match expected_error(b)
                .into_iter()
                .find(|p| !have.contains(p.as_str()))
            {
                Some(p) => Err(report(format!(
                    "{}: failed as it should, but stderr lacks the `# error:` text `{p}`",
                    b.at()
                ))),
                None => Ok(took),
            }
        }
        Some(s) if !s.success() => Err(report(format!(
            "{failed_at}: exited with {s} after {:.1} s",
            took.as_secs_f64()
        ))),
        Some(_) => Ok(took),
    }
}

#[test]
fn markers_parse_and_misuse_is_named() {
    let doc = "intro\n\
               <!-- doc-test: gpu -->\n```bash\n# needs a GPU\nupipe info\n```\n\
               <!-- doc-test: skip (runs for hours, on 8 GPUs) -->\n```sh\nupipe train\n```\n\
               ```console\n$ upipe plan \\\n    --model tiny\noutput line\n$ ls\n```\n\
               <!-- doc-test: continues, fails -->\n```bash\nfalse\n# error: a ... b\n```\n\
               ```\nno language\n```\n\
               ```bash\n# needs 2 GPUs\n```\n\
               <!-- doc-test: skip -->\n```bash\nx\n```\n\
               <!-- doc-test: gpu -->\n\n```text\nout\n```\n";
    let (blocks, errors) = parse("t.md", doc);
    assert_eq!(blocks[0].mark, Mark::Gpu);
    assert_eq!(
        blocks[1].mark,
        Mark::Skip("runs for hours, on 8 GPUs".into())
    );
    assert_eq!(
        blocks[2].script(),
        "upipe plan \\\n    --model tiny\nls\n",
        "console: only the $ lines"
    );
    assert_eq!(blocks[2].lines[1].0, 13);
    assert!(blocks[3].continues && blocks[3].fails);
    assert_eq!(expected_error(&blocks[3]), ["a", "b"]);
    let want = [
        "t.md:22: a code block without a language",
        "t.md:26: the block says it needs GPUs",
        "t.md:28: `skip` needs its reason",
        "t.md:32: a doc-test marker must be the line right above a code block",
    ];
    assert_eq!(errors.len(), want.len(), "{errors:#?}");
    for (e, w) in errors.iter().zip(want) {
        assert!(e.starts_with(w), "{e} (want {w})");
    }
    let mut errs = Vec::new();
    let c = chains(&blocks, &mut errs);
    assert_eq!(c.len(), 3, "console, then the two unmarked bash blocks");
    assert_eq!(c[0].len(), 2, "the `continues` block joins the console one");
}

#[test]
fn the_newcomers_pages_run_in_an_empty_directory() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let base = std::env::temp_dir().join(format!("upipe-doc-scratch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let empty = scratch(&base, 0, root, true).join("work");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    assert_ne!(empty.canonicalize().unwrap(), root.canonicalize().unwrap());
    let linked = scratch(&base, 1, root, false).join("work");
    assert!(linked.join("assets/tokenizer.json").is_file());
    std::fs::remove_dir_all(&base).unwrap();
    assert_eq!(FROM_ANYWHERE, ["README.md", "docs/getting-started.md"]);
}

#[test]
fn every_shell_block_in_the_docs_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !root.join("README.md").is_file() {
        // a test binary copied to another machine (scripts/gpu-check.sh)
        println!("skipped: no repository at {}", root.display());
        return;
    }
    let (mut blocks, mut errors) = (Vec::new(), Vec::new());
    for f in doc_files(root) {
        let text = std::fs::read_to_string(root.join(&f)).unwrap();
        let (b, e) = parse(&f, &text);
        blocks.extend(b);
        errors.extend(e);
    }
    let chains = chains(&blocks, &mut errors);
    assert!(errors.is_empty(), "doc-test markup:\n{}", errors.join("\n"));

    // the README's two commands: the first runs as written, the second is this suite
    let readme = |s: &str| {
        blocks
            .iter()
            .find(|b| b.file == "README.md" && b.script().trim() == s)
            .unwrap_or_else(|| panic!("README.md has no block `{s}`"))
    };
    assert_eq!(readme("cargo run --release -- train").mark, Mark::Run);
    assert!(matches!(readme("cargo test --release").mark, Mark::Skip(_)));

    // the newcomer's flows run, from an empty directory
    let fine_tune = blocks
        .iter()
        .find(|b| b.file == "README.md" && b.script().contains("--model-dir runs/ft"))
        .expect("README.md's fine-tuning block");
    assert_eq!(fine_tune.mark, Mark::Run, "{}", fine_tune.at());
    let started: Vec<&Block> = (blocks.iter())
        .filter(|b| b.file == "docs/getting-started.md" && b.mark == Mark::Run)
        .collect();
    assert!(
        started.len() >= 8,
        "docs/getting-started.md: {} blocks run",
        started.len()
    );

    // identical chains run once (in an empty directory if one of them must)
    let mut unique: Vec<(Vec<Block>, Vec<String>, bool)> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for c in chains {
        let key: String = c
            .iter()
            .map(|b| format!("{}{}\n", b.fails, b.script()))
            .collect();
        let empty = FROM_ANYWHERE.contains(&c[0].file.as_str());
        match seen.get(&key) {
            Some(&i) => {
                unique[i].1.push(c[0].at());
                unique[i].2 |= empty;
            }
            None => {
                seen.insert(key, unique.len());
                let at = c[0].at();
                unique.push((c, vec![at], empty));
            }
        }
    }

    let base = std::env::temp_dir().join(format!("upipe-doc-commands-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let bin = bin_dir(&base);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(String, Result<Duration, String>)>> = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 4));
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    let Some((chain, at, empty)) = unique.get(n) else {
                        break;
                    };
                    let dir = scratch(&base, n, root, *empty);
                    for (k, b) in chain.iter().enumerate() {
                        let r = run_block(b, &dir, &bin, k);
                        let failed = r.is_err();
                        let name = match (k, at.len()) {
                            (0, 1) => b.at(),
                            (0, _) => {
                                format!("{} (the same block: {})", b.at(), at[1..].join(", "))
                            }
                            _ => format!("{} (after {})", b.at(), chain[0].at()),
                        };
                        results.lock().unwrap().push((name, r));
                        if failed {
                            break;
                        }
                    }
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(_, r)| std::cmp::Reverse(r.as_ref().map_or(Duration::MAX, |d| *d)));
    let count = |f: fn(&Block) -> bool| blocks.iter().filter(|b| b.is_shell() && f(b)).count();
    println!(
        "{} shell blocks: {} ran ({} distinct runs) in {:.1} s on {workers} threads, {} need GPUs, {} skipped",
        count(|_| true),
        count(|b| b.mark == Mark::Run),
        results.len(),
        start.elapsed().as_secs_f64(),
        count(|b| b.mark == Mark::Gpu),
        count(|b| matches!(b.mark, Mark::Skip(_))),
    );
    for (name, r) in results.iter().filter(|(_, r)| r.is_ok()).take(8) {
        println!("  {:6.1} s  {name}", r.as_ref().unwrap().as_secs_f64());
    }
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|e| format!("[{name}] {e}")))
        .collect();
    if failures.is_empty() {
        let _ = std::fs::remove_dir_all(&base);
    }
    assert!(
        failures.is_empty(),
        "{} doc block(s) failed (scratch directories in {}):\n\n{}",
        failures.len(),
        base.display(),
        failures.join("\n")
    );
}
