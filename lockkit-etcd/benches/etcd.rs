//! etcd lock benchmark next to the raw requests a lock needs, from the same run.
//!
//! ```text
//! eval "$(scripts/services.sh env)"
//! cargo bench -p lockkit-etcd --bench etcd      # LOCKKIT_TEST_ETCD_URL, or LOCKKIT_BENCH_URL
//! ```
//!
//! Floors: a plain put + delete (two fsync'd writes), and the four requests of the
//! simplest leased lock (lease grant, put with the lease, delete, lease revoke), as
//! `etcdctl lock` makes them minus its waiting.

use std::time::{Duration, Instant};

use etcd_client::PutOptions;
use lockkit_conformance::bench::{handoff, micros as us, percentile};
use lockkit_core::Locker;
use lockkit_etcd::EtcdBackend;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(url) = std::env::var("LOCKKIT_BENCH_URL")
        .ok()
        .or_else(|| std::env::var("LOCKKIT_TEST_ETCD_URL").ok())
    else {
        eprintln!(
            "set LOCKKIT_TEST_ETCD_URL (eval \"$(scripts/services.sh env)\") or LOCKKIT_BENCH_URL"
        );
        return;
    };
    let url = if url.contains('?') {
        url
    } else {
        format!("{url}?session_ttl=10s")
    };
    let backend = EtcdBackend::connect(&url).await.expect("connect");
    let mut client = backend.client();
    let locker = Locker::new(backend.clone());

    let (mut put_delete, mut leased, mut lock) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..1200 {
        let key = format!("/lockkit-bench/raw/{}", i % 10);
        let start = Instant::now();
        client.put(key.as_str(), "", None).await.expect("put");
        client.delete(key.as_str(), None).await.expect("delete");
        let raw = start.elapsed();

        let start = Instant::now();
        let lease = client.lease_grant(10, None).await.expect("grant").id();
        client
            .put(key.as_str(), "", Some(PutOptions::new().with_lease(lease)))
            .await
            .expect("put");
        client.delete(key.as_str(), None).await.expect("delete");
        client.lease_revoke(lease).await.expect("revoke");
        let raw_leased = start.elapsed();

        let name = format!("bench/uncontended/{}", i % 10);
        let start = Instant::now();
        let guard = locker
            .acquire(name.as_str())
            .ttl(Duration::from_secs(30))
            .await
            .expect("acquire");
        guard.release().await.expect("release");
        if i >= 200 {
            put_delete.push(raw);
            leased.push(raw_leased);
            lock.push(start.elapsed());
        }
    }

    let connect = || async { Locker::new(EtcdBackend::connect(&url).await.expect("connect")) };
    let mut hand = handoff(connect, "bench/hot", 16, 20).await;
    let (p50, e50, l50, l99, h50, h99) = (
        percentile(&mut put_delete, 0.5),
        percentile(&mut leased, 0.5),
        percentile(&mut lock, 0.5),
        percentile(&mut lock, 0.99),
        percentile(&mut hand, 0.5),
        percentile(&mut hand, 0.99),
    );
    println!("put+delete median                   {:>8.1} us", us(p50));
    println!("grant+put+delete+revoke median      {:>8.1} us", us(e50));
    println!(
        "acquire+release median              {:>8.1} us ({:.2}x put+delete, {:.2}x the leased floor), p99 {:.1} us",
        us(l50),
        us(l50) / us(p50),
        us(l50) / us(e50),
        us(l99)
    );
    println!(
        "handoff (16 waiters) median         {:>8.1} us, p99 {:.1} us ({} handoffs)",
        us(h50),
        us(h99),
        hand.len()
    );
    println!(
        "{{\"backend\":\"{url}\",\"put_delete_p50_us\":{:.1},\"leased_floor_p50_us\":{:.1},\"lock_p50_us\":{:.1},\"lock_p99_us\":{:.1},\"handoff_p50_us\":{:.1},\"handoff_p99_us\":{:.1}}}",
        us(p50),
        us(e50),
        us(l50),
        us(l99),
        us(h50),
        us(h99)
    );
}
