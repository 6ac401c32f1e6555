//! Mixed fleet: kazoo's `Lock` (Python, nodes `<uuid>__lock__<seq>`) and lockkit on the same
//! lock path exclude each other, and a lockkit waiter behind a kazoo holder is woken when
//! kazoo lets go. lockkit counts every sequential child as a contender; kazoo counts other
//! clients' nodes only with `extra_lock_patterns=["-lock-"]` (without it, kazoo ignores
//! lockkit's and Curator's holders). Needs `$LOCKKIT_TEST_PYTHON` with kazoo
//! (scripts/services.sh installs it).
//!
//! Read-write locks: kazoo's `ReadLock` (`<uuid>__rlock__<seq>`) and `WriteLock`
//! (`<uuid>__lock__<seq>`) against lockkit's `read`/`write` (Curator's
//! `_c_<uuid>-__READ__<seq>`, `_c_<uuid>-__WRIT__<seq>`). lockkit reads `__rlock__` as a
//! reader and `__lock__` as a writer. kazoo's contender regex is
//! `(?:<_EXCLUDE_NAMES + extra_lock_patterns>)(-?\d{10})$`, where `_EXCLUDE_NAMES` is
//! `["__lock__"]` for a `ReadLock` and `["__lock__", "__rlock__"]` for a `WriteLock`: so a
//! mixed fleet gives kazoo's readers `extra_lock_patterns=["__WRIT__"]` (blocked by
//! lockkit's writers, not its readers) and kazoo's writers `["__READ__", "__WRIT__"]`.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use uuid::Uuid;

const KAZOO: &str = r#"
import sys, time
from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout
hosts, path, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
zk = KazooClient(hosts=hosts)
zk.start(timeout=20)
# kazoo sees other clients' lock nodes only when told their pattern: lockkit's and
# Curator's contenders are `_c_<uuid>-lock-<seq>`, their readers `_c_<uuid>-__READ__<seq>`
# and their writers `_c_<uuid>-__WRIT__<seq>`. A kazoo reader already counts `__lock__`,
# a kazoo writer `__lock__` and `__rlock__`.
if kind == "lock":
    lock = zk.Lock(path, "kazoo", extra_lock_patterns=["-lock-"])
elif kind == "read":
    lock = zk.ReadLock(path, "kazoo", extra_lock_patterns=["__WRIT__"])
else:
    lock = zk.WriteLock(path, "kazoo", extra_lock_patterns=["__READ__", "__WRIT__"])
if mode == "hold":
    lock.acquire(timeout=20)
    print("held", flush=True)
    time.sleep(float(sys.argv[5]))
    lock.release()
    print("released", flush=True)
else:
    # "try": without a timeout, one non-blocking attempt; with one, wait that long.
    try:
        if len(sys.argv) > 5:
            got = lock.acquire(timeout=float(sys.argv[5]))
        else:
            got = lock.acquire(blocking=False)
    except LockTimeout:
        got = False
    print("got" if got else "busy", flush=True)
    if lock.is_acquired:
        lock.release()
zk.stop()
"#;

struct Setup {
    python: String,
    hosts: String,
    backend: ZkBackend,
    key: LockKey,
}

async fn setup() -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_ZK_URL")?;
    let python = env::service_url("LOCKKIT_TEST_PYTHON")?;
    let backend = ZkBackend::connect(&url).await.unwrap();
    Some(Setup {
        python,
        hosts: env::host_ports(&url).join(","),
        backend,
        key: LockKey::new(format!("kazoo/{}", Uuid::new_v4().simple())).unwrap(),
    })
}

fn kazoo(s: &Setup, args: &[&str]) -> Child {
    Command::new(&s.python)
        .args(["-c", KAZOO, &s.hosts, &s.backend.lock_dir(&s.key)])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_holder_excludes_lockkit_and_its_release_wakes_a_lockkit_waiter() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["lock", "hold", "2"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    assert!(
        locker.try_acquire(&s.key).await.unwrap().is_none(),
        "lockkit was granted a lock kazoo holds"
    );
    let waited = tokio::time::Instant::now();
    let guard = locker
        .acquire(&s.key)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit waiter must be granted once kazoo releases");
    let waited = waited.elapsed();
    assert_eq!(
        lines.next().unwrap().unwrap(),
        "released",
        "granted before kazoo released"
    );
    assert!(
        waited < Duration::from_secs(10),
        "woken {waited:?} after a 2 s kazoo hold: not by its release"
    );
    guard.release().await.unwrap();
    assert!(holder.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_holder_excludes_kazoo() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.acquire(&s.key).await.unwrap();
    let out = kazoo(&s, &["lock", "try"]).wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "busy",
        "kazoo was granted a lock lockkit holds"
    );
    guard.release().await.unwrap();
    let out = kazoo(&s, &["lock", "try"]).wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "got");
}

