//! Counting semaphores: never more than N permits, each a lease of its own with its own
//! token; a crashed holder's permit comes back within its lease. Skipped on a backend whose
//! capabilities leave semaphores out.

use std::{
    collections::HashSet,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use lockkit_core::{Error, LockKind};
use tokio::time::Instant;

use super::{LONG_TTL, generous_wait};
use crate::{
    Check, Harness, Outcome, Space,
    holder::{HolderProcess, HolderSpec},
    support::expect_err,
};

async fn needs_semaphores<H: Harness>(h: &H) -> Option<Outcome> {
    let client = h.client().await;
    (!client.info().capabilities.semaphore)
        .then(|| Outcome::Skipped("the backend has no semaphores".into()))
}

/// N permits go to N holders (of one client or several), the next is refused until one is
/// given back; every permit has its own token, and a new one's token is greater than that
/// of every permit given back before it was asked for.
pub async fn permits_bound_the_holders<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_semaphores(h).await {
        return skip;
    }
    let space = Space::new("permits_bound_the_holders");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let (sa, sb) = (a.semaphore(&key, 3), b.semaphore(&key, 3));
    let mut held = Vec::new();
    for (i, semaphore) in [&sa, &sa, &sb].into_iter().enumerate() {
        let permit = semaphore.try_acquire().ttl(LONG_TTL).await.check("permit");
        let permit = permit.unwrap_or_else(|| panic!("permit {} of 3 was refused", i + 1));
        assert_eq!(permit.kind().limit(), Some(3));
        assert_eq!(permit.depth(), 1, "a permit is never a re-entry");
        held.push(permit);
    }
    let tokens: HashSet<_> = held.iter().map(|p| p.token()).collect();
    assert_eq!(tokens.len(), 3, "every permit has a token of its own");
    assert!(
        sb.try_acquire().await.check("fourth").is_none(),
        "a fourth permit of three was granted"
    );
    let holders = sb.holders().await.check("holders");
    assert_eq!(
        holders.len(),
        3,
        "holders() lists every permit: {holders:?}"
    );
    let first = held.remove(0);
    let given_back = first.token();
    first.release().await.check("release a permit");
    let next = sb.try_acquire().ttl(LONG_TTL).await.check("permit");
    let next = next.check("a permit given back is free again");
    assert!(next.token() > given_back, "a new permit's token must grow");
    expect_err(next.reenter().await, "re-entering a permit", |e| {
        matches!(e, Error::Unsupported { .. })
    });
    next.release().await.check("release");
    for permit in held {
        permit.release().await.check("release");
    }
    Outcome::Passed
}

/// A client that asks for the semaphore with another permit count, or for a plain lock on
/// the key, is refused with `KindMismatch` and takes nothing.
pub async fn a_different_permit_count_is_refused<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_semaphores(h).await {
        return skip;
    }
    let space = Space::new("a_different_permit_count_is_refused");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let permit = a.semaphore(&key, 3).try_acquire().ttl(LONG_TTL).await;
    let permit = permit.check("permit").check("a free semaphore");
    expect_err(
        b.semaphore(&key, 2).try_acquire().await,
        "a 2-permit semaphore on a 3-permit key",
        |e| matches!(e, Error::KindMismatch { .. }),
    );
    let plain = b.try_acquire(&key).await;
    assert!(
        matches!(plain, Ok(None) | Err(Error::KindMismatch { .. })),
        "a plain lock on a semaphore's key must be refused, got {plain:?}"
    );
    let mut rest = Vec::new();
    for _ in 0..2 {
        let more = a.semaphore(&key, 3).try_acquire().ttl(LONG_TTL).await;
        rest.push(
            more.check("permit")
                .check("the refused clients took no permit"),
        );
    }
    permit.release().await.check("release");
    for more in rest {
        more.release().await.check("release");
    }
    Outcome::Passed
}

