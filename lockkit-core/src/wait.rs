//! One way to wait for a lock: attempt, and between attempts sleep until a wake-up, the
//! holder's lease end or a jittered backoff, whichever comes first, until the deadline.
//! Every backend whose server does not queue its waiters waits through [`wait_for_grant`],
//! so the retry rule and the deadline are kept in one place.

use std::{future::Future, pin::Pin, time::Duration};

use async_trait::async_trait;
use tokio::{sync::Notify, time::Instant};

use crate::{Error, Grant, LockKey, Result};

/// The wait used for "until granted": long enough to never end in practice, short enough
/// that `Instant + WAIT_FOREVER` cannot overflow. Backends must add it with `checked_add`
/// or [`deadline_after`].
pub const WAIT_FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The grant `acquisition` (an attempt that waits, `None` when its wait ran out) yields,
/// or [`Error::Timeout`] for `key` saying how long it waited: the `acquire` of a backend
/// whose own attempt returns `Option<Grant>`.
///
/// # Errors
/// The acquisition's own error, or the timeout.
pub async fn granted_or_timeout(
    key: &LockKey,
    acquisition: impl Future<Output = Result<Option<Grant>>>,
) -> Result<Grant> {
    let started = Instant::now();
    acquisition.await?.ok_or_else(|| Error::Timeout {
        key: key.clone(),
        waited: started.elapsed(),
    })
}

/// `now + wait`, saturating at a far-away instant instead of overflowing.
pub fn deadline_after(wait: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(wait.min(WAIT_FOREVER))
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// The outcome of one acquisition attempt.
#[derive(Debug)]
pub enum Attempt {
    /// The lock was granted.
    Granted(Grant),
    /// Someone else holds the lock.
    Busy {
        /// How long the holder's lease runs on, when the backend can tell: a retry after
        /// that may succeed without any wake-up. `Some(Duration::ZERO)` asks for a retry
        /// straight away (a lost race to create the key, a deadlock the server broke).
        lease_left: Option<Duration>,
    },
}

impl Attempt {
    /// `Busy` with the holder's lease left.
    pub fn busy(lease_left: Duration) -> Self {
        Attempt::Busy {
            lease_left: Some(lease_left),
        }
    }

    /// The grant, if there is one. Pass it to
    /// [`detached_acquire`](crate::spi::detached_acquire) so a grant nobody waits for is
    /// given back.
    pub fn into_grant(self) -> Option<Grant> {
        match self {
            Attempt::Granted(grant) => Some(grant),
            Attempt::Busy { .. } => None,
        }
    }
}

/// The shortest delay a [`Backoff`] or a [`WaitPolicy`] sleeps.
const MIN_DELAY: Duration = Duration::from_millis(1);

/// A capped exponential backoff with jitter: each delay is the current step plus up to
/// half of it again, and the step doubles up to `cap` (so contenders spread out instead
/// of retrying in lock step, as object_store's client backoff does).
#[derive(Debug, Clone)]
pub struct Backoff {
    step: Duration,
    cap: Duration,
}

impl Backoff {
    /// Starts at `first`, doubling up to `cap`; both at least a millisecond, so a wait
    /// built on it can never spin.
    pub fn new(first: Duration, cap: Duration) -> Self {
        let cap = cap.max(MIN_DELAY);
        Backoff {
            step: first.max(MIN_DELAY).min(cap),
            cap,
        }
    }

    /// The next delay (between the step and 1.5 times the step), and doubles the step.
    pub fn next_delay(&mut self) -> Duration {
        let jitter = Duration::try_from_secs_f64(self.step.as_secs_f64() * fastrand::f64() * 0.5)
            .unwrap_or(Duration::ZERO);
        let delay = self.step.saturating_add(jitter);
        self.step = self.step.saturating_mul(2).min(self.cap);
        delay
    }
}

/// A wake-up armed before an attempt, that resolves when it fires.
pub type Armed<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A wake-up that never fires.
pub fn never<'a>() -> Armed<'a> {
    Box::pin(std::future::pending())
}

/// Arms `notify`: the returned future resolves at the first `notify_waiters` (or
/// `notify_one`) after this call, even one that comes before it is polled.
pub fn armed(notify: &Notify) -> Armed<'_> {
    let mut notified = Box::pin(notify.notified());
    notified.as_mut().enable();
    notified
}

