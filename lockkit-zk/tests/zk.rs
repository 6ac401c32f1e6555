//! ZooKeeper-specific behaviour: no herd, no orphan contenders, and a cut-off holder that
//! knows it lost the lock before anyone else can be granted it.

use std::{sync::Arc, time::Duration};

use lockkit_conformance::{FaultProxy, History, env};
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

fn key(case: &str) -> LockKey {
    LockKey::new(format!("zk-test/{case}/{}", Uuid::new_v4().simple())).unwrap()
}

async fn contenders(backend: &ZkBackend, key: &LockKey) -> usize {
    let client = backend.client().await.unwrap();
    match client.list_children(&backend.lock_dir(key)).await {
        Ok(children) => children.len(),
        Err(zookeeper_client::Error::NoNode) => 0,
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let url = format!("{url}?session_timeout=10s");
    let key = key("herd");
    let holder = Locker::new(ZkBackend::connect(&url).await.unwrap());
    let waiters_backend = ZkBackend::connect(&url).await.unwrap();
    let waiters = Locker::new(waiters_backend.clone());
    let held = holder
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();

    let (granted_tx, mut granted) = mpsc::unbounded_channel();
    let (go_tx, go) = watch::channel(false);
    for _ in 0..50 {
        let (waiters, key, granted_tx, mut go) =
            (waiters.clone(), key.clone(), granted_tx.clone(), go.clone());
        tokio::spawn(async move {
            let guard = waiters
                .acquire(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(60))
                .await
                .unwrap();
            granted_tx.send(guard.token()).unwrap();
            while !*go.borrow_and_update() {
                go.changed().await.unwrap();
            }
            guard.release().await.unwrap();
        });
    }
    // All 50 are queued behind the holder.
    for _ in 0..200 {
        if contenders(&waiters_backend, &key).await == 51 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(contenders(&waiters_backend, &key).await, 51);
    let before = waiters_backend.watch_wakeups();
    held.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), granted.recv())
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        waiters_backend.watch_wakeups() - before,
        1,
        "one release woke more than one waiter"
    );

    go_tx.send(true).unwrap();
    for _ in 1..50 {
        tokio::time::timeout(Duration::from_secs(20), granted.recv())
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(
        waiters_backend.watch_wakeups() - before,
        50,
        "each release must wake exactly its successor"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiters_leave_no_contender_nodes() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let url = format!("{url}?session_timeout=10s");
    let key = key("cancel");
    let backend = ZkBackend::connect(&url).await.unwrap();
    let holder = Locker::new(ZkBackend::connect(&url).await.unwrap());
    let waiters = Locker::new(backend.clone());
    let held = holder.acquire(&key).await.unwrap();
    for i in 0..40u64 {
        let attempt = waiters.acquire(&key).wait(Duration::from_secs(30));
        let budget = Duration::from_micros(i * 500);
        assert!(tokio::time::timeout(budget, attempt).await.is_err());
    }
    held.release().await.unwrap();
    let mut left = usize::MAX;
    for _ in 0..100 {
        left = contenders(&backend, &key).await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 0, "cancelled waiters left contender nodes behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_holder_knows_before_anyone_else_is_granted() {
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
    let key = key("cut");
    let history = History::new();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(3))
        .await
        .unwrap();
    let open = history.begin("cut-off holder", &guard);
    // A partition: packets stop, connections stay open.
    for proxy in &proxies {
        proxy.cut();
    }
    let next = rival
        .acquire(&key)
        .wait(Duration::from_secs(30))
        .await
        .unwrap();
    let rival_open = history.begin("rival", &next);
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the cut-off holder never noticed");
    history.end(open, &guard);
    history.end(rival_open, &next);
    history.assert_linear();
    assert!(next.token() > guard.token());
    next.release().await.unwrap();
    drop(Arc::new(proxies));
}

/// A guard never believes in its hold longer than the session can vouch for: with a 30 s
/// lease on a 2 s session, validity reaches at most 2/3 of the session past the last
/// confirmed renewal (a holder paused for longer wakes up invalid, not trusting a node its
/// expired session took with it), and the watchdog renews often enough to keep it valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_is_capped_by_what_the_session_can_guarantee() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let session = Duration::from_secs(2);
    let locker = Locker::new(
        ZkBackend::connect(&format!("{url}?session_timeout=2s"))
            .await
            .unwrap(),
    );
    let key = key("validity-cap");
    let guard = locker
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let backend = locker.backend().clone();
    for _ in 0..20 {
        let bound = backend
            .validity_bound(guard.grant())
            .expect("a held ZooKeeper lock is bounded by its session");
        let left = bound.saturating_duration_since(tokio::time::Instant::now());
        assert!(
            left <= session * 2 / 3,
            "validity of {left:?} promised on a {session:?} session"
        );
        assert!(
            guard.is_valid(),
            "the session's pings must keep the hold valid"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    guard.release().await.unwrap();
}

/// The session's list of holds (kept to fire their loss signals) does not grow with every
/// hold ever taken.
#[tokio::test]
async fn ended_holds_are_not_kept_by_the_session() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let backend = ZkBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    for _ in 0..50 {
        let guard = locker.try_acquire(key("tracked")).await.unwrap().unwrap();
        guard.release().await.unwrap();
    }
    let tracked = backend.tracked_holds().await;
    assert!(tracked <= 2, "{tracked} ended holds still tracked");
}

/// Found by the loaded stability run: a ZooKeeper connection that stops answering for a
/// moment (a loaded machine, a paused server) fails the requests in flight with a custom
/// "no response from connection" error, not `ConnectionLoss`; the session lives on and the
/// client reconnects. A waiting acquisition must ride that out within its deadline, not
/// fail (it did, and the contender it may have created was swept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_rides_out_a_connection_that_stops_answering() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let proxy = FaultProxy::start(server.parse().unwrap()).await.unwrap();
    // A 6 s session: the client gives a silent connection up after 2/5 of it (2.4 s), well
    // before the session could expire.
    let locker = Locker::new(
        ZkBackend::connect(&format!("zk://{}?session_timeout=6s", proxy.local_addr()))
            .await
            .unwrap(),
    );
    let key = key("silent");
    proxy.cut();
    let acquiring = {
        let (locker, key) = (locker.clone(), key.clone());
        tokio::spawn(async move {
            locker
                .acquire(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(20))
                .await
        })
    };
    // Past the client's no-answer limit, within the session.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    proxy.heal();
    let guard = acquiring
        .await
        .unwrap()
        .expect("a connection blip within the session must not fail the acquisition");
    guard.release().await.unwrap();
    // The create that went unanswered may have landed too (the proxy forwards it on
    // heal): no node of that attempt may stay behind to hold the key.
    let observer = ZkBackend::connect(&url).await.unwrap();
    let mut left = contenders(&observer, &key).await;
    for _ in 0..40 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = contenders(&observer, &key).await;
    }
    assert_eq!(left, 0, "contender nodes left behind after the release");
    let rival = Locker::new(observer);
    rival
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("the key is free")
        .release()
        .await
        .unwrap();
}

