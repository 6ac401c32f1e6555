//! The workspace's structure, checked: no two modules of a crate import each other, even
//! through a cycle, and each backend crate stays small (at most four modules besides its
//! `config`). A module that needs another's items takes them from a third (`db`, `spi`) or
//! is split; a crate's root re-exports count as the module that defines the item.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// Every library and binary crate of the workspace, by directory.
const CRATES: &[&str] = &[
    "lockkit-core",
    "lockkit-redis",
    "lockkit-zk",
    "lockkit-mysql",
    "lockkit-postgres",
    "lockkit-etcd",
    "lockkit",
    "conformance",
    "lockkit-lab",
    "lockkit-cli",
];

/// The backend crates, which must stay small.
const BACKENDS: &[&str] = &[
    "lockkit-redis",
    "lockkit-zk",
    "lockkit-mysql",
    "lockkit-postgres",
    "lockkit-etcd",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The text of `path` without comments (line comments, doc comments, string contents are
/// kept as they are: good enough for `crate::` paths).
fn code_of(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A crate's top-level modules (`src/x.rs` or `src/x/mod.rs`, with everything under
/// `src/x/`), each with its code.
fn modules(krate: &Path) -> BTreeMap<String, String> {
    let src = krate.join("src");
    let mut modules: BTreeMap<String, String> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(&src) else {
        return modules;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        if path.is_dir() {
            let mut code = String::new();
            let mut stack = vec![path.clone()];
            while let Some(dir) = stack.pop() {
                for inner in std::fs::read_dir(&dir).unwrap().flatten() {
                    let p = inner.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if p.extension().is_some_and(|e| e == "rs") {
                        code.push_str(&code_of(&p));
                        code.push('\n');
                    }
                }
            }
            modules.entry(name).or_default().push_str(&code);
        } else if path.extension().is_some_and(|e| e == "rs") {
            modules.entry(name).or_default().push_str(&code_of(&path));
        }
    }
    modules
}

fn identifier_at(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The first segments of the paths in `use crate::{...}` groups and `crate::x` paths.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && (c.is_alphanumeric() || c == '_') => {
                        found.insert(identifier_at(&group[j..]).to_owned());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            found.insert(identifier_at(rest).to_owned());
        }
    }
    found
}

/// What the root re-exports, by name: the module that defines it.
fn reexports(root: &str, modules: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    let uses = root
        .match_indices("pub use ")
        .map(|(i, m)| i + m.len())
        .chain(
            root.match_indices("pub(crate) use ")
                .map(|(i, m)| i + m.len()),
        );
    for start in uses {
        let rest = &root[start..];
        let module = identifier_at(rest);
        if !modules.contains_key(module) {
            continue;
        }
        let statement = &rest[..rest.find(';').unwrap_or(rest.len())];
        for name in statement
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty() && *w != module && *w != "self" && *w != "as")
        {
            names.insert(name.to_owned(), module.to_owned());
        }
    }
    names
}

/// Module-to-module imports of one crate, through its root's re-exports.
fn imports(krate: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut modules = modules(krate);
    let root = modules
        .remove("lib")
        .or_else(|| modules.remove("main"))
        .unwrap_or_default();
    let names = reexports(&root, &modules);
    let mut graph = BTreeMap::new();
    for (module, code) in &modules {
        let targets: BTreeSet<String> = crate_paths(code)
            .into_iter()
            .filter_map(|first| {
                if modules.contains_key(&first) {
                    Some(first)
                } else {
                    names.get(&first).cloned()
                }
            })
            .filter(|target| target != module)
            .collect();
        graph.insert(module.clone(), targets);
    }
    graph
}

/// A cycle in `graph`, if there is one, as the modules on it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_another_that_imports_it_back() {
    let mut cycles = Vec::new();
    for krate in CRATES {
        let dir = workspace().join(krate);
        assert!(dir.join("src").is_dir(), "no crate at {}", dir.display());
        let graph = imports(&dir);
        if let Some(cycle) = find_cycle(&graph) {
            cycles.push(format!("{krate}: {}", cycle.join(" -> ")));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn backend_crates_stay_small() {
    for krate in BACKENDS {
        let modules: Vec<String> = modules(&workspace().join(krate))
            .into_keys()
            .filter(|m| m != "lib" && m != "config")
            .collect();
        assert!(
            modules.len() <= 4,
            "{krate} has {} modules besides config: {modules:?}",
            modules.len()
        );
    }
}

/// What `lockkit_core::spi` provides once and backends must not write again: their own
/// attempt outcome, a doubling backoff, or a hold registry by owner and key.
const COPIES_OF_SPI: &[(&str, &str)] = &[
    ("enum Attempt", "spi::Attempt"),
    ("fn into_grant", "spi::Attempt::into_grant"),
    ("* 2).min(", "spi::Backoff"),
    ("HashMap<(OwnerId, LockKey)", "spi::LocalHolds"),
];

#[test]
fn no_backend_rewrites_the_acquire_loop_backoff_or_hold_registry() {
    let mut found = Vec::new();
    for krate in BACKENDS {
        for (module, code) in modules(&workspace().join(krate)) {
            for (pattern, instead) in COPIES_OF_SPI {
                if code.contains(pattern) {
                    found.push(format!("{krate}/{module}: `{pattern}` (use {instead})"));
                }
            }
        }
    }
    let core = modules(&workspace().join("lockkit-core"));
    for (module, code) in core
        .iter()
        .filter(|(m, _)| !["wait", "local_hold"].contains(&m.as_str()))
    {
        for (pattern, instead) in COPIES_OF_SPI {
            if code.contains(pattern) {
                found.push(format!(
                    "lockkit-core/{module}: `{pattern}` (use {instead})"
                ));
            }
        }
    }
    assert!(found.is_empty(), "copies of what spi provides: {found:#?}");
}

/// The checker itself finds a cycle through a root re-export.
#[test]
fn the_checker_sees_a_cycle_through_a_reexport() {
    let dir = std::env::temp_dir().join(format!("lockkit-structure-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(
        src.join("lib.rs"),
        "mod a;\nmod b;\npub use a::Alpha;\npub(crate) use b::{Beta, beta};\n",
    )
    .unwrap();
    std::fs::write(src.join("a.rs"), "use crate::Beta;\npub struct Alpha;\n").unwrap();
    std::fs::write(
        src.join("b.rs"),
        "use crate::{\n    Alpha, // the other\n};\npub struct Beta;\n",
    )
    .unwrap();
    let cycle = find_cycle(&imports(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(cycle.is_some(), "the a <-> b cycle was not seen");
}
