//! Reentrancy, keyed by an explicit owner.

use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Released};
use lockkit_core::{Error, LossSignal, LostReason};

use super::{LONG_TTL, assert_busy, assert_free, hook};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

fn needs_reentrancy<H: Harness>(_: &H, client: &lockkit_core::Locker) -> Option<Outcome> {
    (!client.info().capabilities.reentrant)
        .then(|| Outcome::Skipped("the backend is not reentrant".into()))
}

/// The same owner acquires N times and must release N times.
pub async fn same_owner_needs_as_many_releases<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("same_owner_needs_as_many_releases");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let owner = a.owner();
    let mut guards = Vec::new();
    for depth in 1..=3 {
        let guard = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("reentrant acquire")
            .check("the owner must get its own lock again");
        assert_eq!(guard.depth(), depth);
        guards.push(guard);
    }
    for remaining in (0..3u32).rev() {
        assert_busy(&b, &key, "while the owner still holds some depth").await;
        let guard = guards.pop().check("guard");
        let released = guard.release().await.check("release one depth");
        if remaining == 0 {
            assert_eq!(released, Released::Fully);
        } else {
            assert_eq!(released, Released::Partially { remaining });
        }
    }
    assert_free(&b, &key, "after the last release").await;
    Outcome::Passed
}

/// Nested holds keep the outer hold's token.
pub async fn nested_holds_keep_token<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("nested_holds_keep_token");
    let key = space.key("k");
    let a = h.client().await;
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let owner = a.owner();
    let outer = owner
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("outer")
        .check("free key");
    let inner = owner
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("inner")
        .check("reentrant");
    assert_eq!(inner.token(), outer.token());
    inner.release().await.check("release inner");
    assert!(outer.is_valid());
    outer.release().await.check("release outer");
    Outcome::Passed
}

/// Two owners on the same client (the same connection) exclude each other.
pub async fn other_owner_on_same_connection_is_excluded<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("other_owner_on_same_connection_is_excluded");
    let key = space.key("k");
    let a = h.client().await;
    let (first, second) = (a.owner(), a.owner());
    let held = first
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    assert!(
        second
            .try_acquire(&key)
            .await
            .check("other owner")
            .is_none(),
        "another owner on the same connection got the lock"
    );
    held.release().await.check("release");
    assert!(
        second
            .try_acquire(&key)
            .await
            .check("after release")
            .is_some()
    );
    Outcome::Passed
}

/// When the lock is taken away, every nested guard reports the loss.
pub async fn loss_invalidates_every_depth<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("loss_invalidates_every_depth");
    let key = space.key("k");
    let a = h.client().await;
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let owner = a.owner();
    let ttl = h.short_ttl();
    let outer = owner
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("outer")
        .check("free key");
    let inner = outer.reenter().await.check("reenter");
    hook!(h.take_away(&key).await);
    let wait = ttl * 4 + h.expiry_slack() + Duration::from_secs(5);
    for (name, guard) in [("outer", &outer), ("inner", &inner)] {
        let reason = tokio::time::timeout(wait, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{name} guard never reported the loss"));
        assert_ne!(
            reason,
            LostReason::LeaseExpired,
            "{name}: the loss should be detected, not timed out"
        );
        assert!(!guard.is_valid());
    }
    expect_err(
        inner.release().await,
        "release of a lost inner guard",
        |e| matches!(e, Error::Lost { .. }),
    );
    expect_err(
        outer.release().await,
        "release of a lost outer guard",
        |e| matches!(e, Error::Lost { .. }),
    );
    Outcome::Passed
}

/// A plain `Locker::acquire` uses a fresh owner each time: not reentrant.
pub async fn plain_acquire_is_not_reentrant<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("plain_acquire_is_not_reentrant");
    let key = space.key("k");
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    assert!(
        a.try_acquire(&key)
            .await
            .check("second plain acquire")
            .is_none(),
        "a plain acquire re-entered"
    );
    held.release().await.check("release");
    Outcome::Passed
}

/// `LockGuard::reenter` takes the lock again for the guard's owner.
pub async fn reenter_from_guard<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("reenter_from_guard");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let outer = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let inner = outer.reenter().await.check("reenter");
    assert_eq!((inner.depth(), inner.token()), (2, outer.token()));
    assert_eq!(
        outer.release().await.check("release outer first"),
        Released::Partially { remaining: 1 }
    );
    assert_busy(&b, &key, "the inner hold remains").await;
    assert!(
        inner.is_valid(),
        "releasing the outer guard must not end the inner hold"
    );
    assert_eq!(
        inner.release().await.check("release inner"),
        Released::Fully
    );
    assert_free(&b, &key, "after both releases").await;
    Outcome::Passed
}

