//! ZooKeeper-specific behaviour of read-write locks and semaphores: no herd behind a
//! waiting writer, cancelled waiters leave no node, a retried attempt makes one node, a
//! cut-off reader or permit holder knows it lost its hold before anyone else is granted it.

use std::time::Duration;

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::spi::AcquireRequest;
use lockkit_core::{LockBackend, LockKey, LockKind, Locker, LossSignal};
use lockkit_zk::ZkBackend;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(30);

fn key(case: &str) -> LockKey {
    LockKey::new(format!("zk-rw/{case}/{}", Uuid::new_v4().simple())).unwrap()
}

async fn connect(url: &str) -> ZkBackend {
    ZkBackend::connect(&format!("{url}?session_timeout=10s"))
        .await
        .unwrap()
}

/// A client with kazoo's layout (`layout=kazoo`).
async fn connect_kazoo(url: &str) -> ZkBackend {
    ZkBackend::connect(&format!("{url}?session_timeout=10s&layout=kazoo"))
        .await
        .unwrap()
}

/// The children of `path` (none when it does not exist).
async fn children(backend: &ZkBackend, path: &str) -> Vec<String> {
    let client = backend.client().await.unwrap();
    match client.list_children(path).await {
        Ok(children) => children,
        Err(zookeeper_client::Error::NoNode) => Vec::new(),
        Err(e) => panic!("{e}"),
    }
}

/// Waits (up to 5 s) until `path` has `count` children, for deletions done in the
/// background.
async fn settle(backend: &ZkBackend, path: &str, count: usize, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = children(backend, path).await;
        if now.len() == count {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {path} has {now:?}, expected {count} children"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Readers queued behind a waiting writer watch that writer, not its predecessor: when
/// the writer is granted none of them wakes; when it releases, each wakes once and all
/// read together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_behind_a_waiting_writer_wake_only_when_it_leaves() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let key = key("herd");
    let holder = Locker::new(connect(&url).await);
    let writer = Locker::new(connect(&url).await);
    let readers_backend = connect(&url).await;
    let readers = Locker::new(readers_backend.clone());
    let first = holder.write(&key).ttl(TTL).await.unwrap();
    let dir = readers_backend.lock_dir(&key);
    let waiting_writer = tokio::spawn({
        let key = key.clone();
        async move {
            writer
                .write(&key)
                .ttl(TTL)
                .wait(Duration::from_secs(60))
                .await
        }
    });
    settle(&readers_backend, &dir, 2, "the writer queues").await;
    let mut waiting_readers = Vec::new();
    for _ in 0..5 {
        let (readers, key) = (readers.clone(), key.clone());
        waiting_readers.push(tokio::spawn(async move {
            readers
                .read(&key)
                .ttl(TTL)
                .wait(Duration::from_secs(60))
                .await
        }));
    }
    settle(&readers_backend, &dir, 7, "the readers queue").await;
    first.release().await.unwrap();
    let second = waiting_writer.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        readers_backend.watch_wakeups(),
        0,
        "readers woke when the writer ahead of them was granted"
    );
    assert!(waiting_readers.iter().all(|r| !r.is_finished()));
    second.release().await.unwrap();
    let mut guards = Vec::new();
    for reader in waiting_readers {
        guards.push(reader.await.unwrap().unwrap());
    }
    assert_eq!(readers_backend.watch_wakeups(), 5, "one wake-up per reader");
    for guard in guards {
        guard.release().await.unwrap();
    }
}

