//! The facade is a library users add to their services: it must not drag in the tools
//! (the CLI's argument parser and signal handling, the test suite, the fault lab).

use std::process::Command;

/// Crates that belong to the tools, never to the library.
const TOOL_CRATES: &[&str] = &[
    "clap",
    "nix",
    "serde_json",
    "lockkit-conformance",
    "lockkit-lab",
    "lockkit-cli",
];

/// `cargo tree -p lockkit --prefix none` with `args`, as text.
fn tree(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["tree", "--offline", "-p", "lockkit", "--prefix", "none"])
        .args(args)
        .output()
        .expect("running cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The names of every crate `lockkit` pulls in as a normal dependency with `features`.
fn normal_dependencies(features: &[&str]) -> Vec<String> {
    tree(&[&["-e", "normal"][..], features].concat())
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_facade_depends_on_no_tool_crate() {
    for features in [&["--all-features"][..], &["--no-default-features"][..]] {
        let crates = normal_dependencies(features);
        assert!(
            crates.iter().any(|c| c == "lockkit-core"),
            "cargo tree {features:?} did not list lockkit-core: {crates:?}"
        );
        let tools: Vec<&String> = crates
            .iter()
            .filter(|c| TOOL_CRATES.contains(&c.as_str()))
            .collect();
        assert!(
            tools.is_empty(),
            "`lockkit` ({features:?}) depends on tool crates {tools:?}; they belong in \
             lockkit-cli or lockkit-lab"
        );
    }
}

/// The test hooks (`testing` features) never reach the facade's normal build: they are for
/// the suite and each crate's own tests only.
#[test]
fn the_facade_builds_its_backends_without_test_hooks() {
    let tree = tree(&["-e", "normal,features", "--all-features"]);
    assert!(
        tree.contains("lockkit-core"),
        "cargo tree listed no lockkit-core: {tree}"
    );
    let hooks: Vec<&str> = tree
        .lines()
        .filter(|l| l.contains("feature \"testing\""))
        .collect();
    assert!(
        hooks.is_empty(),
        "the facade's build turns on test hooks: {hooks:?}"
    );
}
