//! Read-write locks: readers share, a writer excludes everyone, a waiting writer keeps new
//! readers out, an owner may downgrade but never upgrade, and every new holder's token grows.
//! Every case is skipped on a backend whose capabilities leave read-write locks out, except
//! the first, which checks such a backend refuses them before any I/O.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use lockkit_core::spi::{AcquireRequest, Released};
use lockkit_core::{Error, FencingToken, LockKey, LockKind, Locker, LossSignal};

use super::{LONG_TTL, assert_busy, generous_wait, residue_clears};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

async fn needs_read_write<H: Harness>(h: &H) -> Option<Outcome> {
    let client = h.client().await;
    (!client.info().capabilities.read_write)
        .then(|| Outcome::Skipped("the backend has no read-write locks".into()))
}

async fn needs_writer_preference<H: Harness>(h: &H) -> Option<Outcome> {
    if let Some(skip) = needs_read_write(h).await {
        return Some(skip);
    }
    let client = h.client().await;
    (!client.info().capabilities.writer_preference)
        .then(|| Outcome::Skipped("the backend has no writer preference".into()))
}

/// Returns once a new reader (on `client`) is refused: new readers enter until a writer's
/// wait is known to the backend, then stay out. Fails the case if they keep entering for
/// the whole `wait`.
async fn until_readers_are_kept_out(client: &Locker, key: &LockKey, wait: Duration) {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match client.read(key).ttl(LONG_TTL).try_now().await.check("read") {
            None => return,
            Some(guard) => {
                guard.release().await.check("release probe");
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "new readers kept entering while a writer waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A backend without read-write locks or semaphores answers `Unsupported` for them at
/// once; one with them grants a read.
pub async fn unsupported_kinds_are_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("unsupported_kinds_are_refused");
    let key = space.key("k");
    let client = h.client().await;
    let capabilities = client.info().capabilities.clone();
    let read = client.read(&key).ttl(LONG_TTL).try_now().await;
    if capabilities.read_write {
        let guard = read.check("read").check("a free key");
        assert_eq!(guard.kind(), LockKind::Read);
        guard.release().await.check("release");
    } else {
        expect_err(read, "a read-write lock where unsupported", |e| {
            matches!(e, Error::Unsupported { .. })
        });
        expect_err(
            client.write(&key).ttl(LONG_TTL).await,
            "a write lock where unsupported",
            |e| matches!(e, Error::Unsupported { .. }),
        );
    }
    let permit = client.semaphore(&key, 2).try_acquire().ttl(LONG_TTL).await;
    if capabilities.semaphore {
        let guard = permit.check("permit").check("a free semaphore");
        assert!(matches!(guard.kind(), LockKind::Permit { .. }));
        guard.release().await.check("release");
    } else {
        expect_err(permit, "a semaphore where unsupported", |e| {
            matches!(e, Error::Unsupported { .. })
        });
    }
    let refused = client.semaphore(&key, 0).acquire().await;
    expect_err(refused, "a semaphore of zero permits", |e| {
        matches!(e, Error::Config(_) | Error::Unsupported { .. })
    });
    Outcome::Passed
}

/// Readers of different clients share a key; a writer is refused while they read and
/// granted, with a greater token, once they are gone.
pub async fn readers_share<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("readers_share");
    let key = space.key("k");
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let one = a
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("first read");
    let one = one.check("a free key");
    let two = b
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("second read");
    let two = two.check("readers must share the key");
    assert_eq!((one.kind(), two.kind()), (LockKind::Read, LockKind::Read));
    assert_ne!(one.token(), two.token(), "each reader is a new holder");
    assert!(
        c.write(&key)
            .ttl(LONG_TTL)
            .try_now()
            .await
            .check("write")
            .is_none(),
        "a writer was granted while two readers held the key"
    );
    assert_busy(&c, &key, "a plain lock counts as a writer").await;
    let holders = c.backend().holders(&key).await.check("holders");
    assert!(
        holders.len() >= 2,
        "holders() should list both readers, got {holders:?}"
    );
    let newest = one.token().max(two.token());
    one.release().await.check("release one");
    assert!(
        c.write(&key)
            .ttl(LONG_TTL)
            .try_now()
            .await
            .check("write")
            .is_none(),
        "a writer was granted while a reader held the key"
    );
    two.release().await.check("release two");
    let writer = c.write(&key).ttl(LONG_TTL).try_now().await.check("write");
    let writer = writer.check("the key is free of readers");
    assert!(writer.token() > newest, "a new writer's token must grow");
    writer.release().await.check("release writer");
    Outcome::Passed
}

/// A writer excludes readers and writers of every other client, and a plain lock excludes
/// readers.
pub async fn writer_excludes_readers_and_writers<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("writer_excludes_readers_and_writers");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let writer = a.write(&key).ttl(LONG_TTL).try_now().await.check("write");
    let writer = writer.check("a free key");
    assert_eq!(writer.kind(), LockKind::Write);
    assert!(b.read(&key).try_now().await.check("read").is_none());
    assert!(b.write(&key).try_now().await.check("write").is_none());
    assert_busy(&b, &key, "a writer excludes a plain lock").await;
    let token = writer.token();
    writer.release().await.check("release");
    let reader = b.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let reader = reader.check("free after the writer left");
    assert!(reader.token() > token, "a new reader's token must grow");
    reader.release().await.check("release reader");
    let plain = a.try_acquire(&key).ttl(LONG_TTL).await.check("plain lock");
    let plain = plain.check("free");
    assert!(b.read(&key).try_now().await.check("read").is_none());
    plain.release().await.check("release plain lock");
    Outcome::Passed
}

