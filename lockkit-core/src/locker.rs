//! The user API: `Locker`, `Owner` and the acquire builders.

use std::{
    collections::HashMap,
    fmt,
    future::{Future, IntoFuture},
    num::NonZeroU32,
    pin::Pin,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use uuid::Uuid;

use crate::{
    AcquireRequest, BackendInfo, Error, HolderInfo, IntoLockKey, LockBackend, LockGuard, LockKey,
    LockKind, LockOptions, OwnerId, Result,
    guard::{Hold, LockGuard as Guard},
    lost::LossSignal,
    wait::{Backoff, WAIT_FOREVER, deadline_after},
};

/// An owner's holds, by key and kind: its read and write holds of a key are separate.
type Holds = Arc<Mutex<HashMap<(LockKey, LockKind), OwnedHold>>>;

/// What an owner remembers of its latest hold on a key: the hold while it lives, and its
/// fencing token for as long as a record of it may linger on a server after it ended
/// (twice the longest lease it asked for). A grant below that token is not a new holder's
/// token: the server counted a stale record of this owner (on Redlock, a quorum can still
/// count an older, lost hold), and taking it would send a storage layer a token older than
/// one it may already have seen from this owner.
struct OwnedHold {
    hold: Weak<Hold>,
    token: crate::FencingToken,
    longest_lease: Arc<std::sync::atomic::AtomicU64>,
    /// Whether the server answered the hold's release "fully released" (its record is
    /// gone there).
    let_go: Arc<std::sync::atomic::AtomicBool>,
    /// When the hold was first seen over, and so when it may be forgotten.
    forget_at: Option<tokio::time::Instant>,
}

impl OwnedHold {
    /// Whether it is still worth remembering at `now`.
    fn remember(&mut self, now: tokio::time::Instant) -> bool {
        if self.hold.strong_count() > 0 {
            return true;
        }
        let forget_at = *self.forget_at.get_or_insert_with(|| {
            let lease = self.longest_lease.load(std::sync::atomic::Ordering::SeqCst);
            now.checked_add(Duration::from_millis(lease.saturating_mul(2)))
                .unwrap_or(now + WAIT_FOREVER)
        });
        now < forget_at
    }
}

/// The entry point: takes locks from one backend. Cheap to clone; clones share the
/// backend and the client identity.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
/// use std::time::Duration;
/// use lockkit_core::{Locker, MemoryBackend};
///
/// let locker = Locker::new(MemoryBackend::new());
/// let guard = locker.acquire("orders/42").ttl(Duration::from_secs(10)).await?;
/// let token = guard.token(); // send it with every write made under the lock
/// assert!(locker.try_acquire("orders/42").await?.is_none());
/// guard.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    backend: Arc<dyn LockBackend>,
    info: BackendInfo,
    client: Uuid,
    next_owner: Arc<AtomicU64>,
    defaults: LockOptions,
    /// One waiting acquisition per key at a time, where a release wakes every waiter;
    /// `None` when turned off (tests only).
    gates: Option<Arc<crate::gate::WaiterGates>>,
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.backend)
            .field("client", &self.client)
            .field("defaults", &self.defaults)
            .finish()
    }
}

impl Locker {
    /// A locker over `backend` with default options (30 s lease, watchdog on, wait until
    /// granted).
    pub fn new(backend: impl LockBackend) -> Self {
        Self::from_arc(Arc::new(backend))
    }

    /// A locker over a shared backend.
    pub fn from_arc(backend: Arc<dyn LockBackend>) -> Self {
        Locker {
            info: backend.info(),
            backend,
            client: Uuid::new_v4(),
            next_owner: Arc::new(AtomicU64::new(1)),
            defaults: LockOptions::default(),
            gates: Some(Arc::default()),
        }
    }

    /// Lets every waiting acquisition of this locker go to the backend at once, as if each
    /// were a client of its own, instead of one per key at a time (see
    /// [`HolderInfo::waiters`]). For tests that race a client's own acquisitions at the
    /// server; it makes a busy key cost more server work per handoff.
    #[doc(hidden)]
    pub fn without_waiter_gates(mut self) -> Self {
        self.gates = None;
        self
    }

    /// Replaces the default options for acquisitions made through this locker.
    pub fn with_options(mut self, defaults: LockOptions) -> Self {
        self.defaults = defaults;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.backend
    }

    /// The backend's self-description.
    pub fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// The default options.
    pub fn options(&self) -> &LockOptions {
        &self.defaults
    }

    fn fresh_owner_id(&self) -> OwnerId {
        OwnerId::new(self.client, self.next_owner.fetch_add(1, Ordering::Relaxed))
    }

    /// A new owner identity for reentrant locking: the same owner may acquire a key again
    /// and must release it as many times.
    pub fn owner(&self) -> Owner {
        Owner {
            id: self.fresh_owner_id(),
            locker: self.clone(),
            holds: Holds::default(),
        }
    }

