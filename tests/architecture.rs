//! The layout docs/architecture.md draws, checked against the code: imports point one way, down
//! the floors; no module cycles; SQL only in the store; every file readable in one sitting; no
//! `too_many_arguments` allowance. A plain reading of the relay's three crates (no service
//! needed): the library (crates/pgoutbox), the command (src) and the benchmark harness
//! (crates/pgoutbox-bench, read as the module `bench`). Every `crate::`, `super::`, `self::`,
//! `pgoutbox::` and `pgoutbox_bench::` path of each file, `use` trees flattened, tests left out.

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
    ("rate", 4),
    ("settle", 4),
    ("otlp", 4),
    ("status", 4),
    ("definitions", 4),
    // The engine.
    ("engine", 5),
    // The server: metrics, health, the console.
    ("server", 6),
    // The command: its pools; the benchmark harness (its own crate); the command line.
    ("connect", 7),
    ("bench", 8),
    ("cli", 9),
];

/// The longest a source file may be: a newcomer reads it in one sitting.
const MAX_LINES: usize = 600;

/// Where SQL text and binds may be: the store, and the benchmark harness's own statements.
const SQL_PLACES: &[&str] = &[
    "crates/pgoutbox/src/store/",
    "crates/pgoutbox-bench/src/sql/",
];

/// The relay's crates: where each one's source is, and the module its root is read as (`crate::`
/// in it names that module; `pgoutbox::` names the library, `pgoutbox_bench::` the harness).
const CRATES: &[(&str, &[&str])] = &[
    ("crates/pgoutbox/src", &[]),
    ("src", &[]),
    ("crates/pgoutbox-bench/src", &["bench"]),
];

fn floor(module: &str) -> u8 {
    FLOORS
        .iter()
        .find(|(m, _)| *m == module)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| {
            panic!("module `{module}` has no floor: add it to FLOORS and docs/architecture.md")
        })
}

/// The files under `dir` whose extension is one of `extensions`.
fn sources_of(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources_of(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|e| extensions.iter().any(|x| e == *x))
        {
            out.push(path);
        }
    }
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    sources_of(dir, &["rs"], out);
}