/// What wakes a waiter between attempts: release notifications (pub/sub, an in-process
/// [`Notify`]), or nothing at all ([`Polling`]).
#[async_trait]
pub trait Wake: Send {
    /// Gets ready to hear wake-ups: subscribes on the first call, reconnects a lost
    /// subscription on later ones. [`wait_for_grant`] calls it before every retry (not
    /// before the first attempt), bounded by the deadline. Answers whether a wake-up can be
    /// relied on to come when the holder lets go; while it cannot, the wait polls with its
    /// backoff. The default answers `false`.
    async fn ready(&mut self) -> bool {
        false
    }

    /// Registers for the next wake-up. Called before every attempt, so a release that
    /// happens between the attempt and the sleep still wakes the waiter.
    fn arm(&self) -> Armed<'_>;
}

/// No wake-ups: the waiter polls.
#[derive(Debug, Clone, Copy, Default)]
pub struct Polling;

impl Wake for Polling {
    fn arm(&self) -> Armed<'_> {
        never()
    }
}

/// How a wait paces its retries.
#[derive(Debug, Clone)]
pub struct WaitPolicy {
    /// Delays between retries while no wake-up can be relied on, and after an attempt that
    /// failed with a retryable error.
    pub backoff: Backoff,
    /// While wake-ups can be relied on and the holder's lease is unknown (a key without
    /// expiry), the sleep between retries. With a known lease the waiter sleeps until it
    /// ends, woken earlier by the release.
    pub notified_cap: Duration,
    /// After a wake-up, wait up to this long (uniformly at random) before the retry: when
    /// several servers announce one release one by one (Redlock), contenders then do not
    /// split the servers between them.
    pub settle: Duration,
}

impl WaitPolicy {
    /// Polls with `backoff`; relies on wake-ups for at most a second; no settling.
    pub fn new(backoff: Backoff) -> Self {
        WaitPolicy {
            backoff,
            notified_cap: Duration::from_secs(1),
            settle: Duration::ZERO,
        }
    }

    /// Sleeps `cap` between retries while wake-ups are relied on and the lease is
    /// unknown (at least a millisecond).
    pub fn notified_cap(mut self, cap: Duration) -> Self {
        self.notified_cap = cap.max(MIN_DELAY);
        self
    }

    /// With up to `settle` of random delay after each wake-up.
    pub fn settle(mut self, settle: Duration) -> Self {
        self.settle = settle;
        self
    }
}

/// Waits up to `wait` for a grant of `key`: runs `attempt`, and while the key is busy
/// sleeps until `wake` fires, the holder's lease ends (plus a millisecond) or the backoff
/// passes, then tries again. `wake.ready()` is first asked after the first attempt found
/// the key busy; if wake-ups can be relied on from then, the first retry comes at once
/// (a subscription made after the attempt cannot have heard a release before it). A
/// `ready()` still busy at the deadline is dropped, and one last attempt is made.
///
/// The one retry rule: a retryable error is retried like contention (after a backoff
/// delay) until the deadline; any other error ends the wait. With a zero `wait` there is
/// one attempt and its error is returned as it is.
///
/// `attempt` must be cancel safe on its own (run it through
/// [`detached_acquire`](crate::spi::detached_acquire)): this loop may be dropped while an
/// attempt runs.
///
/// # Errors
/// [`Error::Timeout`] when the deadline passes without a grant; an attempt's error that is
/// not retryable (or any error when `wait` is zero).
pub async fn wait_for_grant<W, A, F>(
    key: &LockKey,
    wait: Duration,
    mut policy: WaitPolicy,
    wake: &mut W,
    mut attempt: A,
) -> Result<Grant>
where
    W: Wake + ?Sized,
    A: FnMut() -> F,
    F: Future<Output = Result<Attempt>>,
{
    let started = Instant::now();
    let deadline = deadline_after(wait);
    let timeout = || Error::Timeout {
        key: key.clone(),
        waited: started.elapsed(),
    };
    // `None` until `wake.ready()` was first asked; then whether wake-ups can be relied on.
    let mut listening: Option<bool> = None;
    loop {
        // Listening before the attempt, so a release cannot slip in between.
        let woken = wake.arm();
        let sleep = match attempt().await {
            Ok(Attempt::Granted(grant)) => return Ok(grant),
            Ok(Attempt::Busy { lease_left }) => {
                let lease_end = lease_left.map(|left| left.saturating_add(MIN_DELAY));
                match (listening == Some(true), lease_end) {
                    // The release wakes us; the timer only covers a lease that runs out.
                    (true, Some(lease_end)) => lease_end,
                    (true, None) => policy.notified_cap,
                    (false, lease_end) => {
                        let poll = policy.backoff.next_delay();
                        lease_end.map_or(poll, |end| poll.min(end))
                    }
                }
            }
            Err(e) if e.is_retryable() && !wait.is_zero() => {
                tracing::debug!(error = %e, %key, "acquire attempt failed; retrying");
                policy.backoff.next_delay()
            }
            Err(e) => return Err(e),
        };
        if Instant::now() >= deadline {
            return Err(timeout());
        }
        let woken = if listening.is_none() {
            drop(woken);
            let ready = ready_by(deadline, wake).await;
            listening = Some(ready);
            if ready {
                // A subscription made just now heard nothing yet: retry before sleeping.
                continue;
            }
            wake.arm()
        } else {
            woken
        };
        let until = Instant::now().checked_add(sleep).unwrap_or(deadline);
        let notified = tokio::select! {
            () = woken => true,
            () = tokio::time::sleep_until(until.min(deadline)) => false,
        };
        if notified && !policy.settle.is_zero() {
            let settle = policy.settle.mul_f64(fastrand::f64());
            tokio::time::sleep_until((Instant::now() + settle).min(deadline)).await;
        }
        listening = Some(ready_by(deadline, wake).await);
    }
}