    /// Starts building an acquisition of `key` for a fresh owner (not reentrant). Await the
    /// builder to wait for the lock (forever unless `.wait(..)` is set).
    ///
    /// # Examples
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> lockkit_core::Result<()> {
    /// use std::time::Duration;
    /// use lockkit_core::{Error, Locker, MemoryBackend};
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let guard = locker
    ///     .acquire("orders/42")
    ///     .ttl(Duration::from_secs(10))
    ///     .wait(Duration::from_secs(1))
    ///     .await?;
    /// // A second owner waits up to its deadline, then gets a timeout.
    /// let busy = locker.acquire("orders/42").wait(Duration::from_millis(20)).await;
    /// assert!(matches!(busy, Err(Error::Timeout { .. })));
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Awaiting the builder fails with:
    /// - [`Error::InvalidKey`] for an empty or oversized key, [`Error::InvalidTtl`] for a zero
    ///   or out-of-range TTL (nothing reaches the backend);
    /// - [`Error::Timeout`] when the wait ends without a grant (a zero wait: the lock was
    ///   busy);
    /// - [`Error::Backend`] when the service cannot be reached or refuses;
    ///   [`Error::is_retryable`] says whether trying again may help. While waiting,
    ///   retryable errors are retried until the deadline.
    ///
    /// # Cancel safety
    /// Dropping the future at any point leaves no lock behind: a grant that arrives after
    /// the caller left is given back on the runtime, and a server-side wait (a queue node,
    /// a blocked statement) is withdrawn.
    pub fn acquire(&self, key: impl IntoLockKey) -> Acquire {
        Acquire {
            locker: self.clone(),
            key: key.into_lock_key(),
            options: self.defaults.clone(),
            owner: None,
            kind: LockKind::Exclusive,
        }
    }

    /// Starts building a *read* acquisition of the read-write lock `key` (for a fresh owner;
    /// use [`Owner::read`] for re-entry and downgrade). Many readers share the key; a
    /// writer excludes them, and a waiting writer blocks new readers where the backend's
    /// [`crate::Capabilities::writer_preference`] says so. Same builder and guard as
    /// [`Locker::acquire`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
    /// use lockkit_core::{Locker, MemoryBackend};
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let one = locker.read("catalog").await?;
    /// let two = locker.read("catalog").await?; // readers share
    /// assert!(locker.write("catalog").try_now().await?.is_none()); // a writer waits
    /// one.release().await?;
    /// two.release().await?;
    /// let writer = locker.write("catalog").await?;
    /// writer.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Locker::acquire`], and [`Error::Unsupported`] (before any I/O) on a backend
    /// without read-write locks, [`Error::KindMismatch`] when the key is used as another
    /// kind of lock.
    pub fn read(&self, key: impl IntoLockKey) -> Acquire {
        self.acquire(key).kind(LockKind::Read)
    }

    /// Starts building a *write* acquisition of the read-write lock `key` (for a fresh
    /// owner; use [`Owner::write`] for re-entry). A writer excludes every other holder.
    ///
    /// # Errors
    /// As [`Locker::read`].
    pub fn write(&self, key: impl IntoLockKey) -> Acquire {
        self.acquire(key).kind(LockKind::Write)
    }

    /// A counting semaphore of `permits` permits on `key`: at most that many holds at once,
    /// each with its own guard, lease, fencing token and loss signal. Every client of the key
    /// must use the same count; one that does not is refused with [`Error::KindMismatch`]
    /// where the backend stores the count.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> lockkit_core::Result<()> {
    /// use lockkit_core::{Locker, MemoryBackend};
    ///
    /// let locker = Locker::new(MemoryBackend::new());
    /// let connections = locker.semaphore("db-connections", 2);
    /// let a = connections.acquire().await?;
    /// let b = connections.acquire().await?;
    /// assert!(connections.try_acquire().await?.is_none()); // both permits are out
    /// assert!(b.token() > a.token()); // every permit has its own token
    /// a.release().await?;
    /// let c = connections.try_acquire().await?.expect("a permit is free again");
    /// # drop((b, c)); Ok(()) }
    /// ```
    pub fn semaphore(&self, key: impl IntoLockKey, permits: u32) -> Semaphore {
        Semaphore {
            locker: self.clone(),
            key: key.into_lock_key().map_err(|e| e.to_string()),
            permits,
        }
    }

    /// Like [`Locker::acquire`] but never waits: resolves to `Ok(None)` if the lock is busy.
    pub fn try_acquire(&self, key: impl IntoLockKey) -> TryAcquire {
        TryAcquire(self.acquire(key))
    }

    /// Who holds `key` now, as the backend sees it.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], or the backend's error; a retryable [`Error::Backend`] if the
    /// server gives no answer within the backend's [`LockBackend::response_bound`].
    pub async fn inspect(&self, key: impl IntoLockKey) -> Result<Option<HolderInfo>> {
        let key = key.into_lock_key()?;
        inquire(self.backend.as_ref(), &key, self.backend.inspect(&key)).await
    }

    /// Every hold of `key` now: the holder of a lock or the writer, each reader, each
    /// permit ([`HolderInfo::kind`] says which), as the backend sees them.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], or the backend's error; a retryable [`Error::Backend`] if the
    /// server gives no answer within the backend's [`LockBackend::response_bound`].
    pub async fn holders(&self, key: impl IntoLockKey) -> Result<Vec<HolderInfo>> {
        let key = key.into_lock_key()?;
        inquire(self.backend.as_ref(), &key, self.backend.holders(&key)).await
    }
}

/// `inquiry`'s answer, or a retryable error once the backend's response bound passes
/// without one (a link gone silent).
async fn inquire<T>(
    backend: &dyn LockBackend,
    key: &LockKey,
    inquiry: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    crate::backend::answered_within(backend, key, crate::backend::Bounded::Inquiry, inquiry).await
}

/// An owner identity: acquisitions through one `Owner` (and its clones) are reentrant.
#[derive(Clone)]
pub struct Owner {
    id: OwnerId,
    locker: Locker,
    holds: Holds,
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Owner").field("id", &self.id).finish()
    }
}

