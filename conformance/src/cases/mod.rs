//! The cases, one module per behaviour. Each is a plain `pub async fn` taking the harness;
//! it panics on a violated expectation and returns [`crate::Outcome::Skipped`] when the
//! harness lacks what it needs.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{BackendInfo, HolderInfo, LockBackend, LockKey, Locker, Result, async_trait};

use crate::Harness;

pub mod bad_input;
pub mod crash;
pub mod exclusion;
pub mod fencing;
pub mod lease;
pub mod lost;
pub mod ownership;
pub mod randomized;
pub mod reentrancy;
pub mod rw;
pub mod semaphore;
pub mod waiting;

/// Runs a fault hook; returns `Skipped` from the case when the harness lacks it.
macro_rules! hook {
    ($call:expr) => {
        match $call {
            Ok(value) => value,
            Err($crate::HookError::Unsupported(why)) => return $crate::Outcome::Skipped(why),
            Err($crate::HookError::Failed(why)) => panic!("fault hook failed: {why}"),
        }
    };
}
pub(crate) use hook;

/// Waits until nothing is left on the server under `prefix` ([`Harness::residue`]), for at
/// most `within`; panics with `what` if something is still there then. A waiter cut short
/// while its last attempt was already at the server may still be granted a key released
/// just after, and gives that grant back in the background: clean-up may land a little
/// after the case's last call, but long before any lease or marker runs out by itself, so
/// `within` must stay below those. `Err(why)` when the harness cannot count.
pub(crate) async fn residue_clears<H: Harness>(
    h: &H,
    prefix: &str,
    within: Duration,
    what: &str,
) -> std::result::Result<(), String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = match h.residue(prefix).await {
            Ok(left) => left,
            Err(crate::HookError::Unsupported(why)) => return Err(why),
            Err(crate::HookError::Failed(why)) => panic!("residue hook failed: {why}"),
        };
        if left == 0 {
            return Ok(());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{left} server-side item(s) under {prefix} still there {within:?} after {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A lease long enough that it never runs out during a case.
pub(crate) const LONG_TTL: Duration = Duration::from_secs(60);

/// A wait long enough that only a broken backend reaches it.
pub(crate) fn generous_wait<H: Harness>(h: &H) -> Duration {
    h.short_ttl() * 10 + h.expiry_slack() + Duration::from_secs(5)
}

/// Wraps a client's backend and counts renewals (to see when the watchdog stops) and
/// waiting acquisitions (`acquire` calls) in flight: how many there are now, and the most
/// there were at once.
#[derive(Debug)]
pub(crate) struct CountingBackend {
    inner: Arc<dyn LockBackend>,
    pub(crate) renewals: AtomicU64,
    waiting_now: AtomicU64,
    waiting_most: AtomicU64,
    waiting_started: AtomicU64,
}

impl CountingBackend {
    /// A locker over `client`'s backend that counts.
    pub(crate) fn wrap(client: &Locker) -> (Locker, Arc<CountingBackend>) {
        let counting = Arc::new(CountingBackend {
            inner: client.backend().clone(),
            renewals: AtomicU64::new(0),
            waiting_now: AtomicU64::new(0),
            waiting_most: AtomicU64::new(0),
            waiting_started: AtomicU64::new(0),
        });
        (Locker::from_arc(counting.clone()), counting)
    }

    pub(crate) fn renewals(&self) -> u64 {
        self.renewals.load(Ordering::SeqCst)
    }

    /// The most waiting acquisitions in flight at once so far.
    pub(crate) fn most_waiting(&self) -> u64 {
        self.waiting_most.load(Ordering::SeqCst)
    }

    /// How many waiting acquisitions have started.
    pub(crate) fn waiting_started(&self) -> u64 {
        self.waiting_started.load(Ordering::SeqCst)
    }
}

/// Counts one acquisition in flight until dropped (also when its future is).
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl LockBackend for CountingBackend {
    fn info(&self) -> BackendInfo {
        self.inner.info()
    }
    fn response_bound(&self) -> Duration {
        self.inner.response_bound()
    }
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.inner.try_acquire(req).await
    }
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        self.inner.holders(key).await
    }
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.waiting_started.fetch_add(1, Ordering::SeqCst);
        let now = self.waiting_now.fetch_add(1, Ordering::SeqCst) + 1;
        self.waiting_most.fetch_max(now, Ordering::SeqCst);
        let _counted = InFlight(&self.waiting_now);
        self.inner.acquire(req, wait).await
    }
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        self.inner.renew(grant, ttl).await
    }
    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.inner.release(grant).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.inner.inspect(key).await
    }
}

/// Fails unless `client` currently cannot take `key`.
pub(crate) async fn assert_busy(client: &Locker, key: &LockKey, why: &str) {
    let outcome = client.try_acquire(key).await;
    match outcome {
        Ok(None) => {}
        Ok(Some(g)) => panic!("{why}: `{key}` was free (granted token {})", g.token()),
        Err(e) => panic!("{why}: try_acquire on `{key}` failed: {e}"),
    }
}

/// Fails unless `client` can take `key` at once; gives it back.
pub(crate) async fn assert_free(client: &Locker, key: &LockKey, why: &str) {
    match client.try_acquire(key).await {
        Ok(Some(g)) => {
            if let Err(e) = g.release().await {
                panic!("{why}: releasing the probe hold on `{key}` failed: {e}");
            }
        }
        Ok(None) => panic!("{why}: `{key}` is still held"),
        Err(e) => panic!("{why}: try_acquire on `{key}` failed: {e}"),
    }
}
