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
        // The backend's own bound, not the default (time is paused: no drift).
        assert!(
            took < wait + BOUND + Duration::from_secs(1),
            "wait {wait:?}: given up only after {took:?}"
        );
    }
    // Both attempts are given back by their attempt ids, in the background.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(releases.load(Ordering::SeqCst), 2);
}

/// A guard's re-entry is bounded like a zero wait: on a server that stops answering it ends
/// with a retryable error after the backend's bound.
#[tokio::test(start_paused = true)]
async fn an_unanswered_reentry_ends_after_the_backends_bound() {
    #[derive(Debug)]
    struct SilentAfterFirst(Silent);
    #[async_trait]
    impl LockBackend for SilentAfterFirst {
        fn info(&self) -> BackendInfo {
            self.0.info()
        }
        fn response_bound(&self) -> Duration {
            BOUND
        }
        async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
            if self.0.releases.load(Ordering::SeqCst) == 0
                && self.0.memory.inspect(&req.key).await?.is_none()
            {
                return self.0.memory.try_acquire(req).await;
            }
            std::future::pending().await
        }
        async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
            self.0.acquire(req, wait).await
        }
        async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
            self.0.renew(grant, ttl).await
        }
        async fn release(&self, grant: &Grant) -> Result<Released> {
            self.0.release(grant).await
        }
        async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
            self.0.inspect(key).await
        }
    }
    let locker = Locker::new(SilentAfterFirst(Silent {
        memory: MemoryBackend::new(),
        releases: Arc::new(AtomicU32::new(0)),
    }));
    let key = LockKey::new("silent-reentry").unwrap();
    let held = locker.try_acquire(&key).await.unwrap().expect("free");
    let started = tokio::time::Instant::now();
    let reentered = tokio::time::timeout(Duration::from_secs(3600), held.reenter())
        .await
        .expect("an unanswered re-entry must end, not wait forever");
    assert!(
        matches!(
            reentered,
            Err(Error::Backend {
                retryable: true,
                ..
            })
        ),
        "{:?}",
        reentered.map(|g| g.token())
    );
    assert!(started.elapsed() >= BOUND);
}
