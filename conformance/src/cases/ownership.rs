//! Ownership: only the holder may release, renew or extend.

use lockkit_core::spi::{Grant, Released};
use lockkit_core::{Error, OwnerId};

use super::{LONG_TTL, assert_busy, assert_free, generous_wait};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

/// A grant for `key` that names another owner, as a confused or malicious client would
/// forge it.
fn forged(held: &lockkit_core::LockGuard) -> Grant {
    let mut grant = held.grant().clone();
    grant.owner = OwnerId::random();
    grant
}

/// Another owner's release is refused and the lock stays held.
pub async fn foreign_release_is_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("foreign_release_is_refused");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    expect_err(
        b.backend().release(&forged(&held)).await,
        "foreign release",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    assert_busy(&b, &key, "after a refused foreign release").await;
    assert!(held.is_valid());
    assert_eq!(
        held.release().await.check("owner's release"),
        Released::Fully
    );
    Outcome::Passed
}

/// Another owner's renewal is refused.
pub async fn foreign_renew_is_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("foreign_renew_is_refused");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    expect_err(
        b.backend().renew(&forged(&held), LONG_TTL).await,
        "foreign renew",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    held.release().await.check("release");
    Outcome::Passed
}

/// A holder whose lease ran out releases late: it gets `Lost` and the next holder keeps
/// the lock (the seeds' "deleting someone else's lock").
pub async fn late_release_spares_next_holder<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("late_release_spares_next_holder");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let slow = a
        .try_acquire(&key)
        .ttl(ttl)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    let next = b
        .acquire(&key)
        .ttl(LONG_TTL)
        .wait(generous_wait(h))
        .await
        .check("next holder after expiry");
    expect_err(slow.release().await, "late release", |e| {
        matches!(e, Error::Lost { .. })
    });
    assert_busy(
        &c,
        &key,
        "the late release must not free the next holder's lock",
    )
    .await;
    assert_eq!(
        next.release().await.check("next holder's release"),
        Released::Fully
    );
    Outcome::Passed
}

/// Releasing twice is harmless: the second is `NotHeld`, even once someone else holds it.
pub async fn double_release_is_harmless<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("double_release_is_harmless");
    let key = space.key("k");
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let grant = held.grant().clone();
    held.release().await.check("first release");
    expect_err(a.backend().release(&grant).await, "second release", |e| {
        matches!(e, Error::NotHeld { .. })
    });
    let next = b
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("next")
        .check("free after release");
    expect_err(
        a.backend().release(&grant).await,
        "stale release while another holds",
        |e| matches!(e, Error::NotHeld { .. }),
    );
    assert_busy(&c, &key, "a stale release must not free the next holder").await;
    next.release().await.check("release next");
    Outcome::Passed
}

/// `inspect` names the holder, its depth, its token and the lease left.
pub async fn inspect_reports_holder<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("inspect_reports_holder");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let held = owner
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let info = b
        .inspect(&key)
        .await
        .check("inspect")
        .check("a held key must have a holder");
    assert_eq!(info.owner, owner.id().to_string());
    assert_eq!(info.depth, 1);
    if let Some(token) = info.token {
        assert_eq!(token, held.token());
    }
    if let Some(left) = info.ttl_left {
        assert!(left <= LONG_TTL && !left.is_zero(), "lease left {left:?}");
    }
    if h.client().await.info().capabilities.reentrant {
        let nested = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("reenter")
            .check("reentrant");
        assert_eq!(
            b.inspect(&key).await.check("inspect").check("held").depth,
            2
        );
        nested.release().await.check("release nested");
    }
    held.release().await.check("release");
    assert_free(&b, &key, "after release").await;
    Outcome::Passed
}

/// `inspect` of a free key is `None`.
pub async fn inspect_free_key_is_none<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("inspect_free_key_is_none");
    let a = h.client().await;
    assert_eq!(
        a.inspect(space.key("never-held")).await.check("inspect"),
        None
    );
    Outcome::Passed
}