/// An owner's reads are reentrant (same token, as many releases) and its write may be
/// downgraded: it reads while it writes, and once the write is gone other readers join
/// while writers stay out.
pub async fn reads_reenter_and_writes_downgrade<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("reads_reenter_and_writes_downgrade");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let write = owner
        .write(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("write");
    let write = write.check("a free key");
    let read = owner
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("downgrade");
    let read = read.check("a writer may read at once (downgrade)");
    assert_eq!(read.depth(), 1, "a downgrade is a hold of its own");
    let again = owner
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("re-read");
    let again = again.check("reads are reentrant");
    assert_eq!(again.depth(), 2);
    assert_eq!(again.token(), read.token(), "a re-entry keeps its token");
    assert!(
        b.read(&key).try_now().await.check("read").is_none(),
        "another reader entered while the owner wrote"
    );
    assert_eq!(
        write.release().await.check("release write"),
        Released::Fully
    );
    let other = b.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let other = other.check("readers join once the write is gone");
    assert!(b.write(&key).try_now().await.check("write").is_none());
    assert_eq!(
        again.release().await.check("release re-read"),
        Released::Partially { remaining: 1 }
    );
    read.release().await.check("release read");
    assert!(b.write(&key).try_now().await.check("write").is_none());
    other.release().await.check("release other");
    let last = b.write(&key).ttl(LONG_TTL).try_now().await.check("write");
    last.check("free at the end")
        .release()
        .await
        .check("release");
    Outcome::Passed
}

/// An owner that reads and asks to write is refused at once with `WouldDeadlock`, by the
/// locker and by the backend itself (a request that bypasses the locker), and nothing is
/// left behind.
pub async fn upgrade_is_refused<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("upgrade_is_refused");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let read = owner.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let read = read.check("a free key");
    let started = tokio::time::Instant::now();
    expect_err(
        owner.write(&key).wait(generous_wait(h)).await,
        "an upgrade",
        |e| matches!(e, Error::WouldDeadlock { .. }),
    );
    assert!(
        started.elapsed() < generous_wait(h),
        "the upgrade waited instead of failing"
    );
    let request = AcquireRequest::new(key.clone(), read.owner(), LONG_TTL, LossSignal::new())
        .with_kind(LockKind::Write);
    expect_err(
        a.backend().try_acquire(&request).await,
        "an upgrade sent to the backend directly",
        |e| matches!(e, Error::WouldDeadlock { .. }),
    );
    expect_err(
        a.backend().acquire(&request, generous_wait(h)).await,
        "a waiting upgrade sent to the backend directly",
        |e| matches!(e, Error::WouldDeadlock { .. }),
    );
    expect_err(
        owner.acquire(&key).wait(generous_wait(h)).await,
        "a plain lock asked by a reader",
        |e| matches!(e, Error::WouldDeadlock { .. }),
    );
    let other = b.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let other = other.check("no writer marker was left behind by the refused upgrade");
    read.release().await.check("release");
    other.release().await.check("release other");
    Outcome::Passed
}

