//! A release the server answers with "fully released" while this client still has other
//! guards of the hold (the server counted fewer holds: a depth that lapsed on some Redlock
//! masters, a retried acquisition) must mark those guards lost: nobody keeps the hold any
//! more, and another owner may take the key.
//!
//! The backend here is the real in-memory backend behind a wrapper that answers every
//! release as the server that lost count would; only the answer is changed.

use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{
    BackendInfo, HolderInfo, LockBackend, LockKey, Locker, LostReason, MemoryBackend, Result,
    async_trait,
};

#[derive(Debug)]
struct CountsFewer(MemoryBackend);

#[async_trait]
impl LockBackend for CountsFewer {
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
        // The server gives the key up at the first release: this grant's hold, then every
        // other hold of the owner (the nil attempt releases one whatever acquired it).
        let mut outcome = self.0.release(grant).await?;
        let mut any = grant.clone();
        any.attempt = uuid::Uuid::nil();
        while let Released::Partially { .. } = outcome {
            outcome = self.0.release(&any).await?;
        }
        Ok(outcome)
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.0.inspect(key).await
    }
}

#[tokio::test]
async fn a_full_release_with_other_guards_left_marks_them_lost() {
    let locker = Locker::new(CountsFewer(MemoryBackend::new()));
    let key = LockKey::new("counted-fewer").unwrap();
    let owner = locker.owner();
    let outer = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let inner = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    assert!(inner.is_valid() && outer.is_valid());
    inner.release().await.unwrap();
    // The key is free on the server: another owner gets it ...
    let rival = locker
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("the server let the key go");
    // ... so the outer guard must not still claim it.
    assert!(
        !outer.is_valid(),
        "two guards of different owners both report the key held"
    );
    let reason = tokio::time::timeout(Duration::from_secs(20), outer.lost())
        .await
        .expect("the outer guard's loss signal never fired");
    assert_eq!(reason, LostReason::NotOurs);
    rival.release().await.unwrap();
    assert!(
        outer.release().await.is_err(),
        "a lost guard reports its loss"
    );
}
