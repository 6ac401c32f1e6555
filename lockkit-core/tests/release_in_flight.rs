//! A release in flight (its future polled once and then kept without being polled, or
//! dropped) must not leave the hold's other guards believing past their lease: the release
//! holds the hold's operations up, so the watchdog cannot renew them, and it must then say
//! the hold is lost by the local lease end rather than wait behind the release.
//!
//! The backend here is the real in-memory backend behind a wrapper whose release takes
//! 40 ms on the "server"; only its timing is changed.

use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{
    BackendInfo, HolderInfo, LockBackend, LockKey, Locker, MemoryBackend, Result, async_trait,
};

#[derive(Debug)]
struct SlowRelease(MemoryBackend);

#[async_trait]
impl LockBackend for SlowRelease {
    fn info(&self) -> BackendInfo {
        self.0.info()
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.0.try_acquire(req).await
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.0.acquire(req, wait).await
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.0.renew(grant, ttl).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        tokio::time::sleep(Duration::from_millis(40)).await;
        self.0.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.0.inspect(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_but_unpolled_release_never_leaves_a_sibling_believing_past_its_lease() {
    let locker = Locker::new(SlowRelease(MemoryBackend::new()));
    let key = LockKey::new("kept").unwrap();
    let owner = locker.owner();
    let ttl = Duration::from_millis(300);
    let outer = owner.acquire(&key).ttl(ttl).await.unwrap();
    let inner = owner.acquire(&key).ttl(ttl).await.unwrap();
    let mut release = Box::pin(inner.release());
    // One poll (the release is under way), then the caller does something else.
    assert!(
        tokio::time::timeout(Duration::from_millis(5), &mut release)
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let lost_fired = tokio::time::timeout(Duration::ZERO, outer.lost())
        .await
        .is_ok();
    let rival = locker.try_acquire(&key).ttl(ttl).await.unwrap();
    assert!(
        rival.is_none() || lost_fired,
        "another owner holds the key while the outer guard's lost() has not fired"
    );
    let _ = release.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_release_completes_and_the_sibling_stays_held() {
    let locker = Locker::new(SlowRelease(MemoryBackend::new()));
    let key = LockKey::new("dropped").unwrap();
    let owner = locker.owner();
    let ttl = Duration::from_millis(300);
    let outer = owner.acquire(&key).ttl(ttl).await.unwrap();
    let inner = owner.acquire(&key).ttl(ttl).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(5), inner.release())
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        outer.is_valid(),
        "the watchdog kept the outer guard's lease"
    );
    assert!(locker.try_acquire(&key).ttl(ttl).await.unwrap().is_none());
    assert_eq!(outer.release().await.unwrap(), Released::Fully);
}
