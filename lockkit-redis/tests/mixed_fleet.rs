//! A randomized history of a mixed fleet: lockkit clients (tries, waits, and waits dropped
//! mid-way), rslock clients and, on one server, redis-py `Lock` processes contend for the
//! same two keys, on one Redis server and on five Redlock masters (where three send keyspace
//! notifications and two do not). rslock and redis-py hold a key as a plain `SET NX PX`
//! string and publish nothing when they let go, so lockkit's waiters behind them hear the
//! deletion through keyspace notifications (or poll). Every holder writes its critical
//! sections into a shared ledger (`lockkit_conformance::Ledger`); the case fails on two
//! holders of one key at once, on a wait never granted within 30 s, on a key left held at
//! the end, and on a keyspace or release subscription left behind. redis-py needs
//! `$LOCKKIT_TEST_PYTHON` (scripts/services.sh installs it); without it (outside CI) the
//! single-server fleet runs without redis-py.
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays the in-process side of a run.

use std::{
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use lockkit_conformance::{
    Ledger, OwnRedis, Rng, env,
    fleet::{self, Fleet, Peer},
};
use lockkit_core::{LockBackend, Locker};
use lockkit_redis::{RedisBackend, RedlockBackend};
use tokio::time::Instant;

const LOCKKIT_CLIENTS: usize = 2;
const TASKS_PER_LOCKKIT_CLIENT: usize = 3;
const RSLOCK_TASKS: usize = 2;
const REDIS_PY_PROCESSES: usize = 1;
const SECONDS: u64 = 5;

/// One redis-py process of the fleet: `Lock`s on the names given (polling every 5 ms,
/// waiting up to 30 s), each held up to 30 ms with its sections in the ledger; prints its
/// holds.
const REDIS_PY_HOLDER: &str = r#"
import os, random, sys, time
import redis
url, ledger, seconds, seed = sys.argv[1:5]
names = sys.argv[5:]
random.seed(int(seed))
fd = os.open(ledger, os.O_WRONLY | os.O_APPEND)
r = redis.Redis.from_url(url)
locks = [r.lock(name, timeout=10, sleep=0.005, blocking_timeout=30) for name in names]
me = "redispy-%d" % os.getpid()
end, holds = time.monotonic() + float(seconds), 0
while time.monotonic() < end:
    i = random.randrange(len(names))
    if not locks[i].acquire():
        print("redis-py never got key %d in 30 s" % i, flush=True)
        sys.exit(1)
    os.write(fd, ("enter %d %s\n" % (i, me)).encode())
    time.sleep(random.random() * 0.03)
    os.write(fd, ("exit %d %s\n" % (i, me)).encode())
    locks[i].release()
    holds += 1
print(holds, flush=True)
"#;

/// rslock on `urls` (Redlock when several), named `who`, until `until`: one round per try,
/// retried every 1-20 ms until granted, each hold up to 30 ms. Answers its holds.
async fn rslock_holder(
    urls: Vec<String>,
    names: Vec<String>,
    ledger: Arc<Ledger>,
    who: String,
    seed: u64,
    until: Instant,
) -> usize {
    let mut manager = rslock::LockManager::new(urls);
    manager.set_retry(1, Duration::from_millis(1));
    let mut rng = Rng(seed);
    let mut holds = 0;
    while Instant::now() < until {
        let index = rng.below(names.len() as u64) as usize;
        let started = Instant::now();
        let held = loop {
            match manager
                .lock(names[index].as_bytes(), Duration::from_secs(10))
                .await
            {
                Ok(held) => break held,
                Err(_) => {
                    assert!(
                        started.elapsed() < fleet::FLEET_WAIT,
                        "{who} never got key {index} in {:?}",
                        fleet::FLEET_WAIT
                    );
                    tokio::time::sleep(Duration::from_millis(1 + rng.below(20))).await;
                }
            }
        };
        ledger.enter(&index.to_string(), &who).unwrap();
        tokio::time::sleep(rng.duration(fleet::HOLD_AT_MOST)).await;
        ledger.exit(&index.to_string(), &who).unwrap();
        manager.unlock(&held).await;
        holds += 1;
    }
    holds
}

/// Runs the fleet for [`SECONDS`]: lockkit clients made by `connect`, rslock on `urls`,
/// and redis-py processes on `redis_py` (a server's URL) with `python`. Answers the lockkit
/// backends, for checks after.
async fn run_fleet<B, F, Fut>(
    urls: Vec<String>,
    connect: F,
    redis_py: Option<(String, String)>,
) -> Vec<B>
where
    B: LockBackend + Clone + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let fleet = Fleet::new(
        &format!("mixed fleet on {} server(s)", urls.len()),
        2,
        Duration::from_secs(SECONDS),
    );
    let mut peers = Vec::new();
    if let Some((python, url)) = &redis_py {
        for n in 0..REDIS_PY_PROCESSES {
            let child = Command::new(python)
                .args(["-c", REDIS_PY_HOLDER, url])
                .arg(fleet.ledger.path())
                .arg(SECONDS.to_string())
                .arg((fleet.seed ^ n as u64).to_string())
                .args(&fleet.keys)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            peers.push(Peer::Process(child));
        }
    }
    let mut rng = Rng(!fleet.seed);
    for n in 0..RSLOCK_TASKS {
        peers.push(Peer::Task(tokio::spawn(rslock_holder(
            urls.clone(),
            fleet.keys.clone(),
            fleet.ledger.clone(),
            format!("rslock-{n}"),
            rng.next_u64(),
            fleet.until,
        ))));
    }
    let mut backends = Vec::new();
    for _ in 0..LOCKKIT_CLIENTS {
        backends.push(connect().await);
    }
    let lockers: Vec<Locker> = backends.iter().cloned().map(Locker::new).collect();
    let summary = fleet
        .run_beside_peers(&lockers, TASKS_PER_LOCKKIT_CLIENT, peers, "rslock")
        .await;
    if redis_py.is_some() {
        assert!(
            summary.of("redispy") > 0,
            "redis-py never held: {:?}",
            summary.holds
        );
    }
    fleet.assert_all_free(&Locker::new(connect().await)).await;
    backends
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_on_one_server_never_holds_a_key_twice() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let url = server.url();
    let python = std::env::var("LOCKKIT_TEST_PYTHON")
        .ok()
        .filter(|p| !p.is_empty());
    if python.is_none() {
        // In CI it must be there: this fails there.
        env::service_url("LOCKKIT_TEST_PYTHON");
    }
    let backends = run_fleet(
        vec![url.clone()],
        || {
            let url = url.clone();
            async move { RedisBackend::connect(&url).await.unwrap() }
        },
        python.map(|python| (python, url.clone())),
    )
    .await;
    // Every wait ended: no subscription of any of them is left.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: usize = backends.iter().map(RedisBackend::subscribed_channels).sum();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} subscriptions left 10 s after every wait ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_on_redlock_masters_never_holds_a_key_twice() {
    let mut masters = Vec::new();
    for index in 0..5 {
        let args: &[&str] = if index < 3 {
            &["--notify-keyspace-events", "Kg"]
        } else {
            &[]
        };
        let Some(master) = OwnRedis::start(args) else {
            return;
        };
        masters.push(master);
    }
    let urls: Vec<String> = masters.iter().map(OwnRedis::url).collect();
    let redlock = format!(
        "redlock://{}",
        masters
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.port))
            .collect::<Vec<_>>()
            .join(",")
    );
    run_fleet(
        urls,
        || {
            let redlock = redlock.clone();
            async move { RedlockBackend::connect(&redlock).await.unwrap() }
        },
        None,
    )
    .await;
}
