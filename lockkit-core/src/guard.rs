//! The lock guard, the hold it shares with nested guards, and the watchdog that keeps it.

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    AcquireRequest, Error, FencingToken, Grant, LockBackend, LockKey, LockOptions, LostReason,
    OwnerId, Released, Result, lost::LossSignal, options::validate_ttl,
};

/// How much of a lease is kept back locally for clock drift between client and server:
/// 1% of the TTL plus 2 ms, as Redlock does. The guard counts itself valid only until
/// `lease_start + ttl - drift`, so it gives up before the server can.
pub fn local_validity(ttl: Duration) -> Duration {
    let drift = ttl / 100 + Duration::from_millis(2);
    ttl.saturating_sub(drift)
}

/// Pause between renewal attempts after a transient backend error.
fn retry_delay(period: Duration) -> Duration {
    (period / 4).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

struct Lease {
    /// The TTL used for renewals (changed by `extend`).
    ttl: Duration,
    /// Local deadline on the monotonic clock, as of `suspended_at`: past [`Lease::until`],
    /// the hold counts as lost.
    valid_until: Instant,
    /// The machine's suspended time ([`crate::suspend::suspended`]) when `valid_until` was
    /// counted: the monotonic clock stands still while the machine is suspended, the
    /// server's lease does not.
    suspended_at: Duration,
    /// The backend reported the lock fully released.
    released: bool,
}

impl Lease {
    /// The local deadline, moved earlier by the time the machine spent suspended since it
    /// was counted.
    fn until(&self) -> Instant {
        self.until_as_of(crate::suspend::suspended())
    }

    /// The local deadline as it stands when the machine's suspended time is `suspended`.
    fn until_as_of(&self, suspended: Duration) -> Instant {
        moved_by_suspend(self.valid_until, self.suspended_at, suspended)
    }

    /// Moves the deadline to `until`, counted when the machine's suspended time was
    /// `suspended_at`, unless what is left of the current one is later: a renewal or a
    /// re-entry never shortens the lease. Both are compared as of the later of the two
    /// counts, so a renewal that began before a suspend (and counts it) does not take it off
    /// a deadline counted after the resume again.
    fn extend_to(&mut self, until: Instant, suspended_at: Duration) {
        let as_of = self.suspended_at.max(suspended_at);
        let current = self.until_as_of(as_of);
        let new = moved_by_suspend(until, suspended_at, as_of);
        self.valid_until = current.max(new);
        self.suspended_at = as_of;
    }

    /// Sets the deadline to `until`, counted when the machine's suspended time was
    /// `suspended_at` (an extension, which may shorten it).
    fn set(&mut self, until: Instant, suspended_at: Duration) {
        self.valid_until = until;
        self.suspended_at = suspended_at;
    }
}

/// `deadline`, counted when the machine's suspended time was `counted_at`, as it stands
/// when it is `now_at`: earlier by the time suspended in between (never later, whatever
/// order the two readings come in).
fn moved_by_suspend(deadline: Instant, counted_at: Duration, now_at: Duration) -> Instant {
    let slept = now_at.saturating_sub(counted_at);
    if slept.is_zero() {
        return deadline;
    }
    // Past the clock's earliest instant: long over.
    deadline
        .checked_sub(slept)
        .unwrap_or_else(|| deadline.min(Instant::now()))
}

/// What all guards of one owner's hold on one key share: the lease, the loss signal and
/// the watchdog.
pub(crate) struct HoldShared {
    backend: Arc<dyn LockBackend>,
    /// The grant that started the hold; renewals use it.
    grant: Grant,
    options: LockOptions,
    loss: LossSignal,
    /// Serialises renew, extend and release, so a renewal can never follow a release.
    op: tokio::sync::Mutex<()>,
    lease: Mutex<Lease>,
    /// Tells the keeper task to stop.
    stop: CancellationToken,
    /// Wakes the keeper after `extend` moved the lease.
    changed: Notify,
    /// Guards on this hold not yet released or dropped.
    guards: std::sync::atomic::AtomicU32,
    /// The longest lease this hold ever asked the server for (ms): how long a record of
    /// it may outlive it there. Shared with the owner, which remembers it past the hold.
    longest_lease: Arc<std::sync::atomic::AtomicU64>,
    /// Set once a release was answered "fully released": the server keeps no record of
    /// this hold. Shared with the owner, which remembers it past the hold.
    let_go: Arc<std::sync::atomic::AtomicBool>,
    /// Counted in `lockkit_holds` until released (or dropped).
    counted: crate::telemetry::Gauged,
    /// The runtime the keeper runs on.
    runtime: tokio::runtime::Handle,
    /// Whether the keeper task runs yet, and the hold's entry among those waiting for it.
    keeper: Mutex<KeeperStart>,
}

/// A hold's keeper: not yet started (waiting in [`crate::keeper_start`], or not at all on a
/// current-thread runtime, where it starts at once), or started.
#[derive(Default)]
struct KeeperStart {
    started: bool,
    waiting: Option<crate::keeper_start::EntryKey>,
}

impl crate::keeper_start::Deferred for HoldShared {
    fn start_keeper(self: Arc<Self>) {
        let mut keeper = self.keeper.lock().unwrap_or_else(|e| e.into_inner());
        if keeper.started {
            drop(keeper);
            // The caller (the timer thread, a thread that fired the loss) may hold the last
            // reference, and a grant's backend state may need a runtime to be dropped in
            // (a pooled connection): drop it on the hold's runtime.
            if let Some(shared) = Arc::into_inner(self) {
                let runtime = shared.runtime.clone();
                runtime.spawn(async move { drop(shared) });
            }
            return;
        }
        keeper.started = true;
        if let Some(entry) = keeper.waiting.take() {
            crate::keeper_start::forget(entry);
        }
        drop(keeper);
        let runtime = self.runtime.clone();
        runtime.spawn(keep(self));
    }
}

impl HoldShared {
    /// Notes that the server may now keep the hold for `ttl` from now.
    fn asked_for(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.longest_lease
            .fetch_max(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl HoldShared {
    fn lease(&self) -> MutexGuard<'_, Lease> {
        // A poisoned lease only means another thread panicked mid-update of plain data.
        self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lost_error(&self, reason: LostReason) -> Error {
        Error::Lost {
            key: self.grant.key.clone(),
            token: self.grant.token,
            reason,
        }
    }

    /// Until when the hold is believed: the local lease deadline, capped by what the
    /// backend last heard from the server ([`LockBackend::validity_bound`]).
    fn believed_until(&self, lease: &Lease) -> Instant {
        match self.backend.validity_bound(&self.grant) {
            Some(bound) => lease.until().min(bound),
            None => lease.until(),
        }
    }

    /// Fires `LeaseExpired` if the local deadline has passed; returns the loss reason.
    fn check_lost(&self) -> Option<LostReason> {
        if !self.loss.is_fired() {
            let lease = self.lease();
            if !lease.released && Instant::now() >= self.believed_until(&lease) {
                drop(lease);
                self.loss.fire(LostReason::LeaseExpired);
            }
        }
        self.loss.reason()
    }
}

/// A hold: owned by every guard on it; stops its keeper task when the last one goes.
pub(crate) struct Hold {
    shared: Arc<HoldShared>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.shared.stop.cancel();
        let waiting = self
            .shared
            .keeper
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .waiting
            .take();
        if let Some(entry) = waiting {
            crate::keeper_start::forget(entry);
        }
    }
}

impl Hold {
    /// Starts a hold from a fresh grant, with its keeper (watchdog + local expiry): spawned
    /// when it is first due (the first renewal or the local expiry), or at once when the
    /// hold is lost or extended first, or on a current-thread runtime (see
    /// [`crate::keeper_start`]). A hold released before then never gets a task.
    pub(crate) fn start(
        backend: Arc<dyn LockBackend>,
        grant: Grant,
        options: LockOptions,
        runtime: &tokio::runtime::Handle,
    ) -> Arc<Hold> {
        // The suspended time now, not at `lease_start`: a suspend during the acquisition's
        // round trip is not counted (the next renewal counts from its own start).
        let lease = Lease {
            ttl: grant.ttl,
            valid_until: grant.lease_start + local_validity(grant.ttl),
            suspended_at: crate::suspend::suspended(),
            released: false,
        };
        let scheme = backend.info().scheme;
        let shared = Arc::new(HoldShared {
            backend,
            loss: grant.loss.clone(),
            grant,
            options,
            op: tokio::sync::Mutex::new(()),
            lease: Mutex::new(lease),
            stop: CancellationToken::new(),
            changed: Notify::new(),
            guards: std::sync::atomic::AtomicU32::new(0),
            longest_lease: Arc::default(),
            let_go: Arc::default(),
            counted: crate::telemetry::Gauged::hold(scheme),
            runtime: runtime.clone(),
            keeper: Mutex::default(),
        });
        shared.asked_for(shared.grant.ttl);
        let hold = Arc::new(Hold {
            shared: shared.clone(),
        });
        if !defer_keeper(&shared, runtime) {
            crate::keeper_start::Deferred::start_keeper(shared);
        }
        hold
    }

    /// Still usable for a reentrant acquisition.
    pub(crate) fn is_live(&self) -> bool {
        self.shared.check_lost().is_none() && !self.shared.lease().released
    }

    pub(crate) fn token(&self) -> FencingToken {
        self.shared.grant.token
    }

    /// The longest lease (ms) this hold asked for, kept up to date as it is extended.
    pub(crate) fn longest_lease(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.shared.longest_lease.clone()
    }

    /// Whether a release of this hold was answered "fully released", kept up to date.
    pub(crate) fn let_go(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.shared.let_go.clone()
    }

    /// Takes in a reentrant grant on this hold. The backend never shortens the lease on a
    /// reentrant acquisition (it becomes the longer of what was left and the new TTL), so
    /// the local deadline becomes the later of the two; it never moves earlier.
    pub(crate) fn absorb(&self, grant: &Grant) {
        self.shared.asked_for(grant.ttl);
        let mut lease = self.shared.lease();
        let reentrant_until = grant.lease_start + local_validity(grant.ttl);
        lease.extend_to(reentrant_until, crate::suspend::suspended());
    }

    /// Whether no guard is on this hold any more (all released or dropped, or their
    /// releases under way): nobody believes in it.
    pub(crate) fn is_abandoned(&self) -> bool {
        self.shared.guards.load(std::sync::atomic::Ordering::SeqCst) == 0
    }

    /// Marks the hold lost because the backend no longer knows it.
    pub(crate) fn fire_lost(&self, reason: LostReason) -> Error {
        self.shared.loss.fire(reason);
        // The reason that fired first (a backend may have said why already, say
        // `SessionLost`): the error and `lost()` name the same one (helper-35's review).
        let fired = self.shared.loss.reason().unwrap_or(reason);
        self.shared.lost_error(fired)
    }
}

/// Puts a new hold's keeper off until it is first due (see [`crate::keeper_start`]); `false`
/// if it must start now (a current-thread runtime, no timer thread).
fn defer_keeper(shared: &Arc<HoldShared>, runtime: &tokio::runtime::Handle) -> bool {
    if !crate::keeper_start::defers_on(runtime) {
        return false;
    }
    // What the keeper first waits for, as `keep` computes it. The deadline was counted just
    // now (`Hold::start`, the only caller): no suspend to take off, and the suspended time
    // is not read again on the acquisition's path (a resume starts the keeper anyway:
    // `keeper_start::start_all`).
    let valid_until = shared.lease().valid_until;
    let due = if shared.options.watchdog {
        (shared.grant.lease_start + shared.options.renew_period()).min(valid_until)
    } else {
        valid_until
    };
    let deferred: Arc<dyn crate::keeper_start::Deferred> = shared.clone();
    {
        // Held while the entry goes in: a keeper started meanwhile (the timer, a loss)
        // waits for it and removes it.
        let mut keeper = shared.keeper.lock().unwrap_or_else(|e| e.into_inner());
        keeper.waiting = crate::keeper_start::defer(due, Arc::downgrade(&deferred));
        if keeper.waiting.is_none() {
            return false;
        }
    }
    // A loss (a backend's session ended, a release found the hold gone) is reported by the
    // keeper at once, as it always was: start it then.
    let weak = Arc::downgrade(shared);
    shared.loss.on_fire(move || {
        if let Some(shared) = weak.upgrade() {
            crate::keeper_start::Deferred::start_keeper(shared);
        }
    });
    true
}

/// Tells the operator, at `error`, that a hold was lost while it was held (not after its
/// release).
fn report_loss(shared: &HoldShared) {
    if shared.lease().released || shared.stop.is_cancelled() {
        return;
    }
    let reason = shared.loss.reason().unwrap_or(LostReason::NotOurs);
    crate::telemetry::lost(shared.backend.info().scheme, &shared.grant.key, reason);
    tracing::error!(
        key = %shared.grant.key,
        backend = shared.backend.info().scheme,
        owner = %shared.grant.owner,
        token = shared.grant.token.get(),
        %reason,
        "lock lost while held"
    );
}

/// The keeper: renews at the renewal period while the hold lives (watchdog), and fires
/// the loss signal when the local lease deadline passes without a confirmed renewal.
async fn keep(shared: Arc<HoldShared>) {
    let period = shared.options.renew_period();
    let hold_deadline = shared
        .options
        .max_hold
        .and_then(|max| shared.grant.lease_start.checked_add(max));
    let mut next_renew = shared
        .options
        .watchdog
        .then(|| shared.grant.lease_start + period);
    loop {
        let (valid_until, released) = {
            let lease = shared.lease();
            (lease.until(), lease.released)
        };
        if released {
            return;
        }
        let wake = next_renew.map_or(valid_until, |n| n.min(valid_until));
        tokio::select! {
            biased;
            _ = shared.stop.cancelled() => return,
            _ = shared.loss.fired() => {
                report_loss(&shared);
                return;
            }
            _ = shared.changed.notified() => {
                // `extend` moved the lease and may have changed its TTL: count the next
                // renewal from now, at the period of the TTL it set (not the old one, or a
                // shorter lease would lapse before its first renewal).
                if next_renew.is_some() {
                    let ttl = shared.lease().ttl;
                    next_renew = Some(Instant::now() + shared.options.renew_period_for(ttl));
                }
                continue;
            }
            _ = tokio::time::sleep_until(wake) => {}
            // The lease may have run out in a suspend the monotonic clock did not count, or
            // the backend's bound ([`LockBackend::validity_bound`]: a session heard from
            // before it): the hold is lost when `is_valid()` would say so.
            () = crate::suspend::resumed() => {
                if shared.check_lost().is_some() {
                    report_loss(&shared);
                    return;
                }
            }
        }
        let now = Instant::now();
        if now >= shared.lease().until() {
            shared.loss.fire(LostReason::LeaseExpired);
            report_loss(&shared);
            return;
        }
        let Some(due) = next_renew else { continue };
        if now < due {
            continue;
        }
        // `max_hold`: renew only up to the cap, then let the lease run out.
        if hold_deadline.is_some_and(|deadline| deadline <= now) {
            next_renew = None;
            continue;
        }
        // Another guard's operation (a release or an extension) may hold `op` for long: a
        // slow server, or a release future its caller polled once and keeps without polling.
        // The hold cannot be said held past its local lease meanwhile, so the wait for
        // `op` ends there, with the loss signal.
        let _op = tokio::select! {
            biased;
            op = shared.op.lock() => op,
            _ = shared.stop.cancelled() => return,
            () = lease_runs_out(&shared) => {
                if !shared.lease().released && !shared.stop.is_cancelled() {
                    shared.loss.fire(LostReason::LeaseExpired);
                    report_loss(&shared);
                }
                return;
            }
        };
        if shared.stop.is_cancelled() || shared.loss.is_fired() || shared.lease().released {
            return;
        }
        let start = Instant::now();
        let suspended_at_start = crate::suspend::suspended();
        // The lease's TTL as it is now, under `op`: an `extend` that held `op` while this
        // renewal fell due set a new one, and renewing with the TTL read before it cut the
        // extended lease short (helper-35's review).
        let ttl = shared.lease().ttl;
        let renew_ttl = match hold_deadline {
            Some(deadline) => ttl.min(deadline.saturating_duration_since(start)),
            None => ttl,
        };
        if renew_ttl.is_zero() {
            next_renew = None;
            continue;
        }
        let span = tracing::debug_span!(
            "lockkit.renew",
            key = %shared.grant.key,
            backend = shared.backend.info().scheme,
            token = shared.grant.token.get(),
            ttl_ms = u64::try_from(renew_ttl.as_millis()).unwrap_or(u64::MAX),
            outcome = tracing::field::Empty,
        );
        // Answered within what is left of the lease, or it counts as lost: `None`.
        let renewal = tokio::select! {
            biased;
            renewed = shared
                .backend
                .renew(&shared.grant, renew_ttl)
                .instrument(span.clone()) => Some(renewed),
            () = lease_runs_out(&shared) => None,
        };
        let label = match &renewal {
            Some(Ok(())) => "renewed",
            Some(Err(Error::NotHeld { .. } | Error::Lost { .. })) => "not held",
            Some(Err(_)) => "failed",
            None => "unanswered",
        };
        span.record("outcome", label);
        crate::telemetry::renewal(shared.backend.info().scheme, &shared.grant.key, label);
        drop(span);
        match renewal {
            Some(Ok(())) => {
                let mut lease = shared.lease();
                // Never earlier than it was: a renewal never shortens the server's lease.
                lease.extend_to(start + local_validity(renew_ttl), suspended_at_start);
                next_renew = if renew_ttl < ttl {
                    None // capped by max_hold: this was the last renewal
                } else {
                    Some(start + shared.options.renew_period_for(lease.ttl))
                };
            }
            Some(Err(Error::NotHeld { .. } | Error::Lost { .. })) => {
                shared.loss.fire(LostReason::NotOurs);
                report_loss(&shared);
                return;
            }
            Some(Err(error)) => {
                tracing::warn!(
                    key = %shared.grant.key,
                    backend = shared.backend.info().scheme,
                    %error,
                    "lease renewal failed; retrying"
                );
                // At the period of the lease in force (an `extend` may have shortened it),
                // and within what is left of it: a retry timed from the options' period
                // came after a shorter extended lease had run out (helper-35's review).
                let (ttl, valid_until) = {
                    let lease = shared.lease();
                    (lease.ttl, lease.until())
                };
                let now = Instant::now();
                let left = valid_until.saturating_duration_since(now);
                let delay = retry_delay(shared.options.renew_period_for(ttl)).min(left / 2);
                next_renew = Some(now + delay);
            }
            None => {
                shared.loss.fire(LostReason::LeaseExpired);
                report_loss(&shared);
                return;
            }
        }
    }
}

/// Resolves once the hold's local lease has run out: at its deadline on the monotonic clock,
/// or when a resume is noticed past it or past the backend's bound (that clock did not
/// count the suspend, and a wait counted on it before the suspend would end only as long
/// after the resume as it had left before). Also resolves once the hold is lost.
async fn lease_runs_out(shared: &HoldShared) {
    loop {
        let until = shared.lease().until();
        if Instant::now() >= until {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            () = crate::suspend::resumed() => {
                if shared.check_lost().is_some() {
                    return;
                }
            }
        }
    }
}

/// Gives back one hold; shared by `release` and `Drop`.
async fn release_one(hold: Arc<Hold>, grant: Grant) -> Result<Released> {
    let shared = &hold.shared;
    // Counted off before waiting for `op`: a re-entry that races this release and gets a
    // fresh grant must see that no guard believes in this hold any more.
    shared
        .guards
        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    let _op = shared.op.lock().await;
    if let Some(reason) = shared.check_lost() {
        // A lost hold is not released on the server: what the server holds for this
        // owner may by now be a newer hold of the same owner (taken after this one ran
        // out), which an owner-checked release cannot tell apart. Its lease runs out.
        return Err(shared.lost_error(reason));
    }
    // Bounded: on a link gone silent the caller hears an error at the backend's bound.
    // The backend's release is not dropped there but goes on in the background (one may
    // have let go of its own record of the hold and not yet of the server's lock), and its
    // late outcome is settled as an on-time one would be.
    let scheme = shared.backend.info().scheme;
    let release = {
        let (backend, grant) = (shared.backend.clone(), grant.clone());
        async move { backend.release(&grant).await }
    };
    let late = {
        let shared = hold.shared.clone();
        move |outcome: Result<Released>| {
            if let Err(error) = settle_release(&shared, outcome) {
                tracing::debug!(key = %shared.grant.key, %error, "a release that ran late failed");
            }
        }
    };
    let outcome = crate::backend::answered_within(
        shared.backend.as_ref(),
        &grant.key,
        crate::backend::Bounded::Release,
        async move {
            crate::detach::detached(release, late)
                .await
                .unwrap_or_else(|| {
                    Err(Error::backend(
                        scheme,
                        false,
                        "the release panicked; the lease will run out",
                    ))
                })
        },
    )
    .await;
    // After an error the watchdog stops when the hold is dropped, not here: an acquisition
    // of the same owner may still join the hold (its re-entry reached the server before
    // this release), and needs its watchdog.
    settle_release(shared, outcome)
}

/// What a release's outcome means for its hold, on time or late: a full release ends the
/// hold (and tells sibling guards the server let go); a hold the server no longer knows is
/// lost.
fn settle_release(shared: &HoldShared, outcome: Result<Released>) -> Result<Released> {
    if matches!(outcome, Ok(Released::Fully)) {
        crate::telemetry::released(
            shared.backend.info().scheme,
            &shared.grant.key,
            shared.grant.lease_start.elapsed(),
        );
        // Read now, not before `op`: a sibling guard whose release went first is gone.
        if shared.guards.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            // The server let go although other guards of this hold remain (it counted
            // fewer holds than this client: a depth that lapsed on some Redlock masters, a
            // retried acquisition): they must not go on believing in it.
            shared.loss.fire(LostReason::NotOurs);
        }
        shared.lease().released = true;
        shared
            .let_go
            .store(true, std::sync::atomic::Ordering::SeqCst);
        shared.stop.cancel();
        shared.counted.end();
    }
    match outcome {
        Err(Error::NotHeld { .. }) => {
            shared.loss.fire(LostReason::NotOurs);
            Err(shared.lost_error(LostReason::NotOurs))
        }
        outcome => outcome,
    }
}

/// A held lock. Release it with [`LockGuard::release`] to see errors; dropping it releases
/// in the background.
///
/// The guard is the only handle on the hold: renewal (the watchdog), extension and release
/// all go through it and are serialised, so a renewal can never follow a release.
///
/// # Drop
/// Dropping a guard never blocks and never panics. Inside a Tokio runtime the release is
/// spawned onto it; without one, the watchdog stops and the lease runs out on the server.
///
/// A released guard is gone, so it cannot be released or extended twice:
/// ```compile_fail,E0382
/// # async fn f(locker: lockkit_core::Locker) -> lockkit_core::Result<()> {
/// let guard = locker.acquire("k").await?;
/// guard.release().await?;
/// guard.extend(std::time::Duration::from_secs(1)).await?; // error: use of moved value
/// # Ok(()) }
/// ```
#[must_use = "dropping the guard releases the lock at once; hold it while you work"]
pub struct LockGuard {
    hold: Arc<Hold>,
    grant: Grant,
    done: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.grant.key)
            .field("owner", &self.grant.owner)
            .field("token", &self.grant.token)
            .field("depth", &self.grant.depth)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl LockGuard {
    pub(crate) fn new(hold: Arc<Hold>, grant: Grant) -> Self {
        hold.shared
            .guards
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        LockGuard {
            hold,
            grant,
            done: false,
        }
    }

    fn shared(&self) -> &HoldShared {
        &self.hold.shared
    }

    /// The lock's name.
    pub fn key(&self) -> &LockKey {
        &self.grant.key
    }

    /// The owner holding it.
    pub fn owner(&self) -> OwnerId {
        self.grant.owner
    }

    /// The fencing token: pass it with every write made under this lock.
    pub fn token(&self) -> FencingToken {
        self.grant.token
    }

    /// The owner's hold count when this guard was granted (1 for the outermost guard).
    pub fn depth(&self) -> u32 {
        self.grant.depth
    }

    /// The kind of hold: a plain lock, a read or write hold, or a semaphore permit.
    pub fn kind(&self) -> crate::LockKind {
        self.grant.kind
    }

    /// The process identity stored beside this hold: the one its first grant wrote (a
    /// re-entry keeps the outer hold's, as the backend does).
    pub fn holder(&self) -> &crate::HolderIdentity {
        &self.shared().grant.identity
    }

    /// The backend's grant behind this guard, for driving the backend SPI directly.
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Resolves when the hold is lost or can no longer be confirmed: renewal refused,
    /// session ended, or the local lease deadline passed (a monotonic clock). Resolves at
    /// once if that already happened. Never resolves for a hold that stays valid.
    ///
    /// # Cancel safety
    /// Cancel safe; the returned future owns what it needs and may outlive the guard.
    pub fn lost(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        self.shared().loss.fired()
    }

    /// Whether the hold is still confirmed: not lost and before the local deadline.
    pub fn is_valid(&self) -> bool {
        self.shared().check_lost().is_none()
    }

    /// When the hold was found lost (on the local monotonic clock): from then on its
    /// holder no longer believes it holds the lock. `None` while it is not lost.
    pub fn lost_at(&self) -> Option<Instant> {
        self.shared().check_lost()?;
        let fired_at = self.shared().loss.fired_at()?;
        // `is_valid` turned false at the local lease deadline even if the keeper noticed
        // the expiry later: the belief ended at the earlier of the two.
        let lease = self.shared().lease();
        Some(if lease.released {
            fired_at
        } else {
            fired_at.min(self.shared().believed_until(&lease))
        })
    }

    /// The local lease deadline (the hold is not valid past it), or `None` once lost.
    /// [`LockGuard::is_valid`] can turn false before it, when the backend can no longer
    /// vouch for the hold ([`LockBackend::validity_bound`]: a ZooKeeper session silent for
    /// 2/3 of its timeout).
    pub fn valid_until(&self) -> Option<Instant> {
        if self.is_valid() {
            Some(self.shared().lease().until())
        } else {
            None
        }
    }

    /// Extends the lease to at least `ttl` from now (checked on the server), and makes
    /// `ttl` the TTL the watchdog renews with from now on. The server never shortens a
    /// lease (other guards of a reentrant hold may rely on it): extending to a shorter TTL
    /// only makes this guard count itself valid for less and renew more often.
    ///
    /// # Errors
    /// [`Error::Lost`] if the hold was lost (also when the server no longer knows it);
    /// [`Error::InvalidTtl`] before any I/O; backend errors as they come, and a retryable
    /// [`Error::Backend`] if the server gives no answer within the backend's
    /// [`crate::LockBackend::response_bound`] (the extension may or may not have happened).
    ///
    /// # Cancel safety
    /// If dropped mid-way the extension may or may not have happened; the hold is intact.
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        let shared = self.shared();
        validate_ttl(ttl, &shared.backend.info())?;
        let _op = shared.op.lock().await;
        if let Some(reason) = shared.check_lost() {
            return Err(shared.lost_error(reason));
        }
        let start = Instant::now();
        let suspended_at_start = crate::suspend::suspended();
        // Before the request: once sent, the server may keep the hold this long.
        shared.asked_for(ttl);
        let extended = crate::backend::answered_within(
            shared.backend.as_ref(),
            &shared.grant.key,
            crate::backend::Bounded::Extension,
            shared.backend.renew(&shared.grant, ttl),
        );
        match extended.await {
            Ok(()) => {
                let mut lease = shared.lease();
                lease.ttl = ttl;
                lease.set(start + local_validity(ttl), suspended_at_start);
                drop(lease);
                // The keeper must count its next renewal from this TTL: start it now if it
                // was waiting for the old one.
                crate::keeper_start::Deferred::start_keeper(self.hold.shared.clone());
                shared.changed.notify_one();
                Ok(())
            }
            Err(Error::NotHeld { .. } | Error::Lost { .. }) => {
                Err(self.hold.fire_lost(LostReason::NotOurs))
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the same lock again for the same owner, without waiting: depth + 1, same
    /// token, same lease and watchdog. Release every guard to free the lock.
    ///
    /// # Errors
    /// [`Error::Lost`] if the hold is lost.
    pub async fn reenter(&self) -> Result<LockGuard> {
        let shared = self.shared();
        if let Some(reason) = shared.check_lost() {
            return Err(shared.lost_error(reason));
        }
        if !self.grant.kind.is_reentrant() {
            return Err(crate::Error::Unsupported {
                backend: shared.backend.info().scheme,
                what: "re-entering a semaphore permit (every acquisition is a new permit)".into(),
            });
        }
        let ttl = shared.lease().ttl;
        let mut req = AcquireRequest::new(
            self.grant.key.clone(),
            self.grant.owner,
            ttl,
            shared.loss.clone(),
        )
        .with_kind(self.grant.kind);
        // The same owner: one made for a single acquisition still never returns.
        req.owner_returns = self.grant.owner_returns;
        // Bounded like a zero wait: a re-entry cut off here is given back by the backend
        // (its attempt runs detached) when it completes.
        let reentered = crate::backend::answered_within(
            shared.backend.as_ref(),
            &self.grant.key,
            crate::backend::Bounded::Acquisition,
            shared.backend.try_acquire(&req),
        )
        .await?;
        match reentered {
            Some(grant)
                if grant.depth > 1 && grant.token == shared.grant.token && self.hold.is_live() =>
            {
                self.hold.absorb(&grant);
                Ok(LockGuard::new(self.hold.clone(), grant))
            }
            Some(grant) => {
                // The server had forgotten our hold: this is a new lock, not a re-entry.
                // Give it back (it never joined this hold, whose guards it must not count).
                let lost = self.hold.fire_lost(LostReason::NotOurs);
                let backend = shared.backend.clone();
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let _ = backend.release(&grant).await;
                    });
                }
                Err(lost)
            }
            None => Err(self.hold.fire_lost(LostReason::NotOurs)),
        }
    }

    /// Gives back this hold (one level of a reentrant lock) and reports the outcome.
    ///
    /// # Errors
    /// [`Error::Lost`] if the hold was lost before the release: nothing is sent then, since
    /// what the server holds for this owner may be a newer hold of the same owner, and the
    /// lease runs out by itself; backend errors otherwise, in which case the lease runs out
    /// on the server. A release the server does not answer within the backend's
    /// [`crate::LockBackend::response_bound`] (a link gone silent) ends with a
    /// non-retryable [`Error::Backend`] then, rather than wait for good; the release goes
    /// on in the background, and if it never reaches the server the lease runs out there.
    ///
    /// # Cancel safety
    /// Dropping this future does not stop the release: the rest of it goes on in a task of
    /// its own. Poll it to completion or drop it: one polled once and then kept without
    /// being polled holds up this hold's other operations (the watchdog then reports the
    /// other guards' hold lost at its local lease end rather than wait past it).
    pub async fn release(mut self) -> Result<Released> {
        self.done = true;
        let span = tracing::debug_span!(
            "lockkit.release",
            key = %self.grant.key,
            backend = self.shared().backend.info().scheme,
            owner = %self.grant.owner,
            token = self.grant.token.get(),
            depth = self.grant.depth,
            outcome = tracing::field::Empty,
        );
        let outcome = self.release_inner().instrument(span.clone()).await;
        span.record(
            "outcome",
            match &outcome {
                Ok(Released::Fully) => "released",
                Ok(Released::Partially { .. }) => "partially",
                Err(Error::Lost { .. }) => "lost",
                Err(_) => "error",
            },
        );
        outcome
    }

    async fn release_inner(&self) -> Result<Released> {
        // Finished even if this future is dropped (then in a task of its own), so a
        // cancelled release still reaches the server.
        let work = release_one(self.hold.clone(), self.grant.clone());
        crate::detach::detached(work, |outcome| {
            if let Err(error) = outcome {
                tracing::debug!(%error, "a release whose caller went away did not complete");
            }
        })
        .await
        .unwrap_or_else(|| {
            Err(Error::backend(
                self.shared().backend.info().scheme,
                false,
                "the release panicked; the lease will run out",
            ))
        })
    }
}

/// Releases `grant` in the background if a runtime is there; otherwise leaves it to the lease.
fn spawn_or_forget(hold: Arc<Hold>, grant: Grant) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            if let Err(error) = release_one(hold, grant).await {
                tracing::debug!(%error, "background release after drop did not complete");
            }
        });
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            spawn_or_forget(self.hold.clone(), self.grant.clone());
        }
    }
}