/// A read, write or permit waiter that is dropped deletes what it made (contender, lease,
/// the semaphore's mutex node, lockkit's permit registration), and a writer that gives up
/// stops keeping new readers out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiters_leave_no_nodes() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = connect(&url).await;
    let (a, b) = (
        Locker::new(backend.clone()),
        Locker::new(connect(&url).await),
    );
    let rw = key("cancel");
    let dir = backend.lock_dir(&rw);
    let reader = a.read(&rw).ttl(TTL).await.unwrap();
    let write = b.write(&rw).ttl(TTL).wait(Duration::from_secs(60));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), write)
            .await
            .is_err()
    );
    settle(&backend, &dir, 1, "a cancelled writer").await;
    let other = b.read(&rw).ttl(TTL).try_now().await.unwrap();
    let other = other.expect("a writer that gave up still keeps readers out");
    other.release().await.unwrap();
    reader.release().await.unwrap();

    let writer = a.write(&rw).ttl(TTL).await.unwrap();
    let read = b.read(&rw).ttl(TTL).wait(Duration::from_secs(60));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), read)
            .await
            .is_err()
    );
    settle(&backend, &dir, 1, "a cancelled reader").await;
    writer.release().await.unwrap();

    let permits = key("cancel-permit");
    let dir = backend.lock_dir(&permits);
    let held = a.semaphore(&permits, 1).acquire().ttl(TTL).await.unwrap();
    let waiter = b
        .semaphore(&permits, 1)
        .acquire()
        .wait(Duration::from_secs(60));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), waiter)
            .await
            .is_err()
    );
    settle(&backend, &format!("{dir}/leases"), 1, "a cancelled permit").await;
    settle(&backend, &format!("{dir}/locks"), 0, "a cancelled permit").await;
    settle(
        &backend,
        &format!("{dir}/lockkit-permits"),
        1,
        "a cancelled permit",
    )
    .await;
    held.release().await.unwrap();
    settle(&backend, &format!("{dir}/leases"), 0, "a released permit").await;
    settle(
        &backend,
        &format!("{dir}/lockkit-permits"),
        0,
        "a released permit",
    )
    .await;
}

/// An attempt retried with the same attempt id (a lost reply) takes effect once for
/// reads, writes and permits: the same hold, depth 1, one node. A downgrade's read node
/// carries the writer's sequence and outlives the write's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_attempt_makes_one_node() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = connect(&url).await;
    let locker = Locker::new(backend.clone());
    let owner = locker.owner();
    let key = key("retry");
    let dir = backend.lock_dir(&key);
    let write = owner.write(&key).ttl(TTL).await.unwrap();
    let request = AcquireRequest::new(key.clone(), write.owner(), TTL, LossSignal::new())
        .with_kind(LockKind::Read);
    let once = backend.try_acquire(&request).await.unwrap().unwrap();
    let again = backend.try_acquire(&request).await.unwrap().unwrap();
    assert_eq!((once.depth, again.depth), (1, 1));
    assert_eq!(once.token, again.token);
    assert!(once.token > write.token(), "a downgrade is a new hold");
    let nodes = children(&backend, &dir).await;
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    let sequences: Vec<&str> = nodes.iter().map(|n| &n[n.len() - 10..]).collect();
    assert_eq!(
        sequences[0], sequences[1],
        "the read keeps the writer's place"
    );
    write.release().await.unwrap();
    let holders = backend.holders(&key).await.unwrap();
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].kind, Some(LockKind::Read));
    backend.release(&once).await.unwrap();
    settle(&backend, &dir, 0, "all released").await;

    let permit = LockKind::Permit {
        limit: 2.try_into().unwrap(),
    };
    let request =
        AcquireRequest::new(key.clone(), owner.id(), TTL, LossSignal::new()).with_kind(permit);
    let once = backend.try_acquire(&request).await.unwrap().unwrap();
    let again = backend.try_acquire(&request).await.unwrap().unwrap();
    assert_eq!(once.token, again.token);
    assert_eq!(children(&backend, &format!("{dir}/leases")).await.len(), 1);
    // The same owner's second acquisition is a second permit (never a re-entry).
    let second =
        AcquireRequest::new(key.clone(), owner.id(), TTL, LossSignal::new()).with_kind(permit);
    let other = backend.try_acquire(&second).await.unwrap().unwrap();
    assert_ne!(other.token, once.token);
    assert_eq!(backend.holders(&key).await.unwrap().len(), 2);
    backend.release(&once).await.unwrap();
    backend.release(&other).await.unwrap();
}

