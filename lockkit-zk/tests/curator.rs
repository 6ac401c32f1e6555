//! Interoperability with Apache Curator's InterProcessMutex (Debian's
//! libcurator-recipes-java, installed by `scripts/services.sh up`): a Curator client and a
//! lockkit client exclude each other on the same lock.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

const JARS: [&str; 7] = [
    "curator-client.jar",
    "curator-framework.jar",
    "curator-recipes.jar",
    "zookeeper.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// Compiles the Curator helper; `None` (a loud skip, or a failure in CI) without Java.
fn curator_classpath() -> Option<String> {
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
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("curator");
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

/// Runs the Curator helper: `hold <ms>` or `try <ms>`.
fn curator(
    classpath: &str,
    connect: &str,
    path: &str,
    mode: &str,
    ms: u64,
) -> tokio::process::Child {
    tokio::process::Command::new("java")
        .args([
            "-cp",
            classpath,
            "Interop",
            connect,
            path,
            mode,
            &ms.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn lines(
    child: &mut tokio::process::Child,
) -> tokio::io::Lines<BufReader<tokio::process::ChildStdout>> {
    BufReader::new(child.stdout.take().unwrap()).lines()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_lockkit_exclude_each_other() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let Some(classpath) = curator_classpath() else {
        return;
    };
    let connect = env::host_ports(&url).join(",");
    let backend = ZkBackend::connect(&format!("{url}?session_timeout=10s"))
        .await
        .unwrap();
    let locker = Locker::new(backend.clone());
    let key = LockKey::new(format!("curator-{}", Uuid::new_v4().simple())).unwrap();
    let path = backend.lock_dir(&key);

    // Curator holds: lockkit is excluded until Curator releases.
    let mut holder = curator(&classpath, &connect, &path, "hold", 3000);
    let mut out = lines(&mut holder).await;
    let said = tokio::time::timeout(Duration::from_secs(60), out.next_line())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(said.as_deref(), Some("HELD"));
    assert!(
        locker.try_acquire(&key).await.unwrap().is_none(),
        "lockkit got a lock Curator holds"
    );
    let guard = locker
        .acquire(&key)
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(out.next_line().await.unwrap().as_deref(), Some("RELEASED"));

    // lockkit holds: Curator is excluded until lockkit releases.
    let mut rival = curator(&classpath, &connect, &path, "try", 1000);
    let mut said = lines(&mut rival).await;
    assert_eq!(
        said.next_line().await.unwrap().as_deref(),
        Some("BUSY"),
        "Curator got a lock lockkit holds"
    );
    guard.release().await.unwrap();
    let mut after = curator(&classpath, &connect, &path, "try", 5000);
    let mut said = lines(&mut after).await;
    assert_eq!(said.next_line().await.unwrap().as_deref(), Some("GOT"));
}