impl Owner {
    /// The identity.
    pub fn id(&self) -> OwnerId {
        self.id
    }

    /// Builds an acquisition of `key` by this owner; reentrant if the owner holds it.
    pub fn acquire(&self, key: impl IntoLockKey) -> Acquire {
        self.locker.acquire(key).owner(self)
    }

    /// Like [`Owner::acquire`] but never waits.
    pub fn try_acquire(&self, key: impl IntoLockKey) -> TryAcquire {
        TryAcquire(self.acquire(key))
    }

    /// Builds a read acquisition of `key` by this owner: a re-entry if it reads the key
    /// already, a downgrade (granted at once, a separate hold) if it writes it.
    pub fn read(&self, key: impl IntoLockKey) -> Acquire {
        self.locker.read(key).owner(self)
    }

    /// Builds a write acquisition of `key` by this owner: a re-entry if it writes the key
    /// already.
    ///
    /// # Errors
    /// Awaiting it fails at once with [`Error::WouldDeadlock`] if the owner reads the key
    /// and does not write it (an upgrade would wait for itself), as [`Locker::write`]
    /// otherwise.
    pub fn write(&self, key: impl IntoLockKey) -> Acquire {
        self.locker.write(key).owner(self)
    }

    /// Refuses a request of `kind` on `key` that this owner's live holds make impossible:
    /// an upgrade (it reads, does not write, and asks to write) or a change of kind (it
    /// holds the key as a plain lock and asks for a read-write hold, or the other way round).
    fn check_kind(&self, key: &LockKey, kind: LockKind) -> Result<()> {
        let holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        let live = |held: LockKind| {
            holds
                .get(&(key.clone(), held))
                .and_then(|owned| owned.hold.upgrade())
                .is_some_and(|hold| hold.is_live())
        };
        let mismatch = |found: &str| Error::KindMismatch {
            key: key.clone(),
            found: format!("is held by this owner as {found}"),
            asked: kind,
        };
        match kind {
            LockKind::Write | LockKind::Exclusive
                if live(LockKind::Read) && !live(LockKind::Write) =>
            {
                Err(Error::WouldDeadlock {
                    key: key.clone(),
                    held: LockKind::Read,
                    asked: kind,
                })
            }
            LockKind::Write | LockKind::Read if live(LockKind::Exclusive) => {
                Err(mismatch("an exclusive lock"))
            }
            LockKind::Exclusive if live(LockKind::Write) => Err(mismatch("a read-write lock")),
            _ => Ok(()),
        }
    }
}

/// A counting semaphore: a key with at most [`Semaphore::permits`] holds at once. Made by
/// [`Locker::semaphore`]; cheap to clone. Each [`Semaphore::acquire`] takes a new permit
/// (permits are never reentrant), with its own [`LockGuard`].
#[derive(Debug, Clone)]
pub struct Semaphore {
    locker: Locker,
    key: std::result::Result<LockKey, String>,
    permits: u32,
}

impl Semaphore {
    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// Starts building the acquisition of one permit: same builder as
    /// [`Locker::acquire`] (ttl, wait, max_hold, watchdog); await it for the permit's guard.
    ///
    /// # Errors
    /// As [`Locker::acquire`]; [`Error::Config`] for a semaphore of zero permits,
    /// [`Error::Unsupported`] (before any I/O) on a backend without semaphores,
    /// [`Error::KindMismatch`] when the key is used with another permit count or as a lock.
    pub fn acquire(&self) -> Acquire {
        let mut kind = LockKind::Exclusive;
        let key = match (&self.key, NonZeroU32::new(self.permits)) {
            (Err(reason), _) => Err(Error::InvalidKey {
                reason: reason.clone(),
            }),
            (Ok(_), None) => Err(Error::Config(
                "a semaphore needs at least one permit; ask for 1 or more".into(),
            )),
            (Ok(key), Some(limit)) => {
                kind = LockKind::Permit { limit };
                Ok(key.clone())
            }
        };
        Acquire {
            locker: self.locker.clone(),
            key,
            options: self.locker.defaults.clone(),
            owner: None,
            kind,
        }
    }