/// A reader and a permit holder cut off from the ensemble hear of the loss (their session
/// may be gone with their nodes) before a rival is granted what they held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_off_readers_and_permit_holders_know_they_lost() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_ENSEMBLE_URL") else {
        return;
    };
    let mut proxies = Vec::new();
    for server in env::host_ports(&url) {
        proxies.push(FaultProxy::start(server.parse().unwrap()).await.unwrap());
    }
    let hosts: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    let session = "?session_timeout=3s";
    let holder = Locker::new(
        ZkBackend::connect(&format!("zk://{}{session}", hosts.join(",")))
            .await
            .unwrap(),
    );
    let rival = Locker::new(
        ZkBackend::connect(&format!("{url}{session}"))
            .await
            .unwrap(),
    );
    // The same with kazoo's semaphore layout, cut off at the same moment.
    let kazoo_holder = Locker::new(
        ZkBackend::connect(&format!("zk://{}{session}&layout=kazoo", hosts.join(",")))
            .await
            .unwrap(),
    );
    let kazoo_rival = Locker::new(
        ZkBackend::connect(&format!("{url}{session}&layout=kazoo"))
            .await
            .unwrap(),
    );
    let (rw, sem, kazoo_sem) = (key("cut-read"), key("cut-permit"), key("cut-kazoo"));
    let read = holder.read(&rw).ttl(TTL).await.unwrap();
    let permit = holder.semaphore(&sem, 1).acquire().ttl(TTL).await.unwrap();
    let kazoo_permit = kazoo_holder.semaphore(&kazoo_sem, 1).acquire().ttl(TTL);
    let kazoo_permit = kazoo_permit.await.unwrap();
    for proxy in &proxies {
        proxy.cut();
    }
    let write = rival
        .write(&rw)
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        !read.is_valid(),
        "a writer was granted while the cut-off reader still believed it read"
    );
    let next = rival
        .semaphore(&sem, 1)
        .acquire()
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        !permit.is_valid(),
        "a permit was granted while the cut-off holder still believed in its own"
    );
    let kazoo_next = kazoo_rival
        .semaphore(&kazoo_sem, 1)
        .acquire()
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        !kazoo_permit.is_valid(),
        "a kazoo-layout permit was granted while the cut-off holder believed in its own"
    );
    assert!(write.token() > read.token());
    assert!(next.token() > permit.token());
    assert!(kazoo_next.token() > kazoo_permit.token());
    write.release().await.unwrap();
    next.release().await.unwrap();
    kazoo_next.release().await.unwrap();
    drop(proxies);
}

/// The backend itself (not only the locker) refuses a reader's write or plain lock with
/// `WouldDeadlock`, waiting or not, and a writer's plain lock with `KindMismatch`, and
/// creates no node for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_refuses_what_would_wait_for_itself() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = connect(&url).await;
    let locker = Locker::new(backend.clone());
    let owner = locker.owner();
    let key = key("refuse");
    let dir = backend.lock_dir(&key);
    let read = owner.read(&key).ttl(TTL).await.unwrap();
    for kind in [LockKind::Write, LockKind::Exclusive] {
        let request =
            AcquireRequest::new(key.clone(), owner.id(), TTL, LossSignal::new()).with_kind(kind);
        let refused = backend.acquire(&request, Duration::from_secs(5)).await;
        assert!(
            matches!(refused, Err(lockkit_core::Error::WouldDeadlock { .. })),
            "{kind:?} asked by a reader: {refused:?}"
        );
    }
    assert_eq!(children(&backend, &dir).await.len(), 1);
    read.release().await.unwrap();
    let write = owner.write(&key).ttl(TTL).await.unwrap();
    let request = AcquireRequest::new(key.clone(), owner.id(), TTL, LossSignal::new());
    let refused = backend.try_acquire(&request).await;
    assert!(
        matches!(refused, Err(lockkit_core::Error::KindMismatch { .. })),
        "a plain lock asked by a writer: {refused:?}"
    );
    write.release().await.unwrap();
}

