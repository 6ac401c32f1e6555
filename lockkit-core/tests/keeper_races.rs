//! The keeper's timing around `extend` and failed renewals, and the SPI with a TTL beyond
//! any lease (helper-35's review of the seventeenth session).

use std::sync::{
    Arc,
    atomic::{AtomicU32, Ordering},
};
use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{
    BackendInfo, Error, HolderInfo, LockBackend, LockKey, Locker, LossSignal, MemoryBackend,
    OwnerId, Result, async_trait,
};

/// The memory backend; a renewal asking for `slow_ttl` takes 200 ms on the "server"
/// (applied at its end), and the next `fail` renewals asking for `fail_ttl` fail retryably.
#[derive(Debug)]
struct Shaped {
    inner: MemoryBackend,
    slow_ttl: Duration,
    fail_ttl: Duration,
    fail: Arc<AtomicU32>,
    renewals: Arc<std::sync::Mutex<Vec<(tokio::time::Instant, Duration)>>>,
}

#[async_trait]
impl LockBackend for Shaped {
    fn info(&self) -> BackendInfo {
        self.inner.info()
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.inner.try_acquire(req).await
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.inner.acquire(req, wait).await
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.renewals
            .lock()
            .unwrap()
            .push((tokio::time::Instant::now(), ttl));
        if ttl == self.slow_ttl {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if ttl == self.fail_ttl
            && self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(Error::backend("memory", true, "injected transient failure"));
        }
        self.inner.renew(grant, ttl).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.inner.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.inner.inspect(key).await
    }
}

type Log = Arc<std::sync::Mutex<Vec<(tokio::time::Instant, Duration)>>>;
fn shaped(slow_ttl: Duration, fail_ttl: Duration, fail: u32) -> (Shaped, Log, Arc<AtomicU32>) {
    let renewals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let fail = Arc::new(AtomicU32::new(fail));
    (
        Shaped {
            inner: MemoryBackend::new(),
            slow_ttl,
            fail_ttl,
            fail: fail.clone(),
            renewals: renewals.clone(),
        },
        renewals,
        fail,
    )
}

/// An `extend` to a longer TTL that is in flight when the watchdog's renewal falls due: the
/// renewal after it renews with the extended TTL, and the guard's deadline stays the
/// extension's. Before, the keeper read the old TTL before it waited for the extension,
/// renewed with it and put the old, shorter deadline back: the server held the key for the
/// extension's 60 s while the guard said lost after about 1.4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_in_flight_when_a_renewal_falls_due_is_kept() {
    let long = Duration::from_secs(60);
    let (backend, renewals, _) = shaped(long, Duration::ZERO, 0);
    let locker = Locker::new(backend);
    let key = LockKey::new("keeper-races-extend-race").unwrap();
    let t0 = tokio::time::Instant::now();
    let guard = locker
        .try_acquire(&key)
        .ttl(Duration::from_secs(1))
        .await
        .unwrap()
        .unwrap();
    // The renewal falls due at ~333 ms; the extension holds `op` from 250 to 450 ms.
    tokio::time::sleep(Duration::from_millis(250)).await;
    guard.extend(long).await.unwrap();
    let after_extend = guard.valid_until().unwrap() - tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let rival = locker
        .try_acquire(&key)
        .ttl(Duration::from_secs(1))
        .await
        .unwrap();
    for (at, ttl) in renewals.lock().unwrap().iter() {
        println!("renew at {:?} ttl {:?}", *at - t0, ttl);
    }
    println!(
        "valid_until right after extend: +{after_extend:?}; after 2.5 s is_valid={} lost={:?}; rival granted: {}",
        guard.is_valid(),
        tokio::time::timeout(Duration::ZERO, guard.lost())
            .await
            .ok(),
        rival.is_some()
    );
    assert!(rival.is_none(), "the server let go (not the finding)");
    assert!(
        guard.is_valid(),
        "the guard reports a hold lost that the server holds for 60 s (extend({long:?}) succeeded)"
    );
}

