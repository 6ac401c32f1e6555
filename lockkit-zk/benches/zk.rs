//! ZooKeeper lock benchmark next to a plain ephemeral create+delete from the same run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-zk --bench zk          # LOCKKIT_TEST_ZK_URL, or LOCKKIT_BENCH_URL
//! ```

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockkit_core::Locker;
use lockkit_zk::ZkBackend;
use zookeeper_client::{Acls, CreateMode};

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

fn p99(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples
        .get(samples.len() * 99 / 100)
        .copied()
        .unwrap_or_default()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

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

    let last_release: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let locker = Locker::new(ZkBackend::connect(&url).await.expect("connect"));
        let (last_release, samples) = (last_release.clone(), samples.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = locker
                    .acquire("bench/hot")
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(120))
                    .await
                    .expect("acquire hot");
                let granted = Instant::now();
                if let Some(released) = last_release.lock().unwrap().take() {
                    samples.lock().unwrap().push(granted - released);
                }
                *last_release.lock().unwrap() = Some(Instant::now());
                guard.release().await.expect("release hot");
            }
        }));
    }
    for task in tasks {
        task.await.expect("waiter");
    }
    let mut hand = std::mem::take(&mut *samples.lock().unwrap());
    let (r50, l50, l99, h50, h99) = (
        median(&mut raw),
        median(&mut lock),
        p99(&mut lock),
        median(&mut hand),
        p99(&mut hand),
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