/// Writers that stop waiting (their futures dropped at random points, mid-request
/// included) leave nothing that keeps readers out: a new reader enters long before any
/// writer marker's own lease could have run out, and no residue is left.
pub async fn a_cancelled_writer_leaves_no_marker<H: Harness>(h: &H) -> Outcome {
    cancelled_waiters_leave_no_marker(h, "a_cancelled_writer_leaves_no_marker", LockKind::Write)
        .await
}

/// Plain locks that stop waiting behind a reader (their futures dropped at random points,
/// mid-request included) leave nothing that keeps readers out: a plain lock counts as a
/// writer while it waits, and must take its waiting mark with it as a writer does.
pub async fn a_cancelled_plain_lock_leaves_no_marker<H: Harness>(h: &H) -> Outcome {
    cancelled_waiters_leave_no_marker(
        h,
        "a_cancelled_plain_lock_leaves_no_marker",
        LockKind::Exclusive,
    )
    .await
}

/// The two cases above: waiters of `kind` (writers or plain locks) behind a reader, each
/// dropped after a growing moment.
async fn cancelled_waiters_leave_no_marker<H: Harness>(
    h: &H,
    case: &str,
    kind: LockKind,
) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new(case);
    let key = space.key("k");
    let (a, w, c) = (h.client().await, h.client().await, h.client().await);
    let reader = a.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let reader = reader.check("a free key");
    for round in 0..30u64 {
        let waiter = match kind {
            LockKind::Write => w.write(&key),
            _ => w.acquire(&key),
        };
        let waiter = waiter.ttl(LONG_TTL).wait(generous_wait(h));
        let cut = Duration::from_micros(round * 300);
        let outcome = tokio::time::timeout(cut, waiter).await;
        assert!(
            !matches!(outcome, Ok(Ok(_))),
            "a waiting {kind:?} was granted beside a reader"
        );
    }
    // Markers carry leases of seconds: a reader admitted within one second was admitted
    // because nothing was left, not because a marker ran out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    let second = loop {
        if let Some(guard) = c.read(&key).ttl(LONG_TTL).try_now().await.check("read") {
            break guard;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "readers were kept out after every waiting {kind:?} had stopped waiting"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    second.release().await.check("release");
    reader.release().await.check("release reader");
    // A plain lock cut short while its attempt was still at the server can be granted the
    // key the reader just released; it gives that back in the background (seen here:
    // ~0.1-0.2 s on a loaded machine). Two seconds stay below a marker's own three-second
    // lease (MySQL row mode), so a marker left behind is still live, and counted, then.
    let _unsupported = residue_clears(
        h,
        space.prefix(),
        Duration::from_secs(2),
        "the last reader's release",
    )
    .await;
    Outcome::Passed
}

/// While a writer waits, new readers of other owners stay out, a reader that already reads
/// may re-enter (no deadlock), and the writer gets the key when the readers leave.
pub async fn waiting_writer_blocks_new_readers<H: Harness>(h: &H) -> Outcome {
    a_waiter_blocks_new_readers(h, "waiting_writer_blocks_new_readers", LockKind::Write).await
}

/// A plain lock counts as a writer: while one waits behind readers, new readers of other
/// owners stay out (a stream of readers cannot starve it), a reader that already reads may
/// re-enter, and the plain lock gets the key when the readers leave.
pub async fn a_waiting_plain_lock_blocks_new_readers<H: Harness>(h: &H) -> Outcome {
    a_waiter_blocks_new_readers(
        h,
        "a_waiting_plain_lock_blocks_new_readers",
        LockKind::Exclusive,
    )
    .await
}

