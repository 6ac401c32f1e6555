//! The wake of a lockkit waiter behind an rslock holder (a plain `SET NX PX` string, which
//! publishes nothing when it lets go): rslock's `unlock` call to lockkit's grant, p50/p99.
//! Run against servers of your own: `cargo run --release -p lockkit-bench --example
//! foreign_wake -- [samples] redis://127.0.0.1:PORT...`. One URL: a single server; several:
//! Redlock over them as masters (rslock holding on every master, lockkit waiting with
//! `redlock://`). The servers' `notify-keyspace-events` decides whether lockkit hears the
//! deletions or polls.

use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let samples: usize = match args.first().map(|first| first.parse()) {
        Some(Ok(samples)) => {
            args.remove(0);
            samples
        }
        _ => 100,
    };
    assert!(!args.is_empty(), "one redis:// URL or several");
    let lockkit_url = match args.as_slice() {
        [one] => one.clone(),
        masters => format!(
            "redlock://{}",
            masters
                .iter()
                .map(|url| url.trim_start_matches("redis://"))
                .collect::<Vec<_>>()
                .join(",")
        ),
    };
    let manager = rslock::LockManager::new(args.clone());
    let locker = lockkit::connect(&lockkit_url)
        .await
        .expect("lockkit connects");
    let mut waits = Vec::with_capacity(samples);
    let mut unlocks = Vec::with_capacity(samples);
    for round in 0..samples {
        let key = format!("foreign-wake/{}/{round}", std::process::id());
        let held = manager
            .lock(key.as_bytes(), Duration::from_secs(30))
            .await
            .expect("rslock takes the key");
        let waiter = {
            let (locker, key) = (locker.clone(), key.clone());
            tokio::spawn(async move {
                let guard = locker
                    .acquire(key.as_str())
                    .wait(Duration::from_secs(30))
                    .await
                    .expect("granted");
                let at = Instant::now();
                guard.release().await.expect("released");
                at
            })
        };
        // The waiter's first attempts, and (where sent) its keyspace subscriptions; a
        // random phase against its 100 ms polling.
        tokio::time::sleep(Duration::from_millis(300 + (round as u64 * 37) % 100)).await;
        let released = Instant::now();
        manager.unlock(&held).await;
        unlocks.push(released.elapsed().as_secs_f64() * 1e6);
        let granted = waiter.await.expect("the waiter ran");
        waits.push(granted.saturating_duration_since(released).as_secs_f64() * 1e6);
    }
    waits.sort_by(f64::total_cmp);
    unlocks.sort_by(f64::total_cmp);
    let at = |of: &[f64], p: f64| of[((of.len() - 1) as f64 * p).round() as usize];
    println!(
        "lockkit behind rslock ({} server(s)): unlock to grant p50 {:.0} µs, p99 {:.0} µs \
         ({} samples); rslock's unlock call itself p50 {:.0} µs, p99 {:.0} µs",
        args.len(),
        at(&waits, 0.5),
        at(&waits, 0.99),
        waits.len(),
        at(&unlocks, 0.5),
        at(&unlocks, 0.99),
    );
}
