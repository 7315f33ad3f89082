//! The layout docs/architecture.md draws, checked against the code: imports point one way, down
//! the floors; no module cycles; SQL only in the store; every file readable in one sitting; no
//! `too_many_arguments` allowance. A plain reading of src/ (no service needed): every `crate::`,
//! `super::` and `self::` path of each file, `use` trees flattened, tests left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The floors, top-level module by top-level module, from the bottom: a module may import only
/// from its own floor or below (and, on its own floor, without a cycle).
const FLOORS: &[(&str, u8)] = &[
    // pgoutbox-core, re-exported by the library: what applications link.
    ("table", 0),
    ("schema", 0),
    ("enqueue", 0),
    ("error", 0),
    ("inbox", 0),
    ("trace", 0),
    ("webhook", 0),
    ("Error", 0),
    ("Result", 0),
    ("error_chain", 0),
    ("OutboxEvent", 1),
    // Model and configuration types.
    ("model", 1),
    ("config", 2),
    // Every SQL statement and its binds.
    ("store", 3),
    // Sources, sinks, routing, the gate, settle decisions, spans, the operator's status view.
    ("sources", 4),
    ("sinks", 4),
    ("route", 4),
    ("gate", 4),
    ("rate", 4),
    ("settle", 4),
    ("otlp", 4),
    ("status", 4),
    // The engine.
    ("engine", 5),
    // The server: metrics, health, the console.
    ("server", 6),
    // The binary: the command line, the benchmark harness, and what both share.
    ("connect", 7),
    ("flags", 7),
    ("bench", 8),
    ("cli", 9),
];

/// The longest a source file may be: a newcomer reads it in one sitting.
const MAX_LINES: usize = 600;

/// Where SQL text and binds may be: the store, and the benchmark harness's own statements.
const SQL_PLACES: &[&str] = &["src/store/", "src/bench/sql/"];

fn floor(module: &str) -> u8 {
    FLOORS
        .iter()
        .find(|(m, _)| *m == module)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| {
            panic!("module `{module}` has no floor: add it to FLOORS and docs/architecture.md")
        })
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`src/engine/batch.rs` → `engine::batch`; `mod.rs` is
/// its folder), and whether it belongs to the binary.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts
        .last()
        .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts
}

/// The code of a file without its tests (`#[cfg(test)]` to the end: tests sit last) and without
/// comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            // `//` inside a string is rare in these files; a URL in one would only drop a tail.
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `use` trees flattened: `a::{b, c::{d, e}}` → `a::b`, `a::c::d`, `a::c::e`.
fn flatten(tree: &str, prefix: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim().trim_end_matches("::");
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let prefix = join(prefix, head);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    flatten(&inner[start..i], &prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        flatten(&inner[start..], &prefix, out);
    } else if !tree.is_empty() {
        let path = tree.split(" as ").next().unwrap_or(tree).trim();
        out.push(join(prefix, path));
    }
}

fn join(prefix: &str, path: &str) -> String {
    match (prefix.is_empty(), path.is_empty()) {
        (true, _) => path.to_owned(),
        (_, true) => prefix.to_owned(),
        _ => format!("{prefix}::{path}"),
    }
}

/// Every path a file names that starts at `crate`, `super`, `self` or `pgoutbox` (the library,
/// from the binary).
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for statement in code.split(';') {
        let s = statement.trim_start();
        let s = s.strip_prefix("pub(crate) ").unwrap_or(s);
        let s = s.strip_prefix("pub(super) ").unwrap_or(s);
        let s = s.strip_prefix("pub ").unwrap_or(s);
        if let Some(tree) = s.strip_prefix("use ") {
            flatten(tree, "", &mut out);
        }
    }
    let bytes = code.as_bytes();
    for root in ["crate::", "super::", "self::", "pgoutbox::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(root) {
            let start = from + at;
            from = start + root.len();
            if start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_') {
                continue;
            }
            let end = code[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| start + e);
            out.push(code[start..end].trim_end_matches(':').to_owned());
        }
    }
    out
}

/// The module a path names, as a module path of `modules` (the longest prefix that is one), from
/// module `here` of a file that is a folder's `mod.rs` (`is_dir`) or not.
/// The binary's `pgoutbox::…` names the library, whose top-level modules are named apart from the
/// binary's: both resolve from the same root.
fn target(
    path: &str,
    here: &[String],
    is_dir: bool,
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut parts: Vec<&str> = path.split("::").collect();
    let base: Vec<String> = match parts.first().copied() {
        Some("crate" | "pgoutbox") => {
            parts.remove(0);
            Vec::new()
        }
        Some("self") => {
            parts.remove(0);
            let mut b = here.to_vec();
            if !is_dir {
                b.pop();
            }
            b
        }
        Some("super") => {
            let mut b = here.to_vec();
            if !is_dir {
                b.pop();
            }
            while parts.first() == Some(&"super") {
                parts.remove(0);
                b.pop();
            }
            b
        }
        _ => return None,
    };
    let mut best = None;
    let mut candidate = base.clone();
    for part in parts {
        candidate.push(part.to_owned());
        if modules.contains(&candidate) {
            best = Some(candidate.clone());
        } else if best.is_none() && candidate.len() == 1 && floor_known(part) {
            // A re-export of pgoutbox-core (`crate::table`, `crate::Error`).
            return Some(candidate);
        } else {
            break;
        }
    }
    best.or_else(|| (!base.is_empty()).then_some(base))
}