/// The console's page is source too (HTML, CSS, JavaScript): it reads in one sitting like the rest.
const PAGE_SOURCES: &[&str] = &["js", "css", "html"];

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
    for root in [
        "crate::",
        "super::",
        "self::",
        "pgoutbox::",
        "pgoutbox_bench::",
    ] {
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
/// the file of module `here`. `self` is that module and `super` its parent, whether the file is a
/// folder's `mod.rs` or not (`super::x` in `store/cleanup.rs` is `store::x`). A `use` path that
/// starts with a child module of `here` (Rust 2018's relative paths) resolves from `here` too.
/// `crate::` resolves from the file's crate root (`root`); `pgoutbox::` names the library, whose
/// top-level modules are named apart from the command's, and `pgoutbox_bench::` the harness.
fn target(
    path: &str,
    here: &[String],
    root: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut parts: Vec<&str> = path.split("::").collect();
    let base: Vec<String> = match parts.first().copied() {
        Some("crate") => {
            parts.remove(0);
            root.to_vec()
        }
        Some("pgoutbox") => {
            parts.remove(0);
            Vec::new()
        }
        Some("pgoutbox_bench") => {
            parts.remove(0);
            vec!["bench".to_owned()]
        }
        Some("self") => {
            parts.remove(0);
            here.to_vec()
        }
        Some("super") => {
            let mut b = here.to_vec();
            while parts.first() == Some(&"super") {
                parts.remove(0);
                b.pop()?;
            }
            b
        }
        Some(first) => {
            let mut child = here.to_vec();
            child.push(first.to_owned());
            if !modules.contains(&child) {
                return None;
            }
            here.to_vec()
        }
        None => return None,
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

/// The circles of `graph` (each node's edges): every strongly connected component of two or more
/// nodes, or of one node that imports itself, as its nodes.
fn circles<N: Ord + Clone>(graph: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    // Tarjan's algorithm, recursive: the graphs are a few hundred modules.
    struct Walk<'g, N> {
        graph: &'g BTreeMap<N, BTreeSet<N>>,
        index: BTreeMap<N, usize>,
        low: BTreeMap<N, usize>,
        stack: Vec<N>,
        on_stack: BTreeSet<N>,
        found: Vec<Vec<N>>,
    }
    impl<N: Ord + Clone> Walk<'_, N> {
        fn visit(&mut self, n: &N) {
            let i = self.index.len();
            self.index.insert(n.clone(), i);
            self.low.insert(n.clone(), i);
            self.stack.push(n.clone());
            self.on_stack.insert(n.clone());
            let graph = self.graph;
            for m in graph.get(n).into_iter().flatten() {
                if !self.index.contains_key(m) {
                    self.visit(m);
                    let low = self.low[n].min(self.low[m]);
                    self.low.insert(n.clone(), low);
                } else if self.on_stack.contains(m) {
                    let low = self.low[n].min(self.index[m]);
                    self.low.insert(n.clone(), low);
                }
            }
            if self.low[n] == self.index[n] {
                let mut component = Vec::new();
                while let Some(m) = self.stack.pop() {
                    self.on_stack.remove(&m);
                    let done = &m == n;
                    component.push(m);
                    if done {
                        break;
                    }
                }
                let looped = graph.get(n).is_some_and(|to| to.contains(n));
                if component.len() > 1 || looped {
                    component.reverse();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for n in graph.keys() {
        if !walk.index.contains_key(n) {
            walk.visit(n);
        }
    }
    walk.found
}

/// One source file: its path, its module, its crate's root module, its text.
struct File {
    path: PathBuf,
    module: Vec<String>,
    root: Vec<String>,
    text: String,
}

struct Tree {
    files: Vec<File>,
}

fn tree() -> Tree {
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for (dir, root) in CRATES {
        let src = top.join(dir);
        let mut paths = Vec::new();
        sources(&src, &mut paths);
        paths.sort();
        assert!(!paths.is_empty(), "no source under {}", src.display());
        let root: Vec<String> = root.iter().map(|m| (*m).to_owned()).collect();
        for path in paths {
            let mut module = root.clone();
            module.extend(module_of(&src, &path));
            let text = std::fs::read_to_string(&path).expect("read");
            files.push(File {
                path,
                module,
                root: root.clone(),
                text,
            });
        }
    }
    Tree { files }
}

/// The import rules over `files`: every import of a `crate::`, `super::`,
/// `self::` (or relative `use`) path resolved, none pointing up the floors, and no circle among
/// the modules of one folder (the top-level modules being the root's). A module and the modules
/// inside it are not siblings: a folder's `mod.rs` owns its children, and they may use it.
/// `Err` with every violation found.
fn check_imports(files: &[File]) -> Result<(), String> {
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong_way = Vec::new();
    for File {
        path,
        module,
        root,
        text,
    } in files
    {
        let Some(first) = module.first() else {
            continue; // lib.rs and main.rs: the roots declare, they do not import
        };
        let from_floor = floor(first);
        for p in paths(&code(text)) {
            let Some(to) = target(&p, module, root, &modules) else {
                continue;
            };
            let Some(to_first) = to.first() else { continue };
            if to_first != first && floor(to_first) > from_floor {
                wrong_way.push(format!(
                    "{} ({}) → {} ({}): `{p}`",
                    path.display(),
                    from_floor,
                    to_first,
                    floor(to_first)
                ));
            }
            // The two modules side by side in their closest common folder.
            let shared = module.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if shared < module.len() && shared < to.len() {
                graph
                    .entry(module[..=shared].to_vec())
                    .or_default()
                    .insert(to[..=shared].to_vec());
            }
        }
    }
    let mut problems = Vec::new();
    if !wrong_way.is_empty() {
        problems.push(format!(
            "imports that point up the floors:\n{}",
            wrong_way.join("\n")
        ));
    }
    for c in circles(&graph) {
        let names: Vec<String> = c.iter().map(|m| m.join("::")).collect();
        problems.push(format!(
            "the modules {} import each other in a circle",
            names.join(", ")
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

#[test]
fn imports_point_down_the_floors_and_no_module_sits_in_a_cycle() {
    let tree = tree();
    if let Err(problems) = check_imports(&tree.files) {
        panic!("{problems}");
    }
}

/// A fixture tree: (file under src/, text), one crate.
fn fixture(files: &[(&str, &str)]) -> Vec<File> {
    let src = Path::new("src");
    files
        .iter()
        .map(|(path, text)| {
            let path = src.join(path);
            File {
                module: module_of(src, &path),
                root: Vec::new(),
                text: (*text).to_owned(),
                path,
            }
        })
        .collect()
}

#[test]
fn self_and_super_resolve_from_the_file_s_own_module() {
    let modules: BTreeSet<Vec<String>> = [
        vec!["store"],
        vec!["store", "cleanup"],
        vec!["store", "history"],
        vec!["engine"],
        vec!["engine", "run"],
        vec!["engine", "run", "inner"],
    ]
    .into_iter()
    .map(|m| m.into_iter().map(str::to_owned).collect())
    .collect();
    let m = |s: &str| -> Vec<String> { s.split("::").map(str::to_owned).collect() };
    let cases: &[(&str, &str, Option<&str>)] = &[
        // (here, path, the module it names)
        (
            "store::cleanup",
            "super::history::expire",
            Some("store::history"),
        ),
        ("store::cleanup", "super::Store", Some("store")),
        ("store::cleanup", "self::helper", Some("store::cleanup")),
        ("store", "self::history::ensure", Some("store::history")),
        ("store", "super::engine::Relay", Some("engine")),
        (
            "store::cleanup",
            "super::super::engine::Relay",
            Some("engine"),
        ),
        ("engine::run", "inner::thing", Some("engine::run::inner")),
        ("engine::run", "tokio::spawn", None),
        (
            "store::cleanup",
            "crate::engine::run::x",
            Some("engine::run"),
        ),
    ];
    for (here, path, want) in cases {
        assert_eq!(
            target(path, &m(here), &[], &modules),
            want.map(m),
            "{path} from {here}"
        );
    }
}

#[test]
fn the_checker_finds_a_circle_of_sibling_files_and_an_import_up_the_floors() {
    let circle = fixture(&[
        ("store/mod.rs", "mod cleanup;\nmod history;\n"),
        ("store/cleanup.rs", "fn a() { super::history::expire(); }\n"),
        (
            "store/history.rs",
            "use super::cleanup::delete_in_chunks;\n",
        ),
    ]);
    let err = check_imports(&circle).expect_err("a sibling circle");
    assert!(
        err.contains("store::cleanup") && err.contains("store::history"),
        "{err}"
    );
    let nested = fixture(&[
        ("engine/mod.rs", "mod a;\nmod b;\n"),
        ("engine/a/mod.rs", "mod x;\n"),
        ("engine/a/x.rs", "use crate::engine::b::y;\n"),
        ("engine/b.rs", "use super::a::x::z;\n"),
    ]);
    assert!(check_imports(&nested).is_err(), "a circle between folders");
    let up = fixture(&[
        ("store/mod.rs", "use crate::engine::Relay;\n"),
        ("engine/mod.rs", "use crate::store::Store;\n"),
    ]);
    let err = check_imports(&up).expect_err("store reaches up");
    assert!(err.contains("point up the floors"), "{err}");
    let fine = fixture(&[
        (
            "store/mod.rs",
            "mod cleanup;\nmod history;\nuse self::history::ensure;\n",
        ),
        (
            "store/cleanup.rs",
            "use super::history::expire;\nuse super::Store;\n",
        ),
        ("store/history.rs", "use super::Store;\n"),
        ("engine/mod.rs", "use crate::store::Store;\n"),
    ]);
    check_imports(&fine).expect("one way, no circle");
}

#[test]
fn sql_is_written_and_bound_in_the_store_only() {
    let tree = tree();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut outside = Vec::new();
    for File { path, text, .. } in &tree.files {
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
    for File { path, text, .. } in &tree.files {
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", path.display()));
        }
        if text.contains("too_many_arguments") {
            allowed.push(path.display().to_string());
        }
    }
    let mut pages = Vec::new();
    sources_of(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/pgoutbox/src"),
        PAGE_SOURCES,
        &mut pages,
    );
    assert!(!pages.is_empty(), "the console's page is found");
    for path in pages {
        let lines = std::fs::read_to_string(&path)
            .expect("read")
            .lines()
            .count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", path.display()));
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
