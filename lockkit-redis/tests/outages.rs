//! Release notifications through outages: abandoned subscriber connections, a waiter
//! after an outage, a frozen Redlock master (from the adversarial review of the subscriber
//! timeouts).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::{Error, LockKey, Locker};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};
use uuid::Uuid;

fn key(tag: &str) -> LockKey {
    LockKey::new(format!("review/{tag}/{}", Uuid::new_v4().simple())).unwrap()
}

fn upstream(url: &str) -> SocketAddr {
    url.trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

/// One proxied connection: its stall switch and its pump.
type Conns = Arc<Mutex<Vec<(watch::Sender<bool>, JoinHandle<()>)>>>;

/// Per-connection controllable proxy: connection i can be stalled or closed alone.
struct ConnProxy {
    local: SocketAddr,
    conns: Conns,
    _acceptor: JoinHandle<()>,
}

impl ConnProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let local = listener.local_addr().unwrap();
        let conns: Conns = Arc::default();
        let c = conns.clone();
        let acceptor = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (stall, stalled) = watch::channel(false);
                let pump = tokio::spawn(async move {
                    let server = TcpStream::connect(upstream).await.unwrap();
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, stalled.clone()) => {}
                        _ = pump(sr, cw, stalled) => {}
                    }
                });
                c.lock().unwrap().push((stall, pump));
            }
        });
        ConnProxy {
            local,
            conns,
            _acceptor: acceptor,
        }
    }
    fn count(&self) -> usize {
        self.conns.lock().unwrap().len()
    }
    fn stall(&self, i: usize, on: bool) {
        self.conns.lock().unwrap()[i].0.send_replace(on);
    }
    fn close(&self, i: usize) {
        self.conns.lock().unwrap()[i].1.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while *stalled.borrow_and_update() {
            if stalled.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn wait_for_conns(proxy: &ConnProxy, n: usize) {
    let t = Instant::now();
    while proxy.count() < n {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "expected {n} proxied connections"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// a subscriber connection abandoned after a SUBSCRIBE timeout stays open with
/// its reader running; when it ends after the current generation's reader, it stores the
/// older generation into `dead_generation`, and the current (dead) link is no longer seen
/// as dead: nobody reconnects, waiters on existing channels get no release messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_generation_ending_last_does_not_hide_the_dead_link() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let proxy = ConnProxy::start(upstream(&url)).await;
    let frozen = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?response_timeout=300ms&connect_timeout=300ms",
            proxy.local
        ))
        .await
        .unwrap(),
    );
    wait_for_conns(&proxy, 1).await; // 0: command connection
    let direct_backend = RedisBackend::connect(&url).await.unwrap();
    let direct = Locker::new(direct_backend.clone());
    let (k1, k2, k3) = (key("k1"), key("k2"), key("k3"));
    let ttl = Duration::from_secs(30);
    let h1 = direct.acquire(&k1).ttl(ttl).await.unwrap();
    let _h2 = direct.acquire(&k2).ttl(ttl).await.unwrap();
    let _h3 = direct.acquire(&k3).ttl(ttl).await.unwrap();

    // W1 waits on k1: the subscriber opens generation 1 (connection 1).
    let w1 = {
        let (frozen, k1) = (frozen.clone(), k1.clone());
        tokio::spawn(async move {
            let r = frozen.acquire(&k1).wait(Duration::from_secs(12)).await;
            (r.map(|_| ()), Instant::now())
        })
    };
    wait_for_conns(&proxy, 2).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Stall generation 1: W2's SUBSCRIBE times out, the link drops the sink but generation
    // 1's connection and reader stay alive.
    proxy.stall(1, true);
    let w2 = {
        let (frozen, k2) = (frozen.clone(), k2.clone());
        tokio::spawn(async move {
            frozen
                .acquire(&k2)
                .wait(Duration::from_secs(12))
                .await
                .map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    proxy.stall(1, false);

    // W3 opens generation 2 (connection 2), then goes away.
    let w3 = {
        let (frozen, k3) = (frozen.clone(), k3.clone());
        tokio::spawn(async move {
            frozen
                .acquire(&k3)
                .wait(Duration::from_secs(12))
                .await
                .map(|_| ())
        })
    };
    wait_for_conns(&proxy, 3).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    w3.abort();
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Hold W1 inside an attempt (command connection stalled), wake it by a message.
    proxy.stall(0, true);
    let names = direct_backend.names(&k1).unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = admin.publish(&names.channel, "x").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Both subscriber connections end (as on a server restart), generation 2 first.
    proxy.close(2);
    tokio::time::sleep(Duration::from_millis(30)).await;
    proxy.close(1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    proxy.stall(0, false);
    tokio::time::sleep(Duration::from_millis(800)).await;

    let released = Instant::now();
    h1.release().await.unwrap();
    let (outcome, at) = w1.await.unwrap();
    w2.abort();
    eprintln!(
        "W1: {outcome:?} {:?} after the release",
        at.saturating_duration_since(released)
    );
    assert!(outcome.is_ok(), "W1 missed the release: {outcome:?}");
    assert!(
        at.saturating_duration_since(released) < Duration::from_secs(2),
        "W1 was woken {:?} after the release (no live subscription)",
        at.saturating_duration_since(released)
    );
}

/// after an outage, RECONNECT_PAUSE makes the waiter's reconnect fail fast
/// right after the server is back; the first successful attempt then sleeps the holder's
/// whole lease as if subscribed, and a release in between is missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_a_release_soon_after_an_outage() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let proxy = FaultProxy::start(upstream(&url)).await.unwrap();
    let frozen = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?response_timeout=300ms&connect_timeout=300ms",
            proxy.local_addr()
        ))
        .await
        .unwrap(),
    );
    let direct = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let k = key("outage");
    let held = direct
        .acquire(&k)
        .ttl(Duration::from_secs(20))
        .no_watchdog()
        .await
        .unwrap();
    let waiter = {
        let (frozen, k) = (frozen.clone(), k.clone());
        tokio::spawn(async move {
            let r = frozen.acquire(&k).wait(Duration::from_secs(8)).await;
            (r.map(|_| ()), Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.reset();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    proxy.heal();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let released = Instant::now();
    held.release().await.unwrap();
    let (outcome, at) = waiter.await.unwrap();
    eprintln!(
        "waiter: {outcome:?} {:?} after the release",
        at.saturating_duration_since(released)
    );
    assert!(
        outcome.is_ok(),
        "the waiter missed the release: {outcome:?}"
    );
    assert!(at.saturating_duration_since(released) < Duration::from_secs(2));
}

/// one frozen master (a minority Redlock is meant to tolerate) holds every new
/// Redlock waiter inside `join_all(subscribe)` for the subscriber timeout (or up to its
/// deadline): no acquisition round runs meanwhile, so a key released on the healthy
/// majority is not taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_minority_master_does_not_stall_redlock_waiters() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDLOCK_URL") else {
        return;
    };
    let mut proxies = Vec::new();
    for master in url.trim_start_matches("redlock://").split(',') {
        proxies.push(FaultProxy::start(master.parse().unwrap()).await.unwrap());
    }
    let via: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    // Short response timeout (so give_back to the frozen master costs 200 ms), the
    // subscriber's exchanges bounded by max(connect, response) = 6 s.
    let waiter_side = Locker::new(
        lockkit_redis::RedlockBackend::connect(&format!(
            "redlock://{}?response_timeout=200ms&connect_timeout=6s",
            via.join(",")
        ))
        .await
        .unwrap(),
    );
    let direct = Locker::new(lockkit_redis::RedlockBackend::connect(&url).await.unwrap());
    let k = key("redlock-frozen");
    let held = direct
        .acquire(&k)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    proxies[0].cut();
    let waiter = {
        let (w, k) = (waiter_side.clone(), k.clone());
        tokio::spawn(async move {
            let r = w.acquire(&k).wait(Duration::from_secs(20)).await;
            (r.map(|_| ()), Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    held.release().await.unwrap();
    let (outcome, at) = waiter.await.unwrap();
    proxies[0].heal();
    eprintln!(
        "redlock waiter: {outcome:?} {:?} after the release",
        at.saturating_duration_since(released)
    );
    assert!(
        outcome.is_ok(),
        "the key was free on 4 of 5 masters: {outcome:?}"
    );
    assert!(
        at.saturating_duration_since(released) < Duration::from_secs(3),
        "the waiter sat behind the frozen master's subscriber"
    );
}

/// Review finding 6: after a busy round, giving back on a frozen minority master waited for
/// the full response timeout, so every round behind a frozen master cost that long and a
/// waiter ended a response timeout past its deadline. The give-back now waits no longer than
/// a round may (the per-master timeout): its releases are already queued on the master's
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_waiter_keeps_its_deadline_behind_a_frozen_minority_master() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDLOCK_URL") else {
        return;
    };
    let mut proxies = Vec::new();
    for master in url.trim_start_matches("redlock://").split(',') {
        proxies.push(FaultProxy::start(master.parse().unwrap()).await.unwrap());
    }
    let via: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    // A long response timeout (which the give-back used to wait out), a short wait.
    let response_timeout = Duration::from_secs(8);
    let waiter_side = Locker::new(
        lockkit_redis::RedlockBackend::connect(&format!(
            "redlock://{}?response_timeout=8s&connect_timeout=2s",
            via.join(",")
        ))
        .await
        .unwrap(),
    );
    let direct = Locker::new(lockkit_redis::RedlockBackend::connect(&url).await.unwrap());
    let k = key("redlock-frozen-deadline");
    let held = direct
        .acquire(&k)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    proxies[0].cut();
    let wait = Duration::from_millis(700);
    let started = Instant::now();
    let outcome = waiter_side.acquire(&k).wait(wait).await;
    let took = started.elapsed();
    proxies[0].heal();
    held.release().await.unwrap();
    eprintln!("redlock waiter behind a frozen master: {outcome:?} after {took:?}");
    assert!(
        matches!(outcome, Err(Error::Timeout { .. })),
        "the key was held on 4 of 5 masters: {outcome:?}"
    );
    // Wide margin: the old give-back alone took the 8 s response timeout.
    assert!(
        took < wait + response_timeout / 2,
        "the waiter overran its {wait:?} deadline by {:?}",
        took.saturating_sub(wait)
    );
}

/// Second review, finding 3: one slow SUBSCRIBE (another waiter's, on another key) makes
/// the link give the subscriber connection up; aborting its reader skipped the "connection
/// gone" wake-up, so a waiter already subscribed through it was never told and slept out
/// the holder's lease (here: to its deadline, 10 s, although the key was freed at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoning_the_subscriber_tells_the_waiters_already_on_it() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let proxy = ConnProxy::start(upstream(&url)).await;
    let waiting = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?response_timeout=300ms&connect_timeout=300ms",
            proxy.local
        ))
        .await
        .unwrap(),
    );
    wait_for_conns(&proxy, 1).await; // 0: the command connection
    let direct = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let (k1, k2) = (key("abandon-1"), key("abandon-2"));
    let h1 = direct
        .acquire(&k1)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let h2 = direct
        .acquire(&k2)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let w1 = {
        let (l, k) = (waiting.clone(), k1.clone());
        tokio::spawn(async move {
            let r = l.acquire(&k).wait(Duration::from_secs(10)).await;
            (r.map(|_| ()), Instant::now())
        })
    };
    wait_for_conns(&proxy, 2).await; // 1: the subscriber
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall(1, true);
    let w2 = {
        let (l, k) = (waiting.clone(), k2.clone());
        tokio::spawn(async move { l.acquire(&k).wait(Duration::from_secs(10)).await })
    };
    // W2's SUBSCRIBE times out (300 ms): the link gives the connection up.
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.stall(1, false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    h1.release().await.unwrap();
    let (outcome, at) = w1.await.unwrap();
    w2.abort();
    h2.release().await.unwrap();
    let after = at.saturating_duration_since(released);
    eprintln!("W1: {outcome:?}, {after:?} after the release");
    assert!(outcome.is_ok(), "the key was released: {outcome:?}");
    // Wide margin: stranded, W1 slept to its 10 s deadline.
    assert!(
        after < Duration::from_secs(3),
        "W1 heard the release only after {after:?}"
    );
}

/// Second review, finding 7: an acquisition whose reply comes too late fails (a response
/// timeout) although the server ran it and granted the key; nobody releases that grant,
/// and the key stayed held by nobody for its whole lease (60 s here). The locker now gives
/// back whatever the failed attempt took, by its attempt id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_came_too_late_is_given_back() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let proxy = FaultProxy::start(upstream(&url)).await.unwrap();
    let slow = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?response_timeout=300ms&connect_timeout=2s",
            proxy.local_addr()
        ))
        .await
        .unwrap(),
    );
    let direct = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let k = key("late-reply");
    // Every byte now takes 1 s each way: the script runs on the server after ~1 s, the
    // client gave up at 300 ms.
    proxy.set_delay(Duration::from_secs(1));
    let outcome = slow
        .try_acquire(&k)
        .ttl(Duration::from_secs(60))
        .await
        .map(|g| g.map(|_| ()));
    assert!(
        matches!(&outcome, Err(e) if e.is_retryable()),
        "the reply cannot arrive within 300 ms: {outcome:?}"
    );
    // Wide margin: delayed 1 s, the give-back reaches the server ~1.3 s after the start.
    let started = Instant::now();
    loop {
        let holder = direct.inspect(&k).await.unwrap();
        if holder.is_none() && started.elapsed() > Duration::from_millis(1500) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the key is still held by a grant nobody knows of: {holder:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.set_delay(Duration::ZERO);
}

/// Third review, finding 1: dropping an acquiring future after an attempt whose reply was
/// late (its script still queued for the server) left that grant on the server for its
/// whole lease, held by nobody: the give-back by attempt id ran only when the acquisition
/// returned an error. It now runs when the future is dropped before its outcome is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_acquisition_gives_back_a_late_grant() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let proxy = ConnProxy::start(upstream(&url)).await;
    let locker = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?response_timeout=300ms&connect_timeout=300ms",
            proxy.local
        ))
        .await
        .unwrap(),
    );
    wait_for_conns(&proxy, 1).await; // 0: the command connection
    let direct = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let k = key("cancelled-late");
    // Requests on the command connection reach the server only when it is let go.
    proxy.stall(0, true);
    let acquiring = locker
        .acquire(&k)
        .ttl(Duration::from_secs(30))
        .wait(Duration::from_secs(10));
    let outcome = tokio::time::timeout(Duration::from_millis(800), acquiring).await;
    assert!(outcome.is_err(), "the caller gave up (dropped the future)");
    // The attempt in flight times out too; then the queued scripts run: the first grants.
    tokio::time::sleep(Duration::from_millis(600)).await;
    proxy.stall(0, false);
    let started = Instant::now();
    loop {
        let holder = direct.inspect(&k).await.unwrap();
        if holder.is_none() && started.elapsed() > Duration::from_millis(1500) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "a hold nobody knows of: {holder:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Third review, finding 2: with `wait_replicas`, acquisitions queued for the 4 grant
/// connections without a bound: behind a frozen primary, 16 one-shot `try_acquire`s ended
/// in batches at 1, 2, 3 and 4 response timeouts. Waiting for a connection is now bounded
/// by one grant timeout (and ends when the caller goes away): at most two in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_waiting_for_a_connection_keep_a_bound_behind_a_frozen_primary() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_PRIMARY_URL") else {
        return;
    };
    let proxy = ConnProxy::start(upstream(&url)).await;
    // A grant may take response_timeout + wait_replicas_timeout = 1 s.
    let grant_timeout = Duration::from_secs(1);
    let locker = Locker::new(
        RedisBackend::connect(&format!(
            "redis://{}?wait_replicas=1&wait_replicas_timeout=300ms&response_timeout=700ms\
             &connect_timeout=300ms",
            proxy.local
        ))
        .await
        .unwrap(),
    );
    wait_for_conns(&proxy, 5).await; // the command connection and 4 grant connections
    for i in 0..proxy.count() {
        proxy.stall(i, true);
    }
    let started = Instant::now();
    let acquisitions: Vec<_> = (0..16)
        .map(|_| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let outcome = locker.try_acquire(key("frozen-primary")).await;
                (outcome.map(|g| g.is_some()), started.elapsed())
            })
        })
        .collect();
    let mut ended = Vec::new();
    for acquisition in acquisitions {
        let (outcome, at) = acquisition.await.unwrap();
        assert!(outcome.is_err(), "the primary is frozen: {outcome:?}");
        ended.push(at);
    }
    for i in 0..proxy.count() {
        proxy.stall(i, false);
    }
    ended.sort();
    eprintln!("ended between {:?} and {:?}", ended[0], ended[15]);
    // Wide margin: queued without a bound, the last ended after 4 grant timeouts.
    assert!(
        ended[15] < grant_timeout * 3,
        "a one-shot try_acquire took {:?}",
        ended[15]
    );
}