/// A reentrant acquisition resets the lease to the new request's TTL on the server.
pub async fn reentry_resets_lease<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("reentry_resets_lease");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let ttl = h.short_ttl();
    let owner = a.owner();
    let outer = owner
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("outer")
        .check("free key");
    let inner = owner
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("inner")
        .check("reentrant");
    let left = b
        .inspect(&key)
        .await
        .check("inspect")
        .check("held")
        .ttl_left;
    inner.release().await.check("release inner");
    outer.release().await.check("release outer");
    let Some(left) = left else {
        return Outcome::Skipped("the backend does not report the lease left".into());
    };
    assert!(
        left > ttl * 2,
        "re-entry asked for {LONG_TTL:?} but the lease left is {left:?}: not reset"
    );
    Outcome::Passed
}

/// A reentrant acquisition with a shorter TTL, and its release, never cut the lease an
/// outer guard relies on: the server keeps the longer lease, so no other owner is granted
/// while the outer guard counts itself valid.
pub async fn shorter_reentry_never_cuts_the_outer_lease<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("shorter_reentry_never_cuts_the_outer_lease");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let short = h.short_ttl();
    let past_short = short + h.expiry_slack();
    // Long enough to outlast both waits below several times over, with no watchdog: only
    // the outer acquisition's own lease keeps the key.
    let long = past_short * 8;
    let owner = a.owner();
    let outer = owner
        .try_acquire(&key)
        .ttl(long)
        .no_watchdog()
        .await
        .check("outer")
        .check("free key");
    let inner = owner
        .try_acquire(&key)
        .ttl(short)
        .no_watchdog()
        .await
        .check("inner")
        .check("reentrant");
    tokio::time::sleep(past_short).await;
    assert!(outer.is_valid(), "the outer guard must still be valid");
    assert_busy(
        &b,
        &key,
        "a shorter reentrant TTL cut the outer lease on the server",
    )
    .await;
    // The inner hold's own lease is over, but the hold is the owner's: releasing it is a
    // partial release that must not shorten what is left either.
    let _ = inner.release().await;
    tokio::time::sleep(past_short).await;
    assert!(outer.is_valid(), "the outer guard must still be valid");
    assert_busy(
        &b,
        &key,
        "a partial release cut the outer lease on the server while its guard was valid",
    )
    .await;
    if let Some(left) = b
        .inspect(&key)
        .await
        .check("inspect")
        .check("held")
        .ttl_left
    {
        let believed = outer
            .valid_until()
            .check("outer valid")
            .saturating_duration_since(tokio::time::Instant::now());
        assert!(
            left + Duration::from_millis(50) >= believed,
            "the server lease ({left:?} left) is shorter than the outer guard believes ({believed:?})"
        );
    }
    outer.release().await.check("release outer");
    assert_free(&b, &key, "after the outer release").await;
    Outcome::Passed
}

/// Takes `key` for `owner` without a watchdog and waits until the hold is lost (its short
/// lease ran out unrenewed).
async fn hold_until_lost<H: Harness>(
    h: &H,
    owner: &lockkit_core::Owner,
    key: &lockkit_core::LockKey,
) -> lockkit_core::LockGuard {
    let guard = owner
        .try_acquire(key)
        .ttl(h.short_ttl())
        .no_watchdog()
        .await
        .check("first hold")
        .check("free key");
    tokio::time::timeout(super::generous_wait(h), guard.lost())
        .await
        .check("the unrenewed hold must be lost");
    guard
}

/// A guard whose hold was lost never releases a newer hold of the same owner: after the
/// first hold ran out, the owner took the key again; giving back the stale guard reports
/// `Lost` and leaves the new hold in place (an owner-checked release alone cannot tell the
/// two holds apart), and the key is free once the new hold is released (at once, or when a
/// stale depth the server still counted runs out with its lease).
pub async fn stale_guard_spares_the_owners_newer_hold<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("stale_guard_spares_the_owners_newer_hold");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let stale = hold_until_lost(h, &owner, &key).await;
    let fresh = owner
        .acquire(&key)
        .ttl(h.short_ttl() * 4)
        .wait(super::generous_wait(h))
        .await
        .check("the owner takes the key again");
    // The server may have let the first hold run out (a new token) or still counted it
    // when the owner asked again (the same hold going on, the same token): either way,
    // never an older token.
    assert!(fresh.token() >= stale.token(), "a token went backwards");
    expect_err(stale.release().await, "releasing the stale guard", |e| {
        matches!(e, Error::Lost { .. })
    });
    assert!(fresh.is_valid(), "the new hold must still be valid");
    assert_busy(
        &b,
        &key,
        "releasing a stale guard freed the owner's newer hold",
    )
    .await;
    fresh.release().await.check("release the new hold");
    // Free at once, or (if the server still counted the lost hold when the owner asked
    // again) once that depth's lease runs out: never wedged for longer.
    let deadline = tokio::time::Instant::now() + super::generous_wait(h);
    while b.try_acquire(&key).await.check("probe").is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the key stayed held after the owner's last release"
        );
        tokio::time::sleep(h.short_ttl() / 4).await;
    }
    Outcome::Passed
}

