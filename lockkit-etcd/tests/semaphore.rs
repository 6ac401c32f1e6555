//! Semaphores on etcd beyond the conformance suite: a retried attempt takes one permit,
//! a cancelled waiter leaves no key, and `holders()` describes every permit.

use std::{num::NonZeroU32, time::Duration};

use etcd_client::GetOptions;
use lockkit_conformance::env;
use lockkit_core::{
    LockBackend, LockKey, LockKind, Locker, LossSignal, OwnerId,
    spi::{AcquireRequest, Released},
};
use lockkit_etcd::EtcdBackend;

const TTL: Duration = Duration::from_secs(30);

async fn setup(name: &str) -> Option<(EtcdBackend, LockKey)> {
    let url = env::service_url("LOCKKIT_TEST_ETCD_URL")?;
    let backend = EtcdBackend::connect(&format!("{url}?session_ttl=2s"))
        .await
        .unwrap();
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((
        backend,
        LockKey::new(format!("sem-{name}-{unique}")).unwrap(),
    ))
}

async fn keys_in(backend: &EtcdBackend, key: &LockKey) -> i64 {
    backend
        .client()
        .get(
            backend.lock_range(key),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap()
        .count()
}

/// A request for a permit, by `owner`, with an attempt of its own.
fn permit(key: &LockKey, owner: OwnerId, limit: u32) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner, TTL, LossSignal::new()).with_kind(LockKind::Permit {
        limit: NonZeroU32::new(limit).unwrap(),
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retried_permit_attempt_takes_one_permit_and_two_attempts_two() {
    let Some((backend, key)) = setup("retried").await else {
        return;
    };
    let owner = Locker::new(backend.clone()).owner().id();
    let req = permit(&key, owner, 2);
    let first = backend.try_acquire(&req).await.unwrap().unwrap();
    let again = backend.try_acquire(&req).await.unwrap().unwrap();
    assert_eq!((first.depth, again.depth), (1, 1));
    assert_eq!(
        first.token, again.token,
        "a retried attempt is the same permit"
    );
    assert_eq!(keys_in(&backend, &key).await, 1);
    // The same owner, another attempt: another permit.
    let other = permit(&key, owner, 2);
    let second = backend.try_acquire(&other).await.unwrap().unwrap();
    assert!(second.token > first.token);
    assert_eq!(keys_in(&backend, &key).await, 2);
    let third = permit(&key, owner, 2);
    assert!(backend.try_acquire(&third).await.unwrap().is_none());
    assert_eq!(
        keys_in(&backend, &key).await,
        2,
        "a refused permit left its key"
    );
    assert_eq!(backend.release(&first).await.unwrap(), Released::Fully);
    assert!(backend.release(&again).await.is_err(), "released twice");
    assert_eq!(backend.release(&second).await.unwrap(), Released::Fully);
    assert_eq!(keys_in(&backend, &key).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_permit_waiter_leaves_no_key_and_holders_describe_permits() {
    let Some((backend, key)) = setup("cancelled").await else {
        return;
    };
    let locker = Locker::new(backend.clone());
    let semaphore = locker.semaphore(&key, 1);
    let held = semaphore.try_acquire().ttl(TTL).await.unwrap().unwrap();
    for round in 0..10u64 {
        let waiting = semaphore.acquire().ttl(TTL).wait(Duration::from_secs(20));
        let cut = Duration::from_millis(round * 15);
        assert!(tokio::time::timeout(cut, waiting).await.is_err());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while keys_in(&backend, &key).await > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "cancelled waiters left their keys"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let holders = semaphore.holders().await.unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    let info = &holders[0];
    assert_eq!(
        info.kind,
        Some(LockKind::Permit {
            limit: NonZeroU32::new(1).unwrap()
        })
    );
    assert_eq!(info.token, Some(held.token()));
    assert!(
        info.ttl_left
            .is_some_and(|left| left <= Duration::from_secs(2))
    );
    assert_eq!(
        info.identity.as_ref().map(|i| i.pid),
        Some(std::process::id())
    );
    held.release().await.unwrap();
    assert_eq!(keys_in(&backend, &key).await, 0);
}
