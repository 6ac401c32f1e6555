//! A client's waiting acquisitions of one key queue in the client and reach a backend whose
//! release wakes every waiter (here the memory backend) one at a time. These cases pin down
//! the edges: the queue's patience is counted from its last handoff, an owner with a record
//! on the server is never queued behind a waiter for that record, and a deadline spent in
//! the queue still ends with one attempt at the server. The clock is tokio's paused one, so
//! every time below is exact.

use std::{future::IntoFuture, time::Duration};

use lockkit_core::{Error, LockKey, Locker, MemoryBackend};
use tokio::time::Instant;

fn key() -> LockKey {
    LockKey::new("gated").unwrap()
}

/// Waiting acquisitions of `key` at the backend now (the memory backend counts them).
async fn waiters_at_backend(locker: &Locker) -> u32 {
    locker
        .inspect(key())
        .await
        .unwrap()
        .and_then(|holder| holder.waiters)
        .unwrap_or(0)
}

/// 12 tasks of one client wait for a key another client holds, then each holds it for
/// 300 ms in turn: the handoffs span 3.6 s, well past the queue's one-second patience,
/// and yet one waiter of the client, never more, is at the backend at any time (the
/// patience starts again at every handoff). Without the queue, all 12 are there.
async fn most_waiters_at_backend(gated: bool) -> u32 {
    let memory = MemoryBackend::new();
    let other = Locker::new(memory.connect());
    let client = Locker::new(memory.clone());
    let client = if gated {
        client
    } else {
        client.without_waiter_gates()
    };
    let blocker = other.try_acquire(key()).await.unwrap().unwrap();
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let (client, done) = (client.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let guard = client.acquire(key()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            guard.release().await.unwrap();
            done.send(()).unwrap();
        }));
        tokio::task::yield_now().await;
    }
    // Every task has started and reached the backend or the queue.
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let mut most = waiters_at_backend(&other).await;
    blocker.release().await.unwrap();
    for _ in 0..12 {
        finished.recv().await.unwrap();
        most = most.max(waiters_at_backend(&other).await);
    }
    for task in tasks {
        task.await.unwrap();
    }
    most
}

#[tokio::test(start_paused = true)]
async fn one_waiter_of_a_client_reaches_the_backend_through_every_handoff() {
    assert_eq!(
        most_waiters_at_backend(false).await,
        12,
        "without the queue every waiter should be at the backend (the count is wrong)"
    );
    assert_eq!(most_waiters_at_backend(true).await, 1);
}

/// An owner's hold whose local lease has run out (a hold is believed for a little less
/// than its lease) while its record is still on the server: the owner asks again, and the
/// server answers at once as a continuation. It must not queue behind another task of the
/// client that waits at the server for that very record. With `drop_lost_guard`, the lost
/// guard is dropped first, as most callers do once it is invalid: no release is sent for a
/// lost hold, so its record stays on the server until its lease ends.
async fn owner_past_its_local_lease_asks_again(drop_lost_guard: bool) {
    let client = Locker::new(MemoryBackend::new());
    let owner = client.owner();
    let ttl = Duration::from_secs(1);
    let started = Instant::now();
    let held = owner.acquire(key()).ttl(ttl).no_watchdog().await.unwrap();
    let token = held.token();
    let waiter = tokio::spawn({
        let client = client.clone();
        async move { client.acquire(key()).await.unwrap() }
    });
    // Past the local lease (1 s less drift: 988 ms), before the server's (1 s).
    tokio::time::sleep_until(started + Duration::from_millis(992)).await;
    assert!(!held.is_valid(), "the local lease should have run out");
    let held = if drop_lost_guard {
        drop(held);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        None
    } else {
        Some(held)
    };
    let again = owner
        .acquire(key())
        .ttl(ttl)
        .wait(Duration::from_millis(500))
        .await
        .expect("the owner's record on the server should have been continued at once");
    assert_eq!(again.token(), token, "the server continued the old hold");
    assert_eq!(Instant::now(), started + Duration::from_millis(992));
    assert!(!waiter.is_finished(), "the waiter took a held key");
    again.release().await.unwrap();
    drop(held);
    let granted = waiter.await.unwrap();
    granted.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_owner_with_a_record_on_the_server_skips_the_queue() {
    owner_past_its_local_lease_asks_again(false).await;
}

/// (Found by review: with the lost guard dropped, the owner queued behind the waiter for
/// its own record.)
#[tokio::test(start_paused = true)]
async fn an_owner_whose_lost_guard_was_dropped_still_skips_the_queue() {
    owner_past_its_local_lease_asks_again(true).await;
}

/// An owner whose last hold was released cleanly (the server said so) queues like anyone:
/// nothing of it is left on the server.
#[tokio::test(start_paused = true)]
async fn an_owner_whose_hold_was_released_queues_again() {
    let memory = MemoryBackend::new();
    let other = Locker::new(memory.connect());
    let client = Locker::new(memory);
    let owner = client.owner();
    owner.acquire(key()).await.unwrap().release().await.unwrap();
    let blocker = other.try_acquire(key()).await.unwrap().unwrap();
    let first = tokio::spawn({
        let client = client.clone();
        async move { client.acquire(key()).await.unwrap() }
    });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let second = tokio::spawn({
        let owner = owner.clone();
        async move { owner.acquire(key()).await.unwrap() }
    });
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        waiters_at_backend(&other).await,
        1,
        "the owner skipped the queue"
    );
    blocker.release().await.unwrap();
    first.await.unwrap().release().await.unwrap();
    second.await.unwrap().release().await.unwrap();
}

/// An acquisition whose deadline passes in the queue (behind a waiting acquisition whose
/// future is kept but no longer polled) makes one attempt that does not wait before it
/// times out, so a key that is free by then is taken.
#[tokio::test(start_paused = true)]
async fn a_deadline_spent_in_the_queue_still_takes_a_free_key() {
    let memory = MemoryBackend::new();
    let other = Locker::new(memory.connect());
    let client = Locker::new(memory);
    let blocker = other.try_acquire(key()).await.unwrap().unwrap();
    // Polled until it waits at the backend (with the queue's gate), then never again.
    let mut stuck = Box::pin(client.acquire(key()).into_future());
    assert!(
        tokio::time::timeout(Duration::from_millis(10), &mut stuck)
            .await
            .is_err()
    );
    blocker.release().await.unwrap();
    let started = Instant::now();
    let guard = client
        .acquire(key())
        .wait(Duration::from_millis(200))
        .await
        .expect("the free key should be taken after the wait in the queue");
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    // A key still held gives the timeout, with the whole wait.
    let started = Instant::now();
    let error = client
        .acquire(key())
        .wait(Duration::from_millis(50))
        .await
        .unwrap_err();
    match error {
        Error::Timeout { waited, .. } => assert_eq!(waited, Duration::from_millis(50)),
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    guard.release().await.unwrap();
    drop(stuck);
}
