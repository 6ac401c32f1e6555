//! The backend SPI: what a lock service must provide. Users call [`crate::Locker`] instead.

use std::{any::Any, fmt::Debug, sync::Arc, time::Duration};

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use crate::{FencingToken, HolderIdentity, LockKey, LockKind, OwnerId, Result, lost::LossSignal};

/// Whether a backend favours consistency or availability when the network fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Consistency {
    /// Consistent under partition: a lock is never granted twice, at the cost of being
    /// unavailable (ZooKeeper, one MySQL server, the in-process backends).
    Cp,
    /// Available under partition: failover or a lost write may grant a lock twice; use
    /// fencing tokens to stay safe (Redis, Redlock).
    Ap,
}

/// What a backend can do. Tests and callers read it instead of guessing. Build it with
/// `Capabilities { field: value, ..Capabilities::default() }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The same owner may acquire again and must release as many times.
    pub reentrant: bool,
    /// Tokens strictly grow for every new holder of a key.
    pub fencing: bool,
    /// Waiters are woken by the backend (pub/sub, watches, a server queue), not by polling.
    pub notified_wait: bool,
    /// Shortest lease the backend accepts.
    pub min_ttl: Duration,
    /// Longest lease the backend accepts (`None`: no limit).
    pub max_ttl: Option<Duration>,
    /// The backend pushes loss (session expiry, connection death) to the holder instead
    /// of only noticing it on the next renewal.
    pub pushes_loss: bool,
    /// Locks are shared between processes (false for the in-process memory backend).
    pub cross_process: bool,
    /// Waiters queue: a release wakes only the next waiter (ZooKeeper's predecessor watch,
    /// a server's lock queue), not every waiter at once (pub/sub, polling).
    pub queued_wait: bool,
    /// [`HolderInfo::waiters`] is reported: the backend can count the contenders waiting
    /// behind a holder (exactly, or as an estimate where its docs say so).
    pub counts_waiters: bool,
    /// Read-write locks: [`LockKind::Read`] and [`LockKind::Write`] requests. The
    /// [`crate::Locker`] answers [`crate::Error::Unsupported`] for them without I/O when false.
    pub read_write: bool,
    /// A waiting writer blocks new readers of other owners (among lockkit clients; a
    /// peer's readers may not honour it, as the backend's docs say).
    pub writer_preference: bool,
    /// Counting semaphores: [`LockKind::Permit`] requests.
    pub semaphore: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            reentrant: true,
            fencing: true,
            notified_wait: true,
            min_ttl: Duration::from_millis(1),
            max_ttl: None,
            pushes_loss: false,
            cross_process: true,
            queued_wait: false,
            counts_waiters: false,
            read_write: false,
            writer_preference: false,
            semaphore: false,
        }
    }
}

/// A backend's self-description.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendInfo {
    /// URL scheme, e.g. `redis`, `zk`, `memory`.
    pub scheme: &'static str,
    /// CP or AP.
    pub consistency: Consistency,
    /// What it can do.
    pub capabilities: Capabilities,
}

impl BackendInfo {
    /// Describes a backend.
    pub fn new(scheme: &'static str, consistency: Consistency, capabilities: Capabilities) -> Self {
        BackendInfo {
            scheme,
            consistency,
            capabilities,
        }
    }
}

/// One request to take a lock, validated by [`crate::Locker`] before it reaches a backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// The lock name.
    pub key: LockKey,
    /// Who asks. A backend that finds this owner already holding the key grants a
    /// reentrant hold (depth + 1, same token).
    pub owner: OwnerId,
    /// The lease: the grant expires this long after it was made unless renewed.
    pub ttl: Duration,
    /// The hold's loss signal. A backend that learns of loss by itself (session expiry,
    /// a dead connection) fires it; it also goes into the [`Grant`].
    pub loss: LossSignal,
    /// An id for this request, unique per [`AcquireRequest::new`] (a counter under a random
    /// per-process prefix), never nil. Backends use it
    /// to make a retried attempt (after a lost reply, a timeout, a client library's own
    /// retry) take effect once: the same attempt id never adds a second hold. The
    /// [`Grant`] carries it on, so a release can be made idempotent the same way.
    pub attempt: Uuid,
    /// Who is asking (host, pid, program, when): a backend stores it beside a new hold
    /// (never over an existing one on re-entry) and reports it in
    /// [`HolderInfo::identity`].
    pub identity: Arc<HolderIdentity>,
    /// The kind of hold asked for ([`LockKind::Exclusive`] unless built
    /// [`AcquireRequest::with_kind`]). The [`crate::Locker`] sends a backend only kinds its
    /// [`Capabilities`] name. Reentrancy is per owner *and* kind: an owner's write and read
    /// holds of one key are separate holds; a permit is never reentrant.
    pub kind: LockKind,
    /// Whether this owner may ask for the key again after its guards are gone: `true`
    /// unless built [`AcquireRequest::for_one_use`]. An [`crate::Owner`] may; an owner the
    /// [`crate::Locker`] made for this one acquisition never does (only its own guards
    /// re-enter, while it holds). A backend may make the last release of a grant whose
    /// owner never returns cheaper where that release's loss in a server crash is then
    /// harmless (the lease runs out, as after a holder's crash), while the loss of an
    /// owner's release that returns would leave it re-entering a hold it let go of, and
    /// so keep the key from others for as long as it keeps coming back.
    pub owner_returns: bool,
}

