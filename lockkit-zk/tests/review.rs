//! Findings of an adversarial review of the ZooKeeper backend (review-zk): each test failed
//! before its fix.

use std::time::Duration;

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use uuid::Uuid;

fn key(case: &str) -> LockKey {
    LockKey::new(format!("zk-review/{case}/{}", Uuid::new_v4().simple())).unwrap()
}

/// Deletes every contender of `key` (an operator's `deleteall`, a reaper, a revocation):
/// the holder's node is gone behind its back.
async fn take_away(admin: &ZkBackend, key: &LockKey) {
    let client = admin.client().await.unwrap();
    let dir = admin.lock_dir(key);
    for child in client.list_children(&dir).await.unwrap() {
        client
            .delete(&format!("{dir}/{child}"), None)
            .await
            .unwrap();
    }
}

/// A locker whose session expired behind a cut link (`options` for its URL): the client
/// gave its session up (7/5 of the session timeout after the server last answered), and
/// the proxy still stalls every connection. `None` where no server is configured.
async fn expired_behind_a_cut_link(options: &str) -> Option<(FaultProxy, Locker)> {
    let url = env::service_url("LOCKKIT_TEST_ZK_URL")?;
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let proxy = FaultProxy::start(server.parse().unwrap()).await.unwrap();
    let backend = ZkBackend::connect(&format!("zk://{}?{options}", proxy.local_addr()))
        .await
        .unwrap();
    let client = backend.client().await.unwrap();
    proxy.cut();
    let expired = tokio::time::timeout(Duration::from_secs(60), async {
        while !matches!(client.state(), zookeeper_client::SessionState::Expired) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(expired.is_ok(), "the client never gave its session up");
    Some((proxy, Locker::new(backend)))
}

/// A re-entry must not be granted on a hold whose node is gone: another client holds the
/// key by then. The re-entry's own request (it records the depth in the node) is answered
/// `NoNode`; before the fix that answer was ignored and the owner was granted depth 2 while
/// the rival held the key (a double grant until the next renewal found out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reentry_on_a_node_taken_away_is_not_granted() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let url = format!("{url}?session_timeout=10s");
    let (a, b) = (
        Locker::new(ZkBackend::connect(&url).await.unwrap()),
        Locker::new(ZkBackend::connect(&url).await.unwrap()),
    );
    let admin = ZkBackend::connect(&url).await.unwrap();
    let key = key("reentry-taken-away");
    let owner = a.owner();
    // A long lease: the watchdog's first renewal (which would find out) is 20 s away.
    let outer = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    take_away(&admin, &key).await;
    let rival = b
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(10))
        .await
        .expect("the rival is granted the key once the holder's node is gone");
    let again = owner.try_acquire(&key).await;
    if let Ok(Some(inner)) = &again {
        panic!(
            "re-entry granted at depth {} (token {}) while the rival holds `{key}` (token {})",
            inner.depth(),
            inner.token(),
            rival.token()
        );
    }
    let reentered = outer.reenter().await;
    assert!(
        reentered.is_err(),
        "guard re-entry granted on a node taken away, while the rival holds `{key}`"
    );
    assert!(!outer.is_valid(), "the outer hold is known lost");
    drop(again);
    rival.release().await.unwrap();
}

/// A read asked by the owner of a write lock while that write is being released: the
/// downgrade's read node is made, then the write is found ended, and the read must queue
/// like any other (the key is free: it is granted at once). Before the fix the attempt
/// answered "not granted" and a read with a 10 s wait failed with `Timeout` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_racing_the_release_of_its_owners_write_waits_its_deadline() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = ZkBackend::connect(&format!("{url}?session_timeout=10s"))
        .await
        .unwrap();
    let locker = Locker::new(backend.clone());
    let key = key("downgrade-race");
    for round in 0..20 {
        let owner = locker.owner();
        let write = owner
            .write(&key)
            .ttl(Duration::from_secs(30))
            .await
            .unwrap();
        // Polled first, the read finds the write live and sends its read node's create;
        // the release then lets the write go before that create is answered.
        let (read, released) = tokio::join!(
            owner
                .read(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(10)),
            write.release(),
        );
        released.unwrap();
        match read {
            Ok(guard) => {
                guard.release().await.unwrap();
            }
            Err(e) => panic!("round {round}: a read of a free key failed: {e}"),
        }
    }
}