fn floor_known(module: &str) -> bool {
    FLOORS.iter().any(|(m, _)| *m == module)
}

/// A cycle of `graph`, if any (each node's edges), as the nodes around it.
fn cycle<N: Ord + Clone + std::fmt::Debug>(graph: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<N>> {
    fn visit<N: Ord + Clone>(
        n: &N,
        graph: &BTreeMap<N, BTreeSet<N>>,
        state: &mut BTreeMap<N, u8>,
        stack: &mut Vec<N>,
    ) -> Option<Vec<N>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = stack.iter().position(|s| s == n).unwrap_or(0);
                return Some(stack[at..].to_vec());
            }
            _ => {}
        }
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, graph, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in graph.keys() {
        if let Some(c) = visit(n, graph, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

struct Tree {
    files: Vec<(PathBuf, Vec<String>, String)>,
}

fn tree() -> Tree {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let files = files
        .into_iter()
        .map(|f| {
            let module = module_of(&src, &f);
            let text = std::fs::read_to_string(&f).expect("read");
            (f, module, text)
        })
        .collect();
    Tree { files }
}

#[test]
fn imports_point_down_the_floors_and_no_module_sits_in_a_cycle() {
    let tree = tree();
    let modules: BTreeSet<Vec<String>> = tree.files.iter().map(|(_, m, _)| m.clone()).collect();
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong_way = Vec::new();
    for (path, module, text) in &tree.files {
        let Some(first) = module.first() else {
            continue; // lib.rs and main.rs: the roots declare, they do not import
        };
        let is_dir = path.ends_with("mod.rs");
        let from_floor = floor(first);
        for p in paths(&code(text)) {
            let Some(to) = target(&p, module, is_dir, &modules) else {
                continue;
            };
            let Some(to_first) = to.first() else { continue };
            if to_first != first {
                if floor(to_first) > from_floor {
                    wrong_way.push(format!(
                        "{} ({}) → {} ({}): `{p}`",
                        path.display(),
                        from_floor,
                        to_first,
                        floor(to_first)
                    ));
                }
                top.entry(first.clone())
                    .or_default()
                    .insert(to_first.clone());
            } else if to.len() > 1
                && module.len() > 1
                && to[..to.len() - 1] == module[..module.len() - 1]
                && to != *module
            {
                // Siblings in one folder (a folder's mod.rs owns its children: not a sibling).
                files.entry(module.clone()).or_default().insert(to);
            }
        }
    }
    assert!(
        wrong_way.is_empty(),
        "imports that point up the floors:\n{}",
        wrong_way.join("\n")
    );
    if let Some(c) = cycle(&top) {
        panic!("the top-level modules {c:?} import each other in a circle");
    }
    if let Some(c) = cycle(&files) {
        panic!("the files {c:?} import each other in a circle");
    }
}

#[test]
fn sql_is_written_and_bound_in_the_store_only() {
    let tree = tree();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut outside = Vec::new();
    for (path, _, text) in &tree.files {
        let rel = path
            .strip_prefix(root)
            .expect("under the crate")
            .to_string_lossy()
            .into_owned();
        if SQL_PLACES.iter().any(|p| rel.starts_with(p)) {
            continue;
        }
        let code = code(text);
        for needle in [
            "sqlx::query",
            "sqlx::raw_sql",
            "query_as(",
            "query_scalar(",
            ".bind(",
        ] {
            if code.contains(needle) {
                outside.push(format!("{rel}: {needle}"));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "SQL outside the store:\n{}",
        outside.join("\n")
    );
}

#[test]
fn every_source_file_reads_in_one_sitting_and_no_function_takes_too_many_arguments() {
    let tree = tree();
    let mut long = Vec::new();
    let mut allowed = Vec::new();
    for (path, _, text) in &tree.files {
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", path.display()));
        }
        if text.contains("too_many_arguments") {
            allowed.push(path.display().to_string());
        }
    }
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
    assert!(
        allowed.is_empty(),
        "too_many_arguments allowed in:\n{}",
        allowed.join("\n")
    );
    let clippy = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("clippy.toml"))
        .expect("clippy.toml");
    assert!(
        clippy.contains("too-many-arguments-threshold = 7"),
        "clippy.toml sets the threshold: {clippy}"
    );
}