/// An owner whose hold was lost is excluded like anyone else while another owner holds
/// the key: asking again must not re-enter the lost hold (a backend that keeps the lost
/// hold's state locally would grant it at depth 2, a double grant).
pub async fn lost_owner_is_excluded_while_another_holds<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("lost_owner_is_excluded_while_another_holds");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let lost = hold_until_lost(h, &owner, &key).await;
    let rival = b
        .acquire(&key)
        .ttl(LONG_TTL)
        .wait(super::generous_wait(h))
        .await
        .check("another owner takes the key once the lease is over");
    let again = owner
        .try_acquire(&key)
        .await
        .check("the lost owner asks again");
    if let Some(guard) = again {
        panic!(
            "the owner of a lost hold was granted `{key}` (depth {}, token {}) while another \
             owner holds it (token {})",
            guard.depth(),
            guard.token(),
            rival.token()
        );
    }
    drop(lost);
    assert!(rival.is_valid());
    rival.release().await.check("release rival");
    Outcome::Passed
}

/// Two tasks of one owner wait for a key another owner holds; both are granted (depth 1 and
/// 2). Releasing either one leaves the other holding: a rival is never granted while a guard
/// of the owner is still valid. Run twice: as the client queues its waiters of a key (the
/// second task then reaches the server after the first's grant, as a re-entry), and with
/// that queue off, so that both reach the server at once as fresh acquisitions.
pub async fn concurrent_acquisitions_of_one_owner_keep_the_key<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("concurrent_acquisitions_of_one_owner_keep_the_key");
    for queued in [true, false] {
        let key = space.key(if queued { "queued" } else { "unqueued" });
        let (a, b) = (h.client().await, h.client().await);
        if let Some(skip) = needs_reentrancy(h, &a) {
            return skip;
        }
        let a = if queued { a } else { a.without_waiter_gates() };
        one_owners_concurrent_acquisitions(h, &a, &b, &key).await;
    }
    Outcome::Passed
}

async fn one_owners_concurrent_acquisitions<H: Harness>(
    h: &H,
    a: &lockkit_core::Locker,
    b: &lockkit_core::Locker,
    key: &lockkit_core::LockKey,
) {
    let blocker = b
        .try_acquire(key)
        .ttl(LONG_TTL)
        .await
        .check("blocker")
        .check("free key");
    let owner = a.owner();
    let wait = h.short_ttl() * 4 + h.expiry_slack();
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let (owner, key) = (owner.clone(), key.clone());
            tokio::spawn(async move { owner.acquire(&key).ttl(LONG_TTL).wait(wait).await })
        })
        .collect();
    tokio::time::sleep(h.short_ttl() / 2).await;
    blocker.release().await.check("release blocker");
    let mut guards = Vec::new();
    for task in tasks {
        match task.await.check("task") {
            Ok(guard) => guards.push(guard),
            // A backend whose waiters queue in the server may keep the owner's second
            // request queued behind its first (a liveness limit, not a double grant).
            Err(lockkit_core::Error::Timeout { .. }) => {}
            Err(e) => panic!("the owner's acquisition: unexpected error: {e}"),
        }
    }
    if guards.len() < 2 {
        return;
    }
    // Let anything the acquisitions set off in the background run first.
    tokio::time::sleep(h.short_ttl() / 2).await;
    let first = guards.remove(0);
    let second = guards.remove(0);
    let _ = first.release().await;
    if second.is_valid() {
        assert_busy(
            b,
            key,
            "one release of two concurrent acquisitions by one owner freed the key",
        )
        .await;
    }
    let _ = second.release().await;
}