/// Once its session has expired and the servers cannot be reached, every acquisition reopens
/// the session first. That reopening must end at the acquisition's deadline: before the fix
/// it was unbounded by it and done under one lock, so concurrent acquisitions queued behind
/// each other's connection attempts and the n-th of them answered after about n connect
/// timeouts, whatever its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_on_an_expired_session_keep_their_deadlines() {
    // A partition: the client gives its session up (7/5 of the session timeout after the
    // server last answered), and every new connection stalls.
    let Some((proxy, locker)) =
        expired_behind_a_cut_link("session_timeout=2s&connect_timeout=1s").await
    else {
        return;
    };
    let key = key("expired-session-deadline");
    let wait = Duration::from_millis(300);
    let mut attempts = Vec::new();
    for _ in 0..4 {
        let (locker, key) = (locker.clone(), key.clone());
        attempts.push(tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let outcome = locker
                .acquire(&key)
                .ttl(Duration::from_secs(2))
                .wait(wait)
                .await;
            (started.elapsed(), outcome.is_ok())
        }));
    }
    for attempt in attempts {
        let (took, granted) = attempt.await.unwrap();
        assert!(!granted, "granted through a cut link");
        // The wait, one request limit (1 s) past it, and a wide margin.
        assert!(
            took < Duration::from_secs(4),
            "an acquisition with a {wait:?} wait answered after {took:?}"
        );
    }
    // Reopenings cut short leave nothing in the way: once the link heals, a new session
    // is opened and the key is granted.
    proxy.heal();
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(30))
        .await
        .expect("granted once the servers can be reached again");
    guard.release().await.unwrap();
    drop(proxy);
}

/// A hold given up as lost because the link was silent for 2/3 of the session timeout, on a
/// session that then lives on (the link came back in time): once its guard is dropped
/// nobody believes in the hold, and its node must go (as `Held`'s drop intends). Before the
/// fix the backend's registry kept the hold referenced, so the node stayed until the hold's
/// lease ran out on the local clock (here 60 s): every other client waited for a lock its
/// holder had already given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_lost_on_a_silent_link_frees_the_key_once_its_guard_is_dropped() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let proxy = FaultProxy::start(server.parse().unwrap()).await.unwrap();
    let backend = ZkBackend::connect(&format!(
        "zk://{}?session_timeout=6s&connect_timeout=1s",
        proxy.local_addr()
    ))
    .await
    .unwrap();
    let session_before = backend.client().await.unwrap().session_id();
    let holder = Locker::new(backend.clone());
    let rival = Locker::new(
        ZkBackend::connect(&format!("{url}?session_timeout=6s"))
            .await
            .unwrap(),
    );
    let key = key("lost-on-silent-link");
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    proxy.cut();
    // Given up at 2/3 of the session (4 s) after the server last answered; the session
    // itself expires only at 6 s: heal at once, so that it lives on.
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("the holder never gave up its hold on the silent link");
    proxy.heal();
    drop(guard);
    let granted = rival
        .acquire(&key)
        .ttl(Duration::from_secs(6))
        .wait(Duration::from_secs(20))
        .await;
    let session_after = backend.client().await.unwrap().session_id();
    assert_eq!(
        session_before, session_after,
        "premise: the holder's session lived on (it expired: heal came too late)"
    );
    let granted = granted.expect(
        "the rival waited 20 s for a hold given up and dropped by its holder (its node \
         stayed for the rest of its 60 s lease)",
    );
    granted.release().await.unwrap();
}