/// A guard's fencing token, so storage-side fences take a `&LockGuard` or a bare token.
impl From<&LockGuard> for FencingToken {
    fn from(guard: &LockGuard) -> Self {
        guard.token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renewal that began before a suspend and was answered after it, while a re-entry
    /// counted after the resume had moved the deadline: the renewal's deadline is the older
    /// count, and must not take the suspend off the re-entry's again.
    #[test]
    fn a_renewal_counted_before_a_suspend_does_not_shorten_a_later_count() {
        let now = Instant::now();
        let mut lease = Lease {
            ttl: Duration::from_secs(30),
            // The re-entry's deadline, counted after a 20 s suspend (baseline 50 s).
            valid_until: now + Duration::from_secs(30),
            suspended_at: Duration::from_secs(50),
            released: false,
        };
        // The renewal began at baseline 30 s, before the suspend: its deadline has had
        // the 20 s taken off since, and is earlier than what is left.
        lease.extend_to(now + Duration::from_secs(5), Duration::from_secs(30));
        assert_eq!(
            lease.until_as_of(Duration::from_secs(50)),
            now + Duration::from_secs(30),
            "the renewal shortened what was left"
        );
        // A suspend after both still counts once.
        assert_eq!(
            lease.until_as_of(Duration::from_secs(52)),
            now + Duration::from_secs(28)
        );
    }
}