    /// Like [`Semaphore::acquire`] but never waits: `Ok(None)` when every permit is out.
    pub fn try_acquire(&self) -> TryAcquire {
        TryAcquire(self.acquire())
    }

    /// The permits held now, one entry each, as the backend sees them.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], or the backend's error; a retryable [`Error::Backend`] if the
    /// server gives no answer within the backend's [`LockBackend::response_bound`].
    pub async fn holders(&self) -> Result<Vec<HolderInfo>> {
        let key = self
            .key
            .clone()
            .map_err(|reason| Error::InvalidKey { reason })?;
        inquire(
            self.locker.backend.as_ref(),
            &key,
            self.locker.backend.holders(&key),
        )
        .await
    }
}

/// Builder for a waiting acquisition; `.await` it. Created by [`Locker::acquire`] and
/// [`Owner::acquire`].
///
/// # Errors
/// As [`Locker::acquire`].
///
/// # Cancel safety
/// Cancel safe: dropping it, awaited or not, leaves no lock behind (see
/// [`Locker::acquire`]).
#[must_use = "an acquisition does nothing until awaited"]
#[derive(Debug)]
pub struct Acquire {
    locker: Locker,
    key: Result<LockKey>,
    options: LockOptions,
    owner: Option<Owner>,
    kind: LockKind,
}

impl Acquire {
    /// The kind of hold to take (see [`Locker::read`], [`Locker::write`],
    /// [`Locker::semaphore`]).
    fn kind(mut self, kind: LockKind) -> Self {
        self.kind = kind;
        self
    }

    /// Tries once, without waiting, like [`Locker::try_acquire`]: `Ok(None)` when busy.
    pub fn try_now(self) -> TryAcquire {
        TryAcquire(self)
    }