/// Reopening an expired session that takes longer than a caller's bound (a slow server,
/// a slow link) must still finish for the callers after it: a caller that stops waiting
/// for it must not take it down. Before, each try gave up the reopening it had begun, the
/// next began again, and while a reopening took longer than a try's bound no acquisition
/// ever got a session: every one failed with "reopening the expired ZooKeeper session".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reopening_outlives_the_callers_that_gave_up_on_it() {
    // A request limit of 2/5 of the session timeout (1.2 s): connect_timeout is above 3/5.
    let Some((proxy, locker)) =
        expired_behind_a_cut_link("session_timeout=3s&connect_timeout=2500ms").await
    else {
        return;
    };
    // The link is back but slow: a new session's handshake takes about 1.8 s (four chunks,
    // 450 ms each), longer than any one try waits for it, shorter than connect_timeout.
    proxy.heal();
    proxy.set_delay(Duration::from_millis(450));
    let key = key("slow-reopening");
    let mut errors = Vec::new();
    for _ in 0..6 {
        match locker.try_acquire(&key).await {
            Ok(Some(guard)) => {
                guard.release().await.unwrap();
                errors.clear();
                break;
            }
            Ok(None) => panic!("the key was busy although nobody holds it"),
            Err(error) => errors.push(error.to_string()),
        }
    }
    assert!(
        errors.is_empty() || errors.iter().any(|e| !e.contains("reopening")),
        "no try ever found the session reopened: {errors:#?}"
    );
    // And with the link fast again, the key is granted.
    proxy.set_delay(Duration::ZERO);
    let guard = locker
        .acquire(&key)
        .wait(Duration::from_secs(30))
        .await
        .expect("granted once the link is fast again");
    guard.release().await.unwrap();
    drop(proxy);
}

/// A chroot that does not exist on the servers: the acquisition says so, names it and says
/// how to mend it (before: "creating the root node failed: node not exists").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_named() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let chroot = format!("lockkit-no-such-chroot-{}", Uuid::new_v4().simple());
    let locker = Locker::new(
        ZkBackend::connect(&format!("zk://{server}/{chroot}"))
            .await
            .unwrap(),
    );
    let error = locker
        .try_acquire(key("missing-chroot"))
        .await
        .expect_err("granted under a chroot that does not exist");
    let text = error.to_string();
    assert!(
        matches!(error, lockkit_core::Error::Config(_))
            && text.contains(&format!("/{chroot}"))
            && text.contains("does not exist"),
        "{text}"
    );
}

/// Acquisitions that give up on reopening an expired session (the servers cannot be
/// reached) must not each leave a reopening of their own queued behind the one under way:
/// one reopening at a time serves them all. Before, every caller that found the session
/// dead spawned a reopening task, and each ran its own connection attempt after the one
/// before it: with acquisitions arriving faster than one per connection attempt, the queue
/// (and the connection attempts made for callers long gone) grew without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_giving_up_on_an_expired_session_leave_one_reopening() {
    let Some((proxy, locker)) =
        expired_behind_a_cut_link("session_timeout=2s&connect_timeout=1s").await
    else {
        return;
    };
    let key = key("reopening-queue");
    for _ in 0..2 {
        let mut tries = Vec::new();
        for _ in 0..8 {
            let (locker, key) = (locker.clone(), key.clone());
            tries.push(tokio::spawn(async move {
                locker.try_acquire(&key).await.map(|g| g.is_some())
            }));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for tried in tries {
            assert!(
                !matches!(tried.await.unwrap(), Ok(true)),
                "granted through a cut link"
            );
        }
    }
    // Every try has given up; the reopening under way ends within a connection attempt
    // (1 s). From then on nobody asks for a session: no connection may be attempted.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let idle_from = proxy.open_connections();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let attempted = proxy.open_connections().saturating_sub(idle_from);
    assert_eq!(
        attempted, 0,
        "{attempted} connection attempts in 4 s after every caller had given up \
         (reopenings queued for callers long gone)"
    );
    proxy.heal();
    let guard = locker
        .acquire(&key)
        .wait(Duration::from_secs(30))
        .await
        .expect("granted once the servers can be reached again");
    guard.release().await.unwrap();
    drop(proxy);
}