/// An acquisition retried with the same attempt id (after a lost reply, a timeout, a
/// client library's own retry) takes effect once: the depth does not grow. A release
/// retried for the same grant takes effect once too: it never gives back another hold.
pub async fn a_retried_attempt_takes_effect_once<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_retried_attempt_takes_effect_once");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let backend = a.backend().clone();
    let owner = a.owner().id();
    let request = || AcquireRequest::new(key.clone(), owner, LONG_TTL, LossSignal::new());
    let outer_request = request();
    let outer = backend
        .try_acquire(&outer_request)
        .await
        .check("acquire")
        .check("free key");
    let retried = backend
        .try_acquire(&outer_request)
        .await
        .check("the same attempt again")
        .check("a retried attempt that took effect is granted again");
    assert_eq!(outer.depth, 1);
    assert_eq!(retried.depth, 1, "a retried attempt added a second hold");
    assert_eq!(retried.token, outer.token);
    // A new attempt of the same owner is a real reentry.
    let inner = backend
        .try_acquire(&request())
        .await
        .check("reenter")
        .check("the owner gets its own lock again");
    assert_eq!(inner.depth, 2);
    assert_eq!(
        backend
            .release(&inner)
            .await
            .check("release the inner hold"),
        Released::Partially { remaining: 1 }
    );
    // The inner release retried: the outer hold must stay.
    match backend.release(&inner).await {
        Ok(Released::Partially { remaining: 1 }) | Err(Error::NotHeld { .. }) => {}
        other => panic!("a retried release gave back another hold: {other:?}"),
    }
    assert_busy(&b, &key, "the outer hold after a retried inner release").await;
    assert_eq!(
        backend
            .release(&outer)
            .await
            .check("release the outer hold"),
        Released::Fully
    );
    assert_free(&b, &key, "after the last release").await;
    Outcome::Passed
}

/// A reentrant acquisition dropped mid-way (its caller timed out or went away) leaves no
/// hold behind: once the outer hold is released, the key is free.
pub async fn cancelled_reentry_leaves_no_depth<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("cancelled_reentry_leaves_no_depth");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let backend = a.backend().clone();
    let owner = a.owner().id();
    let request = || AcquireRequest::new(key.clone(), owner, LONG_TTL, LossSignal::new());
    let outer = backend
        .try_acquire(&request())
        .await
        .check("acquire")
        .check("free key");
    for _ in 0..20 {
        // Polled once, then dropped if it did not finish at once.
        let reentry = request();
        let mut attempt = std::pin::pin!(backend.try_acquire(&reentry));
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(attempt.as_mut().poll(cx))).await;
        if let std::task::Poll::Ready(done) = polled {
            let inner = done
                .check("reenter")
                .check("the owner gets its own lock again");
            backend.release(&inner).await.check("release the reentry");
        }
    }
    backend
        .release(&outer)
        .await
        .check("release the outer hold");
    let rival = b
        .acquire(&key)
        .wait(super::generous_wait(h))
        .await
        .check("the key must be free once the outer hold is released");
    rival.release().await.check("release the rival");
    Outcome::Passed
}

/// A reentrant acquisition with a longer TTL makes the lease that long: its guard believes
/// it, so the key must stay held that long, without a watchdog (the twin of
/// `shorter_reentry_never_cuts_the_outer_lease`; found by the randomized test on a backend
/// whose re-entry kept the outer lease).
pub async fn longer_reentry_extends_the_lease<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("longer_reentry_extends_the_lease");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let short = h.short_ttl();
    let past_short = short + h.expiry_slack();
    let long = past_short * 8;
    let owner = a.owner();
    let outer = owner
        .try_acquire(&key)
        .ttl(short)
        .no_watchdog()
        .await
        .check("outer")
        .check("free key");
    let inner = owner
        .try_acquire(&key)
        .ttl(long)
        .no_watchdog()
        .await
        .check("inner")
        .check("reentrant");
    tokio::time::sleep(past_short).await;
    if inner.is_valid() {
        assert_busy(
            &b,
            &key,
            "the key was free while a longer reentrant guard believed it held",
        )
        .await;
    } else {
        panic!("a longer reentrant TTL did not make a longer lease");
    }
    drop(outer);
    inner.release().await.check("release inner");
    Outcome::Passed
}

/// Rounds of the racing cases below: each is one chance for the race to land either way.
const RACE_ROUNDS: usize = 25;