/// A fresh attempt id: a counter under a random prefix drawn once per process, shaped as a
/// version-4 uuid (never nil). Unique within the process for its first 2^62 ids, and across
/// processes unless two draw the same 60-bit prefix; that is all an attempt id needs, as
/// backends keep attempts beside their owner, itself unique per process. No system call:
/// `Uuid::new_v4` asks the kernel for entropy on every call, a `getrandom` per acquire.
pub(crate) fn new_attempt_id() -> Uuid {
    static PREFIX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| Uuid::new_v4().as_u64_pair().0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    uuid::Builder::from_random_bytes(Uuid::from_u64_pair(prefix, n).into_bytes()).into_uuid()
}

/// The longest lease lockkit accepts on any backend (100 years of 365 days), whatever the
/// backend declares: a lease end that far ahead is still an [`std::time::Instant`] (a
/// longer one overflowed, and `ttl(Duration::MAX)` panicked after the grant) and a date
/// every server's types hold (MySQL row mode wrote `now + u64::MAX µs` as a lease that
/// had already ended, and another owner was granted the key while the guard was valid).
pub const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl AcquireRequest {
    /// Builds a request. Callers outside lockkit use this only to drive a backend directly.
    /// A `ttl` above [`MAX_TTL`] is taken as that (the [`crate::Locker`] refuses it
    /// before it gets here): a backend driven directly with `Duration::MAX` overflowed
    /// (MySQL row mode wrote a lease that had already ended, and granted the key to the
    /// next owner too; helper-34's review).
    pub fn new(key: LockKey, owner: OwnerId, ttl: Duration, loss: LossSignal) -> Self {
        AcquireRequest {
            key,
            owner,
            ttl: ttl.min(MAX_TTL),
            loss,
            attempt: new_attempt_id(),
            identity: Arc::new(HolderIdentity::now()),
            kind: LockKind::Exclusive,
            owner_returns: true,
        }
    }

    /// The same request for another kind of hold.
    pub fn with_kind(mut self, kind: LockKind) -> Self {
        self.kind = kind;
        self
    }

    /// The same request from an owner made for this one acquisition, which never asks
    /// for the key again once its guards are gone (see [`AcquireRequest::owner_returns`]).
    pub fn for_one_use(mut self) -> Self {
        self.owner_returns = false;
        self
    }
}

/// What a backend hands back when a lock is granted.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Grant {
    /// The lock name.
    pub key: LockKey,
    /// The holder.
    pub owner: OwnerId,
    /// The holder's fencing token (unchanged by reentrant acquisitions).
    pub token: FencingToken,
    /// Hold count after this grant: 1 for a new holder, more when reentrant.
    pub depth: u32,
    /// The lease granted.
    pub ttl: Duration,
    /// A local instant taken *before* the granting request was sent (the request that
    /// was answered with the grant, not the start of a wait): the lease is counted from
    /// here, so local validity never outlasts the server's.
    pub lease_start: Instant,
    /// The hold's loss signal.
    pub loss: LossSignal,
    /// Backend-specific state (a ZooKeeper node path, a dedicated connection).
    pub state: Option<Arc<dyn Any + Send + Sync>>,
    /// The [`AcquireRequest::attempt`] that produced this grant: a release of this grant
    /// that is retried must take effect once, and gives back only a hold this attempt
    /// added. The nil uuid asks to give back one hold of the owner whatever acquired it.
    pub attempt: Uuid,
    /// The identity the granting request carried (see [`AcquireRequest::identity`]).
    pub identity: Arc<HolderIdentity>,
    /// The kind of hold granted (the request's).
    pub kind: LockKind,
    /// The request's [`AcquireRequest::owner_returns`].
    pub owner_returns: bool,
}

