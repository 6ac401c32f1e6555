//! ZooKeeper lock benchmark next to a plain ephemeral create+delete from the same run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-zk --bench zk          # LOCKKIT_TEST_ZK_URL, or LOCKKIT_BENCH_URL
//! ```

use std::time::{Duration, Instant};

use lockkit_conformance::bench::{handoff, micros as us, percentile};
use lockkit_core::Locker;
use lockkit_zk::ZkBackend;
use zookeeper_client::{Acls, CreateMode};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(url) = std::env::var("LOCKKIT_BENCH_URL")
        .ok()
        .or_else(|| std::env::var("LOCKKIT_TEST_ZK_URL").ok())
    else {
        eprintln!(
            "set LOCKKIT_TEST_ZK_URL (eval \"$(scripts/services.sh env)\") or LOCKKIT_BENCH_URL"
        );
        return;
    };
    let url = format!("{url}?session_timeout=10s");
    let backend = ZkBackend::connect(&url).await.expect("connect");
    let client = backend.client().await.expect("client");
    let locker = Locker::new(backend.clone());
    let ephemeral = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
    let _ = client
        .mkdir(
            "/lockkit-bench",
            &CreateMode::Persistent.with_acls(Acls::anyone_all()),
        )
        .await;

    let mut raw = Vec::new();
    let mut lock = Vec::new();
    for i in 0..1200 {
        let path = format!("/lockkit-bench/n{}", i % 10);
        let start = Instant::now();
        client.create(&path, b"", &ephemeral).await.expect("create");
        client.delete(&path, None).await.expect("delete");
        if i >= 200 {
            raw.push(start.elapsed());
        }
        let key = format!("bench/uncontended/{}", i % 10);
        let start = Instant::now();
        let guard = locker
            .acquire(key.as_str())
            .ttl(Duration::from_secs(30))
            .await
            .expect("acquire");
        guard.release().await.expect("release");
        if i >= 200 {
            lock.push(start.elapsed());
        }
    }

    let connect = || async { Locker::new(ZkBackend::connect(&url).await.expect("connect")) };
    let mut hand = handoff(connect, "bench/hot", 16, 20).await;
    let (r50, l50, l99, h50, h99) = (
        percentile(&mut raw, 0.5),
        percentile(&mut lock, 0.5),
        percentile(&mut lock, 0.99),
        percentile(&mut hand, 0.5),
        percentile(&mut hand, 0.99),
    );
    println!("ephemeral create+delete median  {:>8.1} us", us(r50));
    println!(
        "acquire+release median          {:>8.1} us ({:.2}x), p99 {:.1} us",
        us(l50),
        us(l50) / us(r50),
        us(l99)
    );
    println!(
        "handoff (16 waiters) median     {:>8.1} us, p99 {:.1} us ({} handoffs)",
        us(h50),
        us(h99),
        hand.len()
    );
    println!(
        "{{\"backend\":\"{url}\",\"create_delete_p50_us\":{:.1},\"lock_p50_us\":{:.1},\"ratio\":{:.2},\"handoff_p50_us\":{:.1},\"handoff_p99_us\":{:.1}}}",
        us(r50),
        us(l50),
        us(l50) / us(r50),
        us(h50),
        us(h99)
    );
}
