//! The lost signal.

use std::time::Duration;

use lockkit_core::{Error, LostReason};

use super::{LONG_TTL, hook};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

/// Taking the lock away behind the holder's back fires `lost` (found by the watchdog).
pub async fn lost_fires_when_taken_away<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("lost_fires_when_taken_away");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    hook!(h.take_away(&key).await);
    let reason = tokio::time::timeout(
        ttl * 4 + h.expiry_slack() + Duration::from_secs(5),
        held.lost(),
    )
    .await
    .check("lost never fired after the lock was taken away");
    assert_ne!(
        reason,
        LostReason::LeaseExpired,
        "the watchdog should have been told, not timed out"
    );
    assert!(!held.is_valid());
    Outcome::Passed
}

/// Once fired, `lost()` resolves at once for a late subscriber.
pub async fn late_subscriber_sees_loss_at_once<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("late_subscriber_sees_loss_at_once");
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
    let first = tokio::time::timeout(ttl * 4 + Duration::from_secs(5), held.lost())
        .await
        .check("lost after expiry");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let late = tokio::time::timeout(Duration::from_secs(1), held.lost())
        .await
        .check("a late subscriber must see the loss at once");
    assert_eq!(first, late);
    Outcome::Passed
}

/// An idle holder with a live watchdog gets no false alarm over five TTLs.
pub async fn no_false_alarm_for_idle_holder<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("no_false_alarm_for_idle_holder");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    tokio::select! {
        reason = held.lost() => panic!("false alarm: lost fired ({reason:?}) for a live holder"),
        _ = tokio::time::sleep(ttl * 5) => {}
    }
    assert!(held.is_valid());
    held.release().await.check("release");
    Outcome::Passed
}

/// Killing the holder's connection or session fires `lost`.
pub async fn lost_fires_when_connection_killed<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("lost_fires_when_connection_killed");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    hook!(h.kill_connection(&a).await);
    tokio::time::timeout(
        ttl * 4 + h.expiry_slack() + Duration::from_secs(10),
        held.lost(),
    )
    .await
    .check("lost never fired after the connection was killed");
    assert!(!held.is_valid());
    Outcome::Passed
}

/// Releasing a lost guard reports `Lost`, not success.
pub async fn lost_guard_release_returns_lost<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("lost_guard_release_returns_lost");
    let key = space.key("k");
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(h.short_ttl())
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    tokio::time::timeout(LONG_TTL, held.lost())
        .await
        .check("lost after expiry");
    let err = expect_err(held.release().await, "release after loss", |e| {
        matches!(e, Error::Lost { .. })
    });
    assert!(!err.is_retryable());
    Outcome::Passed
}

/// A backend that declares `pushes_loss` fires `lost` when the session ends, without
/// waiting for a renewal (no watchdog here, and a lease far longer than the wait).
pub async fn session_loss_is_pushed<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("session_loss_is_pushed");
    let key = space.key("k");
    let a = h.client().await;
    if !a.info().capabilities.pushes_loss {
        return Outcome::Skipped("the backend does not push loss".into());
    }
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    hook!(h.kill_connection(&a).await);
    let reason = tokio::time::timeout(Duration::from_secs(5) + h.expiry_slack(), held.lost())
        .await
        .check("a backend that pushes loss must fire lost without a renewal");
    assert_eq!(reason, LostReason::SessionLost);
    assert!(!held.is_valid());
    Outcome::Passed
}

/// A holder cut off from its servers stops believing it holds the lock before any rival
/// is granted: its lost signal (or its local lease deadline, whichever comes first) comes
/// before the rival's grant. A session-based backend must give up at what the session can
/// still guarantee, not at the full session timeout.
pub async fn cut_off_holder_gives_up_before_a_rival_is_granted<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("cut_off_holder_gives_up_before_a_rival_is_granted");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    hook!(h.cut_link(&a, true).await);
    // The last deadline the holder believed, as of the cut; nothing can renew it now.
    let believed = held.valid_until();
    let rival = b
        .acquire(&key)
        .ttl(LONG_TTL)
        .wait(super::generous_wait(h) + Duration::from_secs(30))
        .await
        .check("the rival must be granted once the cut-off holder's lease is over");
    let granted = tokio::time::Instant::now();
    let gave_up = match (held.lost_at(), believed) {
        (Some(lost), Some(valid)) => lost.min(valid),
        (Some(lost), None) => lost,
        (None, Some(valid)) => valid,
        (None, None) => panic!("the holder was neither lost nor valid"),
    };
    assert!(
        gave_up <= granted,
        "the cut-off holder still believed it held the lock {:?} after a rival was granted",
        gave_up - granted
    );
    hook!(h.cut_link(&a, false).await);
    tokio::time::timeout(LONG_TTL, held.lost())
        .await
        .check("lost must fire for the cut-off holder");
    let _ = held.release().await;
    rival.release().await.check("release rival");
    Outcome::Passed
}
