//! A MySQL client whose link goes silent, or whose server is gone: what the others see,
//! and what its own calls answer (helper-31's review, F1, F2 and F4). Every case goes
//! through a fault proxy in front of the test server.

use std::time::{Duration, Instant};

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::{LockBackend, LockKey, Locker, LossSignal, OwnerId, spi::AcquireRequest};
use lockkit_mysql::MysqlBackend;
use uuid::Uuid;

fn base() -> Option<String> {
    env::service_url("LOCKKIT_TEST_MYSQL_URL")
}

fn url(options: &str) -> Option<String> {
    base().map(|u| format!("{u}?{options}"))
}

/// The test server's URL with its host and port replaced by `addr` (a fault proxy).
fn url_via(addr: std::net::SocketAddr, options: &str) -> Option<String> {
    let u = base()?;
    let (scheme_user, rest) = u.split_once('@').unwrap();
    let db = rest.split_once('/').unwrap().1;
    Some(format!("{scheme_user}@{addr}/{db}?{options}"))
}

fn server() -> Option<std::net::SocketAddr> {
    let u = base()?;
    Some(env::host_ports(&u)[0].parse().unwrap())
}

fn key() -> LockKey {
    LockKey::new(format!("stalls/{}", Uuid::new_v4().simple())).unwrap()
}

/// `close()` of a for-update client returns while a hold's link is silent. Before, the
/// hold's liveness check (every 250 ms) sent its statement into the silent link with no
/// limit and kept the hold's connection locked meanwhile, and `close()` waited for that
/// lock for as long as the link stayed silent (past the 15 s bound here; forever behind a
/// silent load balancer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_returns_while_a_for_update_holds_link_is_silent() {
    let Some(server) = server() else { return };
    let proxy = FaultProxy::start(server).await.unwrap();
    let url = url_via(
        proxy.local_addr(),
        "mode=for-update&table=lockkit_test_stalls&connect_timeout=2s",
    )
    .unwrap();
    let backend = MysqlBackend::connect(&url).await.unwrap();
    let locker = Locker::new(backend.clone());
    let guard = locker
        .acquire(key())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut();
    // The liveness check sends its statement into the silent link.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let closing = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.close().await })
    };
    let closed = tokio::time::timeout(Duration::from_secs(15), closing).await;
    proxy.heal();
    assert!(
        closed.is_ok(),
        "close() still waiting after 15 s with a for-update hold on a silent link"
    );
    assert!(!guard.is_valid(), "a closed client holds nothing");
    drop(guard);
}

