//! Mixed fleet: kazoo's `Lock` (Python, nodes `<uuid>__lock__<seq>`) and lockkit on the same
//! lock path exclude each other, and a lockkit waiter behind a kazoo holder is woken when
//! kazoo lets go. lockkit counts every sequential child as a contender; kazoo counts other
//! clients' nodes only with `extra_lock_patterns=["-lock-"]` (without it, kazoo ignores
//! lockkit's and Curator's holders). Needs `$LOCKKIT_TEST_PYTHON` with kazoo
//! (scripts/services.sh installs it).

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
hosts, path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
zk = KazooClient(hosts=hosts)
zk.start(timeout=20)
# kazoo sees other clients' lock nodes only when told their pattern: lockkit's and
# Curator's contenders are `_c_<uuid>-lock-<seq>`.
lock = zk.Lock(path, "kazoo", extra_lock_patterns=["-lock-"])
if mode == "hold":
    lock.acquire(timeout=20)
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
    lock.release()
    print("released", flush=True)
else:
    print("got" if lock.acquire(blocking=False) else "busy", flush=True)
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
    let mut holder = kazoo(&s, &["hold", "2"]);
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
    let out = kazoo(&s, &["try"]).wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "busy",
        "kazoo was granted a lock lockkit holds"
    );
    guard.release().await.unwrap();
    let out = kazoo(&s, &["try"]).wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "got");
}
