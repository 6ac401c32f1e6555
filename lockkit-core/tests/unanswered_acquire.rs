//! A backend whose server never answers an acquisition (a link gone silent: requests are
//! held, no error comes) is given up on at the wait's deadline plus the backend's
//! [`LockBackend::response_bound`]: the caller gets a retryable error instead of waiting
//! forever, and the locker gives back whatever the attempt may still take. A guard's
//! re-entry, release and extension are bounded by the backend's bound alone.
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

/// The in-memory backend behind a link that can be cut: while cut, every request waits
/// until the link is back (as on a link gone silent), then goes through.
#[derive(Debug)]
struct SilentAfterGrant {
    memory: MemoryBackend,
    /// `true` while the link is cut: requests wait until it is back.
    cut: tokio::sync::watch::Sender<bool>,
    renewals: Arc<AtomicU32>,
}
impl SilentAfterGrant {
    async fn answer<T>(&self, answer: impl std::future::Future<Output = T>) -> T {
        let mut link = self.cut.subscribe();
        let _ = link.wait_for(|cut| !*cut).await;
        answer.await
    }
}
#[async_trait]
impl LockBackend for SilentAfterGrant {
    fn info(&self) -> BackendInfo {
        self.memory.info()
    }
    fn response_bound(&self) -> Duration {
        BOUND
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.answer(self.memory.try_acquire(req)).await
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.answer(self.memory.acquire(req, wait)).await
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        self.answer(self.memory.renew(grant, ttl)).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        // Behind any request sent before it, once the link is back: requests on one
        // connection reach the server in order.
        self.answer(async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.memory.release(grant).await
        })
        .await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.answer(self.memory.inspect(key)).await
    }
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        self.answer(self.memory.holders(key)).await
    }
}
/// A guard's release and extension are bounded too, and so are the locker's questions
/// about a key: on a server that stops answering after the grant, each ends with an error
/// after the backend's bound (retryable but for the release, whose guard is gone), and the
/// hold's watchdog stops with the release. The release is not dropped but goes on: once the
/// link is back it reaches the server, which lets the key go long before the lease.
#[tokio::test(start_paused = true)]
async fn an_unanswered_release_or_extension_ends_after_the_backends_bound() {
    let cut = tokio::sync::watch::Sender::new(false);
    let renewals = Arc::new(AtomicU32::new(0));
    let locker = Locker::new(SilentAfterGrant {
        memory: MemoryBackend::new(),
        cut: cut.clone(),
        renewals: renewals.clone(),
    });
    let ttl = Duration::from_secs(600);
    let (released, extended) = (
        LockKey::new("silent-release").unwrap(),
        LockKey::new("silent-extension").unwrap(),
    );
    let first = locker.try_acquire(&released).ttl(ttl).await.unwrap();
    let second = locker.try_acquire(&extended).ttl(ttl).await.unwrap();
    let (first, second) = (first.expect("free"), second.expect("free"));
    cut.send_replace(true);
    let started = tokio::time::Instant::now();
    let (release, extension, inspected, holders) =
        tokio::time::timeout(Duration::from_secs(3600), async {
            tokio::join!(
                first.release(),
                second.extend(ttl),
                locker.inspect(&extended),
                locker.holders(&extended)
            )
        })
        .await
        .expect("an unanswered release, extension or question must end, not wait forever");
    let took = started.elapsed();
    let retryable = |outcome: std::result::Result<(), Error>| match outcome {
        Err(Error::Backend { retryable, .. }) => Some(retryable),
        _ => None,
    };
    assert_eq!(retryable(release.map(drop)), Some(false), "release");
    assert_eq!(retryable(extension), Some(true), "extension");
    assert_eq!(retryable(inspected.map(drop)), Some(true), "inspect");
    assert_eq!(retryable(holders.map(drop)), Some(true), "holders");
    assert!(
        took >= BOUND && took < BOUND + Duration::from_secs(1),
        "{took:?}"
    );
    // The released hold's watchdog is gone: over a renewal period (ttl / 3) only the
    // extended hold's keeper renews (once, unanswered until the link is back).
    let before = renewals.load(Ordering::SeqCst);
    tokio::time::sleep(ttl / 3 + Duration::from_secs(1)).await;
    assert!(
        renewals.load(Ordering::SeqCst) <= before + 1,
        "the released hold is still renewed"
    );
    // The link is back: the release that went on in the background lets the key go, long
    // before its lease (which runs for another 6 minutes).
    cut.send_replace(false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        locker.inspect(&released).await.unwrap().is_none(),
        "the release given up on by its caller never reached the server"
    );
    assert!(locker.inspect(&extended).await.unwrap().is_some());
    drop(second);
}

