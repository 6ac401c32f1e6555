//! Waiting with a deadline, wake-ups, and cancellation.

use std::time::Duration;

use lockkit_core::Error;
use tokio::time::Instant;

use super::{CountingBackend, LONG_TTL, generous_wait, hook, residue_clears};
use crate::{Check, Harness, History, Outcome, Space, support::expect_err};

/// A zero wait on a busy key fails with `Timeout` at once.
pub async fn zero_wait_returns_at_once<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("zero_wait_returns_at_once");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let started = Instant::now();
    let err = expect_err(
        b.acquire(&key).wait(Duration::ZERO).await,
        "zero wait",
        |e| matches!(e, Error::Timeout { .. }),
    );
    assert!(err.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a zero wait took {:?}",
        started.elapsed()
    );
    held.release().await.check("release");
    Outcome::Passed
}

/// A wait on a key that stays held ends with `Timeout` near its deadline: not before it,
/// and not long after.
pub async fn wait_times_out_near_deadline<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("wait_times_out_near_deadline");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let wait = Duration::from_millis(500);
    let started = Instant::now();
    let err = expect_err(b.acquire(&key).wait(wait).await, "bounded wait", |e| {
        matches!(e, Error::Timeout { .. })
    });
    let took = started.elapsed();
    assert!(
        took >= wait,
        "timed out after {took:?}, before the {wait:?} deadline"
    );
    assert!(
        took < wait + Duration::from_secs(5),
        "timed out only after {took:?}"
    );
    match err {
        Error::Timeout { key: k, waited } => {
            assert_eq!(k, key);
            assert!(waited >= wait);
        }
        other => panic!("{other}"),
    }
    held.release().await.check("release");
    Outcome::Passed
}

/// An acquisition whose client is cut off from its servers (no byte passes; connections
/// stay open, as when packets are dropped) ends, with an error or a timeout, within its
/// wait and the backend's bound on an unanswered request, however far it got: it never
/// hangs on a link gone silent, and is never granted. Once the link is back, another client
/// gets the key: the attempt left no lock behind.
pub async fn a_wait_on_a_cut_link_ends<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_wait_on_a_cut_link_ends");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    // Used just now, so that pooled connections are handed out unchecked.
    a.try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key")
        .release()
        .await
        .check("release");
    hook!(h.cut_link(&a, true).await);
    let wait = Duration::from_secs(2);
    // Wide: a wait plus any backend's bound on an unanswered request.
    let ended = tokio::time::timeout(
        wait + Duration::from_secs(60),
        a.acquire(&key).ttl(LONG_TTL).wait(wait),
    )
    .await;
    hook!(h.cut_link(&a, false).await);
    let outcome = ended.check("an acquisition on a cut link must end, not hang");
    if let Ok(held) = outcome {
        panic!("granted on a cut link (token {})", held.token().get());
    }
    b.acquire(&key)
        .ttl(LONG_TTL)
        .wait(generous_wait(h) + Duration::from_secs(10))
        .await
        .check("the key must be free once the link is back")
        .release()
        .await
        .check("release");
    Outcome::Passed
}

/// A release wakes a waiter promptly: long before the holder's 60 s lease would have
/// ended, so the waiter was notified, not polling at the lease.
pub async fn waiter_is_woken_promptly_by_release<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("waiter_is_woken_promptly_by_release");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move {
            let guard = b
                .acquire(&key)
                .wait(Duration::from_secs(50))
                .await
                .check("waiter");
            (Instant::now(), guard)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released_at = Instant::now();
    held.release().await.check("release");
    let (granted_at, guard) = waiter.await.check("waiter task");
    let handoff = granted_at.saturating_duration_since(released_at);
    assert!(
        handoff < Duration::from_secs(5),
        "the waiter took {handoff:?} to notice a release"
    );
    guard.release().await.check("release waiter");
    Outcome::Passed
}