/// The same silence, with the key held: the waiter is parked on its predecessor's watch
/// when the link goes quiet, the holder lets go meanwhile, and the waiter must still be
/// granted within its wait once the link answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_waiter_rides_out_a_connection_that_stops_answering() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let proxy = FaultProxy::start(server.parse().unwrap()).await.unwrap();
    let holder = Locker::new(ZkBackend::connect(&url).await.unwrap());
    let waiter = Locker::new(
        ZkBackend::connect(&format!("zk://{}?session_timeout=6s", proxy.local_addr()))
            .await
            .unwrap(),
    );
    let key = key("silent-queued");
    let held = holder
        .acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let acquiring = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            waiter
                .acquire(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    held.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(3200)).await;
    proxy.heal();
    let guard = acquiring
        .await
        .unwrap()
        .expect("a queued waiter must ride out a connection blip within the session");
    assert!(guard.is_valid());
    guard.release().await.unwrap();
}

/// A server that stops answering must not stretch a wait: zookeeper-client queues requests
/// while it reconnects and fails them only when it gives the session up (7/5 of the
/// session after the server last answered). An acquisition ends at most one request limit
/// (2/5 of the session) after its deadline; it ran until the session was given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_keeps_its_deadline_behind_a_server_that_stops_answering() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let server = env::host_ports(&url).into_iter().next().unwrap();
    let proxy = FaultProxy::start(server.parse().unwrap()).await.unwrap();
    let holder = Locker::new(ZkBackend::connect(&url).await.unwrap());
    // A 20 s session: the request limit is 8 s, the client gives the session up after 28 s.
    let waiter = Locker::new(
        ZkBackend::connect(&format!("zk://{}?session_timeout=20s", proxy.local_addr()))
            .await
            .unwrap(),
    );
    let key = key("silent-deadline");
    let held = holder
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let acquiring = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            waiter
                .acquire(&key)
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(3))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    // Deadline 3 s + one request limit 8 s = 11 s at most; 28 s on the old code.
    let outcome = tokio::time::timeout(Duration::from_secs(40), acquiring)
        .await
        .expect("the waiter never returned")
        .unwrap();
    let took = started.elapsed();
    assert!(
        outcome.is_err(),
        "granted while the key was held: {outcome:?}"
    );
    assert!(
        took < Duration::from_secs(18),
        "a 3 s wait behind a silent server ended after {took:?}"
    );

    // A one-shot try during the silence ends within one request limit, as an error that
    // says the server is not answering (not as a held lock).
    let started = tokio::time::Instant::now();
    let tried = tokio::time::timeout(Duration::from_secs(40), waiter.try_acquire(&key))
        .await
        .expect("the try never returned");
    let took = started.elapsed();
    match tried {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(found) => panic!("a try against a silent server answered {found:?}"),
    }
    assert!(
        took < Duration::from_secs(18),
        "a try against a silent server ended after {took:?}"
    );
    proxy.heal();
    held.release().await.unwrap();
}