/// The two cases above: a waiter of `kind` (a writer or a plain lock) behind a reader.
async fn a_waiter_blocks_new_readers<H: Harness>(h: &H, case: &str, kind: LockKind) -> Outcome {
    if let Some(skip) = needs_writer_preference(h).await {
        return skip;
    }
    let space = Space::new(case);
    let key = space.key("k");
    let (a, w, c) = (h.client().await, h.client().await, h.client().await);
    let reader = a.owner();
    let first = reader
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("read");
    let first = first.check("a free key");
    let wait = generous_wait(h);
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            match kind {
                LockKind::Write => w.write(&key).ttl(LONG_TTL).wait(wait).await,
                _ => w.acquire(&key).ttl(LONG_TTL).wait(wait).await,
            }
        }
    });
    until_readers_are_kept_out(&c, &key, wait).await;
    let again = reader
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("re-read");
    let again = again.check("a reader re-entering behind a waiting writer must pass");
    again.release().await.check("release re-read");
    assert!(
        !waiter.is_finished(),
        "the waiting {kind:?} was granted beside a reader"
    );
    first.release().await.check("release read");
    let granted = waiter
        .await
        .check("waiter task")
        .check("the waiting writer or plain lock");
    assert_eq!(granted.kind(), kind);
    assert!(c.read(&key).try_now().await.check("read").is_none());
    granted.release().await.check("release the waiter's hold");
    let last = c
        .read(&key)
        .ttl(LONG_TTL)
        .wait(wait)
        .await
        .check("read after");
    last.release().await.check("release");
    Outcome::Passed
}

/// A writer waiting keeps out a new read of its own owner too (else the writer would wait
/// for its own owner's read and end in `WouldDeadlock`), and is granted when the other
/// readers leave; its owner may then read (downgrade).
pub async fn a_waiting_writer_keeps_out_its_own_owners_new_read<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_writer_preference(h).await {
        return skip;
    }
    let space = Space::new("a_waiting_writer_keeps_out_its_own_owners_new_read");
    let key = space.key("k");
    let (a, b, c) = (h.client().await, h.client().await, h.client().await);
    let other = b.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let other = other.check("a free key");
    let owner = a.owner();
    let wait = generous_wait(h);
    let writer = tokio::spawn({
        let (owner, key) = (owner.clone(), key.clone());
        async move { owner.write(&key).ttl(LONG_TTL).wait(wait).await }
    });
    until_readers_are_kept_out(&c, &key, wait).await;
    let own = owner.read(&key).ttl(LONG_TTL).try_now().await;
    assert!(
        matches!(own, Ok(None)),
        "a new read of the waiting writer's own owner must wait, got {own:?}"
    );
    other.release().await.check("release the other reader");
    let granted = writer.await.check("writer task");
    let granted = granted.check("the waiting writer, once the other reader left");
    let downgrade = owner.read(&key).ttl(LONG_TTL).try_now().await.check("read");
    let downgrade = downgrade.check("a writer may read (downgrade)");
    granted.release().await.check("release write");
    downgrade.release().await.check("release read");
    Outcome::Passed
}

/// An owner that reads briefly and re-enters for long, then gives back the brief hold, keeps
/// the long one: no writer is granted after the brief lease would have run out.
pub async fn a_short_reentry_given_back_keeps_the_longer_read<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("a_short_reentry_given_back_keeps_the_longer_read");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let owner = a.owner();
    let short = h.short_ttl();
    let brief = owner.read(&key).ttl(short).no_watchdog().try_now().await;
    let brief = brief.check("read").check("a free key");
    let long = owner.read(&key).ttl(LONG_TTL).no_watchdog().try_now().await;
    let long = long.check("re-read").check("reads are reentrant");
    brief.release().await.check("release the brief read");
    tokio::time::sleep(short + h.expiry_slack() + Duration::from_millis(500)).await;
    assert!(long.is_valid(), "the long read is no longer valid");
    let writer = b.write(&key).ttl(LONG_TTL).try_now().await.check("write");
    assert!(
        writer.is_none(),
        "a writer was granted while the owner still held its long read"
    );
    long.release().await.check("release the long read");
    let writer = b.write(&key).ttl(LONG_TTL).try_now().await.check("write");
    writer
        .check("free at the end")
        .release()
        .await
        .check("release");
    Outcome::Passed
}