/// A row-mode client that stalls inside its transaction (after the `SELECT ... FOR UPDATE`
/// that locks the key's row, before its `COMMIT`; here a test pause, then a silent link)
/// keeps the row locked only briefly: the server ends a transaction left idle. Before, the
/// server kept the row lock until its `wait_timeout` (8 hours by default): another client's
/// 10 s wait, starting when the stalled client's 2 s lease was long over, ended after 30 s
/// with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_client_stalled_mid_transaction_frees_the_key() {
    let Some(server) = server() else { return };
    let proxy = FaultProxy::start(server).await.unwrap();
    let via = url_via(proxy.local_addr(), "mode=row&table=lockkit_test_stalls").unwrap();
    let stuck = MysqlBackend::connect(&via).await.unwrap();
    let k = key();
    let req = AcquireRequest::new(
        k.clone(),
        OwnerId::random(),
        Duration::from_secs(2),
        LossSignal::new(),
    );
    stuck.try_acquire(&req).await.unwrap().expect("a free key");
    // A retry of that acquisition goes to the full transaction: it locks the key's row,
    // then (test hook) pauses before writing; the link goes silent meanwhile.
    lockkit_mysql::set_retry_pause(Duration::from_millis(1000));
    let retry = {
        let (stuck, req) = (stuck.clone(), req.clone());
        tokio::spawn(async move { stuck.try_acquire(&req).await.map(|g| g.is_some()) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.cut();
    lockkit_mysql::set_retry_pause(Duration::ZERO);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let other = Locker::new(
        MysqlBackend::connect(&url("mode=row&table=lockkit_test_stalls").unwrap())
            .await
            .unwrap(),
    );
    let started = Instant::now();
    let got = tokio::time::timeout(
        Duration::from_secs(60),
        other
            .acquire(&k)
            .ttl(Duration::from_secs(5))
            .wait(Duration::from_secs(10)),
    )
    .await;
    let waited = started.elapsed();
    drop(proxy);
    retry.abort();
    match got {
        Ok(Ok(guard)) => {
            guard.release().await.unwrap();
        }
        Ok(Err(e)) => panic!(
            "a key whose holder's lease ran out 3 s ago was not granted within a 10 s wait: \
             {e} (after {waited:?})"
        ),
        Err(_) => panic!("no answer within 60 s"),
    }
}

/// With the server gone (connections closed, new ones refused), a call says the server
/// cannot be reached, in both modes. Before, it said every pooled connection was busy and
/// to raise `pool_size` (row mode) or `max_holds` (for-update mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_not_reported_as_a_full_pool() {
    let Some(server) = server() else { return };
    let mut wrong = Vec::new();
    for mode in ["row", "for-update"] {
        let proxy = FaultProxy::start(server).await.unwrap();
        let url = url_via(
            proxy.local_addr(),
            &format!("mode={mode}&table=lockkit_test_stalls&connect_timeout=1s"),
        )
        .unwrap();
        let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
        drop(proxy);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for _ in 0..3 {
            let e = locker
                .try_acquire(key())
                .ttl(Duration::from_secs(5))
                .await
                .unwrap_err();
            let text = e.to_string();
            if text.contains("raise pool_size")
                || text.contains("raise max_holds")
                || !text.contains("reach")
            {
                wrong.push(format!("{mode}: {text}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "an unreachable server reported as something else: {wrong:#?}"
    );
}

/// A server that takes longer than a quarter second to connect to (far away, or behind a
/// slow TLS handshake; here a proxy that delays every chunk by 100 ms, which makes the
/// handshake and the session set-up take several hundred) still gets for-update locks.
/// Before, the pool of dedicated connections gave a new connection 250 ms in all (its
/// bound on waiting for one in use), and every acquisition that needed a new one failed,
/// saying every dedicated connection was in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_to_connect_server_still_gets_for_update_locks() {
    let Some(server) = server() else { return };
    let proxy = FaultProxy::start(server).await.unwrap();
    proxy.set_delay(Duration::from_millis(100));
    let url = url_via(
        proxy.local_addr(),
        "mode=for-update&table=lockkit_test_stalls&connect_timeout=10s",
    )
    .unwrap();
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let guard = locker
        .try_acquire(key())
        .ttl(Duration::from_secs(30))
        .await
        .expect("a slow connection is still a connection")
        .expect("a free key");
    guard.release().await.unwrap();
}

/// A for-update wait while every dedicated connection is in use (`max_holds` reached) waits
/// for one until its own deadline, as any wait: a short wait ends in `Timeout`, a long one
/// is granted once a connection comes free (here: the one hold let go 2 s in), and a wait
/// dropped meanwhile takes nothing. A try still says at once that every connection is in
/// use. Before, every acquisition failed after 250 ms, a 20 s wait too, saying to raise
/// `max_holds` (PostgreSQL's advisory mode had the same, fixed this session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_for_update_wait_with_every_dedicated_connection_in_use_waits_its_deadline() {
    let Some(url) = url("mode=for-update&table=lockkit_test_stalls&max_holds=1") else {
        return;
    };
    let locker = Locker::new(MysqlBackend::connect(&url).await.unwrap());
    let held = locker
        .acquire(key())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let other = key();
    let started = Instant::now();
    let waited = locker
        .acquire(&other)
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_millis(600))
        .await;
    let took = started.elapsed();
    assert!(
        matches!(waited, Err(lockkit_core::Error::Timeout { .. })) && took < Duration::from_secs(5),
        "a 600 ms wait took {took:?}: {:?}",
        waited.map(|g| g.token())
    );
    let tried = locker
        .try_acquire(&other)
        .ttl(Duration::from_secs(30))
        .await;
    match tried {
        Err(e) => assert!(
            e.is_retryable() && e.to_string().contains("max_holds"),
            "{e}"
        ),
        Ok(g) => panic!(
            "a try with no connection to use answered {:?}",
            g.map(|g| g.token())
        ),
    }
    let dropped = tokio::spawn({
        let (locker, other) = (locker.clone(), other.clone());
        async move { locker.acquire(&other).wait(Duration::from_secs(20)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    dropped.abort();
    let long = tokio::spawn({
        let (locker, other) = (locker.clone(), other.clone());
        async move {
            let started = Instant::now();
            let granted = locker.acquire(&other).wait(Duration::from_secs(20)).await;
            (granted, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    held.release().await.unwrap();
    let (granted, took) = long.await.unwrap();
    let granted = granted.unwrap_or_else(|e| panic!("the 20 s wait ended after {took:?}: {e}"));
    assert!(took >= Duration::from_secs(1), "granted after {took:?}");
    granted.release().await.unwrap();
}
