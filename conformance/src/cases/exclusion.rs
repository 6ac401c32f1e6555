//! Mutual exclusion.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lockkit_core::Error;
use lockkit_core::spi::Released;

use super::{LONG_TTL, assert_busy, assert_free};
use crate::{
    Check, Harness, History, Outcome, Space,
    holder::{HolderProcess, HolderSpec},
    support::expect_err,
};

/// Acquire, release, and acquire again from another client; the token grows.
pub async fn acquire_release_reacquire<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("acquire_release_reacquire");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let first = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("first acquire")
        .check("free key");
    assert_eq!(first.depth(), 1);
    assert!(first.is_valid());
    let token = first.token();
    assert_eq!(first.release().await.check("release"), Released::Fully);
    let second = b
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("reacquire")
        .check("key free after release");
    assert!(second.token() > token, "token must grow for a new holder");
    second.release().await.check("second release");
    Outcome::Passed
}

/// While one client holds a key, another's try_acquire returns `None` and a zero wait
/// fails with `Timeout`.
pub async fn contended_try_acquire_is_none<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("contended_try_acquire_is_none");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let held = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    assert_busy(&b, &key, "a held key must not be granted to another client").await;
    expect_err(
        b.acquire(&key).wait(Duration::ZERO).await,
        "zero wait on a held key",
        |e| matches!(e, Error::Timeout { .. }),
    );
    held.release().await.check("release");
    Outcome::Passed
}

/// Holding one key does not block another.
pub async fn independent_keys_do_not_contend<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("independent_keys_do_not_contend");
    let (a, b) = (h.client().await, h.client().await);
    let one = a
        .try_acquire(space.key("one"))
        .ttl(LONG_TTL)
        .await
        .check("acquire one")
        .check("one free");
    let two = b
        .try_acquire(space.key("two"))
        .ttl(LONG_TTL)
        .await
        .check("acquire two")
        .check("two must not contend with one");
    one.release().await.check("release one");
    two.release().await.check("release two");
    Outcome::Passed
}

/// 8 clients x 100 unsynchronised read-modify-writes through the lock lose nothing, and
/// the history of holds is linear.
pub async fn counter_is_exact_under_contention<H: Harness>(h: &H) -> Outcome {
    const CLIENTS: u64 = 8;
    const ROUNDS: u64 = 100;
    let space = Space::new("counter_is_exact_under_contention");
    let key = space.key("counter");
    let counter = Arc::new(AtomicU64::new(0));
    let history = History::new();
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let client = h.client().await;
        let (key, counter, history) = (key.clone(), counter.clone(), history.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let guard = client
                    .acquire(&key)
                    .ttl(LONG_TTL)
                    .wait(Duration::from_secs(60))
                    .await
                    .check("acquire counter lock");
                let open = history.begin(format!("client {c}"), &guard);
                // A deliberately non-atomic read-modify-write with a yield in the middle.
                let value = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(value + 1, Ordering::SeqCst);
                history.end(open, &guard);
                guard.release().await.check("release counter lock");
            }
        }));
    }
    for task in tasks {
        task.await.check("worker");
    }
    assert_eq!(
        counter.load(Ordering::SeqCst),
        CLIENTS * ROUNDS,
        "updates were lost"
    );
    assert_eq!(history.records().len() as u64, CLIENTS * ROUNDS);
    history.assert_linear();
    Outcome::Passed
}

/// Releasing and relocking in a tight loop never wedges the key.
pub async fn release_relock_loop<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("release_relock_loop");
    let key = space.key("k");
    let client = h.client().await;
    let mut last = None;
    for round in 0..50 {
        let guard = client
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("relock")
            .unwrap_or_else(|| panic!("round {round}: key still held after release"));
        if let Some(previous) = last {
            assert!(
                guard.token() > previous,
                "round {round}: token did not grow"
            );
        }
        last = Some(guard.token());
        guard.release().await.check("release");
    }
    Outcome::Passed
}

/// A lock held by a child process blocks this process until the child dies.
pub async fn child_process_hold_blocks_parent<H: Harness>(h: &H) -> Outcome {
    if !h.cross_process() {
        return Outcome::Skipped("the backend does not share locks across processes".into());
    }
    let space = Space::new("child_process_hold_blocks_parent");
    let key = space.key("k");
    let mut child = HolderProcess::spawn(&HolderSpec {
        key: key.clone(),
        ttl: h.short_ttl(),
        watchdog: true,
        permits: 0,
    })
    .await;
    let parent = h.client().await;
    assert_busy(&parent, &key, "the child's hold must exclude the parent").await;
    // The stored identity names the child process, not the one asking.
    let holder = parent
        .inspect(&key)
        .await
        .check("inspect the child's hold")
        .check("the child holds the key");
    let identity = holder.identity.check("the child's hold names its process");
    assert_eq!(identity.pid, child.pid(), "the holder's pid is the child's");
    expect_err(
        parent.acquire(&key).wait(h.short_ttl() * 3).await,
        "waiting past several leases while the child renews",
        |e| matches!(e, Error::Timeout { .. }),
    );
    child.kill().await;
    let guard = parent
        .acquire(&key)
        .wait(super::generous_wait(h))
        .await
        .check("acquire after the child died");
    assert!(guard.token() > child.token);
    guard.release().await.check("release");
    assert_free(&parent, &key, "after release").await;
    Outcome::Passed
}
