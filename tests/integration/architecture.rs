//! The architecture's checkable facts (ARCHITECTURE.md, "Invariants"): no
//! module imports one of a higher layer, no source files import each other
//! in a cycle (unit-test modules aside), and no source file is longer than
//! `MAX_LINES`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules by layer, lowest first; a module may import its own
/// layer's and lower layers' modules. The crate root's files (`error.rs`,
/// `input_path.rs`, `rng.rs`) are below every layer.
const LAYERS: &[&[&str]] = &[
    &["backend"],
    &["comm"],
    &["attention"],
    &["model"],
    &["data", "checkpoint", "optim"],
    &["train"],
    &["plan"],
    &["cli"],
];

/// The longest a source file may be.
const MAX_LINES: usize = 800;

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's library code: comment lines dropped, and its unit tests
/// (the `#[cfg(test)]` module at its end, which may import whatever it
/// checks) left out.
fn code_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let tests_start = lines
        .windows(2)
        .position(|w| w[0] == "#[cfg(test)]" && w[1].starts_with("mod "))
        .unwrap_or(lines.len());
    lines[..tests_start]
        .iter()
        .map(|l| l.trim_start())
        .filter(|l| !l.starts_with("//"))
        .collect()
}

/// Every `crate::a::b...` and `super::a...` path named in `line`, as
/// segments from the crate root (`module`: the file's own module path).
fn crate_paths(line: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find(|c: char| c.is_alphanumeric() || c == '_') {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        let mut segs = tail[..end].split("::").filter(|s| !s.is_empty());
        let mut base: Option<Vec<String>> = match segs.next() {
            Some("crate") => Some(Vec::new()),
            Some("super") => module.split_last().map(|(_, up)| up.to_vec()),
            _ => None,
        };
        if let Some(path) = base.as_mut() {
            for seg in segs {
                if seg == "super" {
                    path.pop();
                } else {
                    path.push(seg.to_string());
                }
            }
            if !path.is_empty() {
                paths.push(path.clone());
            }
        }
        rest = &tail[end..];
    }
    paths
}

/// A file's module path from the crate root (`src/a/b.rs`, `src/a/b/mod.rs`: `[a, b]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut segs: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if segs
        .last()
        .is_some_and(|s| s == "mod" || s == "lib" || s == "main")
    {
        segs.pop();
    }
    segs
}

/// The source file a `crate::` path lands in: the longest prefix of its
/// segments that names a module file.
fn module_file(src: &Path, segs: &[String]) -> Option<PathBuf> {
    (1..=segs.len()).rev().find_map(|n| {
        let dir = segs[..n].iter().fold(src.to_path_buf(), |p, s| p.join(s));
        let file = dir.with_extension("rs");
        let module = dir.join("mod.rs");
        [file, module].into_iter().find(|p| p.is_file())
    })
}

/// The top-level module of a file under `src` (None for the crate root's files).
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts = rel.components();
    let first = parts.next()?.as_os_str().to_str()?.to_string();
    if parts.next().is_none() {
        let stem = first.trim_end_matches(".rs");
        return layer_of(stem).map(|_| stem.to_string());
    }
    Some(first)
}

struct Tree {
    src: PathBuf,
    /// file → the files it imports through `crate::` paths
    imports: BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    lines: BTreeMap<PathBuf, usize>,
}

fn read_tree() -> Tree {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut imports = BTreeMap::new();
    let mut lines = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        lines.insert(f.clone(), text.lines().count());
        let module = module_path(&src, &f);
        let targets: BTreeSet<PathBuf> = code_lines(&text)
            .into_iter()
            .flat_map(|l| crate_paths(l, &module))
            .filter_map(|segs| module_file(&src, &segs))
            .filter(|t| *t != f)
            .collect();
        imports.insert(f, targets);
    }
    Tree {
        src,
        imports,
        lines,
    }
}

#[test]
fn no_module_imports_a_higher_layer() {
    let tree = read_tree();
    let mut wrong = Vec::new();
    for (file, targets) in &tree.imports {
        let Some(from) = top_module(&tree.src, file) else {
            continue;
        };
        let from_layer = layer_of(&from).unwrap_or_else(|| panic!("{from} has no layer"));
        for t in targets {
            let Some(to) = top_module(&tree.src, t) else {
                continue;
            };
            let to_layer = layer_of(&to).unwrap_or_else(|| panic!("{to} has no layer"));
            if to_layer > from_layer {
                wrong.push(format!("{} imports {}", file.display(), t.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports of a higher layer:\n{}",
        wrong.join("\n")
    );
}

/// Files whose imports lead back to themselves (strongly connected
/// components of more than one file, by Tarjan's algorithm).
fn cycles(imports: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        imports: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.imports.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        imports,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in imports.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn no_source_files_import_each_other_in_a_cycle() {
    let tree = read_tree();
    let found = cycles(&tree.imports);
    let shown: Vec<String> = found
        .iter()
        .map(|c| {
            let names: Vec<String> = c
                .iter()
                .map(|f| f.strip_prefix(&tree.src).unwrap().display().to_string())
                .collect();
            names.join(" <-> ")
        })
        .collect();
    assert!(shown.is_empty(), "import cycles:\n{}", shown.join("\n"));
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    let p = |s: &str| PathBuf::from(s);
    let mut imports = BTreeMap::new();
    imports.insert(p("a"), BTreeSet::from([p("b")]));
    imports.insert(p("b"), BTreeSet::from([p("c")]));
    imports.insert(p("c"), BTreeSet::from([p("a")]));
    imports.insert(p("d"), BTreeSet::from([p("a")]));
    let found = cycles(&imports);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].len(), 3);
}

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let tree = read_tree();
    let long: Vec<String> = tree
        .lines
        .iter()
        .filter(|(_, n)| **n > MAX_LINES)
        .map(|(f, n)| format!("{}: {n} lines", f.display()))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}