/// Randomized: many clients take and give back permits of a 3-permit semaphore; never more
/// than 3 are out, and everyone gets one in the end.
pub async fn permits_never_exceed_the_limit<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_semaphores(h).await {
        return skip;
    }
    let space = Space::new("permits_never_exceed_the_limit");
    let key = space.key("k");
    let out = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    // Every client connects first and all start together, so that permits are out at the
    // same time however slowly clients connect.
    let start = Arc::new(tokio::sync::Barrier::new(6));
    for task in 0..6u64 {
        let client = h.client().await;
        let (key, out, most, start) = (key.clone(), out.clone(), most.clone(), start.clone());
        let wait = generous_wait(h);
        tasks.push(tokio::spawn(async move {
            let semaphore = client.semaphore(&key, 3);
            let mut seed = 0xD1B5_4A32_D192_ED03u64.wrapping_mul(task + 1);
            start.wait().await;
            for round in 0..10 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let permit = if seed.is_multiple_of(4) {
                    match semaphore.try_acquire().ttl(LONG_TTL).await.check("try") {
                        Some(permit) => permit,
                        None => continue,
                    }
                } else {
                    semaphore
                        .acquire()
                        .ttl(LONG_TTL)
                        .wait(wait)
                        .await
                        .check("permit")
                };
                let now = out.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                assert!(now <= 3, "{now} permits of 3 were out at once");
                // The first permits are held long enough for the others to be granted.
                let hold = if round == 0 { 200 } else { seed % 6 };
                tokio::time::sleep(Duration::from_millis(hold)).await;
                out.fetch_sub(1, Ordering::SeqCst);
                permit.release().await.check("release");
            }
        }));
    }
    for task in tasks {
        task.await.check("task");
    }
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "permits were never shared"
    );
    let client = h.client().await;
    let semaphore = client.semaphore(&key, 3);
    let mut all = Vec::new();
    for _ in 0..3 {
        let permit = semaphore.try_acquire().ttl(LONG_TTL).await.check("permit");
        all.push(permit.check("every permit is back at the end"));
    }
    for permit in all {
        permit.release().await.check("release");
    }
    Outcome::Passed
}

/// A waiter for a full semaphore is granted when a permit is given back (woken, not
/// left to its deadline).
pub async fn a_waiter_gets_the_permit_given_back<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_semaphores(h).await {
        return skip;
    }
    let space = Space::new("a_waiter_gets_the_permit_given_back");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a.semaphore(&key, 1).try_acquire().ttl(LONG_TTL).await;
    let held = held.check("permit").check("a free semaphore");
    let wait = generous_wait(h);
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            b.semaphore(&key, 1)
                .acquire()
                .ttl(LONG_TTL)
                .wait(wait)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "a second permit of one was granted");
    let token = held.token();
    held.release().await.check("release");
    let granted = waiter
        .await
        .check("waiter task")
        .check("the waiter's permit");
    assert!(granted.token() > token);
    assert!(matches!(granted.kind(), LockKind::Permit { .. }));
    granted.release().await.check("release");
    Outcome::Passed
}

/// A SIGKILLed holder's permit is free again within its lease (plus the backend's slack).
pub async fn a_killed_holders_permit_comes_back<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_semaphores(h).await {
        return skip;
    }
    if !h.cross_process() {
        return Outcome::Skipped("the backend does not share locks across processes".into());
    }
    let space = Space::new("a_killed_holders_permit_comes_back");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let mut child = HolderProcess::spawn(&HolderSpec {
        key: key.clone(),
        ttl,
        watchdog: true,
        permits: 1,
    })
    .await;
    let parent = h.client().await;
    let semaphore = parent.semaphore(&key, 1);
    assert!(
        semaphore.try_acquire().await.check("try").is_none(),
        "the child's permit was not counted"
    );
    child.kill().await;
    let killed = Instant::now();
    let permit = semaphore
        .acquire()
        .ttl(LONG_TTL)
        .wait(generous_wait(h))
        .await
        .check("a permit after the kill");
    let freed_after = killed.elapsed();
    let bound = ttl + h.expiry_slack() + Duration::from_secs(2);
    assert!(
        freed_after < bound,
        "the permit came back {freed_after:?} after the kill; bound {bound:?}"
    );
    assert!(
        permit.token() > child.token,
        "a new permit's token must grow"
    );
    permit.release().await.check("release");
    Outcome::Passed
}