/// A release given up on at the bound must not leave an acquisition of the same owner,
/// which joins the hold when the link is back, without its watchdog: the joined guard's
/// hold is renewed for as long as it is held.
#[tokio::test(start_paused = true)]
async fn an_owner_joining_a_hold_whose_release_was_given_up_on_keeps_it_renewed() {
    let cut = tokio::sync::watch::Sender::new(false);
    let locker = Locker::new(SilentAfterGrant {
        memory: MemoryBackend::new(),
        cut: cut.clone(),
        renewals: Arc::new(AtomicU32::new(0)),
    });
    let owner = locker.owner();
    let key = LockKey::new("silent-join").unwrap();
    let ttl = Duration::from_secs(30);
    let first = owner.acquire(&key).ttl(ttl).await.unwrap();
    let token = first.token();
    cut.send_replace(true);
    let joining = tokio::spawn({
        let (owner, key) = (owner.clone(), key.clone());
        async move {
            owner
                .acquire(&key)
                .ttl(ttl)
                .wait(Duration::from_secs(600))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let released = first.release().await;
    assert!(
        matches!(
            released,
            Err(Error::Backend {
                retryable: false,
                ..
            })
        ),
        "{released:?}"
    );
    cut.send_replace(false);
    let second = joining.await.unwrap().expect("the owner's acquisition");
    assert_eq!(
        second.token(),
        token,
        "the re-entry reached the server first: it joined the hold"
    );
    // Five leases on: held and renewed all along.
    for _ in 0..15 {
        tokio::time::sleep(ttl / 3).await;
        assert!(second.is_valid(), "the joined hold ran out: no watchdog");
        assert!(
            locker.inspect(&key).await.unwrap().is_some(),
            "the key ran out on the server under a guard that believes in it"
        );
    }
    second.release().await.unwrap();
    assert!(locker.inspect(&key).await.unwrap().is_none());
}

/// A backend whose acquisitions are never answered and whose releases always fail
/// retryably (an outage); it notes when it is dropped.
#[derive(Debug)]
struct Outage {
    memory: MemoryBackend,
    releases: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
    dropped: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

impl Drop for Outage {
    fn drop(&mut self) {
        if let Ok(mut dropped) = self.dropped.lock() {
            *dropped = Some(tokio::time::Instant::now());
        }
    }
}

#[async_trait]
impl LockBackend for Outage {
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
    async fn release(&self, _: &Grant) -> Result<Released> {
        self.releases
            .lock()
            .expect("not poisoned")
            .push(tokio::time::Instant::now());
        Err(Error::backend("outage", true, "connection refused"))
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.memory.inspect(key).await
    }
}

/// The give-back of an unanswered acquisition, failing throughout an outage, ends with
/// its last try: it does not sleep a backoff step after it for nothing (holding the
/// backend, and saying "again").
#[tokio::test(start_paused = true)]
async fn a_give_back_that_keeps_failing_ends_at_its_last_try() {
    let releases = Arc::new(std::sync::Mutex::new(Vec::new()));
    let dropped = Arc::new(std::sync::Mutex::new(None));
    let locker = Locker::new(Outage {
        memory: MemoryBackend::new(),
        releases: releases.clone(),
        dropped: dropped.clone(),
    });
    let key = LockKey::new("outage").unwrap();
    let outcome = locker
        .acquire(&key)
        .ttl(Duration::from_secs(60))
        .wait(Duration::ZERO)
        .await;
    assert!(outcome.is_err(), "an unanswered acquisition fails");
    drop(locker);
    let mut ended = None;
    for _ in 0..600 {
        ended = *dropped.lock().expect("not poisoned");
        if ended.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ended = ended.expect("the give-back ended within a minute");
    let tries = releases.lock().expect("not poisoned").clone();
    assert_eq!(tries.len(), 8, "tries: {tries:?}");
    let last = *tries.last().expect("tried");
    let after = ended.saturating_duration_since(last);
    assert!(
        after < Duration::from_millis(150),
        "the give-back ended {after:?} after its last try"
    );
}
