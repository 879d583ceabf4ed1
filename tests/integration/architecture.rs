//! The architecture's checkable facts (ARCHITECTURE.md, "Invariants"): no
//! module imports one of a higher layer, and no source file joins an import
//! cycle, inside a folder or across folders (unit-test modules aside),
//! every import form read: `use` trees grouped, nested,
//! multi-line and public, `super::`, `self::` and child-module paths, a
//! re-exported name followed to the file that defines it.

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

/// Past this many lines a file holds several concerns (files split by concern,
/// never to pass a count: this is an alarm, not a target).
const MAX_LINES: usize = 1500;

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

/// The file's code as one string: comment lines and its unit tests left
/// out ([`code_lines`]), so a `use` tree spread over lines reads whole.
fn code_text(text: &str) -> String {
    code_lines(text).join("\n")
}

/// The child modules a file declares (`mod x;`, `pub mod x;`,
/// `pub(crate) mod x;`): a path may start with their names.
fn declared_children(code: &str) -> BTreeSet<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub(crate) ")
                .or(l.strip_prefix("pub "))
                .unwrap_or(l);
            let name = rest.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.trim().to_string())
        })
        .collect()
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`, `self`, `*`, `as` renames) into
/// its leaf paths, as segment lists.
fn expand_use_tree(tree: &str) -> Vec<Vec<String>> {
    let tree = strip_renames(tree);
    let mut out = Vec::new();
    expand_into(&tree, &mut Vec::new(), &mut out);
    out
}

fn expand_into(tree: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let (head, group) = match tree.find('{') {
        Some(open) if tree.ends_with('}') => (&tree[..open], Some(&tree[open + 1..tree.len() - 1])),
        _ => (tree, None),
    };
    let segs: Vec<String> = head
        .split("::")
        .filter(|s| !s.is_empty() && *s != "*" && *s != "self")
        .map(str::to_string)
        .collect();
    let depth = prefix.len();
    prefix.extend(segs);
    match group {
        None => out.push(prefix.clone()),
        Some(items) => {
            for item in split_top_level(items) {
                expand_into(item, prefix, out);
            }
        }
    }
    prefix.truncate(depth);
}

/// A `use` tree with its whitespace and its renames (`as name`) dropped.
fn strip_renames(tree: &str) -> String {
    let mut out = String::new();
    let mut words = tree.split_whitespace();
    while let Some(w) = words.next() {
        if w == "as" {
            // keep what follows the new name (`,`, `}`)
            let next = words.next().unwrap_or("");
            out.push_str(next.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
        } else {
            out.push_str(w);
        }
    }
    out
}

/// `items` split at the commas outside braces.
fn split_top_level(items: &str) -> Vec<&str> {
    let (mut depth, mut start, mut parts) = (0, 0, Vec::new());
    for (i, c) in items.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&items[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&items[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// A path's segments from the crate root, when it names something of this
/// crate: `crate::…`, `super::…`, `self::…`, or a child module declared in
/// the file (`module`: the file's module path; `children`: its `mod`s).
fn from_root(
    segs: &[String],
    module: &[String],
    children: &BTreeSet<String>,
) -> Option<Vec<String>> {
    let (first, rest) = segs.split_first()?;
    let mut path: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "super" => module.split_last().map(|(_, up)| up.to_vec())?,
        "self" => module.to_vec(),
        child if children.contains(child) => {
            let mut p = module.to_vec();
            p.push(child.to_string());
            p
        }
        _ => return None,
    };
    for seg in rest {
        if seg == "super" {
            path.pop();
        } else {
            path.push(seg.clone());
        }
    }
    (!path.is_empty()).then_some(path)
}

/// What one file names of this crate, as segments from the crate root.
struct Named {
    /// Every path: the leaves of each `use` tree (`pub use`, grouped,
    /// nested and multi-line trees included) and every `a::b` path written
    /// in the code.
    paths: Vec<Vec<String>>,
    /// The names it re-exports (`pub use`), to the paths they come from.
    reexports: BTreeMap<String, Vec<String>>,
}

/// The `use` statements of `code` (whether public, their tree), and the
/// code without them.
fn use_statements(code: &str) -> (Vec<(bool, String)>, String) {
    let (mut uses, mut rest) = (Vec::new(), String::new());
    for stmt in code.split_inclusive(';') {
        let start = stmt.find("use ").filter(|&at| {
            let before = stmt[..at].trim();
            let head = before.rsplit(['\n', '{', '}']).next().unwrap_or("").trim();
            matches!(head, "" | "pub" | "pub(crate)" | "pub(super)")
        });
        match start {
            Some(at) => {
                let public = stmt[..at].trim_end().ends_with(['b', ')']);
                rest.push_str(&stmt[..at]);
                uses.push((public, stmt[at + 4..].trim_end_matches(';').to_string()));
            }
            None => rest.push_str(stmt),
        }
    }
    (uses, rest)
}

fn crate_names(code: &str, module: &[String], children: &BTreeSet<String>) -> Named {
    let root = |segs: &Vec<String>| from_root(segs, module, children);
    let (uses, rest) = use_statements(code);
    let mut named = Named {
        paths: inline_paths(&rest).iter().filter_map(root).collect(),
        reexports: BTreeMap::new(),
    };
    for (public, tree) in uses {
        for path in expand_use_tree(&tree).iter().filter_map(root) {
            if public && let Some(name) = path.last() {
                named.reexports.insert(name.clone(), path.clone());
            }
            named.paths.push(path);
        }
    }
    named
}

/// [`crate_names`]' paths alone.
fn crate_paths(code: &str, module: &[String], children: &BTreeSet<String>) -> Vec<Vec<String>> {
    crate_names(code, module, children).paths
}

/// The `a::b::c` paths written in `code`, as segment lists.
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let is_path = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(|c: char| c.is_alphanumeric() || c == '_') {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !is_path(c)).unwrap_or(tail.len());
        let token = &tail[..end];
        if token.contains("::") {
            paths.push(
                token
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect(),
            );
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
    /// file → the files it imports (a re-exported name: the file that
    /// defines it)
    imports: BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    lines: BTreeMap<PathBuf, usize>,
}

/// The file that defines what `segs` names: the module file of its longest
/// prefix, followed through that file's re-exports.
fn defining_file(src: &Path, segs: &[String], named: &BTreeMap<PathBuf, Named>) -> Option<PathBuf> {
    let mut segs = segs.to_vec();
    for _ in 0..8 {
        let file = module_file(src, &segs)?;
        let depth = module_path(src, &file).len();
        let Some(from) = segs
            .get(depth)
            .and_then(|n| named.get(&file)?.reexports.get(n))
        else {
            return Some(file);
        };
        let mut next = from.clone();
        next.extend_from_slice(&segs[depth + 1..]);
        if next == segs {
            return Some(file);
        }
        segs = next;
    }
    module_file(src, &segs)
}

fn read_tree() -> Tree {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut named = BTreeMap::new();
    let mut lines = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        lines.insert(f.clone(), text.lines().count());
        let module = module_path(&src, &f);
        let code = code_text(&text);
        let children = declared_children(&code);
        named.insert(f, crate_names(&code, &module, &children));
    }
    let imports = named
        .iter()
        .map(|(f, n)| {
            let targets = n
                .paths
                .iter()
                .filter_map(|segs| defining_file(&src, segs, &named))
                .filter(|t| t != f)
                .collect();
            (f.clone(), targets)
        })
        .collect();
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
fn no_source_file_joins_an_import_cycle() {
    let tree = read_tree();
    let name = |f: &PathBuf| f.strip_prefix(&tree.src).unwrap().display().to_string();
    // a folder's `mod.rs` declares and re-exports: what it would define
    // lives in a file of its own, so no two files import each other
    let found: Vec<String> = cycles(&tree.imports)
        .iter()
        .map(|c| c.iter().map(name).collect::<Vec<_>>().join(" <-> "))
        .collect();
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn every_import_form_is_read() {
    let module = vec!["plan".to_string(), "walk".to_string()];
    let children = BTreeSet::from(["decoder".to_string()]);
    let code = "use super::{sim::{Buf, Sim}, StepSpec as Spec};\n\
                pub use decoder::DecoderWalk;\n\
                use crate::{\n    backend::Tensor,\n    model::{self, Unit},\n};\n\
                use std::sync::Arc;\n\
                let x = self::attention::f(crate::rng::Rng::new(1));";
    let mut got: Vec<String> = crate_paths(code, &module, &children)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    got.sort();
    got.dedup();
    let want = [
        "backend::Tensor",
        "model",
        "model::Unit",
        "plan::StepSpec",
        "plan::sim::Buf",
        "plan::sim::Sim",
        "plan::walk::attention::f",
        "plan::walk::decoder::DecoderWalk",
        "rng::Rng::new",
    ];
    assert_eq!(got, want);
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