/// `wake.ready()`, or `false` if the deadline passes first: the loop then makes its last
/// attempt without wake-ups, and ends.
async fn ready_by<W: Wake + ?Sized>(deadline: Instant, wake: &mut W) -> bool {
    tokio::time::timeout_at(deadline, wake.ready())
        .await
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    };

    use super::*;
    use crate::{AcquireRequest, FencingToken, LossSignal, OwnerId};

    fn request() -> AcquireRequest {
        AcquireRequest::new(
            LockKey::new("wait").expect("a valid key"),
            OwnerId::new(uuid::Uuid::new_v4(), 1),
            Duration::from_secs(10),
            LossSignal::new(),
        )
    }

    fn granted(req: &AcquireRequest) -> Attempt {
        Attempt::Granted(Grant::new(req, FencingToken::new(1), 1, Instant::now()))
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_with_at_most_half_a_step_of_jitter() {
        let mut backoff = Backoff::new(Duration::from_millis(2), Duration::from_millis(10));
        for step in [2u64, 4, 8, 10, 10] {
            let delay = backoff.next_delay();
            let step = Duration::from_millis(step);
            assert!(
                delay >= step && delay <= step + step / 2,
                "{delay:?} for {step:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_after_the_holders_lease_without_any_wake_up() {
        let req = request();
        let tries = AtomicU32::new(0);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_secs(60),
            Duration::from_secs(60),
        ));
        let started = Instant::now();
        let grant = wait_for_grant(
            &req.key,
            Duration::from_secs(30),
            policy,
            &mut Polling,
            || {
                let n = tries.fetch_add(1, Ordering::SeqCst);
                let req = &req;
                async move {
                    Ok(if n == 0 {
                        Attempt::busy(Duration::from_secs(2))
                    } else {
                        granted(req)
                    })
                }
            },
        )
        .await
        .expect("granted once the lease ran out");
        assert_eq!(grant.depth, 1);
        assert_eq!(tries.load(Ordering::SeqCst), 2);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
            "{waited:?}"
        );
    }

    /// An in-process wake source that is relied on.
    struct Notified(Arc<Notify>);

    #[async_trait]
    impl Wake for Notified {
        async fn ready(&mut self) -> bool {
            true
        }
        fn arm(&self) -> Armed<'_> {
            armed(&self.0)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_during_the_attempt_still_wakes_the_waiter() {
        let req = request();
        let notify = Arc::new(Notify::new());
        let mut wake = Notified(notify.clone());
        let tries = AtomicU32::new(0);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_secs(60),
            Duration::from_secs(60),
        ))
        .notified_cap(Duration::from_secs(3600));
        let started = Instant::now();
        wait_for_grant(
            &req.key,
            Duration::from_secs(600),
            policy,
            &mut wake,
            || {
                let n = tries.fetch_add(1, Ordering::SeqCst);
                let (req, notify) = (&req, notify.clone());
                async move {
                    match n {
                        0 => Ok(Attempt::Busy { lease_left: None }),
                        1 => {
                            // The holder lets go after this attempt looked, before it sleeps.
                            notify.notify_waiters();
                            Ok(Attempt::Busy { lease_left: None })
                        }
                        _ => Ok(granted(req)),
                    }
                }
            },
        )
        .await
        .expect("woken by the release");
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "slept through the wake-up"
        );
    }

    /// A wake source whose `ready()` never finishes (a master that does not answer its
    /// SUBSCRIBE).
    struct Stuck;

    #[async_trait]
    impl Wake for Stuck {
        async fn ready(&mut self) -> bool {
            std::future::pending().await
        }
        fn arm(&self) -> Armed<'_> {
            never()
        }
    }

    /// Review 13, F2: a deadline that passes while subscribing still gets its last attempt.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_that_passes_in_ready_still_gets_a_last_attempt() {
        let req = request();
        let tries = AtomicU32::new(0);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(100),
        ));
        let grant = wait_for_grant(
            &req.key,
            Duration::from_millis(200),
            policy,
            &mut Stuck,
            || {
                let n = tries.fetch_add(1, Ordering::SeqCst);
                let req = &req;
                async move {
                    Ok(if n == 0 {
                        Attempt::Busy { lease_left: None }
                    } else {
                        granted(req)
                    })
                }
            },
        )
        .await;
        assert!(grant.is_ok(), "{grant:?}");
        assert_eq!(tries.load(Ordering::SeqCst), 2);
    }

    /// Review 13, F6: a zero backoff or cap cannot make a wait spin.
    #[test]
    fn a_zero_backoff_still_sleeps_a_millisecond() {
        let mut backoff = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert!(backoff.next_delay() >= MIN_DELAY);
        let mut huge = Backoff::new(Duration::MAX / 2, Duration::MAX);
        huge.next_delay();
        huge.next_delay();
        assert_eq!(
            WaitPolicy::new(backoff)
                .notified_cap(Duration::ZERO)
                .notified_cap,
            MIN_DELAY
        );
    }

    /// A wait of `wait` on an attempt that always fails (`retryable` or not): the outcome
    /// and how many attempts were made.
    async fn always_failing(retryable: bool, wait: Duration) -> (Result<Grant>, u32) {
        let req = request();
        let tries = AtomicU32::new(0);
        let policy = WaitPolicy::new(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(100),
        ));
        let outcome = wait_for_grant(&req.key, wait, policy, &mut Polling, || {
            tries.fetch_add(1, Ordering::SeqCst);
            async move { Err(Error::backend("test", retryable, "failing")) }
        })
        .await;
        (outcome, tries.load(Ordering::SeqCst))
    }

    #[tokio::test(start_paused = true)]
    async fn retryable_errors_are_retried_until_the_deadline_and_end_in_a_timeout() {
        let (outcome, tries) = always_failing(true, Duration::from_secs(5)).await;
        assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}");
        assert!(tries > 10, "{tries}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_final_error_ends_the_wait_at_once() {
        let (outcome, tries) = always_failing(false, Duration::from_secs(5)).await;
        assert!(
            matches!(
                outcome,
                Err(Error::Backend {
                    retryable: false,
                    ..
                })
            ),
            "{outcome:?}"
        );
        assert_eq!(tries, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_wait_tries_once_and_returns_its_error_or_a_timeout() {
        let req = request();
        let policy = || {
            WaitPolicy::new(Backoff::new(
                Duration::from_millis(10),
                Duration::from_millis(100),
            ))
        };
        let (down, tries) = always_failing(true, Duration::ZERO).await;
        assert!(
            matches!(
                down,
                Err(Error::Backend {
                    retryable: true,
                    ..
                })
            ),
            "{down:?}"
        );
        assert_eq!(tries, 1);
        let busy = wait_for_grant(&req.key, Duration::ZERO, policy(), &mut Polling, || async {
            Ok(Attempt::busy(Duration::from_secs(1)))
        })
        .await;
        assert!(matches!(busy, Err(Error::Timeout { .. })), "{busy:?}");
    }
}