impl Grant {
    /// Builds a grant for `req`.
    pub fn new(
        req: &AcquireRequest,
        token: FencingToken,
        depth: u32,
        lease_start: Instant,
    ) -> Self {
        Grant {
            key: req.key.clone(),
            owner: req.owner,
            token,
            depth,
            ttl: req.ttl,
            lease_start,
            loss: req.loss.clone(),
            state: None,
            attempt: req.attempt,
            identity: req.identity.clone(),
            kind: req.kind,
            owner_returns: req.owner_returns,
        }
    }

    /// Attaches backend-specific state.
    pub fn with_state(mut self, state: Arc<dyn Any + Send + Sync>) -> Self {
        self.state = Some(state);
        self
    }
}

/// The outcome of one release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// The owner still holds the lock this many more times.
    Partially {
        /// Holds left.
        remaining: u32,
    },
    /// The lock is free.
    Fully,
}

/// Who holds a key, as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// The holder as stored, e.g. `<uuid>:<n>`; for a lock held in a foreign format, a
    /// description of what was found.
    pub owner: String,
    /// Hold count (1 when unknown).
    pub depth: u32,
    /// The holder's fencing token, when the backend can tell.
    pub token: Option<FencingToken>,
    /// Lease left, when the backend can tell.
    pub ttl_left: Option<Duration>,
    /// The process that took the hold, when it was stored beside it (holds made by lockkit;
    /// not those of other clients, such as Redisson, Curator or etcdctl).
    pub identity: Option<HolderIdentity>,
    /// Contenders waiting behind the holder, where the backend can tell: exact on
    /// ZooKeeper, etcd and the memory backend, an estimate on Redis (clients subscribed to
    /// the lock's release channel), `None` where the server does not say. Where waiters do
    /// not queue on the server (`queued_wait` false, as on the memory backend), a
    /// [`crate::Locker`]'s exclusive waiters of one key queue in the locker and reach the
    /// backend one at a time, so a locker's waiters count as one there, until the one at
    /// the backend has waited there a second (then the rest go to the backend too; a
    /// handoff within the locker starts that second again).
    pub waiters: Option<u32>,
    /// The kind of hold, where the backend tells kinds apart (`None`: a plain lock, or
    /// not known).
    pub kind: Option<LockKind>,
}

impl HolderInfo {
    /// Describes a holder.
    pub fn new(
        owner: impl Into<String>,
        depth: u32,
        token: Option<FencingToken>,
        ttl_left: Option<Duration>,
    ) -> Self {
        HolderInfo {
            owner: owner.into(),
            depth,
            token,
            ttl_left,
            identity: None,
            waiters: None,
            kind: None,
        }
    }

    /// With the kind of hold.
    pub fn with_kind(mut self, kind: LockKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// With the holder's stored identity (`None`: not identified).
    pub fn with_identity(mut self, identity: Option<HolderIdentity>) -> Self {
        self.identity = identity;
        self
    }

    /// With the number of waiters behind the holder.
    pub fn with_waiters(mut self, waiters: u32) -> Self {
        self.waiters = Some(waiters);
        self
    }
}

/// [`LockBackend::response_bound`] of a backend that names none: long enough for the slow
/// answers a backend's own timeouts allow (reconnects, elections, replica waits), short
/// enough that a link gone silent does not hold a caller for good.
pub const DEFAULT_RESPONSE_BOUND: Duration = Duration::from_secs(120);

/// [`LockBackend::response_bound`] of a SQL backend: twice its `connect_timeout`, and ten
/// seconds more. sqlx bounds no statement the server never answers (it waits as long as the
/// link stays open). The slowest legitimate answers such a backend gives chain a pool's
/// wait or a connection opened to end a waiter's session (each within the connect timeout)
/// and a statement that may wait for a row lock (PostgreSQL's shared pool cuts those at
/// `statement_timeout`, ten seconds).
pub fn sql_response_bound(connect_timeout: Duration) -> Duration {
    connect_timeout
        .saturating_mul(2)
        .saturating_add(Duration::from_secs(10))
}

/// What [`answered_by`] bounds, for the error it returns when the bound passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bounded {
    /// An acquisition or a re-entry, bounded past its wait.
    Acquisition,
    /// A release: it goes on in the background (see `release_one`), and its lease runs out
    /// on the server if it does not get there. Not retryable: its guard is gone.
    Release,
    /// An extension: the hold stays as valid as its last confirmed lease.
    Extension,
    /// A question about who holds a key (`inspect`, `holders`).
    Inquiry,
}

