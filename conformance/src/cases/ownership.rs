//! Ownership: only the holder may release, renew or extend.

use std::time::Duration;

use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{Error, HolderIdentity, LossSignal, OwnerId};

use super::{LONG_TTL, assert_busy, assert_free, generous_wait, hook};
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

/// A release dropped after its first poll (its caller timed out or went away, with the
/// link cut so the request cannot have landed) still gives the lock up, although the
/// caller keeps the grant: at the latest its lease runs out, and a rival gets the key.
/// (Found on etcd, whose keep-alives went on for a hold whose release was dropped.)
pub async fn a_dropped_release_leaves_no_orphan<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_dropped_release_leaves_no_orphan");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let backend = a.backend().clone();
    let request = AcquireRequest::new(
        key.clone(),
        a.owner().id(),
        h.short_ttl(),
        LossSignal::new(),
    );
    let grant = backend
        .try_acquire(&request)
        .await
        .check("acquire")
        .check("free key");
    // Where the harness can cut the link, the release surely does not reach the server
    // before it is dropped; elsewhere it may, which the case allows.
    let cut = match h.cut_link(&a, true).await {
        Ok(()) => true,
        Err(crate::HookError::Unsupported(_)) => false,
        Err(crate::HookError::Failed(why)) => panic!("fault hook failed: {why}"),
    };
    {
        let mut release = std::pin::pin!(backend.release(&grant));
        let polled =
            std::future::poll_fn(|cx| std::task::Poll::Ready(release.as_mut().poll(cx))).await;
        if let std::task::Poll::Ready(done) = polled {
            done.check("a release that finished at once");
        }
    }
    if cut {
        hook!(h.cut_link(&a, false).await);
    }
    let rival = b
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("the key must be free once a dropped release's lease ran out");
    rival.release().await.check("release the rival");
    drop(grant);
    Outcome::Passed
}

/// A release or an extension whose client is cut off from its servers (no byte passes;
/// connections stay open, as when packets are dropped) ends, with an error or (had it gone
/// through before the cut took hold) its outcome, within the backend's bound on an
/// unanswered request: neither hangs on a link gone silent. Once the link is back, another
/// client gets both keys within their lease: nothing kept them past it.
pub async fn a_release_on_a_cut_link_ends<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_release_on_a_cut_link_ends");
    let (released, extended) = (space.key("released"), space.key("extended"));
    let (a, b) = (h.client().await, h.client().await);
    // Long enough that both calls still find their holds valid and go to the server.
    let ttl = h.short_ttl().max(Duration::from_secs(5));
    let first = a
        .try_acquire(&released)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    let second = a
        .try_acquire(&extended)
        .ttl(ttl)
        .await
        .check("acquire")
        .check("free key");
    hook!(h.cut_link(&a, true).await);
    // Wide: the SQL backends give up at their bound (20 s by default); every other one
    // has request timeouts of its own, far shorter than its bound (120 s by default).
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(first.release(), second.extend(ttl))
    })
    .await;
    hook!(h.cut_link(&a, false).await);
    // Any outcome will do (the call went through before the cut took hold, it was given
    // up on, or the hold was found lost meanwhile), as long as there is one.
    let (release, extension) =
        ended.check("a release and an extension on a cut link must end, not hang");
    drop((release, extension, second));
    for key in [&released, &extended] {
        b.acquire(key)
            .wait(ttl + generous_wait(h))
            .await
            .check("the key must be free within its lease once the link is back")
            .release()
            .await
            .check("release");
    }
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
    // Who holds it: this process, as the guard says it wrote.
    let identity = info
        .identity
        .clone()
        .check("inspect must name the holder's host and process");
    let this = HolderIdentity::now();
    assert_eq!(identity.host, this.host, "holder host");
    assert_eq!(identity.pid, std::process::id(), "holder pid");
    assert_eq!(identity.program, this.program, "holder program");
    assert_eq!(
        identity.requested_at_ms(),
        held.holder().requested_at_ms(),
        "requested-at as the guard wrote it"
    );
    if h.client().await.info().capabilities.reentrant {
        // A re-entry asks later (its request carries a later time): the record must keep
        // the first hold's.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let nested = owner
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("reenter")
            .check("reentrant");
        let info = b.inspect(&key).await.check("inspect").check("held");
        assert_eq!(info.depth, 2);
        assert_eq!(
            info.identity.map(|i| i.requested_at_ms()),
            Some(identity.requested_at_ms()),
            "a re-entry keeps the first hold's identity"
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
