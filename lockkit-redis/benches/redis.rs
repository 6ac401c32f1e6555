//! Redis lock benchmark: lockkit next to the server's own round trip, from one run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-redis --bench redis            # LOCKKIT_TEST_REDIS_URL
//! LOCKKIT_BENCH_URL=redlock://... cargo bench -p lockkit-redis --bench redis
//! ```
//!
//! Prints, and writes as one JSON line:
//! - uncontended acquire+release median and p99 on one connection, next to `PING` and
//!   next to the peer rslock (in-process, on the same masters, in interleaved batches so
//!   both see the same machine noise);
//! - hot-key handoff with 16 waiters: release-to-next-grant median and p99;
//! - throughput over 1,000 keys with 32 tasks, next to the server's `SET` rate.

use std::time::{Duration, Instant};

use lockkit_conformance::bench::{handoff, micros, percentile};
use lockkit_core::Locker;

async fn ping_samples(url: &str, n: usize) -> Vec<Duration> {
    let mut conn = redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .expect("ping");
        samples.push(start.elapsed());
    }
    samples.sort();
    samples
}

async fn lock_samples(locker: &Locker, n: usize) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("bench/uncontended/{}", i % 100);
        let start = Instant::now();
        let guard = locker.acquire(key.as_str()).await.expect("acquire");
        guard.release().await.expect("release");
        samples.push(start.elapsed());
    }
    samples.sort();
    samples
}

/// rslock's uncontended lock+unlock on the masters of `url` (one for `redis://`, all of
/// them for `redlock://`).
async fn rslock_samples(manager: &rslock::LockManager, n: usize) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("bench/rslock/{}", i % 100);
        let start = Instant::now();
        let lock = manager
            .lock(key.as_bytes(), Duration::from_secs(30))
            .await
            .expect("rslock lock");
        manager.unlock(&lock).await;
        samples.push(start.elapsed());
    }
    samples
}

async fn handoff_samples(url: &str, waiters: usize, rounds: usize) -> Vec<Duration> {
    let connect =
        || async { Locker::from_arc(lockkit_redis::connect(url).await.expect("connect")) };
    handoff(connect, "bench/hot", waiters, rounds).await
}

async fn lock_throughput(url: &str, tasks: usize, keys: usize, run: Duration) -> f64 {
    let locker = Locker::from_arc(lockkit_redis::connect(url).await.expect("connect"));
    let deadline = Instant::now() + run;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let locker = locker.clone();
        handles.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut i = t;
            while Instant::now() < deadline {
                let key = format!("bench/throughput/{}", i % keys);
                if let Some(guard) = locker.try_acquire(key.as_str()).await.expect("try_acquire") {
                    guard.release().await.expect("release");
                    done += 1;
                }
                i += tasks;
            }
            done
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.expect("task");
    }
    total as f64 / run.as_secs_f64()
}

async fn set_throughput(url: &str, tasks: usize, keys: usize, run: Duration) -> f64 {
    let nodes = lockkit_conformance::env::host_ports(url);
    if url.starts_with("redis+cluster://") {
        let client = redis::cluster::ClusterClient::new(
            nodes
                .iter()
                .map(|n| format!("redis://{n}"))
                .collect::<Vec<_>>(),
        )
        .expect("cluster url");
        let conn = client.get_async_connection().await.expect("connect");
        sets_on(conn, tasks, keys, run).await
    } else {
        let conn = redis::Client::open(format!("redis://{}", nodes[0]))
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        sets_on(conn, tasks, keys, run).await
    }
}