/// `inspect` counts a waiter behind the holder on a backend that says it counts waiters
/// (exactly or, on Redis, as the clients listening for the release).
pub async fn inspect_counts_waiters<H: Harness>(h: &H) -> Outcome {
    let (a, b) = (h.client().await, h.client().await);
    if !a.info().capabilities.counts_waiters {
        return Outcome::Skipped("the backend does not count waiters".into());
    }
    let space = Space::new("inspect_counts_waiters");
    let key = space.key("k");
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let before = a.inspect(&key).await.check("inspect").check("held");
    assert_eq!(before.waiters, Some(0), "nobody waits yet");
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move { b.acquire(&key).wait(Duration::from_secs(60)).await })
    };
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let info = a.inspect(&key).await.check("inspect").check("held");
        if info.waiters.is_some_and(|n| n >= 1) {
            break;
        }
        assert!(
            Instant::now() < give_up,
            "a waiter was never counted: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    held.release().await.check("release");
    let guard = waiter.await.check("waiter task").check("waiter");
    guard.release().await.check("release waiter");
    Outcome::Passed
}

/// A waiter gets the key once a dead holder's lease runs out, without any release.
pub async fn waiter_acquires_after_holder_expires<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("waiter_acquires_after_holder_expires");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let started = Instant::now();
    let dead = a
        .try_acquire(&key)
        .ttl(h.short_ttl())
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    let guard = b
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("waiter after expiry");
    let took = started.elapsed();
    let bound = h.short_ttl() + h.expiry_slack() + Duration::from_secs(2);
    assert!(
        took < bound,
        "the waiter got the key {took:?} after a {:?} lease began (bound {bound:?}): \
         it was not woken when the lease ran out",
        h.short_ttl()
    );
    assert!(guard.token() > dead.token());
    guard.release().await.check("release");
    Outcome::Passed
}

/// A waiter cancelled mid-wait leaves nothing on the server.
pub async fn cancelled_waiter_leaves_no_residue<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("cancelled_waiter_leaves_no_residue");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    for _ in 0..5 {
        let cancelled = tokio::time::timeout(
            Duration::from_millis(100),
            b.acquire(&key).wait(Duration::from_secs(30)),
        )
        .await;
        assert!(
            cancelled.is_err(),
            "the waiter should still have been waiting"
        );
    }
    held.release().await.check("release");
    // A cancelled wait whose last attempt was already at the server can still be granted
    // the key just released; that grant is given back in the background. The key must be
    // free soon, long before any lease could run out on its own.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match b.try_acquire(&key).await.check("probe") {
            Some(probe) => {
                probe.release().await.check("release the probe");
                break;
            }
            None => {
                assert!(
                    Instant::now() < until,
                    "after the cancelled waits: `{key}` is still held 10 s after its release"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    // Let asynchronous clean-up (unsubscribe, node deletion) land, then count.
    match residue_clears(
        h,
        space.prefix(),
        Duration::from_secs(10),
        "the cancelled waits",
    )
    .await
    {
        Ok(()) => Outcome::Passed,
        Err(why) => Outcome::Skipped(why),
    }
}

/// Acquisitions dropped at many points mid-flight never leave an orphaned lock.
pub async fn cancelled_acquire_leaves_no_orphan<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("cancelled_acquire_leaves_no_orphan");
    let (a, b) = (h.client().await, h.client().await);
    for round in 0u64..60 {
        let key = space.key(&format!("k{round}"));
        // Drop points from "before the first poll" to "after the grant".
        let budget = Duration::from_micros(round * round * 10);
        let attempt = a.acquire(&key).ttl(LONG_TTL).wait(Duration::from_secs(30));
        if let Ok(guard) = tokio::time::timeout(budget, attempt).await {
            guard.check("acquire").release().await.check("release");
        }
        // A 60 s orphan would make this fail; a background clean-up gets a moment.
        let probe = b.acquire(&key).wait(Duration::from_secs(5)).await;
        match probe {
            Ok(guard) => {
                guard.release().await.check("release probe");
            }
            Err(e) => panic!("round {round}: a cancelled acquire left `{key}` locked: {e}"),
        }
    }
    Outcome::Passed
}