/// A root whose ACL lets nobody create children: the server's refusal of the key's
/// directory comes back as itself, not retryable, both from a try and from a wait (review
/// of the pipelined create: it had become a retryable "could not create a contender",
/// retried five times per attempt and for a whole wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_that_refuses_creates_gives_the_servers_refusal() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_URL") else {
        return;
    };
    let root = format!("/lockkit-refusing-{}", Uuid::new_v4().simple());
    let admin = ZkBackend::connect(&url).await.unwrap();
    let client = admin.client().await.unwrap();
    client
        .create(
            &root,
            &[],
            &zookeeper_client::CreateMode::Persistent
                .with_acls(zookeeper_client::Acls::anyone_read()),
        )
        .await
        .unwrap();
    let backend = ZkBackend::connect(&format!("{url}?root={root}"))
        .await
        .unwrap();
    let locker = Locker::new(backend);
    let tried = locker.try_acquire(key("refused-try")).await;
    let waited = locker
        .acquire(key("refused-wait"))
        .wait(Duration::from_secs(30))
        .await;
    client.delete(&root, None).await.unwrap();
    for outcome in [tried.map(|g| g.is_some()), waited.map(|_| true)] {
        let err = match outcome {
            Ok(granted) => panic!("answered {granted} under a root that refuses creates"),
            Err(e) => e,
        };
        assert!(!err.is_retryable(), "a refusal typed retryable: {err}");
        assert!(
            err.to_string().contains("container node"),
            "the server's refusal is not named: {err}"
        );
    }
}
