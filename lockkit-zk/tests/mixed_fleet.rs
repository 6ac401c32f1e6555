//! A randomized history of a mixed fleet on ZooKeeper: lockkit clients (tries, waits, and
//! waits dropped mid-way) and kazoo `Lock` processes contend for the same two lock paths,
//! with lockkit's default (Curator's) node names beside kazoo told their pattern, and beside
//! Apache Curator's `InterProcessMutex`, and with `layout=kazoo` beside stock kazoo. (Not
//! Curator and kazoo in one fleet: each ignores the other's nodes, and a first cut of this
//! test saw Curator enter a path kazoo held.) Every holder writes its critical sections into a
//! shared ledger (`lockkit_conformance::Ledger`); the case fails on two holders of one path
//! at once, on a wait never granted within 30 s, and on a path left held at the end. Needs
//! `$LOCKKIT_TEST_PYTHON` with kazoo, and javac with Debian's Curator (scripts/services.sh
//! installs them).
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays the lockkit side of a run.

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use lockkit_conformance::{
    env,
    fleet::{self, Fleet},
};
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;

mod support;

/// One kazoo process of the fleet: `Lock`s on the paths given, taken at random (waiting up
/// to 30 s), each held up to 30 ms with its sections in the ledger; prints its holds.
const KAZOO_HOLDER: &str = r#"
import os, random, sys, time
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
hosts, ledger, seconds, seed, kind = sys.argv[1:6]
paths = sys.argv[6:]
random.seed(int(seed))
fd = os.open(ledger, os.O_WRONLY | os.O_APPEND)
zk = KazooClient(hosts=hosts)
zk.start(timeout=20)
extra = ["-lock-"] if kind == "told" else []
locks = [zk.Lock(path, "kazoo", extra_lock_patterns=extra) for path in paths]
me = "kazoo-%d" % os.getpid()
end, holds, swept = time.monotonic() + float(seconds), 0, 0
while time.monotonic() < end:
    i = random.randrange(len(paths))
    if kind == "told":
        # Beside Curator's layout the path is a container, which the server removes once
        # idle; a kazoo Lock checks its path once, so a fresh one makes sure of it each
        # time, and a removal between its check and its create is tried again.
        locks[i] = zk.Lock(paths[i], "kazoo", extra_lock_patterns=extra)
    try:
        got = locks[i].acquire(timeout=30)
    except NoNodeError:
        # Only beside containers: in kazoo's layout lockkit's paths stay, as kazoo's do.
        if kind != "told":
            raise
        swept += 1
        continue
    if not got:
        print("kazoo never got path %d in 30 s" % i, flush=True)
        sys.exit(1)
    os.write(fd, ("enter %d %s\n" % (i, me)).encode())
    time.sleep(random.random() * 0.03)
    os.write(fd, ("exit %d %s\n" % (i, me)).encode())
    locks[i].release()
    holds += 1
zk.stop()
print("paths removed under kazoo: %d" % swept, flush=True)
print(holds, flush=True)
"#;

const LOCKKIT_CLIENTS: usize = 2;
const TASKS_PER_CLIENT: usize = 3;
/// kazoo or Curator processes beside the lockkit clients.
const PEER_PROCESSES: usize = 2;
const SECONDS: u64 = 5;

/// The other client of a fleet.
#[derive(Clone, Copy, PartialEq)]
enum Peer {
    /// kazoo told lockkit's (Curator's) contender pattern, beside lockkit's default layout.
    KazooTold,
    /// Stock kazoo, beside lockkit with `layout=kazoo`.
    KazooStock,
    /// Curator's `InterProcessMutex`, beside lockkit's default layout.
    Curator,
}

async fn run_fleet(peer: Peer) {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let layout = if peer == Peer::KazooStock {
        "kazoo"
    } else {
        "curator"
    };
    let url = format!("{url}?layout={layout}");
    let hosts = env::host_ports(&url).join(",");
    let fleet = Fleet::new(
        &format!("ZooKeeper mixed fleet, layout={layout}"),
        2,
        Duration::from_secs(SECONDS),
    );
    let mut lockers = Vec::new();
    let mut paths = Vec::new();
    for _ in 0..LOCKKIT_CLIENTS {
        let backend = ZkBackend::connect(&url).await.unwrap();
        paths = fleet
            .keys
            .iter()
            .map(|key| backend.lock_dir(&LockKey::new(key.as_str()).unwrap()))
            .collect();
        lockers.push(Locker::new(backend));
    }
    let (peers, kind) = if peer == Peer::Curator {
        let Some(classpath) = support::curator_classpath() else {
            return;
        };
        let curators = (0..PEER_PROCESSES)
            .map(|n| {
                Command::new("java")
                    .args(["-cp", &classpath, "Interop", &hosts, &paths[0], "fleet"])
                    .arg((SECONDS * 1000).to_string())
                    .arg(fleet.ledger.path())
                    .arg((fleet.seed ^ n as u64).to_string())
                    .arg(&paths[1])
                    .stdout(Stdio::piped())
                    .spawn()
                    .map(fleet::Peer::Process)
                    .unwrap()
            })
            .collect();
        (curators, "curator")
    } else {
        let Some(python) = env::service_url("LOCKKIT_TEST_PYTHON") else {
            return;
        };
        let told = if peer == Peer::KazooTold {
            "told"
        } else {
            "stock"
        };
        let kazoos = (0..PEER_PROCESSES)
            .map(|n| {
                Command::new(&python)
                    .args(["-c", KAZOO_HOLDER, &hosts])
                    .arg(fleet.ledger.path())
                    .arg(SECONDS.to_string())
                    .arg((fleet.seed ^ n as u64).to_string())
                    .arg(told)
                    .args(&paths)
                    .stdout(Stdio::piped())
                    .spawn()
                    .map(fleet::Peer::Process)
                    .unwrap()
            })
            .collect();
        (kazoos, "kazoo")
    };
    fleet
        .run_beside_peers(&lockers, TASKS_PER_CLIENT, peers, kind)
        .await;
    let check = Locker::new(ZkBackend::connect(&url).await.unwrap());
    fleet.assert_all_free(&check).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_kazoo_told_its_pattern_never_hold_a_path_twice() {
    run_fleet(Peer::KazooTold).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_and_curator_never_hold_a_path_twice() {
    run_fleet(Peer::Curator).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockkit_in_kazoo_layout_and_stock_kazoo_never_hold_a_path_twice() {
    run_fleet(Peer::KazooStock).await;
}
