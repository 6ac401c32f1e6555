//! A server may still count an older, lost hold of an owner (on Redlock, a quorum of
//! masters can keep a record of it until its lease runs out) and answer that owner's next
//! acquisition as a continuation of it, with that hold's older fencing token. A new hold
//! must never carry a token below one its owner already held on the key: the grant is
//! given back and the acquisition fails, retryably. And the owner's other hold, whose last
//! guard is being released meanwhile, must still be released cleanly.
//!
//! The backend here is the real in-memory backend behind a wrapper that, once armed,
//! answers acquisitions as that server would (depth 2, the older token); everything else
//! is the memory backend's own.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lockkit_core::{
    AcquireRequest, BackendInfo, FencingToken, Grant, HolderInfo, LockBackend, LockKey, Locker,
    MemoryBackend, Released, Result, async_trait,
};

#[derive(Debug, Default)]
struct StaleRecord {
    memory: MemoryBackend,
    /// When set, acquisitions are answered with this token at depth 2.
    stale: Mutex<Option<FencingToken>>,
    /// When set, renewals take 400 ms (the watchdog then holds its hold's `op`).
    slow_renewals: AtomicBool,
}

impl StaleRecord {
    fn answer(&self, grant: Grant) -> Grant {
        match *self.stale.lock().unwrap() {
            Some(token) => {
                let mut grant = grant;
                grant.token = token;
                grant.depth = 2;
                grant
            }
            None => grant,
        }
    }
}

#[async_trait]
impl LockBackend for StaleRecord {
    fn info(&self) -> BackendInfo {
        self.memory.info()
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        Ok(self.memory.try_acquire(req).await?.map(|g| self.answer(g)))
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        Ok(self.answer(self.memory.acquire(req, wait).await?))
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        if self.slow_renewals.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        self.memory.renew(grant, ttl).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.memory.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.memory.inspect(key).await
    }
}

/// Waits (up to 20 s) until another owner can take `key`, then lets it go.
async fn free_soon(locker: &Locker, key: &LockKey) {
    for _ in 0..200 {
        if let Some(rival) = locker.try_acquire(key).await.unwrap() {
            rival.release().await.unwrap();
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("`{key}` stayed held with nobody holding it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_hold_never_carries_a_token_below_its_owners_last() {
    let backend = std::sync::Arc::new(StaleRecord::default());
    let locker = Locker::from_arc(backend.clone());
    let key = LockKey::new("stale-owner-record").unwrap();
    let owner = locker.owner();
    let first = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let older = first.token();
    first.release().await.unwrap();
    let second = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let newer = second.token();
    assert!(newer > older);
    second.release().await.unwrap();

    *backend.stale.lock().unwrap() = Some(older);
    let third = owner.acquire(&key).ttl(Duration::from_secs(60)).await;
    *backend.stale.lock().unwrap() = None;
    match third {
        Ok(guard) => panic!(
            "a new hold got token {} after this owner's {newer}",
            guard.token()
        ),
        Err(e) => assert!(e.is_retryable(), "{e}"),
    }
    // What the refused acquisition took on the server was given back.
    free_soon(&locker, &key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_token_racing_the_last_release_leaves_that_release_clean() {
    let backend = std::sync::Arc::new(StaleRecord::default());
    let locker = Locker::from_arc(backend.clone());
    let key = LockKey::new("stale-owner-record-race").unwrap();
    let owner = locker.owner();
    let first = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let older = first.token();
    first.release().await.unwrap();
    let held = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .renew_every(Duration::from_millis(100))
        .await
        .unwrap();
    assert!(held.token() > older);

    // A renewal is under way (it holds the hold's `op` for 400 ms) when the last guard
    // is released, and a re-entry comes back meanwhile with the older token.
    backend.slow_renewals.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let releasing = tokio::spawn(held.release());
    tokio::time::sleep(Duration::from_millis(30)).await;
    *backend.stale.lock().unwrap() = Some(older);
    let reentered = owner.acquire(&key).ttl(Duration::from_secs(60)).await;
    *backend.stale.lock().unwrap() = None;
    backend.slow_renewals.store(false, Ordering::SeqCst);
    if let Ok(guard) = &reentered {
        assert!(
            guard.token() > older,
            "a hold got token {} below its owner's {}",
            guard.token(),
            older
        );
    }
    releasing
        .await
        .unwrap()
        .expect("the last guard's release, racing a refused re-entry, must succeed");
    if let Ok(guard) = reentered {
        guard.release().await.unwrap();
    }
    // Nothing of this owner is left on the server to hold the key for its lease.
    free_soon(&locker, &key).await;
}
