//! A randomized history of a mixed fleet: lockkit clients and rslock clients contend for
//! the same few keys, on one Redis server and on five Redlock masters (where three send
//! keyspace notifications and two do not), with lockkit waits that give up or are dropped
//! mid-way. rslock holds a key as a plain `SET NX PX` string and publishes nothing when it
//! lets go, so lockkit's waiters behind it hear its deletion through keyspace notifications
//! (or poll). The case fails on two holders of one key at once (whoever they are), on a
//! waiter that was never granted within a wait far longer than every hold, on a key left
//! held at the end, and on a keyspace or release subscription left behind.
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays a run (the seed is printed).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    time::Duration,
};

use lockkit_conformance::{OwnRedis, Rng, torture_seed};
use lockkit_core::{LockBackend, Locker};
use lockkit_redis::{RedisBackend, RedlockBackend};
use tokio::time::Instant;

const KEYS: usize = 2;
const LOCKKIT_CLIENTS: usize = 2;
const TASKS_PER_LOCKKIT_CLIENT: usize = 3;
const RSLOCK_TASKS: usize = 2;
/// Far longer than any wait needs: every hold lasts 30 ms at most.
const WAIT: Duration = Duration::from_secs(30);

/// Who is inside each key's critical section: +1 on a grant, -1 before the release.
struct Inside {
    keys: Vec<AtomicUsize>,
    holds: AtomicU32,
    rslock_holds: AtomicU32,
}

impl Inside {
    fn enter(&self, key: usize, who: &str) {
        let before = self.keys[key].fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            before, 0,
            "{who} was granted key {key} while another held it"
        );
        self.holds.fetch_add(1, Ordering::Relaxed);
    }

    fn leave(&self, key: usize) {
        self.keys[key].fetch_sub(1, Ordering::SeqCst);
    }
}

async fn lockkit_task(
    locker: Locker,
    names: Vec<String>,
    inside: Arc<Inside>,
    seed: u64,
    until: Instant,
) {
    let mut rng = Rng(seed);
    while Instant::now() < until {
        let key = rng.below(KEYS as u64) as usize;
        let name = names[key].as_str();
        let who = format!("lockkit task {seed:x}");
        let guard = match rng.below(10) {
            // A try, which may find the key busy.
            0 => match locker.acquire(name).try_now().await {
                Ok(Some(guard)) => guard,
                Ok(None) => continue,
                Err(error) => panic!("{who}: try failed: {error}"),
            },
            // A wait dropped mid-way (cancellation safety: nothing may stay held).
            1 | 2 => {
                let cut = Duration::from_millis(rng.below(40));
                match tokio::time::timeout(cut, locker.acquire(name).wait(WAIT)).await {
                    Ok(Ok(guard)) => guard,
                    Ok(Err(error)) => panic!("{who}: wait failed: {error}"),
                    Err(_) => continue,
                }
            }
            _ => locker
                .acquire(name)
                .wait(WAIT)
                .await
                .unwrap_or_else(|error| panic!("{who}: not granted within {WAIT:?}: {error}")),
        };
        inside.enter(key, &who);
        tokio::time::sleep(Duration::from_millis(rng.below(30))).await;
        inside.leave(key);
        guard
            .release()
            .await
            .unwrap_or_else(|error| panic!("{who}: release failed: {error}"));
    }
}

async fn rslock_task(
    urls: Vec<String>,
    names: Vec<String>,
    inside: Arc<Inside>,
    seed: u64,
    until: Instant,
) {
    let mut manager = rslock::LockManager::new(urls);
    // Its own retries are ours: one round per call.
    manager.set_retry(1, Duration::from_millis(1));
    let mut rng = Rng(seed);
    while Instant::now() < until {
        let key = rng.below(KEYS as u64) as usize;
        let started = Instant::now();
        let held = loop {
            match manager
                .lock(names[key].as_bytes(), Duration::from_secs(10))
                .await
            {
                Ok(held) => break held,
                Err(_) => {
                    assert!(
                        started.elapsed() < WAIT,
                        "rslock never got key {key} in {WAIT:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(1 + rng.below(20))).await;
                }
            }
        };
        inside.enter(key, "rslock");
        inside.rslock_holds.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(rng.below(30))).await;
        inside.leave(key);
        manager.unlock(&held).await;
    }
}

/// Runs the fleet for `secs` seconds: lockkit clients made by `connect`, rslock on `urls`.
async fn run_fleet<B, F, Fut>(urls: Vec<String>, connect: F, secs: u64)
where
    B: LockBackend + Clone + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = B>,
{
    let seed = torture_seed();
    eprintln!(
        "mixed fleet on {} server(s): LOCKKIT_TORTURE_SEED={seed}",
        urls.len()
    );
    let names: Vec<String> = (0..KEYS)
        .map(|key| format!("mixed/{seed:x}/{key}"))
        .collect();
    let inside = Arc::new(Inside {
        keys: (0..KEYS).map(|_| AtomicUsize::new(0)).collect(),
        holds: AtomicU32::new(0),
        rslock_holds: AtomicU32::new(0),
    });
    let until = Instant::now() + Duration::from_secs(secs);
    let mut backends = Vec::new();
    let mut tasks = Vec::new();
    let mut rng = Rng(seed);
    for _ in 0..LOCKKIT_CLIENTS {
        let backend = connect().await;
        let locker = Locker::new(backend.clone());
        backends.push(backend);
        for _ in 0..TASKS_PER_LOCKKIT_CLIENT {
            tasks.push(tokio::spawn(lockkit_task(
                locker.clone(),
                names.clone(),
                inside.clone(),
                rng.next_u64(),
                until,
            )));
        }
    }
    for _ in 0..RSLOCK_TASKS {
        tasks.push(tokio::spawn(rslock_task(
            urls.clone(),
            names.clone(),
            inside.clone(),
            rng.next_u64(),
            until,
        )));
    }
    for task in tasks {
        task.await
            .expect("a fleet task failed (its message is above)");
    }
    let (holds, rslock_holds) = (
        inside.holds.load(Ordering::Relaxed),
        inside.rslock_holds.load(Ordering::Relaxed),
    );
    eprintln!("{holds} holds, {rslock_holds} of them rslock's");
    assert!(
        rslock_holds > 0 && holds > rslock_holds,
        "both kinds of client must have held: {holds} holds, {rslock_holds} rslock's"
    );
    // Nothing left held: a fresh lockkit client takes every key at once.
    let check = Locker::new(connect().await);
    for name in &names {
        let guard = check
            .acquire(name.as_str())
            .try_now()
            .await
            .expect("the check's try")
            .unwrap_or_else(|| panic!("{name} is still held after the fleet stopped"));
        guard.release().await.expect("the check's release");
    }
    drop(backends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_on_one_server_never_holds_a_key_twice() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let url = server.url();
    let backends: Arc<std::sync::Mutex<Vec<RedisBackend>>> = Arc::default();
    let made = backends.clone();
    run_fleet(
        vec![url.clone()],
        || {
            let (url, made) = (url.clone(), made.clone());
            async move {
                let backend = RedisBackend::connect(&url).await.unwrap();
                made.lock().unwrap().push(backend.clone());
                backend
            }
        },
        6,
    )
    .await;
    // Every wait ended: no subscription of any of them is left.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: usize = backends
            .lock()
            .unwrap()
            .iter()
            .map(RedisBackend::subscribed_channels)
            .sum();
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
        6,
    )
    .await;
}
