//! A randomized history of a mixed fleet on ZooKeeper: lockkit clients (tries, waits, and
//! waits dropped mid-way) and kazoo `Lock` processes contend for the same two lock paths,
//! once with lockkit's default (Curator's) node names and kazoo told lockkit's pattern, once
//! with `layout=kazoo` and stock kazoo. Every holder writes its critical sections into a
//! shared ledger (`lockkit_conformance::Ledger`); the case fails on two holders of one path
//! at once, on a wait never granted within 30 s, and on a path left held at the end. Needs
//! `$LOCKKIT_TEST_PYTHON` with kazoo (scripts/services.sh installs it).
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays the lockkit side of a run.

use std::{
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use lockkit_conformance::{Ledger, Rng, env, fleet, torture_seed};
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use tokio::time::Instant;
use uuid::Uuid;

/// One kazoo process of the fleet: `Lock`s on the paths given, taken at random (waiting up
/// to 30 s), each held up to 30 ms with its sections in the ledger; prints its holds.
const KAZOO_HOLDER: &str = r#"
import os, random, sys, time
from kazoo.client import KazooClient
hosts, ledger, seconds, seed, kind = sys.argv[1:6]
paths = sys.argv[6:]
random.seed(int(seed))
fd = os.open(ledger, os.O_WRONLY | os.O_APPEND)
zk = KazooClient(hosts=hosts)
zk.start(timeout=20)
extra = ["-lock-"] if kind == "told" else []
locks = [zk.Lock(path, "kazoo", extra_lock_patterns=extra) for path in paths]
me = "kazoo-%d" % os.getpid()
end, holds = time.monotonic() + float(seconds), 0
while time.monotonic() < end:
    i = random.randrange(len(paths))
    if not locks[i].acquire(timeout=30):
        print("kazoo never got path %d in 30 s" % i, flush=True)
        sys.exit(1)
    os.write(fd, ("enter %d %s\n" % (i, me)).encode())
    time.sleep(random.random() * 0.03)
    os.write(fd, ("exit %d %s\n" % (i, me)).encode())
    locks[i].release()
    holds += 1
zk.stop()
print(holds, flush=True)
"#;

const LOCKKIT_CLIENTS: usize = 2;
const TASKS_PER_CLIENT: usize = 3;
const KAZOO_PROCESSES: usize = 2;
const SECONDS: u64 = 6;

async fn run_fleet(layout: &str, kazoo_kind: &str) {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let Some(python) = env::service_url("LOCKKIT_TEST_PYTHON") else {
        return;
    };
    let seed = torture_seed();
    eprintln!("ZooKeeper mixed fleet, layout={layout}: LOCKKIT_TORTURE_SEED={seed}");
    let url = format!("{url}?layout={layout}");
    let run = Uuid::new_v4().simple().to_string();
    let keys: Vec<String> = (0..2).map(|i| format!("mixed/{run}/{i}")).collect();
    let ledger = Arc::new(Ledger::new().unwrap());
    let first = ZkBackend::connect(&url).await.unwrap();
    let paths: Vec<String> = keys
        .iter()
        .map(|key| first.lock_dir(&LockKey::new(key.as_str()).unwrap()))
        .collect();
    let kazoos: Vec<_> = (0..KAZOO_PROCESSES)
        .map(|n| {
            Command::new(&python)
                .args(["-c", KAZOO_HOLDER, &env::host_ports(&url).join(",")])
                .arg(ledger.path())
                .arg(SECONDS.to_string())
                .arg((seed ^ n as u64).to_string())
                .arg(kazoo_kind)
                .args(&paths)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(SECONDS);
    let mut rng = Rng(seed);
    let mut tasks = Vec::new();
    let mut backends = vec![first];
    while backends.len() < LOCKKIT_CLIENTS {
        backends.push(ZkBackend::connect(&url).await.unwrap());
    }
    for (client, backend) in backends.iter().enumerate() {
        let locker = Locker::new(backend.clone());
        for task in 0..TASKS_PER_CLIENT {
            tasks.push(tokio::spawn(fleet::lockkit_holder(
                locker.clone(),
                keys.clone(),
                ledger.clone(),
                format!("lockkit-{client}.{task}"),
                rng.next_u64(),
                until,
            )));
        }
    }
    let mut lockkit_holds = 0;
    for task in tasks {
        lockkit_holds += task
            .await
            .expect("a lockkit task failed (its message is above)");
    }
    let kazoo_holds: Vec<String> = tokio::task::spawn_blocking(move || {
        kazoos
            .into_iter()
            .map(|kazoo| {
                let out = kazoo.wait_with_output().unwrap();
                let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                assert!(out.status.success(), "a kazoo holder failed: {said}");
                said
            })
            .collect()
    })
    .await
    .unwrap();
    let summary = ledger
        .check()
        .unwrap_or_else(|violation| panic!("{violation}"));
    eprintln!(
        "lockkit holds {lockkit_holds}, kazoo holds {kazoo_holds:?}; ledger: {:?}",
        summary.holds
    );
    assert_eq!(summary.of("lockkit"), lockkit_holds);
    assert!(
        summary.of("lockkit") > 0 && summary.of("kazoo") > 0,
        "both kinds of client must have held: {:?}",
        summary.holds
    );
    // Nothing left held: a fresh lockkit client takes every path at once.
    let check = Locker::new(ZkBackend::connect(&url).await.unwrap());
    for key in &keys {
        let guard = check
            .acquire(key.as_str())
            .try_now()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} is still held after the fleet stopped"));
        guard.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_kazoo_told_its_pattern_never_hold_a_path_twice() {
    run_fleet("curator", "told").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_in_kazoo_layout_and_stock_kazoo_never_hold_a_path_twice() {
    run_fleet("kazoo", "stock").await;
}