/// Sixteen waiters on one key all get it in turn, with no overlap.
pub async fn many_waiters_all_acquire<H: Harness>(h: &H) -> Outcome {
    const WAITERS: usize = 16;
    let space = Space::new("many_waiters_all_acquire");
    let key = space.key("k");
    let a = h.client().await;
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let history = History::new();
    let mut tasks = Vec::new();
    for w in 0..WAITERS {
        let client = h.client().await;
        let (key, history) = (key.clone(), history.clone());
        tasks.push(tokio::spawn(async move {
            let guard = client
                .acquire(&key)
                .ttl(LONG_TTL)
                .wait(Duration::from_secs(60))
                .await
                .check("waiter");
            let open = history.begin(format!("waiter {w}"), &guard);
            tokio::time::sleep(Duration::from_millis(5)).await;
            history.end(open, &guard);
            guard.release().await.check("waiter release");
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    held.release().await.check("release");
    for task in tasks {
        task.await.check("waiter task");
    }
    assert_eq!(history.records().len(), WAITERS);
    history.assert_linear();
    Outcome::Passed
}

/// When the holder's session ends, a waiter is woken at once (not at the lease's end).
/// Skipped for backends that keep a lock past its holder's session.
pub async fn waiter_is_woken_when_holder_session_ends<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("waiter_is_woken_when_holder_session_ends");
    let key = space.key("k");
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move { b.acquire(&key).wait(Duration::from_secs(50)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    hook!(h.kill_connection(&a).await);
    // Does this backend free the lock with the session at all? (The waiter may be the
    // holder by the time we look: only the first holder's record counts.)
    let deadline = Instant::now() + h.expiry_slack();
    let first_holder = held.token();
    while c
        .inspect(&key)
        .await
        .check("inspect")
        .is_some_and(|holder| holder.token.is_none_or(|token| token == first_holder))
    {
        if Instant::now() >= deadline {
            waiter.abort();
            return Outcome::Skipped(
                "the backend keeps a lock after its holder's session ends".into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap_or_else(|_| panic!("the waiter was not woken when the holder's session ended"))
        .check("waiter task")
        .check("waiter");
    guard.release().await.check("release waiter");
    drop(held);
    Outcome::Passed
}

/// A waiter behind a long-held lock is woken by the backend, not by asking the server
/// over and over: its requests during a 3 s wait are counted by the fault proxy in front
/// of its client. A notified waiter sends a handful (subscribe, one try, keep-alives); a
/// backend that polls by design must back off (a 1 ms poller sends thousands).
pub async fn waiter_does_not_poll_the_server<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("waiter_does_not_poll_the_server");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    // Warm the waiter's connections up, so connecting is not counted.
    let _ = b.inspect(&key).await.check("inspect");
    let before = hook!(h.requests_sent(&b).await);
    let wait = Duration::from_secs(3);
    let result = b.acquire(&key).wait(wait).await;
    let sent = hook!(h.requests_sent(&b).await) - before;
    expect_err(result, "waiting behind a long hold", |e| {
        matches!(e, Error::Timeout { .. })
    });
    held.release().await.check("release");
    let notified = b.info().capabilities.notified_wait;
    let limit = if notified { 40 } else { 400 };
    eprintln!(
        "lockkit-conformance: waiter_does_not_poll_the_server on {}: {sent} requests in {wait:?} (limit {limit})",
        h.name()
    );
    assert!(
        sent <= limit,
        "a waiter sent {sent} requests in a {wait:?} wait behind a long-held lock \
         (limit {limit}, notified_wait = {notified}): it polls the server"
    );
    Outcome::Passed
}

/// On a backend whose waiters queue (`queued_wait`), a release wakes only the next waiter:
/// the other waiters send (almost) nothing while the next one takes over. Watching the
/// head of the queue, or any node but one's predecessor, wakes them all (a herd), and
/// each of them then asks the server again: counted by the proxies in front of them.
pub async fn release_wakes_only_the_next_waiter<H: Harness>(h: &H) -> Outcome {
    const WAITERS: usize = 12;
    let space = Space::new("release_wakes_only_the_next_waiter");
    let key = space.key("k");
    let holder = h.client().await;
    if !holder.info().capabilities.queued_wait {
        return Outcome::Skipped("the backend's waiters do not queue (queued_wait)".into());
    }
    let held = holder
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    // Wake-ups where the backend counts them (keep-alives cannot blur them); otherwise
    // requests to the server.
    let by_wakeups = h.watch_wakeups(&holder).await.is_ok();
    let count = |client: &lockkit_core::Locker| {
        let client = client.clone();
        async move {
            if by_wakeups {
                h.watch_wakeups(&client).await
            } else {
                h.requests_sent(&client).await
            }
        }
    };
    let what = if by_wakeups { "wake-ups" } else { "requests" };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (granted_tx, mut granted_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    let mut warmed = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let client = h.client().await;
        let _ = client.inspect(&key).await.check("warm up");
        warmed.push(hook!(count(&client).await));
        let (key, granted_tx, mut stop_rx) = (key.clone(), granted_tx.clone(), stop_rx.clone());
        let wait = generous_wait(h) + Duration::from_secs(30);
        let waiter = client.clone();
        tasks.push(tokio::spawn(async move {
            let guard = waiter
                .acquire(&key)
                .ttl(LONG_TTL)
                .wait(wait)
                .await
                .check("a queued waiter must be granted in turn");
            let _ = granted_tx.send(i);
            let _ = stop_rx.wait_for(|stop| *stop).await;
            guard.release().await.check("release in turn");
        }));
        waiters.push(client);
    }
    // Let every waiter settle into the queue: at least half a second, then until every
    // waiter has asked the server since its warm-up (where requests are counted) and no
    // waiter's count moves for a quarter of one. A loaded machine may still be setting
    // some waiters up after the first half second (even not yet started), and their set-up
    // is not a herd. (After 10 s what still moves is periodic, keep-alives: go on.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let settle_until = Instant::now() + Duration::from_secs(10);
    let mut before = Vec::new();
    for client in &waiters {
        before.push(hook!(count(client).await));
    }
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut now = Vec::new();
        for client in &waiters {
            now.push(hook!(count(client).await));
        }
        let queued = by_wakeups || now.iter().zip(&warmed).all(|(now, warm)| now > warm);
        let settled = queued && now == before;
        before = now;
        if settled || Instant::now() >= settle_until {
            break;
        }
    }
    held.release().await.check("release");
    let next = tokio::time::timeout(generous_wait(h), granted_rx.recv())
        .await
        .check("no waiter was granted after the release")
        .check("waiter channel");
    // Long enough for a woken herd to ask the server again; short enough that keep-alives
    // add little.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut others = 0;
    for (i, client) in waiters.iter().enumerate() {
        if i != next {
            others += hook!(count(client).await) - before[i];
        }
    }
    let _ = stop_tx.send(true);
    for task in tasks {
        task.await.check("waiter task");
    }
    eprintln!(
        "lockkit-conformance: release_wakes_only_the_next_waiter on {}: {others} {what} among the {} waiters left in the queue",
        h.name(),
        WAITERS - 1
    );
    assert!(
        others < (WAITERS as u64 - 1) / 2,
        "one release caused {others} {what} among the {} waiters still queued: a herd",
        WAITERS - 1
    );
    Outcome::Passed
}

/// A grant that comes after a wait longer than its TTL still carries its whole lease: the
/// lease starts when the grant is observed, not when the wait began (otherwise the grant
/// arrives already expired, and `lockkit run --wait 10m` stops its command at once).
pub async fn a_long_wait_yields_a_full_lease<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_long_wait_yields_a_full_lease");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let ttl = Duration::from_secs(2).max(h.short_ttl());
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let waiter = {
        let key = key.clone();
        tokio::spawn(async move {
            let guard = b
                .acquire(&key)
                .ttl(ttl)
                .no_watchdog()
                .wait(Duration::from_secs(60))
                .await
                .check("waiter");
            (Instant::now(), guard)
        })
    };
    // Longer than the waiter's TTL.
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    held.release().await.check("release");
    let (granted_at, guard) = waiter.await.check("waiter task");
    assert!(
        guard.is_valid(),
        "a grant after a wait longer than its {ttl:?} TTL was already invalid"
    );
    let left = guard
        .valid_until()
        .check("a held guard has a lease")
        .saturating_duration_since(granted_at);
    assert!(
        left > ttl / 2,
        "a grant after a long wait kept only {left:?} of its {ttl:?} lease"
    );
    assert!(guard.lost_at().is_none(), "lost at once after a long wait");
    guard.release().await.check("release the waiter's grant");
    Outcome::Passed
}

/// Where a release wakes every waiter (no server queue: pub/sub, `NOTIFY`, polling), the
/// waiting acquisitions of one client on one key reach its backend one at a time, the
/// others queued in the client: otherwise each release sends every one of them to the
/// server again, for one grant (16 tasks of one Redis client ran 14 scripts per hold where
/// 2 do). All of them still get the key in turn, with no overlap.
///
/// The client lets its queued waiters go to the server beside the one there once that one
/// has waited a second (a stuck future must not hold the others back for ever). A round in
/// which the machine stalled that long proves nothing, and is run again, twice at most.
pub async fn a_clients_waiters_reach_the_server_one_at_a_time<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("a_clients_waiters_reach_the_server_one_at_a_time");
    let holder = h.client().await;
    if holder.info().capabilities.queued_wait {
        return Outcome::Skipped("the backend's waiters queue on the server (queued_wait)".into());
    }
    for round in 0..3 {
        let key = space.key(&format!("k{round}"));
        let (at_once, longest_step) = waiters_at_the_backend_at_once(h, &holder, &key).await;
        eprintln!(
            "lockkit-conformance: a_clients_waiters_reach_the_server_one_at_a_time on {}: \
             round {round}: at most {at_once} of {QUEUED_WAITERS} waiting acquisitions at \
             the backend at once; longest step {longest_step:?}",
            h.name()
        );
        assert!(at_once >= 1, "no waiting acquisition reached the backend");
        if at_once == 1 {
            return Outcome::Passed;
        }
        assert!(
            longest_step >= STALL,
            "{at_once} of one client's {QUEUED_WAITERS} waiting acquisitions of one key were at \
             its backend at once, with no step of the run as long as {STALL:?}: a release \
             wakes them all (a herd)"
        );
    }
    panic!(
        "three rounds in a row stalled for {STALL:?} or more: the machine is too slow to \
         tell a herd from a stuck waiter"
    )
}

const QUEUED_WAITERS: usize = 12;

/// A step this long may have let the client's queued waiters run out of patience
/// (`lockkit_core`'s gate waits a second for the waiter at the server).
const STALL: Duration = Duration::from_millis(800);

/// One round of [`a_clients_waiters_reach_the_server_one_at_a_time`]: how many of the
/// waiting acquisitions were at the backend at once, at most, and the longest step of the
/// run (from the first waiter's start to the first grant, and between grants).
async fn waiters_at_the_backend_at_once<H: Harness>(
    h: &H,
    holder: &lockkit_core::Locker,
    key: &lockkit_core::LockKey,
) -> (u64, Duration) {
    let (client, counting) = CountingBackend::wrap(&h.client().await);
    let held = holder
        .try_acquire(key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    let history = History::new();
    let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let granted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let first_start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..QUEUED_WAITERS {
        let (client, key, history) = (client.clone(), key.clone(), history.clone());
        let (started, granted) = (started.clone(), granted.clone());
        let wait = generous_wait(h) + Duration::from_secs(30);
        tasks.push(tokio::spawn(async move {
            started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let guard = client
                .acquire(&key)
                .ttl(LONG_TTL)
                .wait(wait)
                .await
                .check("waiter");
            granted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Instant::now());
            let open = history.begin(format!("waiter {w}"), &guard);
            tokio::time::sleep(Duration::from_millis(2)).await;
            history.end(open, &guard);
            guard.release().await.check("waiter release");
        }));
    }
    // Every waiter has started, and one has reached the backend.
    let give_up = Instant::now() + Duration::from_secs(5);
    while (started.load(std::sync::atomic::Ordering::SeqCst) < QUEUED_WAITERS
        || counting.waiting_started() < 1)
        && Instant::now() < give_up
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released_at = Instant::now();
    held.release().await.check("release");
    for task in tasks {
        task.await.check("waiter task");
    }
    assert_eq!(history.records().len(), QUEUED_WAITERS);
    history.assert_linear();
    // Each waiter's time holding the client's queue: the first one's from the start to its
    // grant, every later one's from the grant before (when the queue passed to it).
    let mut steps = vec![released_at - first_start];
    let mut grants = granted.lock().unwrap_or_else(|e| e.into_inner()).clone();
    grants.sort();
    let mut last = first_start;
    for grant in grants {
        steps.push(grant.saturating_duration_since(last));
        last = grant;
    }
    let longest = steps.into_iter().max().unwrap_or_default();
    (counting.most_waiting(), longest)
}