/// After an `extend` to a short TTL, a renewal that fails once is retried within the new
/// lease. Before, the retry was timed from the options' period (here 1 s, from the 30 s
/// TTL), after the new lease (600 ms) had run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_after_an_extend_is_retried_within_the_new_lease() {
    let short = Duration::from_millis(600);
    let (backend, renewals, fail) = shaped(Duration::ZERO, short, 0);
    let locker = Locker::new(backend);
    let key = LockKey::new("keeper-races-retry").unwrap();
    let t0 = tokio::time::Instant::now();
    let guard = locker
        .try_acquire(&key)
        .ttl(Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    guard.extend(short).await.unwrap();
    // The watchdog's first renewal at the new TTL (due ~200 ms after) fails once.
    fail.store(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2000)).await;
    for (at, ttl) in renewals.lock().unwrap().iter() {
        println!("renew at {:?} ttl {:?}", *at - t0, ttl);
    }
    let lost = tokio::time::timeout(Duration::ZERO, guard.lost())
        .await
        .ok();
    println!("after 2 s: is_valid={} lost={lost:?}", guard.is_valid());
    assert!(
        guard.is_valid(),
        "one transient failure lost a hold whose retry came after its lease"
    );
}

/// Control: the same failure on a hold acquired with the short TTL survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_is_retried_within_the_lease() {
    let short = Duration::from_millis(600);
    let (backend, _, _) = shaped(Duration::ZERO, short, 1);
    let locker = Locker::new(backend);
    let key = LockKey::new("keeper-races-retry-control").unwrap();
    let guard = locker.try_acquire(&key).ttl(short).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert!(guard.is_valid());
}

/// A backend driven through the SPI with `Duration::MAX` (a `renew`, or a request whose
/// public `ttl` field was set after `AcquireRequest::new`) does not panic. Before, the memory
/// backend added it to its clock and panicked.
#[tokio::test]
async fn a_huge_ttl_through_the_spi_never_panics() {
    let backend = MemoryBackend::new();
    let key = LockKey::new("keeper-races-spi").unwrap();
    let req = AcquireRequest::new(
        key.clone(),
        OwnerId::random(),
        Duration::from_secs(5),
        LossSignal::new(),
    );
    let grant = backend.try_acquire(&req).await.unwrap().unwrap();
    let renewed = tokio::spawn(async move {
        let r = backend.renew(&grant, Duration::MAX).await;
        (backend, grant, r)
    })
    .await;
    println!(
        "renew(Duration::MAX) through the SPI: {:?}",
        renewed.as_ref().map(|(_, _, r)| r)
    );
    let mut req2 = AcquireRequest::new(
        key.clone(),
        OwnerId::random(),
        Duration::from_secs(5),
        LossSignal::new(),
    );
    req2.ttl = Duration::MAX;
    let b2 = MemoryBackend::new();
    let acquired =
        tokio::spawn(async move { b2.try_acquire(&req2).await.map(|g| g.is_some()) }).await;
    println!("try_acquire with req.ttl set to Duration::MAX after new(): {acquired:?}");
    assert!(renewed.is_ok(), "renew(Duration::MAX) panicked");
    assert!(acquired.is_ok(), "try_acquire panicked");
}

/// The memory backend, except that a renewal finds the hold's session gone: it fires the
/// hold's signal with `SessionLost` and answers `NotHeld` (as MySQL's for-update mode does).
#[derive(Debug)]
struct SessionGone(MemoryBackend);

#[async_trait]
impl LockBackend for SessionGone {
    fn info(&self) -> BackendInfo {
        self.0.info()
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.0.try_acquire(req).await
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.0.acquire(req, wait).await
    }
    async fn renew(&self, grant: &Grant, _ttl: Duration) -> Result<()> {
        grant.loss.fire(lockkit_core::LostReason::SessionLost);
        Err(Error::NotHeld {
            key: grant.key.clone(),
        })
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.0.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.0.inspect(key).await
    }
}

/// An `extend` that finds the session gone names the reason the backend gave, as `lost()`
/// does. Before, its error said `NotOurs` while `lost()` said `SessionLost`.
#[tokio::test]
async fn an_extend_that_finds_the_session_gone_says_so() {
    let locker = Locker::new(SessionGone(MemoryBackend::new()));
    let guard = locker
        .try_acquire("keeper-races-session")
        .ttl(Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let error = guard.extend(Duration::from_secs(60)).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Lost {
                reason: lockkit_core::LostReason::SessionLost,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(guard.lost().await, lockkit_core::LostReason::SessionLost);
}
