//! Leases, the watchdog, `max_hold` and `extend`.

use std::time::Duration;

use lockkit_core::{Error, LostReason};
use tokio::time::Instant;

use super::{CountingBackend, LONG_TTL, assert_busy, assert_free, generous_wait};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

/// The shortest lease of a case that needs every renewal of a hold to land in time: its
/// keeper may stall for two thirds of it (a loaded CI machine) without the hold lapsing.
const RENEWAL_SLACK_TTL: Duration = Duration::from_secs(1);

/// Without renewal a lease runs out: a rival gets the key after the TTL, never before, and
/// the holder's guard reports the loss.
pub async fn unrenewed_lease_expires<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("unrenewed_lease_expires");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let requested = Instant::now();
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    assert_busy(&b, &key, "before the lease ran out").await;
    let rival = b
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("rival waits for expiry");
    let granted_after = requested.elapsed();
    assert!(
        granted_after >= ttl.mul_f64(0.95),
        "rival granted after {granted_after:?}, before the {ttl:?} lease could have run out"
    );
    assert!(rival.token() > held.token());
    assert!(!held.is_valid(), "the holder must know its lease ran out");
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), held.lost())
            .await
            .check("lost must have fired"),
        LostReason::LeaseExpired
    );
    rival.release().await.check("release rival");
    Outcome::Passed
}

/// The watchdog keeps a lease alive for five TTLs while the guard lives.
pub async fn watchdog_keeps_lease_alive<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("watchdog_keeps_lease_alive");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    let lost = held.lost();
    tokio::select! {
        reason = lost => panic!("the watchdog let the lease go: {reason:?}"),
        _ = tokio::time::sleep(ttl * 5) => {}
    }
    assert!(held.is_valid());
    assert_busy(&b, &key, "after 5 TTLs with the watchdog running").await;
    held.release().await.check("release");
    Outcome::Passed
}

/// Once released, a guard's watchdog renews no more.
pub async fn renewal_stops_on_release<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("renewal_stops_on_release");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (client, counter) = CountingBackend::wrap(&h.client().await);
    let held = client
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    tokio::time::sleep(ttl).await;
    assert!(
        counter.renewals() >= 1,
        "the watchdog never renewed within one TTL"
    );
    held.release().await.check("release");
    let after_release = counter.renewals();
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(
        counter.renewals(),
        after_release,
        "renewals went on after release"
    );
    assert_free(&h.client().await, &key, "after release").await;
    Outcome::Passed
}

/// Once dropped, a guard's watchdog renews no more and the lock is given back.
pub async fn renewal_stops_on_drop<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("renewal_stops_on_drop");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (client, counter) = CountingBackend::wrap(&h.client().await);
    let held = client
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .renew_every(ttl / 3)
        .await
        .check("acquire")
        .check("free key");
    tokio::time::sleep(ttl).await;
    assert!(counter.renewals() >= 1, "the watchdog never renewed");
    drop(held);
    // The background release frees the key long before the 60 s lease would.
    let other = h.client().await;
    let guard = other
        .acquire(&key)
        .wait(Duration::from_secs(10))
        .await
        .check("key freed by the dropped guard");
    let after_drop = counter.renewals();
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(
        counter.renewals(),
        after_drop,
        "renewals went on after drop"
    );
    guard.release().await.check("release");
    Outcome::Passed
}

/// `max_hold` caps renewal: the lease runs out after about `max_hold` and the guard
/// reports the loss.
///
/// The lease is at least a second (`RENEWAL_SLACK_TTL`): the case asserts that no rival
/// is granted before `max_hold`, so every renewal until then must land, and on a loaded
/// 2-core CI machine a 300 ms lease (renewed every 100 ms) was once granted to the rival at
/// one TTL (a grant's `fsync` or the keeper's task delayed 200 ms). A longer lease leaves
/// two thirds of it for such a stall and still shows the cap.
pub async fn max_hold_caps_renewal<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("max_hold_caps_renewal");
    let key = space.key("k");
    let ttl = h.short_ttl().max(RENEWAL_SLACK_TTL);
    let max_hold = ttl * 2;
    let (a, b) = (h.client().await, h.client().await);
    let started = Instant::now();
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .max_hold(max_hold)
        .await
        .check("acquire")
        .check("free key");
    let rival = b
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("rival after max_hold");
    let waited = started.elapsed();
    assert!(
        waited >= max_hold.mul_f64(0.95),
        "granted to a rival after {waited:?}, before max_hold {max_hold:?}"
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), held.lost())
            .await
            .check("lost after max_hold"),
        LostReason::LeaseExpired
    );
    rival.release().await.check("release");
    Outcome::Passed
}

/// `extend` moves the expiry: the lease outlives its original TTL.
pub async fn extend_moves_expiry<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("extend_moves_expiry");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    let before = held.valid_until().check("valid after acquire");
    held.extend(LONG_TTL).await.check("extend");
    let after = held.valid_until().check("valid after extend");
    assert!(
        after > before + ttl,
        "valid_until did not move: {before:?} -> {after:?}"
    );
    tokio::time::sleep(ttl * 2 + h.expiry_slack()).await;
    assert!(held.is_valid());
    assert_busy(&b, &key, "past the original TTL after extend").await;
    held.release().await.check("release");
    Outcome::Passed
}

/// `extend` after the lease ran out is `Lost`.
pub async fn extend_after_expiry_is_lost<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("extend_after_expiry_is_lost");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    tokio::time::sleep(ttl + h.expiry_slack()).await;
    expect_err(held.extend(LONG_TTL).await, "extend after expiry", |e| {
        matches!(e, Error::Lost { .. })
    });
    Outcome::Passed
}

