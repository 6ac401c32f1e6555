//! The wake of a lockkit waiter behind an rslock holder (a plain `SET NX PX` string, which
//! publishes nothing when it lets go): rslock's `unlock` call to lockkit's grant, p50/p99.
//! Run against a server of your own: `cargo run --release -p lockkit-bench --example
//! foreign_wake -- redis://127.0.0.1:PORT [samples]`; the server's `notify-keyspace-events`
//! decides whether lockkit hears the deletion or polls.

use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect("a redis:// URL");
    let samples: usize = args.next().map_or(100, |n| n.parse().expect("a count"));
    let manager = rslock::LockManager::new(vec![url.clone()]);
    let locker = lockkit::connect(&url).await.expect("lockkit connects");
    let mut waits = Vec::with_capacity(samples);
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
        // The waiter's first attempts, and (where sent) its keyspace subscription; a
        // random phase against its 100 ms polling.
        tokio::time::sleep(Duration::from_millis(300 + (round as u64 * 37) % 100)).await;
        let released = Instant::now();
        manager.unlock(&held).await;
        let granted = waiter.await.expect("the waiter ran");
        waits.push(granted.saturating_duration_since(released).as_secs_f64() * 1e6);
    }
    waits.sort_by(f64::total_cmp);
    let at = |p: f64| waits[((waits.len() - 1) as f64 * p).round() as usize];
    println!(
        "lockkit behind rslock: unlock to grant p50 {:.0} µs, p99 {:.0} µs ({} samples)",
        at(0.5),
        at(0.99),
        waits.len()
    );
}