/// With kazoo's layout: permit acquisitions dropped at every point (waiting under the
/// semaphore's lock, mid-request, just granted) leave no lease and no node of the lock at
/// `<key>-__lock__`; an attempt retried with the same id takes one lease; a permit's
/// token is its lease's `czxid`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kazoo_layout_permits_cancelled_or_retried_leave_one_lease_each() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = connect_kazoo(&url).await;
    let (a, b) = (
        Locker::new(backend.clone()),
        Locker::new(connect_kazoo(&url).await),
    );
    let permits = key("kazoo-cancel");
    let dir = backend.lock_dir(&permits);
    let lock_dir = format!("{dir}-__lock__");
    let held = a.semaphore(&permits, 1).acquire().ttl(TTL).await.unwrap();
    let waiter = b
        .semaphore(&permits, 1)
        .acquire()
        .wait(Duration::from_secs(60));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), waiter)
            .await
            .is_err()
    );
    settle(&backend, &dir, 1, "a cancelled waiter").await;
    settle(&backend, &lock_dir, 0, "a cancelled waiter").await;
    held.release().await.unwrap();
    settle(&backend, &dir, 0, "a released permit").await;

    // Dropped at spread-out moments, with a free permit and with none.
    let kept = a.semaphore(&permits, 2).acquire().ttl(TTL).await;
    assert!(
        matches!(kept, Err(lockkit_core::Error::KindMismatch { .. })),
        "kazoo's node keeps the count: {kept:?}"
    );
    let held = a.semaphore(&permits, 1).acquire().ttl(TTL).await.unwrap();
    let other = key("kazoo-cancel-free");
    for round in 0..40u64 {
        let cut = Duration::from_millis(round * 7 % 60);
        for (name, wait) in [
            (&permits, Duration::from_secs(60)),
            (&other, Duration::ZERO),
        ] {
            let acquire = b.semaphore(name, 1).acquire().ttl(TTL).wait(wait);
            if let Ok(Ok(permit)) = tokio::time::timeout(cut, acquire).await {
                permit.release().await.unwrap();
            }
        }
    }
    settle(&backend, &dir, 1, "dropped permit acquisitions").await;
    settle(&backend, &lock_dir, 0, "dropped permit acquisitions").await;
    let other_dir = backend.lock_dir(&other);
    settle(&backend, &other_dir, 0, "dropped permit acquisitions").await;
    settle(
        &backend,
        &format!("{other_dir}-__lock__"),
        0,
        "dropped permit acquisitions",
    )
    .await;
    held.release().await.unwrap();

    let two = LockKind::Permit {
        limit: 2.try_into().unwrap(),
    };
    let retried = key("kazoo-retry");
    let dir = backend.lock_dir(&retried);
    let request =
        AcquireRequest::new(retried.clone(), a.owner().id(), TTL, LossSignal::new()).with_kind(two);
    let once = backend.try_acquire(&request).await.unwrap().unwrap();
    let again = backend.try_acquire(&request).await.unwrap().unwrap();
    assert_eq!((once.token, once.depth), (again.token, again.depth));
    let leases = children(&backend, &dir).await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    let client = backend.client().await.unwrap();
    let (_, stat) = client
        .get_data(&format!("{dir}/{}", leases[0]))
        .await
        .unwrap();
    assert_eq!(once.token.get(), u64::try_from(stat.czxid).unwrap());
    backend.release(&once).await.unwrap();
    settle(&backend, &dir, 0, "a released retried permit").await;
}

/// With kazoo's layout, waiters for a full semaphore queue on its lock and only the head
/// watches the leases: a release wakes the head (the leases changed) and, once the head
/// has its permit and lets go of the lock, the next in line (its predecessor went), not
/// every waiter. Each later release hands on the same way, until all were granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kazoo_layout_semaphore_waiters_are_not_a_herd() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let key = key("kazoo-herd");
    let holder = Locker::new(connect_kazoo(&url).await);
    let waiters_backend = connect_kazoo(&url).await;
    let waiters = Locker::new(waiters_backend.clone());
    let lock_dir = format!("{}-__lock__", waiters_backend.lock_dir(&key));
    let held = holder.semaphore(&key, 1).acquire().ttl(TTL).await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..4 {
        let (waiters, key) = (waiters.clone(), key.clone());
        waiting.push(tokio::spawn(async move {
            waiters
                .semaphore(&key, 1)
                .acquire()
                .ttl(TTL)
                .wait(Duration::from_secs(60))
                .await
        }));
    }
    settle(&waiters_backend, &lock_dir, 4, "the waiters queue").await;
    let before = waiters_backend.watch_wakeups();
    held.release().await.unwrap();
    // One waiter is granted, and the next in line takes its place at the head.
    settle(&waiters_backend, &lock_dir, 3, "the head was granted").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let woken = waiters_backend.watch_wakeups() - before;
    assert!(
        woken <= 2,
        "one release woke {woken} waiters' watches: a herd (4 waiters queued)"
    );
    let mut granted = 0;
    while granted < 4 {
        let done = waiting.iter().position(|w| w.is_finished());
        let Some(done) = done else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let permit = waiting.swap_remove(done).await.unwrap().unwrap();
        granted += 1;
        permit.release().await.unwrap();
    }
}