    /// The lease (default 30 s). The watchdog renews it while the guard lives.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.options.ttl = ttl;
        self
    }

    /// Waits at most this long for a busy lock, then fails with [`Error::Timeout`].
    /// Zero tries once.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.options.wait = Some(wait);
        self
    }

    /// Stops the watchdog from renewing after the lock has been held this long.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.options.max_hold = Some(max_hold);
        self
    }

    /// Renews this often instead of at a third of the TTL.
    pub fn renew_every(mut self, period: Duration) -> Self {
        self.options.renew_every = Some(period);
        self
    }

    /// Turns the watchdog off: the lease runs out after the TTL unless
    /// [`LockGuard::extend`] is called.
    pub fn no_watchdog(mut self) -> Self {
        self.options.watchdog = false;
        self
    }

    /// Acquires as `owner`, reentrantly. Ignored for a semaphore permit, which is never
    /// reentrant.
    pub fn owner(mut self, owner: &Owner) -> Self {
        self.owner = Some(owner.clone());
        self
    }

    /// Replaces all options at once.
    pub fn options(mut self, options: LockOptions) -> Self {
        self.options = options;
        self
    }

    /// [`Acquire::run`] inside a `lockkit.acquire` span (at `debug`, never `info`: it is
    /// the hot path) that records the key, backend, owner, TTL and wait asked, and how it
    /// ended: `outcome` (granted, busy, timeout, error), `token`, `depth`, `waited_ms`, and
    /// `gate` where the acquisition queued behind the client's other waiters of the key
    /// (`passed`; `impatient`: went on beside a gate held for a second; `deadline`: the
    /// wait ran out there, and one attempt that does not wait followed).
    async fn run_traced(self, wait: Option<Duration>) -> Result<Option<LockGuard>> {
        use tracing::{Instrument, field};
        let span = tracing::debug_span!(
            "lockkit.acquire",
            key = field::Empty,
            backend = self.locker.info.scheme,
            owner = field::Empty,
            ttl_ms = u64::try_from(self.options.ttl.as_millis()).unwrap_or(u64::MAX),
            wait_ms = wait.map(|w| u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
            outcome = field::Empty,
            token = field::Empty,
            depth = field::Empty,
            waited_ms = field::Empty,
            gate = field::Empty,
        );
        let backend = self.locker.info.scheme;
        let started = tokio::time::Instant::now();
        let waiting = crate::telemetry::Gauged::waiter(backend);
        let key_label = self.key.as_ref().ok().and_then(crate::telemetry::key_label);
        let outcome = if span.is_disabled() {
            self.run(wait).await
        } else {
            if let Ok(key) = &self.key {
                span.record("key", field::display(key));
            }
            self.run(wait).instrument(span.clone()).await
        };
        drop(waiting);
        let waited = started.elapsed();
        span.record(
            "waited_ms",
            u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
        );
        let label = match &outcome {
            Ok(Some(guard)) => {
                span.record("owner", field::display(guard.owner()));
                span.record("token", guard.token().get());
                span.record("depth", guard.depth());
                "granted"
            }
            Ok(None) => "busy",
            Err(Error::Timeout { .. }) => "timeout",
            Err(error) => {
                tracing::debug!(parent: &span, %error, "acquisition failed");
                "error"
            }
        };
        span.record("outcome", label);
        crate::telemetry::acquisition(backend, key_label.as_deref(), label, waited);
        outcome
    }

    async fn run(self, wait: Option<Duration>) -> Result<Option<LockGuard>> {
        let key = self.key?;
        let locker = self.locker;
        self.options.validate(&locker.info)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::Config(
                "lockkit needs a Tokio runtime for its watchdog; call it from within one".into(),
            )
        })?;
        crate::backend::timers_enabled()?;
        let kind = self.kind;
        let capabilities = &locker.info.capabilities;
        let unsupported = match kind {
            LockKind::Read | LockKind::Write => !capabilities.read_write,
            LockKind::Permit { .. } => !capabilities.semaphore,
            _ => false,
        };
        if unsupported {
            return Err(Error::Unsupported {
                backend: locker.info.scheme,
                what: match kind {
                    LockKind::Permit { .. } => "counting semaphores as configured (the \
                                                backend's docs say which of its modes have them)"
                        .into(),
                    _ => "read-write locks as configured (the backend's docs say which of its \
                          modes have them)"
                        .into(),
                },
            });
        }
        // A permit is never reentrant: every acquisition is a holder of its own.
        let owner = self.owner.filter(|_| kind.is_reentrant());
        if let Some(owner) = &owner {
            owner.check_kind(&key, kind)?;
        }
        let owner_id = match &owner {
            Some(owner) => owner.id,
            None => locker.fresh_owner_id(),
        };
        // A grant refused below the owner's token floor while another task of the owner
        // holds the key is retried up to this deadline (see below).
        let started = tokio::time::Instant::now();
        let deadline = deadline_after(wait.unwrap_or(WAIT_FOREVER));
        let mut refusal_pause = Backoff::new(Duration::from_millis(5), Duration::from_millis(500));
        // Whether this call began with no live hold of its owner on the key: a retry may
        // then meet another task's hold, but the call stays a fresh acquisition.
        let mut began_fresh = None;
        // Where a release wakes every waiter (pub/sub, polling), a fresh exclusive
        // acquisition that waits queues behind this client's other waiters on the key
        // first, so that one of them, not all, goes to the server at each release (see
        // `crate::gate`). Not while the owner has a hold of the key, live or not (a re-entry,
        // or a hold whose record may still be on the server: it must never wait behind a
        // waiter that waits for the owner's own record), nor an attempt that does not wait.
        let waits = wait.is_none_or(|wait| !wait.is_zero());
        // After the deadline passed in the gate: one attempt that does not wait, so that a
        // key that is free by then is still taken (busy: `Timeout`; an error of that
        // attempt, such as a lost link, is returned as it is).
        let mut wait = wait;
        let mut last_try = false;
        let gates = locker.gates.as_ref().filter(|_| {
            waits
                && kind == LockKind::Exclusive
                && !locker.info.capabilities.queued_wait
                && owner
                    .as_ref()
                    .is_none_or(|owner| !owner.may_have_record_on(&key))
        });
        let _gate_pass = match gates {
            Some(gates) => {
                began_fresh = Some(true);
                let entry = gates.enter(&key, deadline).await;
                // Only into this acquisition's own span (not a caller's, when ours is off).
                let span = tracing::Span::current();
                if span
                    .metadata()
                    .is_some_and(|meta| meta.name() == "lockkit.acquire")
                {
                    span.record("gate", entry.label());
                }
                match entry {
                    crate::gate::Entry::Passed(pass) => Some(pass),
                    crate::gate::Entry::Impatient => None,
                    crate::gate::Entry::DeadlinePassed => {
                        wait = Some(Duration::ZERO);
                        last_try = true;
                        None
                    }
                }
            }
            None => None,
        };
        loop {
            let existing = owner.as_ref().and_then(|owner| owner.live_hold(&key, kind));
            let began_fresh = *began_fresh.get_or_insert(existing.is_none());
            // A fresh signal even beside a live hold: a backend that finds the hold keeps the
            // signal it was given with it (the hold's own), and one that makes a new hold
            // (the owner's last release won a race with this re-entry) gives that hold this one.
            let request =
                AcquireRequest::new(key.clone(), owner_id, self.options.ttl, LossSignal::new())
                    .with_kind(kind);
            let request = if owner.is_some() {
                request
            } else {
                request.for_one_use()
            };
            let backend = &locker.backend;
            // If this future is dropped before the outcome is seen, or the outcome is one the
            // client cannot know (a retryable error, a deadline passed while an attempt was
            // out), whatever the attempt took is given back by its attempt id. Only for a fresh
            // acquisition: a re-entry's attempt is kept apart from the owner's other holds by
            // the attempt ledger, except holds the ledger never saw (written before it
            // existed), which a stray give-back could take.
            let mut unknown_outcome = existing.is_none().then(|| GiveBackOnDrop {
                backend: backend.clone(),
                request: request.clone(),
                runtime: runtime.clone(),
                armed: true,
            });
            // A backend that does not answer (a link gone silent) is given up on this long
            // after the deadline; `unknown_outcome` then gives back what the attempt takes.
            let bound = backend.response_bound();
            let outcome = match wait {
                Some(wait) if wait.is_zero() => {
                    crate::backend::answered_within(
                        backend.as_ref(),
                        &key,
                        crate::backend::Bounded::Acquisition,
                        backend.try_acquire(&request),
                    )
                    .await
                }
                Some(_) => {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    crate::backend::answered_by(
                        deadline.checked_add(bound),
                        bound,
                        backend.as_ref(),
                        &key,
                        crate::backend::Bounded::Acquisition,
                        backend.acquire(&request, left),
                    )
                    .await
                    .map(Some)
                    // The whole wait, not what was left of it on a retry.
                    .map_err(|error| match error {
                        Error::Timeout { key, .. } => Error::Timeout {
                            key,
                            waited: started.elapsed(),
                        },
                        other => other,
                    })
                }
                None => backend.acquire(&request, WAIT_FOREVER).await.map(Some),
            };
            let grant = match outcome {
                Ok(grant) => grant,
                Err(error) => {
                    if !(error.is_retryable() || matches!(error, Error::Timeout { .. })) {
                        // A definite refusal (bad input, configuration): nothing was taken.
                        unknown_outcome = None;
                    }
                    drop(unknown_outcome);
                    return Err(error);
                }
            };
            if let Some(known) = unknown_outcome.take() {
                known.disarm();
            }
            // From here on nothing awaits: a dropped future cannot orphan the grant.
            // With no live hold here, a grant at depth > 1 means the server still counts holds
            // of this owner that are over locally (lost a moment before their server lease
            // ended; a lost guard sends no release). The server never let go, so this is the
            // same hold going on (same token). The stale depth is left to run out with the
            // lease after this hold's release: giving it back blindly could take holds this
            // acquisition just added (on Redlock, depths differ from master to master).
            let Some(grant) = grant else {
                if last_try {
                    return Err(Error::Timeout {
                        key,
                        waited: started.elapsed(),
                    });
                }
                return Ok(None);
            };
            // A re-entry of the hold this owner has now, which may not be the one seen before
            // the request (another task of the owner let the old one go and took a new one
            // meanwhile): the backend counted it on that hold, so its guard joins that hold and
            // hears that hold's loss signal.
            let current = owner.as_ref().and_then(|owner| owner.live_hold(&key, kind));
            if let Some(hold) =
                current.filter(|hold| grant.depth > 1 && grant.token == hold.token())
            {
                hold.absorb(&grant);
                return Ok(Some(Guard::new(hold, grant)));
            }
            if let Some(hold) = existing {
                // The hold may have been lost while the request was out (its deadline passed):
                // then this depth belongs to a hold nobody believes in any more. Give it back.
                if grant.depth > 1 && grant.token == hold.token() && hold.is_live() {
                    hold.absorb(&grant);
                    return Ok(Some(Guard::new(hold, grant)));
                }
                if !hold.is_abandoned() {
                    // Our hold was gone on the server although we thought it live.
                    let lost = hold.fire_lost(crate::LostReason::NotOurs);
                    if !began_fresh {
                        // The caller re-entered that hold: give the fresh grant back and
                        // report the outer hold lost.
                        let backend = locker.backend.clone();
                        runtime.spawn(async move {
                            if let Err(error) = backend.release(&grant).await {
                                tracing::debug!(%error, "giving back an unexpected fresh grant failed");
                            }
                        });
                        return Err(lost);
                    }
                    // The caller asked for a fresh hold and only met another task's hold on a
                    // retry (below): that hold is lost, and this grant is the caller's own.
                }
                // The owner's last guard let go while the request was out, and the server made
                // a new hold (or, token equal, counted this one on the old hold's record, which
                // the release under way leaves to it): nobody believes in the old hold, so this
                // is a fresh acquisition, with its own loss signal, like one made with no hold
                // here at all. The old hold is left alone: its release must still be sent.
            }
            // Any grant left starts a hold, and a new hold's token must not be below one this
            // owner already held on the key (see `OwnedHold`). Equal is a continuation: the
            // server kept this owner's hold throughout, so nobody else held it in between.
            let floor = owner.as_ref().and_then(|owner| owner.token_floor(&key));
            if let Some(floor) = floor.filter(|floor| grant.token < *floor) {
                if let Some(owner) = owner.as_ref() {
                    // The refused request reached the server as a re-entry of the stale record
                    // and may have lengthened its lease to this TTL: the floor must outlive that.
                    owner.keep_floor(&key, kind, grant.ttl);
                }
                let lease = grant.ttl;
                let (error, given_back) = refuse_older_token(&locker, grant, floor, &runtime);
                // Two tasks of one owner raced for the key (on Redlock each can collect a
                // majority, with its own token) and the other one holds it now: within the
                // caller's wait, try again, as a re-entry of that hold. Without such a hold
                // the grant came from a stale record of the owner, and asking again would
                // only lengthen that record's lease (a refused request reaches the server as
                // its re-entry): the caller gets the (retryable) refusal, as does a zero wait.
                let other_hold = owner
                    .as_ref()
                    .is_some_and(|owner| owner.live_hold(&key, kind).is_some());
                if !other_hold || wait.is_some_and(|wait| wait.is_zero()) {
                    return Err(error);
                }
                tracing::debug!(%error, "retrying within the caller's wait");
                let pause_until =
                    (tokio::time::Instant::now() + refusal_pause.next_delay()).min(deadline);
                // The give-back first, so the retry does not race it on the server; never
                // past the deadline. Dropping this future meanwhile leaves it running.
                let give_back_until =
                    (tokio::time::Instant::now() + lease.min(Duration::from_secs(5))).min(deadline);
                let _ = tokio::time::timeout_at(give_back_until, given_back).await;
                tokio::time::sleep_until(pause_until).await;
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        key,
                        waited: started.elapsed(),
                    });
                }
                continue;
            }
            return Ok(Some(start_hold(
                &locker,
                owner.as_ref(),
                self.options,
                key,
                grant,
                &runtime,
            )));
        }
    }
}