/// kazoo's output of a `try` run: "got" or "busy".
fn kazoo_try(s: &Setup, args: &[&str]) -> String {
    let out = kazoo(s, args).wait_with_output().unwrap();
    assert!(out.status.success(), "kazoo {args:?} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

const TTL: Duration = Duration::from_secs(30);

/// A kazoo `WriteLock` holder keeps out both a lockkit reader and a lockkit writer, and a
/// lockkit reader waiting behind it is granted when kazoo releases: woken by the release
/// (well after the hold began, long before the wait's timeout), not by timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_writer_excludes_lockkit_readers_and_writers_and_its_release_wakes_a_reader() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["write", "hold", "3"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    let held = tokio::time::Instant::now();
    assert!(
        locker
            .read(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a read kazoo's writer holds"
    );
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write kazoo's writer holds"
    );
    let guard = locker
        .read(&s.key)
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit reader must be granted once kazoo's writer releases");
    let waited = held.elapsed();
    assert_eq!(lines.next().unwrap().unwrap(), "released");
    assert!(
        waited > Duration::from_secs(1),
        "granted {waited:?} into a 3 s kazoo write hold"
    );
    assert!(
        waited < Duration::from_secs(15),
        "woken {waited:?} after a 3 s kazoo write hold: not by its release"
    );
    guard.release().await.unwrap();
    assert!(holder.wait().unwrap().success());
}

/// A kazoo `ReadLock` holder shares with a lockkit reader (granted at once, without
/// waiting) and keeps out a lockkit writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_reader_shares_with_a_lockkit_reader_and_excludes_a_lockkit_writer() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["read", "hold", "3"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    let reader = locker
        .read(&s.key)
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("lockkit's reader must share with kazoo's reader");
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write while kazoo and lockkit held reads"
    );
    reader.release().await.unwrap();
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write kazoo's reader holds"
    );
    assert_eq!(lines.next().unwrap().unwrap(), "released");
    assert!(holder.wait().unwrap().success());
    let writer = locker
        .write(&s.key)
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("the write must be free once kazoo's reader released");
    writer.release().await.unwrap();
}

/// A lockkit writer keeps out a kazoo reader told lockkit's writer pattern (`__WRIT__`)
/// through `extra_lock_patterns`, as a mixed fleet must configure it: kazoo's try with a
/// 1 s timeout fails while lockkit holds, and succeeds once lockkit releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_writer_excludes_a_kazoo_reader() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.write(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(
        kazoo_try(&s, &["read", "try", "1"]),
        "busy",
        "kazoo was granted a read lockkit's writer holds"
    );
    assert_eq!(
        kazoo_try(&s, &["write", "try", "1"]),
        "busy",
        "kazoo was granted a write lockkit's writer holds"
    );
    guard.release().await.unwrap();
    assert_eq!(kazoo_try(&s, &["read", "try", "1"]), "got");
}

/// A lockkit reader shares with a kazoo reader (kazoo's non-blocking try succeeds) and
/// keeps out a kazoo writer (its try with a 1 s timeout fails); once lockkit releases, the
/// kazoo writer gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_reader_shares_with_a_kazoo_reader_and_excludes_a_kazoo_writer() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.read(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(
        kazoo_try(&s, &["read", "try"]),
        "got",
        "kazoo's reader did not share with lockkit's reader"
    );
    assert_eq!(
        kazoo_try(&s, &["write", "try", "1"]),
        "busy",
        "kazoo was granted a write lockkit's reader holds"
    );
    guard.release().await.unwrap();
    assert_eq!(kazoo_try(&s, &["write", "try", "1"]), "got");
}
