//! A server may still count an older, lost hold of an owner (on Redlock, a quorum of
//! masters can keep a record of it until its lease runs out) and answer that owner's next
//! acquisition as a continuation of it, with that hold's older fencing token. A new hold
//! must never carry a token below one its owner already held on the key: the grant is
//! given back and the acquisition fails, retryably, without asking again (which would
//! lengthen the stale record's lease). Only when another task of the owner holds the key
//! by then (two tasks raced for it) does it try again within its wait, as a re-entry of
//! that hold. And the owner's other hold, whose last guard is being released meanwhile,
//! must still be released cleanly.
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
    /// When set, the next acquisition waits here (after `at_gate` is told) before it
    /// reaches the memory backend.
    gate: Mutex<Option<std::sync::Arc<tokio::sync::Notify>>>,
    at_gate: tokio::sync::Notify,
    /// When set, renewals take 1 s (the watchdog then holds its hold's `op`).
    slow_renewals: AtomicBool,
    /// Told when a slow renewal starts.
    renewal_started: tokio::sync::Notify,
}

impl StaleRecord {
    /// Waits at the gate, if one is set (once).
    async fn pass_gate(&self) {
        let gate = self.gate.lock().unwrap().take();
        if let Some(gate) = gate {
            self.at_gate.notify_one();
            gate.notified().await;
        }
    }

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
        self.pass_gate().await;
        Ok(self.memory.try_acquire(req).await?.map(|g| self.answer(g)))
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.pass_gate().await;
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
    assert_eq!(
        backend.stale_answers.load(Ordering::SeqCst),
        1,
        "with no other hold of the owner, a refused grant must not be asked for again"
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
/// its own token): the first takes it, and the second's grant comes back with an older
/// token. Within its wait the second tries again, as a re-entry of the first's hold; a
/// zero wait gets the refusal at once, retryably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_grant_beside_the_owners_other_hold_is_tried_again() {
    let (backend, locker, key, owner, older) = one_hold_and_gone("stale-owner-record-race2").await;

    for wait in [Duration::ZERO, Duration::from_secs(20)] {
        backend.stale_answers.store(0, Ordering::SeqCst);
        // The second task's request is held at the backend's door while the first task
        // takes the key; then it is answered with the older token.
        let open = std::sync::Arc::new(tokio::sync::Notify::new());
        *backend.gate.lock().unwrap() = Some(open.clone());
        let second = tokio::spawn({
            let (owner, key) = (owner.clone(), key.clone());
            // A zero wait goes through the backend's `try_acquire`.
            async move {
                owner
                    .acquire(&key)
                    .ttl(Duration::from_secs(60))
                    .wait(wait)
                    .await
            }
        });
        tokio::time::timeout(Duration::from_secs(10), backend.at_gate.notified())
            .await
            .expect("the second task never reached the backend");
        let first = owner
            .try_acquire(&key)
            .ttl(Duration::from_secs(60))
            .await
            .unwrap()
            .expect("the first task's acquisition");
        assert!(first.token() > older);
        *backend.stale_limit.lock().unwrap() = Some(1);
        *backend.stale.lock().unwrap() = Some(older);
        open.notify_one();
        let second = second.await.unwrap();
        assert_eq!(backend.stale_answers.load(Ordering::SeqCst), 1);
        if wait.is_zero() {
            let error = second.expect_err("a zero wait got a grant below its owner's token");
            assert!(
                error.is_retryable() && !matches!(error, lockkit_core::Error::Timeout { .. }),
                "{error}"
            );
        } else {
            let guard = second.expect("a refused grant beside the owner's hold was not retried");
            assert_eq!(
                guard.token(),
                first.token(),
                "the retry re-enters the first task's hold"
            );
            guard.release().await.unwrap();
        }
        first.release().await.unwrap();
        free_soon(&locker, &key).await;
    }
}