/// Gives back a fresh acquisition's attempt when dropped armed: see [`give_back_attempt`].
struct GiveBackOnDrop {
    backend: Arc<dyn LockBackend>,
    request: AcquireRequest,
    runtime: tokio::runtime::Handle,
    armed: bool,
}

impl GiveBackOnDrop {
    /// The outcome is known (a grant, or a definite "busy"): nothing to give back.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for GiveBackOnDrop {
    fn drop(&mut self) {
        if self.armed {
            give_back_attempt(&self.backend, &self.request, &self.runtime);
        }
    }
}

/// After an acquisition that failed with an outcome the client cannot know (a reply lost
/// or late, a deadline that passed while an attempt was out), gives back whatever that
/// attempt may still have taken on the server, in the background: nobody will release it,
/// and it would keep the key for its whole lease. The release names the attempt, so it
/// takes back only a hold this attempt added (never an outer hold of the same owner), and
/// changes nothing where the attempt took nothing; so it is sent again after a retryable
/// failure, until the attempt's lease would have run out, [`GIVE_BACK_TRIES`] times at
/// most; the task ends with the last try.
fn give_back_attempt(
    backend: &Arc<dyn LockBackend>,
    request: &AcquireRequest,
    runtime: &tokio::runtime::Handle,
) {
    let (backend, unknown) = (
        backend.clone(),
        crate::Grant::new(
            request,
            crate::FencingToken::new(0),
            1,
            tokio::time::Instant::now(),
        ),
    );
    // A give-back that failed retryably (its line given up as silent, whose abort drops
    // what it still held) is sent again until the attempt's lease would have run out: the
    // attempt may have landed, and nobody else gives it back. At most
    // [`GIVE_BACK_TRIES`] times: during an outage every failed acquisition starts one of
    // these, and a caller retrying in a loop must not pile up a lease's worth of them.
    let until = tokio::time::Instant::now()
        .checked_add(request.ttl)
        .unwrap_or_else(|| tokio::time::Instant::now() + WAIT_FOREVER);
    runtime.spawn(async move {
        let mut backoff =
            Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        for tried in 1..=GIVE_BACK_TRIES {
            match backend.release(&unknown).await {
                Ok(released) => {
                    tracing::debug!(key = %unknown.key, ?released, "gave back what a failed attempt took");
                    return;
                }
                Err(error) if error.is_retryable() => {
                    if tried == GIVE_BACK_TRIES {
                        break;
                    }
                    let next = tokio::time::Instant::now() + backoff.next_delay();
                    if next >= until {
                        return;
                    }
                    tracing::debug!(key = %unknown.key, %error, "giving back what a failed attempt took; again");
                    tokio::time::sleep_until(next).await;
                }
                Err(_) => return,
            }
        }
        tracing::debug!(key = %unknown.key, "gave up giving back what a failed attempt took; its lease ends it");
    });
}

