//! What the ZooKeeper tests beside Apache Curator share: the Curator helper
//! (`tests/curator/Interop.java`), compiled once per test process.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use lockkit_conformance::env;

const JARS: [&str; 7] = [
    "curator-client.jar",
    "curator-framework.jar",
    "curator-recipes.jar",
    "zookeeper.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// Compiles the Curator helper once per test process; `None` (a loud skip, or a failure in
/// CI) without Java. Once: tests run in parallel, and a `javac` rewriting `Interop.class`
/// while another test's JVM loads it gave "Truncated class file" (a CI failure, and the
/// likely cause of an earlier one where the helper ended before saying HELD).
pub fn curator_classpath() -> Option<String> {
    static COMPILED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    COMPILED.get_or_init(compile_curator_helper).clone()
}

fn compile_curator_helper() -> Option<String> {
    let jars: Vec<PathBuf> = JARS
        .iter()
        .map(|j| Path::new("/usr/share/java").join(j))
        .collect();
    let javac = Command::new("javac")
        .arg("-version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !javac || jars.iter().any(|j| !j.exists()) {
        assert!(
            !env::in_ci(),
            "Curator or javac missing in CI: scripts/services.sh up installs libcurator-recipes-java"
        );
        eprintln!(
            "lockkit: SKIPPED, Curator interop needs javac and Debian's libcurator-recipes-java"
        );
        return None;
    }
    // A directory of this process's own: another run's javac cannot rewrite it either.
    let out =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("curator-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let jars = jars
        .iter()
        .map(|j| j.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/curator/Interop.java");
    let status = Command::new("javac")
        .args(["-cp", &jars, "-d"])
        .arg(&out)
        .arg(source)
        .status()
        .unwrap();
    assert!(status.success(), "javac failed");
    Some(format!("{}:{jars}", out.display()))
}
