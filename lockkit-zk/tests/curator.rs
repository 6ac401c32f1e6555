//! Interoperability with Apache Curator 5.4.0 (Debian's libcurator-recipes-java, installed
//! by `scripts/services.sh up`) on the same paths: InterProcessMutex and lockkit's lock
//! exclude each other; InterProcessReadWriteLock's readers and writers and lockkit's share
//! and exclude as readers and writers do; InterProcessSemaphoreV2's leases and lockkit's
//! permits count against one limit. Curator 5.4.0 predates the CURATOR-621 downgrade fix,
//! so no test relies on a Curator downgrade; lockkit's own downgrade must keep a queued
//! Curator writer out.

use std::{process::Stdio, time::Duration};

use lockkit_conformance::env;
use lockkit_core::{LockBackend, LockKey, Locker};
use lockkit_zk::ZkBackend;
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

mod support;
use support::curator_classpath;

/// Runs the Curator helper: `hold <ms>` or `try <ms>`.
fn curator(
    classpath: &str,
    connect: &str,
    path: &str,
    mode: &str,
    ms: u64,
) -> tokio::process::Child {
    curator_with(classpath, connect, path, &[mode, &ms.to_string()])
}

/// Runs the Curator helper with `args` after the path (see `curator/Interop.java`).
fn curator_with(
    classpath: &str,
    connect: &str,
    path: &str,
    args: &[&str],
) -> tokio::process::Child {
    tokio::process::Command::new("java")
        .args(["-cp", classpath, "Interop", connect, path])
        .args(args)
        .stdout(Stdio::piped())
        // A Java exception shows in the test's output (slf4j-nop keeps the rest quiet).
        .stderr(Stdio::inherit())
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

/// The next line the helper prints (it starts a JVM first: up to a minute).
async fn said(out: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>) -> String {
    tokio::time::timeout(Duration::from_secs(60), out.next_line())
        .await
        .expect("the Curator helper said nothing for a minute")
        .unwrap()
        .unwrap_or_default()
}

struct Setup {
    classpath: String,
    connect: String,
    backend: ZkBackend,
    locker: Locker,
    key: LockKey,
    path: String,
}

impl Setup {
    async fn new(name: &str) -> Option<Setup> {
        let url = env::service_url("LOCKKIT_TEST_ZK_URL")?;
        let classpath = curator_classpath()?;
        let backend = ZkBackend::connect(&format!("{url}?session_timeout=10s"))
            .await
            .unwrap();
        let key = LockKey::new(format!("curator-{name}-{}", Uuid::new_v4().simple())).unwrap();
        Some(Setup {
            classpath,
            connect: env::host_ports(&url).join(","),
            locker: Locker::new(backend.clone()),
            path: backend.lock_dir(&key),
            backend,
            key,
        })
    }

    fn curator(&self, args: &[&str]) -> tokio::process::Child {
        curator_with(&self.classpath, &self.connect, &self.path, args)
    }

    /// Runs a Curator try (`rw-read-try`, ...) and returns what it said.
    async fn curator_try(&self, args: &[&str]) -> String {
        let mut child = self.curator(args);
        let mut out = lines(&mut child).await;
        let answer = said(&mut out).await;
        // Let it release and close its session: killed, its node would stay for the
        // session timeout.
        let exit = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
        assert!(exit.is_ok(), "the Curator helper did not exit");
        answer
    }

    /// Waits until `count` children of the lock's path contain `label`.
    async fn await_children(&self, label: &str, count: usize) {
        let client = self.backend.client().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let children = client.list_children(&self.path).await.unwrap_or_default();
            if children.iter().filter(|c| c.contains(label)).count() >= count {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {count} `{label}` nodes: {children:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_curator_writer_and_lockkit_readers_exclude_each_other() {
    let Some(s) = Setup::new("rw").await else {
        return;
    };
    // A Curator writer holds: lockkit's readers and writers are out until it lets go,
    // and a waiting lockkit reader is woken by the release.
    let mut holder = s.curator(&["rw-write-hold", "3000"]);
    let mut out = lines(&mut holder).await;
    assert_eq!(said(&mut out).await, "HELD");
    assert!(
        s.locker.read(&s.key).try_now().await.unwrap().is_none(),
        "lockkit read beside a Curator writer"
    );
    assert!(
        s.locker.write(&s.key).try_now().await.unwrap().is_none(),
        "lockkit wrote beside a Curator writer"
    );
    let reader = s
        .locker
        .read(&s.key)
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(said(&mut out).await, "RELEASED");
    // lockkit's nodes have Curator's names.
    let client = s.backend.client().await.unwrap();
    let children = client.list_children(&s.path).await.unwrap();
    assert!(
        children
            .iter()
            .any(|c| c.starts_with("_c_") && c.contains("-__READ__")),
        "{children:?}"
    );
    reader.release().await.unwrap();

    // A lockkit writer holds: a Curator reader is out until it lets go.
    let writer = s
        .locker
        .write(&s.key)
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(
        s.curator_try(&["rw-read-try", "1000"]).await,
        "BUSY",
        "Curator read beside a lockkit writer"
    );
    writer.release().await.unwrap();
    assert_eq!(s.curator_try(&["rw-read-try", "5000"]).await, "GOT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_lockkit_readers_share() {
    let Some(s) = Setup::new("read").await else {
        return;
    };
    let mut holder = s.curator(&["rw-read-hold", "3000"]);
    let mut out = lines(&mut holder).await;
    assert_eq!(said(&mut out).await, "HELD");
    let reader = s.locker.read(&s.key).try_now().await.unwrap();
    let reader = reader.expect("a lockkit reader must share with a Curator reader");
    let holders = s.backend.holders(&s.key).await.unwrap();
    assert_eq!(holders.len(), 2, "both readers are holders: {holders:?}");
    assert!(
        s.locker.write(&s.key).try_now().await.unwrap().is_none(),
        "lockkit wrote beside a Curator reader"
    );
    // While lockkit reads, a Curator reader shares and a Curator writer is out.
    assert_eq!(s.curator_try(&["rw-read-try", "5000"]).await, "GOT");
    assert_eq!(said(&mut out).await, "RELEASED");
    assert_eq!(s.curator_try(&["rw-write-try", "1000"]).await, "BUSY");
    reader.release().await.unwrap();
    assert_eq!(s.curator_try(&["rw-write-try", "5000"]).await, "GOT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_downgrade_keeps_a_queued_curator_writer_out() {
    let Some(s) = Setup::new("downgrade").await else {
        return;
    };
    let owner = s.locker.owner();
    let write = owner.write(&s.key).try_now().await.unwrap();
    let write = write.expect("a free key");
    // A Curator writer queues behind lockkit's write.
    let mut rival = s.curator(&["rw-write-try", "4000"]);
    let mut out = lines(&mut rival).await;
    s.await_children("__WRIT__", 2).await;
    // lockkit downgrades: its read keeps the writer's place (CURATOR-621's fixed form),
    // so Curator 5.4.0's writer, which sorts by sequence, stays behind it.
    let read = owner.read(&s.key).try_now().await.unwrap();
    let read = read.expect("a writer may read at once");
    write.release().await.unwrap();
    assert_eq!(
        said(&mut out).await,
        "BUSY",
        "the Curator writer got the lock while lockkit's downgraded read held it"
    );
    read.release().await.unwrap();
    assert_eq!(s.curator_try(&["rw-write-try", "5000"]).await, "GOT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_leases_count_against_lockkit_permits() {
    let Some(s) = Setup::new("sem").await else {
        return;
    };
    let semaphore = s.locker.semaphore(&s.key, 2);
    let mut holder = s.curator(&["sem-hold", "3000", "2"]);
    let mut out = lines(&mut holder).await;
    assert_eq!(said(&mut out).await, "HELD");
    let first = semaphore.try_acquire().await.unwrap();
    let first = first.expect("one of two permits is free beside Curator's lease");
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "Curator's lease did not count against lockkit's permits"
    );
    let holders = semaphore.holders().await.unwrap();
    assert_eq!(
        holders.len(),
        2,
        "Curator's lease and lockkit's: {holders:?}"
    );
    let second = semaphore
        .acquire()
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(said(&mut out).await, "RELEASED");
    // lockkit holds both permits: Curator gets no lease until one is given back.
    assert_eq!(s.curator_try(&["sem-try", "1000", "2"]).await, "BUSY");
    first.release().await.unwrap();
    assert_eq!(s.curator_try(&["sem-try", "5000", "2"]).await, "GOT");
    second.release().await.unwrap();
}
