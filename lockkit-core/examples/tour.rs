//! A tour of the lockkit contract on the in-process backend: exclusion, reentrancy and
//! fencing, each shown by running it.
//!
//! ```text
//! cargo run -p lockkit-core --example tour
//! ```

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use lockkit_core::{FencingToken, Locker, MemoryBackend, Result};

#[tokio::main]
async fn main() -> Result<()> {
    let server = MemoryBackend::new();

    // 1. Exclusion: 8 workers, each a separate client, do 50 non-atomic read-yield-write
    //    updates of a shared counter. Without the lock updates are lost; with it, none.
    let unlocked = Arc::new(AtomicU64::new(0));
    let locked = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..8 {
        let locker = Locker::new(server.connect());
        let (unlocked, locked) = (unlocked.clone(), locked.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..50 {
                let v = unlocked.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                unlocked.store(v + 1, Ordering::SeqCst);

                let guard = locker
                    .acquire("stock/sku-1")
                    .wait(Duration::from_secs(10))
                    .await?;
                let v = locked.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                locked.store(v + 1, Ordering::SeqCst);
                guard.release().await?;
            }
            Result::Ok(())
        }));
    }
    for worker in workers {
        worker
            .await
            .map_err(|e| lockkit_core::Error::Config(e.to_string()))??;
    }
    println!(
        "exclusion : 400 updates -> without lock {}, with lock {}",
        unlocked.load(Ordering::SeqCst),
        locked.load(Ordering::SeqCst)
    );

    // 2. Reentrancy: one owner takes the lock three times and must release it three times.
    let locker = Locker::new(server.connect());
    let rival = Locker::new(server.connect());
    let owner = locker.owner();
    let outer = owner.acquire("menu").await?;
    let middle = owner.acquire("menu").await?;
    let inner = middle.reenter().await?;
    println!(
        "reentrancy: depths {} {} {}, one token {}",
        outer.depth(),
        middle.depth(),
        inner.depth(),
        inner.token()
    );
    inner.release().await?;
    middle.release().await?;
    println!(
        "reentrancy: after 2 of 3 releases a rival gets it? {}",
        rival.try_acquire("menu").await?.is_some()
    );
    outer.release().await?;
    let after = rival.try_acquire("menu").await?;
    println!(
        "reentrancy: after 3 of 3 releases a rival gets it? {}",
        after.is_some()
    );
    drop(after);

    // 3. Fencing: a holder stalls past its lease; a rival takes over; the storage refuses
    //    the stale holder's write because its token is older.
    let slow = locker
        .acquire("ledger")
        .ttl(Duration::from_millis(200))
        .no_watchdog()
        .await?;
    let fast = rival.acquire("ledger").wait(Duration::from_secs(5)).await?;
    let mut highest = FencingToken::new(0);
    let mut write = |who: &str, token: FencingToken| {
        let accepted = token >= highest;
        if accepted {
            highest = token;
        }
        println!(
            "fencing   : {who} writes with token {token}: {}",
            if accepted {
                "accepted"
            } else {
                "REFUSED (stale)"
            }
        );
    };
    write("rival", fast.token());
    write("stalled holder", slow.token());
    println!(
        "fencing   : stalled holder's guard still valid? {}",
        slow.is_valid()
    );
    fast.release().await?;
    Ok(())
}
