//! A server may still count an older, lost hold of an owner (on Redlock, a quorum of
//! masters can keep a record of it until its lease runs out) and answer that owner's next
//! acquisition as a continuation of it, with that hold's older fencing token. A new hold
//! must never carry a token below one its owner already held on the key: the grant is
//! given back and, within the caller's wait, the acquisition tries again; when the wait
//! ends (or there is none) it fails, retryably. And the owner's other hold, whose last
//! guard is being released meanwhile, must still be released cleanly.
//!
//! The backend here is the real in-memory backend behind a wrapper that, once armed,
//! answers acquisitions as that server would (depth 2, the older token); everything else
//! is the memory backend's own.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{
    BackendInfo, FencingToken, HolderInfo, LockBackend, LockKey, Locker, MemoryBackend, Result,
    async_trait,
};

#[derive(Debug, Default)]
struct StaleRecord {
    memory: MemoryBackend,
    /// When set, acquisitions are answered with this token at depth 2.
    stale: Mutex<Option<FencingToken>>,
    /// When set, `stale` is cleared after this many stale answers.
    stale_limit: Mutex<Option<usize>>,
    /// Stale answers given.
    stale_answers: AtomicUsize,
    /// When set, renewals take 1 s (the watchdog then holds its hold's `op`).
    slow_renewals: AtomicBool,
    /// Told when a slow renewal starts.
    renewal_started: tokio::sync::Notify,
}

impl StaleRecord {
    fn answer(&self, grant: Grant) -> Grant {
        let mut stale = self.stale.lock().unwrap();
        match *stale {
            Some(token) => {
                let answered = self.stale_answers.fetch_add(1, Ordering::SeqCst) + 1;
                if self
                    .stale_limit
                    .lock()
                    .unwrap()
                    .is_some_and(|n| answered >= n)
                {
                    *stale = None;
                }
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
            self.renewal_started.notify_one();
            tokio::time::sleep(Duration::from_secs(1)).await;
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

/// A wrapped memory backend, a key, and an owner whose first hold there (token returned)
/// has been released.
async fn one_hold_and_gone(
    name: &str,
) -> (
    std::sync::Arc<StaleRecord>,
    Locker,
    LockKey,
    lockkit_core::Owner,
    FencingToken,
) {
    let backend = std::sync::Arc::new(StaleRecord::default());
    let locker = Locker::from_arc(backend.clone());
    let key = LockKey::new(name).unwrap();
    let owner = locker.owner();
    let first = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let older = first.token();
    first.release().await.unwrap();
    (backend, locker, key, owner, older)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_hold_never_carries_a_token_below_its_owners_last() {
    let (backend, locker, key, owner, older) = one_hold_and_gone("stale-owner-record").await;
    let second = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let newer = second.token();
    assert!(newer > older);
    second.release().await.unwrap();

    *backend.stale.lock().unwrap() = Some(older);
    let third = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_millis(300))
        .await;
    *backend.stale.lock().unwrap() = None;
    match third {
        Ok(guard) => panic!(
            "a new hold got token {} after this owner's {newer}",
            guard.token()
        ),
        Err(e) => assert!(
            e.is_retryable() && !matches!(e, lockkit_core::Error::Timeout { .. }),
            "{e}"
        ),
    }
    assert!(
        backend.stale_answers.load(Ordering::SeqCst) >= 2,
        "the refused grant was not tried again within the wait"
    );
    // What the refused acquisition took on the server was given back.
    free_soon(&locker, &key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_token_racing_the_last_release_leaves_that_release_clean() {
    let (backend, locker, key, owner, older) = one_hold_and_gone("stale-owner-record-race").await;
    let held = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .renew_every(Duration::from_millis(100))
        .await
        .unwrap();
    assert!(held.token() > older);

    // A renewal is under way (it holds the hold's `op` for 1 s) when the last guard
    // is released, and a re-entry comes back meanwhile with the older token.
    backend.slow_renewals.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), backend.renewal_started.notified())
        .await
        .expect("the watchdog never renewed");
    // The release runs as a task of its own: it counts the guard off at once, then waits
    // for the renewal (0.2 s is ample for the first, and well inside the renewal's 1 s).
    let releasing = tokio::spawn(held.release());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !releasing.is_finished(),
        "the release did not wait for the renewal under way"
    );
    *backend.stale.lock().unwrap() = Some(older);
    let reentered = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_millis(300))
        .await;
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

/// A refused acquisition reaches the server as a re-entry of the stale record and may
/// lengthen its lease to its own TTL: the owner must keep refusing the older token for as
/// long as that record may live, however often it retries, not only for the lease of the
/// hold it remembers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_keep_refusing_an_older_token_while_the_stale_record_lives() {
    let (backend, locker, key, owner, older) =
        one_hold_and_gone("stale-owner-record-retries").await;
    // The newer hold asked for a short lease: remembered for 2 x 200 ms once over.
    let second = owner
        .acquire(&key)
        .ttl(Duration::from_millis(200))
        .await
        .unwrap();
    let newer = second.token();
    second.release().await.unwrap();

    *backend.stale.lock().unwrap() = Some(older);
    let until = tokio::time::Instant::now() + Duration::from_millis(1500);
    let mut tries = 0;
    while tokio::time::Instant::now() < until {
        tries += 1;
        if let Ok(guard) = owner
            .acquire(&key)
            .ttl(Duration::from_secs(1))
            .wait(Duration::from_millis(100))
            .await
        {
            panic!(
                "try {tries}: a hold got token {} after this owner's {newer}",
                guard.token()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    *backend.stale.lock().unwrap() = None;
    free_soon(&locker, &key).await;
}

/// Two tasks of one owner racing for a key (on Redlock, each can collect a majority with
/// its own token) can leave one of them a grant below the other's token. Within its wait
/// the refused one tries again and gets a hold whose token is not below the owner's last;
/// a zero wait gets the refusal at once, retryably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_older_token_is_tried_again_within_the_wait() {
    let (backend, locker, key, owner, older) = one_hold_and_gone("stale-owner-record-wait").await;
    let second = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .unwrap();
    let newer = second.token();
    second.release().await.unwrap();

    // A zero wait: refused, not retried.
    *backend.stale_limit.lock().unwrap() = Some(1);
    *backend.stale.lock().unwrap() = Some(older);
    let refused = owner
        .try_acquire(&key)
        .ttl(Duration::from_secs(60))
        .await
        .map(|guard| guard.map(|g| g.token()));
    assert!(
        matches!(&refused, Err(e) if e.is_retryable()),
        "a zero wait was not refused at once: {refused:?}"
    );
    assert_eq!(backend.stale_answers.load(Ordering::SeqCst), 1);
    free_soon(&locker, &key).await;

    // Within a wait: the refused grant is given back and the next try is granted.
    *backend.stale.lock().unwrap() = Some(older);
    let granted = owner
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .wait(Duration::from_secs(20))
        .await
        .expect("a refused older token was not tried again within the wait");
    assert_eq!(backend.stale_answers.load(Ordering::SeqCst), 2);
    assert!(
        granted.token() > newer,
        "a hold got token {} after this owner's {newer}",
        granted.token()
    );
    granted.release().await.unwrap();
    free_soon(&locker, &key).await;
}