/// Readers that keep coming, each overlapping the last, never starve a writer.
pub async fn writer_is_not_starved_by_readers<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_writer_preference(h).await {
        return skip;
    }
    let space = Space::new("writer_is_not_starved_by_readers");
    let key = space.key("k");
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..3 {
        let (client, key, stop) = (h.client().await, key.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let wait = Duration::from_secs(60);
                if let Ok(guard) = client.read(&key).ttl(LONG_TTL).wait(wait).await {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let _ = guard.release().await;
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let writer = h.client().await;
    let granted = writer
        .write(&key)
        .ttl(LONG_TTL)
        .wait(generous_wait(h))
        .await;
    stop.store(true, Ordering::SeqCst);
    let granted = granted.check("a writer behind a stream of readers");
    granted.release().await.check("release writer");
    for reader in readers {
        reader.await.check("reader task");
    }
    Outcome::Passed
}

/// Randomized: several clients read and write one key at random; a writer never holds
/// beside anyone, and writers' tokens grow in the order they were granted.
pub async fn read_write_histories_stay_exclusive<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("read_write_histories_stay_exclusive");
    let key = space.key("k");
    let readers = Arc::new(AtomicU32::new(0));
    let writers = Arc::new(AtomicU32::new(0));
    let last_writer = Arc::new(Mutex::new(FencingToken::new(0)));
    let mut tasks = Vec::new();
    for task in 0..5u64 {
        let client = h.client().await;
        let (key, readers, writers, last_writer) = (
            key.clone(),
            readers.clone(),
            writers.clone(),
            last_writer.clone(),
        );
        let wait = generous_wait(h);
        tasks.push(tokio::spawn(async move {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(task + 1);
            for _ in 0..12 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let write = seed.is_multiple_of(3);
                let hold = Duration::from_millis(seed % 7);
                if write {
                    let guard = client.write(&key).ttl(LONG_TTL).wait(wait).await;
                    let guard = guard.check("write");
                    assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                    assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer beside readers");
                    {
                        let mut last = last_writer.lock().unwrap_or_else(|e| e.into_inner());
                        assert!(guard.token() > *last, "writer tokens must grow");
                        *last = guard.token();
                    }
                    tokio::time::sleep(hold).await;
                    writers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.check("release write");
                } else {
                    let guard = client.read(&key).ttl(LONG_TTL).wait(wait).await;
                    let guard = guard.check("read");
                    readers.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(
                        writers.load(Ordering::SeqCst),
                        0,
                        "a reader beside a writer"
                    );
                    tokio::time::sleep(hold).await;
                    readers.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.check("release read");
                }
            }
        }));
    }
    for task in tasks {
        task.await.check("task");
    }
    let client = h.client().await;
    let free = client
        .write(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("write");
    free.check("nothing left held")
        .release()
        .await
        .check("release");
    Outcome::Passed
}

/// A writer that downgraded (took the read lock beside its write) and then enters the write
/// lock again is granted a re-entry of its write: same token, one more depth, no loss. The
/// read taken in between (a hold with a token of its own) must not change what the write
/// re-entry reports.
pub async fn a_write_reentered_after_a_downgrade_keeps_its_token<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_read_write(h).await {
        return skip;
    }
    let space = Space::new("a_write_reentered_after_a_downgrade_keeps_its_token");
    let key = space.key("k");
    let client = h.client().await;
    let owner = client.owner();
    let write = owner
        .write(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("write")
        .check("a free key");
    let read = owner
        .read(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("downgrade")
        .check("a writer may read at once (downgrade)");
    assert!(read.token() > write.token(), "the read is a new hold");
    let again = owner
        .write(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("write re-entry after a downgrade")
        .check("writes are reentrant");
    assert_eq!(again.depth(), 2, "a re-entry of the write");
    assert_eq!(again.token(), write.token(), "a re-entry keeps its token");
    assert!(
        write.is_valid() && again.is_valid(),
        "the write was reported lost by its own re-entry"
    );
    assert_eq!(
        again.release().await.check("release re-entry"),
        Released::Partially { remaining: 1 }
    );
    read.release().await.check("release read");
    assert_eq!(
        write.release().await.check("release write"),
        Released::Fully
    );
    let other = h.client().await;
    other
        .write(&key)
        .ttl(LONG_TTL)
        .try_now()
        .await
        .check("write")
        .check("free at the end")
        .release()
        .await
        .check("release");
    Outcome::Passed
}
