//! A frozen server (every byte stalls, connections stay open) must not keep waiters past
//! their deadlines: opening or using the shared subscriber connection is bounded, and one
//! stuck subscriber does not block the waiters queued behind it (finding 11).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use lockkit_conformance::{FaultProxy, env};
use lockkit_core::{Error, LockKey, Locker};
use lockkit_redis::{RedisBackend, RedlockBackend};
use uuid::Uuid;

/// Far beyond any deadline below, so only a waiter that is never released trips it.
const NEVER: Duration = Duration::from_secs(20);

fn key() -> LockKey {
    LockKey::new(format!("frozen/{}", Uuid::new_v4().simple())).unwrap()
}

/// Waiters on `frozen` (whose server stalls) behind a live holder all give up by their
/// deadline plus the response timeout, not never.
async fn waiters_give_up(frozen: Locker, key: &LockKey) {
    let wait = Duration::from_millis(800);
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let (frozen, key) = (frozen.clone(), key.clone());
        waiters.push(tokio::spawn(async move {
            let started = Instant::now();
            let outcome = frozen.acquire(&key).wait(wait).await;
            (outcome.map(|_| ()), started.elapsed())
        }));
    }
    for waiter in waiters {
        let (outcome, took) = tokio::time::timeout(NEVER, waiter)
            .await
            .expect("a waiter on a frozen server was never released")
            .unwrap();
        assert!(
            matches!(outcome, Err(Error::Timeout { .. } | Error::Backend { .. })),
            "{outcome:?}"
        );
        eprintln!("waiter gave up after {took:?}");
    }
}

#[tokio::test]
async fn waiters_on_a_frozen_server_keep_their_deadlines() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let upstream: SocketAddr = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let via_proxy = format!(
        "redis://{}?response_timeout=300ms&connect_timeout=300ms",
        proxy.local_addr()
    );
    let frozen = Locker::new(RedisBackend::connect(&via_proxy).await.unwrap());
    let direct = Locker::new(RedisBackend::connect(&url).await.unwrap());
    let key = key();
    let held = direct
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    proxy.cut();
    waiters_give_up(frozen, &key).await;
    proxy.heal();
    held.release().await.unwrap();
}

#[tokio::test]
async fn redlock_waiters_on_frozen_masters_keep_their_deadlines() {
    let Some(url) = env::service_url("LOCKKIT_TEST_REDLOCK_URL") else {
        return;
    };
    let mut proxies = Vec::new();
    for master in url.trim_start_matches("redlock://").split(',') {
        proxies.push(FaultProxy::start(master.parse().unwrap()).await.unwrap());
    }
    let via: Vec<String> = proxies.iter().map(|p| p.local_addr().to_string()).collect();
    let frozen = Locker::new(
        RedlockBackend::connect(&format!(
            "redlock://{}?response_timeout=300ms&connect_timeout=300ms",
            via.join(",")
        ))
        .await
        .unwrap(),
    );
    let direct = Locker::new(RedlockBackend::connect(&url).await.unwrap());
    let key = key();
    let held = direct
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    for proxy in &proxies {
        proxy.cut();
    }
    waiters_give_up(frozen, &key).await;
    for proxy in &proxies {
        proxy.heal();
    }
    held.release().await.unwrap();
}