/// How many times the give-back of an unanswered acquisition is sent at most: seven backoff
/// steps between the tries, from 100 ms to 2 s with up to half a step of jitter (7 to 10 s
/// in all), each try also bounded by its own answer's time.
const GIVE_BACK_TRIES: u32 = 8;

impl Owner {
    /// Whether a record of a hold of this owner on `key` may be on the server, of any kind:
    /// a hold that still exists here, live or not (held, being released, lost while its
    /// guard lives), or one that ended without the server answering its release "fully
    /// released" (lost, dropped, a release that failed or outran its bound), for as long
    /// as its token floor is remembered.
    fn may_have_record_on(&self, key: &LockKey) -> bool {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        holds.iter_mut().any(|((held, _), owned)| {
            held == key
                && (owned.hold.strong_count() > 0
                    || (!owned.let_go.load(Ordering::SeqCst) && owned.remember(now)))
        })
    }

    /// This owner's hold on `key`, if it has one that is still live.
    fn live_hold(&self, key: &LockKey, kind: LockKind) -> Option<Arc<Hold>> {
        let holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        holds
            .get(&(key.clone(), kind))
            .and_then(|owned| owned.hold.upgrade())
            .filter(|hold| hold.is_live())
    }

    /// The lowest token a new hold of this owner on `key` may carry: the token of its
    /// latest hold there, while a record of that hold may linger on a server.
    ///
    /// Over every kind the owner held the key as: a stale write record that a new write
    /// re-enters must not hand out a token below a read the owner held since.
    fn token_floor(&self, key: &LockKey) -> Option<crate::FencingToken> {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        holds
            .iter_mut()
            .filter(|((held, _), _)| held == key)
            .filter_map(|(_, owned)| owned.remember(now).then_some(owned.token))
            .max()
    }
}

