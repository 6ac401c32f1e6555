//! `wait_replicas=N`: a grant must be confirmed by N replicas (Redis `WAIT`), or it is
//! refused with a clear error and given back.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use uuid::Uuid;

async fn primary() -> Option<(String, redis::aio::MultiplexedConnection)> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_PRIMARY_URL")?;
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // The replica must be attached and in sync before WAIT can count it.
    for _ in 0..100 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut admin)
            .await
            .unwrap();
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            return Some((url, admin));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the replica of {url} never came online");
}

#[tokio::test]
async fn a_grant_confirmed_by_the_replica_is_kept() {
    let Some((url, _)) = primary().await else {
        return;
    };
    let locker = Locker::new(
        RedisBackend::connect(&format!("{url}?wait_replicas=1"))
            .await
            .unwrap(),
    );
    let key = LockKey::new(format!("replicas/{}", Uuid::new_v4().simple())).unwrap();
    let guard = locker.try_acquire(&key).await.unwrap().expect("free key");
    // The replica has the lock too.
    let replica = env::service_url("LOCKKIT_TEST_REDIS_REPLICA_URL").unwrap();
    let mut replica = redis::Client::open(replica.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let on_replica: bool = replica.exists(key.as_str()).await.unwrap();
    assert!(on_replica, "WAIT returned but the replica lacks the lock");
    guard.release().await.unwrap();
}

#[tokio::test]
async fn too_few_replicas_refuse_the_grant_and_give_it_back() {
    let Some((url, mut admin)) = primary().await else {
        return;
    };
    // Only one replica exists: asking for two can never be confirmed.
    let locker = Locker::new(
        RedisBackend::connect(&format!(
            "{url}?wait_replicas=2&wait_replicas_timeout=200ms"
        ))
        .await
        .unwrap(),
    );
    let key = LockKey::new(format!("replicas/{}", Uuid::new_v4().simple())).unwrap();
    let err = locker.try_acquire(&key).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("2 replica(s)") && message.contains("given back"),
        "{message}"
    );
    assert!(err.is_retryable());
    let exists: bool = admin.exists(key.as_str()).await.unwrap();
    assert!(!exists, "a refused grant must not stay on the primary");
}

/// `WAIT` blocks the connection it is sent on: it must not run on the shared command
/// connection, where every renewal, release and inspection of this client would queue
/// behind it (finding 16).
#[tokio::test]
async fn a_grant_waiting_for_replicas_does_not_stall_other_commands() {
    let Some((url, _)) = primary().await else {
        return;
    };
    // Two replicas never confirm (there is one): every WAIT runs its full timeout.
    let locker = Locker::new(
        RedisBackend::connect(&format!("{url}?wait_replicas=2&wait_replicas_timeout=4s"))
            .await
            .unwrap(),
    );
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move {
            let key = LockKey::new(format!("replicas/{}", Uuid::new_v4().simple())).unwrap();
            locker.try_acquire(&key).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let other = LockKey::new(format!("replicas/{}", Uuid::new_v4().simple())).unwrap();
    locker.inspect(&other).await.unwrap();
    assert!(
        !waiting.is_finished(),
        "an inspection had to wait for another acquisition's WAIT to time out"
    );
    assert!(
        waiting.await.unwrap().is_err(),
        "two replicas cannot confirm"
    );
}

/// Review finding 10: every acquisition ran on one grant connection, so each queued on the
/// server behind the others' `WAIT`: the second failed with a response timeout (its script
/// possibly run, a hold nobody knew of) and the third ended after three `WAIT` timeouts.
/// Acquisitions now have grant connections to themselves, and queue in the client (before
/// sending anything) when all are busy.
#[tokio::test]
async fn acquisitions_waiting_for_replicas_do_not_queue_behind_each_other() {
    let Some((url, mut admin)) = primary().await else {
        return;
    };
    let wait_timeout = Duration::from_secs(2);
    // Two replicas never confirm (there is one): every WAIT runs its full timeout.
    let locker = Locker::new(
        RedisBackend::connect(&format!(
            "{url}?wait_replicas=2&wait_replicas_timeout=2s&response_timeout=1s"
        ))
        .await
        .unwrap(),
    );
    let started = std::time::Instant::now();
    let acquisitions: Vec<_> = (0..6)
        .map(|_| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let key = LockKey::new(format!("replicas/{}", Uuid::new_v4().simple())).unwrap();
                let outcome = locker.try_acquire(&key).await;
                (key, outcome.map(|_| ()), started.elapsed())
            })
        })
        .collect();
    let mut ended = Vec::new();
    for acquisition in acquisitions {
        let (key, outcome, at) = acquisition.await.unwrap();
        eprintln!("acquisition ended after {at:?}: {outcome:?}");
        let message = outcome
            .expect_err("two replicas cannot confirm")
            .to_string();
        assert!(
            message.contains("2 replica(s) had to confirm") && message.contains("given back"),
            "every acquisition gets the replicas' answer, not a timeout: {message}"
        );
        let exists: bool = admin.exists(key.as_str()).await.unwrap();
        assert!(!exists, "a refused grant must not stay on the primary");
        ended.push(at);
    }
    ended.sort();
    // Wide margin: queued on one connection, the third ended after three WAIT timeouts.
    assert!(
        ended[2] < wait_timeout * 2,
        "three acquisitions did not wait for their replicas at once: {ended:?}"
    );
}