/// `attempt`'s outcome, or, if it has none by `until` (`None`: no bound), a backend error
/// that says so (retryable but for a release). The attempt is dropped then: a backend's
/// acquisition and renewal are cancel safe (see [`LockBackend::renew`]), the caller of an
/// acquisition gives back what it may still take, and a release is detached first (see
/// `release_one` in `guard.rs`), so that only a wait for it is dropped.
pub(crate) async fn answered_by<T>(
    until: Option<tokio::time::Instant>,
    bound: Duration,
    backend: &dyn LockBackend,
    key: &LockKey,
    what: Bounded,
    attempt: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let Some(until) = until else {
        return attempt.await;
    };
    timers_enabled()?;
    tokio::time::timeout_at(until, attempt)
        .await
        .unwrap_or_else(|_| {
            let (done, after) = match what {
                Bounded::Acquisition => (
                    format!(
                        "the acquisition of `{key}` had no answer within its wait and {bound:?} \
                         more, and was given up (whatever it may still take is given back)"
                    ),
                    "try again",
                ),
                Bounded::Release => (
                    format!(
                        "the release of `{key}` had no answer within {bound:?}; it goes on in \
                         the background, and if it does not reach the server the lease runs \
                         out there by itself"
                    ),
                    "nothing needs doing for this hold",
                ),
                Bounded::Extension => (
                    format!(
                        "the extension of `{key}` had no answer within {bound:?} and was given \
                         up; the hold counts as valid only until its last confirmed lease"
                    ),
                    "try again, or stop relying on the hold at its validity",
                ),
                Bounded::Inquiry => (
                    format!(
                        "the question of who holds `{key}` had no answer within {bound:?} and \
                         was given up"
                    ),
                    "try again",
                ),
            };
            // A release cannot be tried again (its guard is gone); the others can.
            Err(crate::Error::backend(
                backend.info().scheme,
                what != Bounded::Release,
                format!(
                    "{done}: the server may be unreachable (a link gone silent holds requests \
                     without an error) or slow, or the request waits behind a lock of another \
                     client's transaction; {after}"
                ),
            ))
        })
}

/// Whether the current Tokio runtime has its timers enabled, as lockkit needs (its
/// watchdog, and its bounds on requests nobody answers, run on timers): the typed error
/// that says how to build such a runtime if not. Tokio panics when a timer is made in a
/// runtime without them, so this makes one with that panic caught (the panic hook still
/// prints it, beside the error the caller gets). A program built with `panic = "abort"`
/// aborts there instead, as it would have at lockkit's first timer.
pub(crate) fn timers_enabled() -> Result<()> {
    let made = std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO)));
    made.map_err(|_| {
        crate::Error::Config(
            "lockkit needs a Tokio runtime with its timers enabled (its watchdog and its \
             bounds on unanswered requests run on timers): build the runtime with \
             `enable_all()` or `enable_time()`"
                .into(),
        )
    })
}

/// `now + bound`, or `None` (no bound) if that is past the clock's range.
pub(crate) fn bound_from_now(bound: Duration) -> Option<tokio::time::Instant> {
    tokio::time::Instant::now().checked_add(bound)
}

/// [`answered_by`] with the backend's own [`LockBackend::response_bound`], counted from now:
/// what a call that does not wait for a lock (a try, a release, an extension, an inquiry)
/// gets.
pub(crate) async fn answered_within<T>(
    backend: &dyn LockBackend,
    key: &LockKey,
    what: Bounded,
    attempt: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let bound = backend.response_bound();
    answered_by(bound_from_now(bound), bound, backend, key, what, attempt).await
}

