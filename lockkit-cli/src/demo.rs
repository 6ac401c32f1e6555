//! `lockkit demo stock`: the classic stock-deduction story, told by running it.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicI64, Ordering},
    },
    time::Duration,
};

use lockkit::{FencingToken, Locker, Result};

const PER_WORKER: i64 = 3;

/// A stock row in a database that reads and writes separately, as `SELECT` then `UPDATE`.
#[derive(Default)]
struct Stock {
    items: AtomicI64,
    /// The highest fencing token that wrote, for the fenced variant.
    fence: Mutex<Option<FencingToken>>,
}

impl Stock {
    /// A read-modify-write with a gap in the middle, where other writers can slip in.
    async fn sell_one(&self) {
        let seen = self.items.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_micros(200)).await;
        self.items.store(seen - 1, Ordering::SeqCst);
    }

    /// A write that carries the writer's token; older tokens are refused.
    fn fenced_write(&self, token: FencingToken, items: i64) -> bool {
        let mut fence = self.fence.lock().unwrap_or_else(|e| e.into_inner());
        if fence.is_some_and(|highest| token < highest) {
            return false;
        }
        *fence = Some(token);
        self.items.store(items, Ordering::SeqCst);
        true
    }
}

async fn clients(url: &str, n: u32) -> Result<Vec<Locker>> {
    let mut all = Vec::new();
    for _ in 0..n {
        all.push(lockkit::connect(url).await?);
    }
    Ok(all)
}

/// Runs the three acts and prints what happened.
pub async fn stock(url: &str, workers: u32, start: i64) -> Result<()> {
    let sold = i64::from(workers) * PER_WORKER;
    println!(
        "stock demo on {url}: {workers} workers each sell {PER_WORKER} of {start} items ({sold} sales)"
    );

    // Act 1: no lock.
    let stock = Arc::new(Stock::default());
    stock.items.store(start, Ordering::SeqCst);
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let stock = stock.clone();
            tokio::spawn(async move {
                for _ in 0..PER_WORKER {
                    stock.sell_one().await;
                }
            })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
    let left = stock.items.load(Ordering::SeqCst);
    println!(
        "1. without a lock: {left} left, expected {}: {} sales lost",
        start - sold,
        left - (start - sold)
    );

    // Act 2: every read-modify-write under the lock.
    let stock = Arc::new(Stock::default());
    stock.items.store(start, Ordering::SeqCst);
    let key = "demo/stock".to_owned();
    let mut tasks = Vec::new();
    for locker in clients(url, workers).await? {
        let (stock, key) = (stock.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..PER_WORKER {
                let guard = locker
                    .acquire(key.as_str())
                    .wait(Duration::from_secs(120))
                    .await?;
                stock.sell_one().await;
                guard.release().await?;
            }
            Result::Ok(())
        }));
    }
    for task in tasks {
        if let Ok(outcome) = task.await {
            outcome?;
        }
    }
    let left = stock.items.load(Ordering::SeqCst);
    println!(
        "2. under the lock:  {left} left, expected {}: {}",
        start - sold,
        if left == start - sold {
            "exact"
        } else {
            "WRONG"
        }
    );

    // Act 3: a worker pauses past its lease; a rival takes over; the storage refuses the
    // paused worker's stale write because its fencing token is older.
    let stock = Stock::default();
    stock.items.store(start, Ordering::SeqCst);
    let (slow, fast) = (lockkit::connect(url).await?, lockkit::connect(url).await?);
    let key = format!("{key}/fenced");
    let paused = slow
        .acquire(key.as_str())
        .ttl(Duration::from_millis(300))
        .no_watchdog()
        .await?;
    let seen = stock.items.load(Ordering::SeqCst);
    println!(
        "3. worker A takes the lock (token {}) and reads {seen} items, then pauses (GC, swap, SIGSTOP)",
        paused.token()
    );
    let rival = fast
        .acquire(key.as_str())
        .wait(Duration::from_secs(30))
        .await?;
    let now = stock.items.load(Ordering::SeqCst);
    let accepted = stock.fenced_write(rival.token(), now - 1);
    println!(
        "   A's lease runs out; worker B takes the lock (token {}) and sells one: {}",
        rival.token(),
        if accepted { "written" } else { "refused" }
    );
    let stale = stock.fenced_write(paused.token(), seen - 1);
    println!(
        "   A wakes up and writes {} without asking its guard (is_valid() would say {}): {}",
        seen - 1,
        paused.is_valid(),
        if stale {
            "ACCEPTED (stale write!)"
        } else {
            "refused: token older than the last writer's"
        }
    );
    println!(
        "   items left: {} (one sale, counted once)",
        stock.items.load(Ordering::SeqCst)
    );
    rival.release().await?;
    drop(paused);
    Ok(())
}
