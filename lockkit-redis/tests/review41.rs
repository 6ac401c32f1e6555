//! Review 41 (helper-41): the single-server Redis backend's waiter queue, tokens and
//! scripts under crashes, pauses and lost replies.

use std::time::{Duration, Instant};

use lockkit_conformance::env;
use lockkit_core::spi::AcquireRequest;
use lockkit_core::{LockBackend, LockGuard, LockKey, Locker, LossSignal, OwnerId};
use lockkit_redis::RedisBackend;
use uuid::Uuid;

fn server() -> Option<String> {
    env::service_url("LOCKKIT_TEST_REDIS_URL")
}

fn key() -> String {
    format!("review41/{}", Uuid::new_v4().simple())
}

async fn backend(url: &str) -> RedisBackend {
    RedisBackend::connect(url).await.unwrap()
}

/// A waiter queued behind a holder with a long lease. The release names the waiter queued
/// before it, whose grant (a short lease) is published as taken; that holder then dies
/// (no release, no renewal). The key is free a second later: the waiter must be granted
/// then, not when the first holder's lease (learned before the handoff) would have ended.
#[tokio::test]
async fn a_waiter_that_heard_the_key_taken_does_not_sleep_out_the_previous_lease() {
    let Some(url) = server() else { return };
    let key = key();
    let holding = Locker::new(backend(&url).await);
    let dying = backend(&url).await;
    let waiting = Locker::new(backend(&url).await);
    let holder = holding
        .acquire(key.as_str())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    // The holder that dies: a plain backend acquisition, never renewed nor released.
    let request = AcquireRequest::new(
        LockKey::new(key.as_str()).unwrap(),
        OwnerId::new(Uuid::new_v4(), 1),
        Duration::from_secs(1),
        LossSignal::new(),
    );
    let dying_wait = tokio::spawn({
        let dying = dying.clone();
        async move { dying.acquire(&request, Duration::from_secs(20)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiter = tokio::spawn({
        let (waiting, key) = (waiting.clone(), key.clone());
        async move {
            let guard: LockGuard = waiting
                .acquire(key.as_str())
                .ttl(Duration::from_secs(30))
                .wait(Duration::from_secs(60))
                .await
                .unwrap();
            (guard, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await.unwrap();
    let grant = tokio::time::timeout(Duration::from_secs(5), dying_wait)
        .await
        .expect("the waiter queued first is named and granted")
        .unwrap()
        .unwrap();
    let granted_to_dying = Instant::now();
    // Its holder dies here: the 1 s lease runs out, nobody publishes anything.
    drop(grant);
    let (guard, granted) = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter slept past the free key, until the first holder's 30 s lease")
        .unwrap();
    let after = granted - granted_to_dying;
    assert!(
        after < Duration::from_secs(6),
        "granted {after:?} after the dead holder's grant (its lease was 1 s)"
    );
    guard.release().await.unwrap();
}

/// A zero timeout is refused with a typed error, as the etcd, PostgreSQL and ZooKeeper URLs
/// refuse theirs: with `response_timeout=0s` every script was sent, ran (and granted) on the
/// server, and its answer was given up on before it could arrive.
#[tokio::test]
async fn zero_timeouts_are_refused_before_any_request() {
    for option in [
        "response_timeout=0s",
        "connect_timeout=0s",
        "response_timeout=0ms",
        "wait_replicas=1&wait_replicas_timeout=0s",
    ] {
        let url = format!("redis://127.0.0.1:16379?{option}");
        let parsed = lockkit_redis::RedisConfig::parse(&url);
        assert!(
            matches!(parsed, Err(lockkit_core::Error::Config(_))),
            "{option}: {parsed:?}"
        );
    }
}

/// Timeouts too long to add up are a typed error, not a panic in the caller (the grant
/// connections' bound is the response timeout plus `WAIT`'s).
#[tokio::test]
async fn absurd_timeouts_are_a_typed_error_not_a_panic() {
    let Some(url) = server() else { return };
    let huge = "10000000000000000000s";
    let url = format!("{url}?response_timeout={huge}&wait_replicas_timeout={huge}");
    let outcome = tokio::spawn(async move { RedisBackend::connect(&url).await.map(|_| ()) }).await;
    match outcome {
        Ok(Err(lockkit_core::Error::Config(_))) => {}
        other => panic!("expected a Config error, got {other:?}"),
    }
    // The same through a config built in code.
    let mut config = lockkit_redis::RedisConfig::parse(&server().unwrap()).unwrap();
    config.response_timeout = Duration::MAX;
    let outcome =
        tokio::spawn(async move { RedisBackend::from_config(config).await.map(|_| ()) }).await;
    match outcome {
        Ok(Err(lockkit_core::Error::Config(_))) => {}
        other => panic!("expected a Config error, got {other:?}"),
    }
}

/// The fencing counter is a plain string nothing reads between grants: an `allkeys-*`
/// eviction policy may drop it, or an operator deleting stray keys. A re-entry of a live
/// hold must still report the hold's own token; before, it reported the counter (0, gone),
/// and the core took that for a hold gone on the server: the re-entry failed with `Lost`
/// and the outer guard, still held on the server, fired lost.
#[tokio::test]
async fn a_re_entry_keeps_its_holds_token_when_the_counter_is_gone() {
    let Some(url) = server() else { return };
    let key = key();
    let locker = Locker::new(backend(&url).await);
    let owner = locker.owner();
    let outer = owner
        .acquire(key.as_str())
        .ttl(Duration::from_secs(30))
        .await
        .unwrap();
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(format!("redisson_lock_token:{{{key}}}"))
        .query_async(&mut admin)
        .await
        .unwrap();
    let shown = locker.inspect(key.as_str()).await.unwrap().unwrap();
    assert_eq!(
        shown.token,
        Some(outer.token()),
        "inspect shows the hold's token"
    );
    let inner = owner
        .acquire(key.as_str())
        .ttl(Duration::from_secs(30))
        .await
        .expect("a re-entry of a live hold");
    assert_eq!(inner.depth(), 2);
    assert_eq!(inner.token(), outer.token());
    assert!(
        outer.is_valid(),
        "the outer guard's hold is still on the server"
    );
    let counter: Option<u64> = redis::cmd("GET")
        .arg(format!("redisson_lock_token:{{{key}}}"))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        counter,
        Some(outer.token().get()),
        "the counter is put back to the hold's token"
    );

    inner.release().await.unwrap();
    outer.release().await.unwrap();
}