/// The service a lock lives in. Object-safe: `Arc<dyn LockBackend>` is how configuration
/// swaps backends.
///
/// Implementations are driven by [`crate::Locker`], which validates input, runs the
/// watchdog and the lost signal, and handles drop. Each method documents what a backend
/// must guarantee; the conformance suite checks it.
#[async_trait]
pub trait LockBackend: Send + Sync + Debug + 'static {
    /// Scheme, consistency class and capabilities.
    fn info(&self) -> BackendInfo;

    /// Takes the lock if it is free (or already held by `req.owner`), without waiting.
    ///
    /// # Behavior
    /// - free key: grant with depth 1 and a token greater than any earlier token of the key;
    /// - held by `req.owner`: depth + 1, same token, and the server-side lease becomes
    ///   `max(lease left, req.ttl)`: a reentrant acquisition never shortens the lease an
    ///   outer guard relies on;
    /// - retried with the same `req.attempt` after it already took effect: the same
    ///   grant again, never one more hold;
    /// - held by anyone else, in any format: `Ok(None)`.
    ///
    /// # Cancel safety
    /// Dropping the future must not leave a lock nobody will release.
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>>;

    /// Like [`LockBackend::try_acquire`] but waits up to `wait` for the lock, woken by the
    /// backend's notification; polling only as a bounded fallback.
    ///
    /// # Errors
    /// [`crate::Error::Timeout`] when `wait` passes without a grant.
    ///
    /// # Cancel safety
    /// Dropping the future leaves nothing behind: no lock, node, row or subscription.
    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant>;

    /// Extends the lease of `grant` to at least `ttl` from now, checking ownership on the
    /// server. Never shortens it: the server-side lease becomes `max(lease left, ttl)`,
    /// because other guards of the same reentrant hold may rely on the longer one.
    ///
    /// # Errors
    /// [`crate::Error::NotHeld`] when the key is not held by `grant.owner`.
    ///
    /// # Cancel safety
    /// Dropping the future (the watchdog gives up on a renewal at the local lease's end,
    /// an extension at [`LockBackend::response_bound`]) leaves the hold as it was or
    /// renewed, never shorter on the server than the client counts it, and leaves no
    /// connection, session or local state that blocks the hold's release or others'.
    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()>;

    /// Gives back one hold, checking ownership on the server. Publishes the release so
    /// waiters wake. A partial release leaves the lease as it is (never shortens it); a
    /// release retried for the same grant takes effect once.
    ///
    /// # Errors
    /// [`crate::Error::NotHeld`] when the key is not held by `grant.owner` (expired,
    /// released already, or taken over): nothing is changed then.
    ///
    /// # Cancel safety
    /// [`crate::LockGuard`] never drops a release half-way: it finishes in the background
    /// when the guard's caller stops waiting for it. A future dropped anyway (by a caller of
    /// the backend itself) must leave no lock that outlives its lease.
    async fn release(&self, grant: &Grant) -> Result<Released>;

    /// Reports who holds `key`, if anyone (for a key held by several readers or permits,
    /// one of them; [`LockBackend::holders`] lists them all).
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>>;

    /// Every live hold of `key`: one entry per owner and kind (a reentrant hold is one
    /// entry with its depth), one per permit. Default: what [`LockBackend::inspect`] reports.
    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        Ok(self.inspect(key).await?.into_iter().collect())
    }

    /// The latest instant `grant` can be trusted on what the backend last heard from the
    /// server, whatever its lease (ZooKeeper: the last answered request plus 2/3 of the
    /// session timeout), or `None` when the lease alone decides. Checked without I/O every
    /// time a guard says whether it is valid, so a holder that was paused past it never
    /// wakes up believing in a hold its session may have taken with it. Default: `None`.
    fn validity_bound(&self, grant: &Grant) -> Option<Instant> {
        let _ = grant;
        None
    }

    /// How long past its wait an acquisition may go unanswered before [`crate::Locker`]
    /// gives up on it: a backend's own bound on a request the server does not answer (a
    /// link gone silent), with room for its slowest legitimate answer after a deadline.
    /// The locker then returns a retryable [`crate::Error::Backend`] and gives back by its
    /// attempt id whatever the attempt may still take. A zero wait is bounded by this alone;
    /// a wait without a deadline (the default of [`crate::Locker::acquire`]) is not
    /// bounded, and neither is anything when this is [`Duration::MAX`]. A re-entry through
    /// [`crate::LockGuard::reenter`] is bounded like a zero wait, and so are a guard's
    /// release and extension (the watchdog's renewals end at the local lease) and the
    /// locker's `inspect` and `holders`. Default:
    /// [`DEFAULT_RESPONSE_BOUND`].
    fn response_bound(&self) -> Duration {
        DEFAULT_RESPONSE_BOUND
    }

    /// One plain round trip to the service (`PING`, `SELECT 1`, ...), for health checks and
    /// for benchmarks that compare a lock with the service's own latency.
    async fn ping(&self) -> Result<()> {
        Err(crate::Error::Unsupported {
            backend: self.info().scheme,
            what: "ping".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_ids_are_distinct_v4_and_never_nil() {
        let ids: Vec<Uuid> = (0..10_000).map(|_| new_attempt_id()).collect();
        let distinct: std::collections::HashSet<&Uuid> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
        for id in &ids {
            assert!(!id.is_nil());
            assert_eq!(id.get_version(), Some(uuid::Version::Random));
        }
        // Threads share one sequence.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| (0..1_000).map(|_| new_attempt_id()).collect::<Vec<_>>())
            })
            .collect();
        let mut all: std::collections::HashSet<Uuid> = ids.into_iter().collect();
        for thread in threads {
            for id in thread.join().unwrap() {
                assert!(all.insert(id), "{id} was made twice");
            }
        }
    }
}