/// A re-entry that races the owner's last release is granted (a nested hold if it got
/// there first, a fresh one if the release did) and its guard holds the key; it is never
/// refused as "lost" (second review, finding 5: the core called the fresh grant a sign
/// that the hold had been lost, gave it back and failed the acquisition).
pub async fn a_reentry_racing_the_last_release_is_granted<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_reentry_racing_the_last_release_is_granted");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    for round in 0..RACE_ROUNDS {
        let key = space.key(&format!("k{round}"));
        let owner = a.owner();
        let outer = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("acquire")
            .check("free key");
        let reentry = {
            let (owner, key, wait) = (owner.clone(), key.clone(), super::generous_wait(h));
            tokio::spawn(async move { owner.acquire(&key).ttl(LONG_TTL).wait(wait).await })
        };
        if round % 2 == 1 {
            tokio::task::yield_now().await;
        }
        outer.release().await.check("release the outer hold");
        let inner = match reentry.await.check("the re-entry task") {
            Ok(inner) => inner,
            Err(e) => panic!("round {round}: a re-entry racing the last release failed: {e}"),
        };
        assert!(inner.is_valid(), "round {round}: the re-entry's guard");
        assert_busy(&b, &key, "while the re-entry's guard holds it").await;
        inner.release().await.check("release the re-entry");
    }
    assert_free(&b, &space.key("k0"), "after the last round").await;
    Outcome::Passed
}

/// Two guards of one hold released at once both succeed, and the hold is not reported
/// lost (second review, finding 6: the count of other guards was read before the release
/// waited its turn, so a sibling's release that went first made the last one look like the
/// server had dropped a hold some guard still believed in).
pub async fn sibling_releases_never_fire_the_loss_signal<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("sibling_releases_never_fire_the_loss_signal");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    for round in 0..RACE_ROUNDS {
        let key = space.key(&format!("k{round}"));
        let owner = a.owner();
        let first = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("acquire")
            .check("free key");
        let second = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("reenter")
            .check("the owner gets its own lock again");
        let lost = first.lost();
        let (one, two) = tokio::join!(
            tokio::spawn(first.release()),
            tokio::spawn(second.release())
        );
        let mut outcomes = [
            one.check("release task").check("release one guard"),
            two.check("release task").check("release the other guard"),
        ];
        outcomes.sort_by_key(|r| matches!(r, Released::Fully));
        assert_eq!(
            outcomes,
            [Released::Partially { remaining: 1 }, Released::Fully],
            "round {round}"
        );
        if let Ok(reason) = tokio::time::timeout(Duration::ZERO, lost).await {
            panic!("round {round}: two clean releases reported the hold lost ({reason:?})");
        }
        assert_free(&b, &key, "after both releases").await;
    }
    Outcome::Passed
}

/// A retried attempt that took effect is granted again with the lease counted from the
/// retry, and the server holds the key that long too (second review, finding 2: row,
/// memory and file modes answered the retry without touching the lease, so its guard
/// believed the key for as long past the server's lease as the retry came after the first
/// try, and another client was granted it meanwhile).
pub async fn a_retried_attempt_keeps_the_lease_it_reports<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_retried_attempt_keeps_the_lease_it_reports");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    if let Some(skip) = needs_reentrancy(h, &a) {
        return skip;
    }
    let past_short = h.short_ttl() + h.expiry_slack();
    // The retry comes `2 * past_short` into a lease of `3 * past_short`; the check below
    // runs a slack past the first lease, over a short TTL plus a past_short before the
    // retried lease ends: wide margins both ways, for a loaded machine.
    let lease = past_short * 3;
    let backend = a.backend().clone();
    let request = AcquireRequest::new(key.clone(), a.owner().id(), lease, LossSignal::new());
    let first = backend
        .try_acquire(&request)
        .await
        .check("acquire")
        .check("free key");
    // The reply was "lost": the same attempt again, well into the lease.
    tokio::time::sleep(past_short * 2).await;
    let retried = backend
        .try_acquire(&request)
        .await
        .check("the same attempt again")
        .check("a retried attempt that took effect is granted again");
    assert_eq!(retried.depth, 1, "a retried attempt added a second hold");
    // Past the first try's lease (and the slack), within the retry's.
    let first_lease_over = first.lease_start + lease + h.expiry_slack();
    tokio::time::sleep_until(first_lease_over).await;
    let believed_until = retried.lease_start + lockkit_core::spi::local_validity(lease);
    assert!(
        tokio::time::Instant::now() < believed_until,
        "the test's own timing: the retried grant should still be believed"
    );
    assert_busy(
        &b,
        &key,
        "the retried grant is believed, but the server let the key go at the first try's lease",
    )
    .await;
    assert_eq!(
        backend.release(&retried).await.check("release"),
        Released::Fully
    );
    assert_free(&b, &key, "after the release").await;
    Outcome::Passed
}