impl Owner {
    /// Remembers the floor on `key` for at least twice `ttl` from now.
    fn keep_floor(&self, key: &LockKey, kind: LockKind, ttl: Duration) {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(owned) = holds.get_mut(&(key.clone(), kind)) {
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
            owned
                .longest_lease
                .fetch_max(ms, std::sync::atomic::Ordering::SeqCst);
            // A refused grant came from a record of this owner on the server: whatever
            // the hold's release said, a record is there now.
            owned.let_go = Arc::default();
            if let Some(forget_at) = owned.forget_at.as_mut() {
                let now = tokio::time::Instant::now();
                let kept = now
                    .checked_add(ttl.saturating_mul(2))
                    .unwrap_or(now + WAIT_FOREVER);
                *forget_at = (*forget_at).max(kept);
            }
        }
    }
}

/// Gives back a grant whose token is below `floor` (see [`OwnedHold`]) and says so, as a
/// retryable error: by the time the caller tries again, the stale record may be gone.
fn refuse_older_token(
    locker: &Locker,
    grant: crate::Grant,
    floor: crate::FencingToken,
    runtime: &tokio::runtime::Handle,
) -> (Error, tokio::task::JoinHandle<()>) {
    let error = Error::backend(
        "lockkit",
        true,
        format!(
            "the server granted `{}` with fencing token {}, below token {} this owner already \
             held there (it still counted an older hold of this owner); the grant was given \
             back, try again",
            grant.key, grant.token, floor
        ),
    );
    let backend = locker.backend.clone();
    let given_back = runtime.spawn(async move {
        if let Err(error) = backend.release(&grant).await {
            tracing::debug!(%error, "giving back a grant with an older token failed");
        }
    });
    (error, given_back)
}

/// A new hold from a fresh grant, recorded with its owner (if any) for re-entries.
fn start_hold(
    locker: &Locker,
    owner: Option<&Owner>,
    options: LockOptions,
    key: LockKey,
    grant: crate::Grant,
    runtime: &tokio::runtime::Handle,
) -> Guard {
    let hold = Hold::start(locker.backend.clone(), grant.clone(), options, runtime);
    if let Some(owner) = owner {
        let mut holds = owner.holds.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        holds.retain(|_, owned| owned.remember(now));
        let entry = (key, grant.kind);
        let token = holds
            .get(&entry)
            .map_or(grant.token, |before| before.token.max(grant.token));
        holds.insert(
            entry,
            OwnedHold {
                hold: Arc::downgrade(&hold),
                token,
                longest_lease: hold.longest_lease(),
                let_go: hold.let_go(),
                forget_at: None,
            },
        );
    }
    Guard::new(hold, grant)
}

impl IntoFuture for Acquire {
    type Output = Result<LockGuard>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<LockGuard>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        let wait = self.options.wait;
        Box::pin(async move {
            let key = self.key.as_ref().ok().cloned();
            match (self.run_traced(wait).await?, key) {
                (Some(guard), _) => Ok(guard),
                // Only a zero wait comes back empty: the lock was busy.
                (None, Some(key)) => Err(Error::Timeout {
                    key,
                    waited: Duration::ZERO,
                }),
                (None, None) => Err(Error::Config("no lock key was given".into())),
            }
        })
    }
}

/// Builder for a non-waiting acquisition; `.await` it for `Ok(None)` when busy.
#[must_use = "an acquisition does nothing until awaited"]
#[derive(Debug)]
pub struct TryAcquire(Acquire);

impl TryAcquire {
    /// The lease.
    pub fn ttl(self, ttl: Duration) -> Self {
        TryAcquire(self.0.ttl(ttl))
    }
    /// See [`Acquire::max_hold`].
    pub fn max_hold(self, max_hold: Duration) -> Self {
        TryAcquire(self.0.max_hold(max_hold))
    }
    /// See [`Acquire::renew_every`].
    pub fn renew_every(self, period: Duration) -> Self {
        TryAcquire(self.0.renew_every(period))
    }
    /// See [`Acquire::no_watchdog`].
    pub fn no_watchdog(self) -> Self {
        TryAcquire(self.0.no_watchdog())
    }
    /// See [`Acquire::owner`].
    pub fn owner(self, owner: &Owner) -> Self {
        TryAcquire(self.0.owner(owner))
    }
    /// See [`Acquire::options`].
    pub fn options(self, options: LockOptions) -> Self {
        TryAcquire(self.0.options(options))
    }
}

impl IntoFuture for TryAcquire {
    type Output = Result<Option<LockGuard>>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<Option<LockGuard>>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.0.run_traced(Some(Duration::ZERO)))
    }
}