/// After release the backend refuses to renew the old grant: `NotHeld`. (A released
/// `LockGuard` is consumed, so through the user API this cannot even be written.)
pub async fn renew_after_release_is_not_held<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("renew_after_release_is_not_held");
    let key = space.key("k");
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let grant = held.grant().clone();
    held.release().await.check("release");
    expect_err(
        a.backend().renew(&grant, LONG_TTL).await,
        "renew after release",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    assert_free(
        &h.client().await,
        &key,
        "renew after release must not resurrect it",
    )
    .await;
    Outcome::Passed
}

/// `is_valid` and `valid_until` follow the lease on the local monotonic clock.
pub async fn validity_tracks_the_lease<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("validity_tracks_the_lease");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    // The server started the lease before its answer arrived: a lease counted from any
    // later instant would outlive it. (Counted from the request instead, a grant observed
    // after a long wait would already be over.)
    let answered = Instant::now();
    let until = held.valid_until().check("valid after acquire");
    assert!(held.is_valid());
    assert!(until <= answered + ttl, "valid_until past the lease");
    assert!(until > Instant::now(), "valid_until already passed");
    assert!(
        until < held.grant().lease_start + ttl,
        "valid_until {until:?} is not before lease_start + ttl: no margin for clock drift"
    );
    tokio::time::sleep_until(until + Duration::from_millis(20)).await;
    assert!(!held.is_valid(), "still valid after valid_until");
    assert_eq!(held.valid_until(), None);
    Outcome::Passed
}

/// Once a lease has run out, the key is free for everyone: `inspect` reports nobody, and
/// the backend refuses the old grant's release and renewal (`NotHeld`) without
/// resurrecting it.
pub async fn expired_lease_is_gone<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("expired_lease_is_gone");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    let grant = held.grant().clone();
    tokio::time::sleep(ttl + h.expiry_slack()).await;
    assert_eq!(
        b.inspect(&key).await.check("inspect after expiry"),
        None,
        "inspect reports a holder whose lease ran out"
    );
    expect_err(
        a.backend().release(&grant).await,
        "release after expiry",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    expect_err(
        a.backend().renew(&grant, LONG_TTL).await,
        "renew after expiry",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    assert_free(&b, &key, "a refused renewal must not resurrect the lease").await;
    drop(held);
    Outcome::Passed
}

/// After `extend`, the watchdog renews with the extended TTL, not the original one.
pub async fn extend_sets_the_watchdog_ttl<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("extend_sets_the_watchdog_ttl");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .renew_every(ttl / 3)
        .await
        .check("acquire")
        .check("free key");
    held.extend(LONG_TTL).await.check("extend");
    // Several renewals at the fixed period happen meanwhile.
    tokio::time::sleep(ttl * 2).await;
    let left = held
        .valid_until()
        .check("valid after extend")
        .saturating_duration_since(Instant::now());
    assert!(
        left > ttl * 2,
        "the watchdog renewed with the old {ttl:?} TTL: only {left:?} of validity left"
    );
    if let Some(server_left) = b
        .inspect(&key)
        .await
        .check("inspect")
        .check("held")
        .ttl_left
    {
        assert!(
            server_left > ttl * 2,
            "the server lease is {server_left:?}: renewed with the old TTL"
        );
    }
    held.release().await.check("release");
    Outcome::Passed
}

/// `extend` to a shorter TTL makes the watchdog renew at the shorter TTL's period, so the
/// lease never lapses between renewals (and the guard raises no false alarm).
pub async fn extend_to_a_shorter_ttl_keeps_renewing<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("extend_to_a_shorter_ttl_keeps_renewing");
    let key = space.key("k");
    let short = h.short_ttl();
    let long = short * 12;
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(long)
        .await
        .check("acquire")
        .check("free key");
    // Let the watchdog settle into its period for the long TTL first.
    tokio::time::sleep(short / 2).await;
    held.extend(short).await.check("extend to a shorter TTL");
    // Past several short leases, but well before the old renewal period (long / 3).
    tokio::time::sleep(short * 3).await;
    assert!(
        held.is_valid(),
        "after extend({short:?}) the watchdog kept the old period ({:?}): the lease lapsed ({:?})",
        long / 3,
        held.lost_at().map(|_| "lost")
    );
    assert_busy(&b, &key, "while the extended hold is renewed").await;
    held.release().await.check("release");
    Outcome::Passed
}

/// The same with an explicit `renew_every` longer than the TTL `extend` sets (both valid
/// when given): the watchdog renews at a third of the new TTL, not at `renew_every`, which
/// renewed only after the extended lease had run out (the guard reported a live hold lost;
/// helper-34's review).
pub async fn extend_below_renew_every_keeps_renewing<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("extend_below_renew_every_keeps_renewing");
    let key = space.key("k");
    let short = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(short * 12)
        .renew_every(short * 8)
        .await
        .check("acquire")
        .check("free key");
    held.extend(short).await.check("extend below renew_every");
    // Past several short leases, but well before `renew_every`.
    tokio::time::sleep(short * 4).await;
    assert!(
        held.is_valid(),
        "after extend({short:?}) the watchdog waited for renew_every ({:?}): the lease lapsed",
        short * 8
    );
    assert_busy(&b, &key, "while the extended hold is renewed").await;
    held.release().await.check("release");
    Outcome::Passed
}
