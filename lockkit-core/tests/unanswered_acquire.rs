//! A backend whose server never answers an acquisition (a link gone silent: requests are
//! held, no error comes) is given up on at the wait's deadline plus the backend's
//! [`LockBackend::response_bound`]: the caller gets a retryable error instead of waiting
//! forever, and the locker gives back whatever the attempt may still take.
//!
//! The backend here is the real in-memory backend behind a wrapper whose acquisitions never
//! finish; releases reach the in-memory backend and are counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{
    BackendInfo, Error, HolderInfo, LockBackend, LockKey, Locker, MemoryBackend, Result,
    async_trait,
};

#[derive(Debug)]
struct Silent {
    memory: MemoryBackend,
    releases: Arc<AtomicU32>,
}

const BOUND: Duration = Duration::from_secs(3);

#[async_trait]
impl LockBackend for Silent {
    fn info(&self) -> BackendInfo {
        self.memory.info()
    }
    fn response_bound(&self) -> Duration {
        BOUND
    }
    async fn try_acquire(&self, _: &AcquireRequest) -> Result<Option<Grant>> {
        std::future::pending().await
    }
    async fn acquire(&self, _: &AcquireRequest, _: Duration) -> Result<Grant> {
        std::future::pending().await
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.memory.renew(grant, ttl).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.memory.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.memory.inspect(key).await
    }
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_acquisition_ends_after_its_wait_and_the_backends_bound() {
    let releases = Arc::new(AtomicU32::new(0));
    let locker = Locker::new(Silent {
        memory: MemoryBackend::new(),
        releases: releases.clone(),
    });
    let key = LockKey::new("silent").unwrap();
    for wait in [Duration::ZERO, Duration::from_secs(2)] {
        let started = tokio::time::Instant::now();
        let outcome =
            tokio::time::timeout(Duration::from_secs(3600), locker.acquire(&key).wait(wait))
                .await
                .expect("an unanswered acquisition must end, not wait forever");
        let took = started.elapsed();
        match outcome {
            Err(Error::Backend { retryable, .. }) => assert!(retryable, "wait {wait:?}"),
            other => panic!("wait {wait:?}: {:?}", other.map(|g| g.token())),
        }
        assert!(
            took >= wait + BOUND,
            "wait {wait:?}: given up after {took:?}, before the wait and the bound"
        );
    }
    // Both attempts are given back by their attempt ids, in the background.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(releases.load(Ordering::SeqCst), 2);
}