async fn sets_on<C>(conn: C, tasks: usize, keys: usize, run: Duration) -> f64
where
    C: redis::aio::ConnectionLike + Clone + Send + 'static,
{
    let deadline = Instant::now() + run;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let mut conn = conn.clone();
        handles.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut i = t;
            while Instant::now() < deadline {
                let _: () = redis::cmd("SET")
                    .arg(format!("bench/set/{}", i % keys))
                    .arg("x")
                    .query_async(&mut conn)
                    .await
                    .expect("set");
                done += 1;
                i += tasks;
            }
            done
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.expect("task");
    }
    total as f64 / run.as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(url) = std::env::var("LOCKKIT_BENCH_URL")
        .ok()
        .or_else(|| std::env::var("LOCKKIT_TEST_REDIS_URL").ok())
    else {
        eprintln!(
            "set LOCKKIT_TEST_REDIS_URL (eval \"$(scripts/services.sh env)\") or LOCKKIT_BENCH_URL"
        );
        return;
    };
    let first_node = format!("redis://{}", lockkit_conformance::env::host_ports(&url)[0]);
    let locker = Locker::from_arc(lockkit_redis::connect(&url).await.expect("connect"));

    // Warm up connections and script caches.
    let _ = ping_samples(&first_node, 200).await;
    let _ = lock_samples(&locker, 200).await;

    let masters: Vec<String> = lockkit_conformance::env::host_ports(&url)
        .iter()
        .map(|n| format!("redis://{n}"))
        .collect();
    let peer = (!url.starts_with("redis+cluster://")).then(|| rslock::LockManager::new(masters));
    if let Some(peer) = &peer {
        let _ = rslock_samples(peer, 200).await;
    }

    // Interleaved batches: lockkit, rslock and PING see the same moments of the machine.
    let (mut ping, mut lock, mut rslock) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..10 {
        ping.extend(ping_samples(&first_node, 300).await);
        lock.extend(lock_samples(&locker, 300).await);
        if let Some(peer) = &peer {
            rslock.extend(rslock_samples(peer, 300).await);
        }
    }
    ping.sort();
    lock.sort();
    rslock.sort();
    let mut handoff = handoff_samples(&url, 16, 40).await;
    let run = Duration::from_secs(3);
    let locks_per_sec = lock_throughput(&url, 32, 1000, run).await;
    let sets_per_sec = set_throughput(&url, 32, 1000, run).await;

    let (ping50, lock50, lock99) = (
        percentile(&mut ping, 0.5),
        percentile(&mut lock, 0.5),
        percentile(&mut lock, 0.99),
    );
    let (hand50, hand99) = (
        percentile(&mut handoff, 0.5),
        percentile(&mut handoff, 0.99),
    );
    println!("backend                      {url}");
    println!("PING median                  {:>9.1} us", micros(ping50));
    println!(
        "acquire+release median       {:>9.1} us  ({:.2}x PING)   p99 {:.1} us",
        micros(lock50),
        micros(lock50) / micros(ping50),
        micros(lock99)
    );
    let (peer50, peer99) = if rslock.is_empty() {
        (Duration::ZERO, Duration::ZERO)
    } else {
        (percentile(&mut rslock, 0.5), percentile(&mut rslock, 0.99))
    };
    if !rslock.is_empty() {
        println!(
            "rslock lock+unlock median     {:>9.1} us  p99 {:.1} us   lockkit/rslock {:.2}x",
            micros(peer50),
            micros(peer99),
            micros(lock50) / micros(peer50)
        );
    }
    println!(
        "handoff (16 waiters) median  {:>9.1} us  p99 {:.1} us  ({} handoffs)",
        micros(hand50),
        micros(hand99),
        handoff.len()
    );
    println!(
        "throughput (1000 keys, 32)   {:>9.0} acquire+release/s   vs SET {:.0}/s ({:.2}x)",
        locks_per_sec,
        sets_per_sec,
        locks_per_sec / sets_per_sec
    );
    println!(
        "{{\"backend\":\"{url}\",\"ping_p50_us\":{:.1},\"lock_p50_us\":{:.1},\"lock_p99_us\":{:.1},\"ratio_to_ping\":{:.2},\"rslock_p50_us\":{:.1},\"rslock_p99_us\":{:.1},\"handoff_p50_us\":{:.1},\"handoff_p99_us\":{:.1},\"locks_per_s\":{:.0},\"sets_per_s\":{:.0}}}",
        micros(ping50),
        micros(lock50),
        micros(lock99),
        micros(lock50) / micros(ping50),
        micros(peer50),
        micros(peer99),
        micros(hand50),
        micros(hand99),
        locks_per_sec,
        sets_per_sec
    );
}
