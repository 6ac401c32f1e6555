//! How many lease revocations (each a Raft write) a contender that gives up costs
//! (helper-46, finding 3): counted on the member's own gRPC metrics, so this file holds one
//! test (nothing else of this binary sends requests meanwhile), and the bound leaves room
//! for a few from other clients of the member.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_etcd::EtcdBackend;

/// How many calls of gRPC method `method` the member at `host` handled, by code.
async fn handled(host: &str, method: &str) -> Vec<(String, u64)> {
    let text = tokio::task::spawn_blocking({
        let host = host.to_owned();
        move || {
            let out = std::process::Command::new("curl")
                .args(["-s", &format!("http://{host}/metrics")])
                .output()
                .unwrap();
            String::from_utf8(out.stdout).unwrap()
        }
    })
    .await
    .unwrap();
    text.lines()
        .filter(|l| l.starts_with("grpc_server_handled_total{"))
        .filter(|l| l.contains(&format!("grpc_method=\"{method}\"")))
        .filter_map(|l| {
            let code = l
                .split("grpc_code=\"")
                .nth(1)?
                .split('"')
                .next()?
                .to_owned();
            let count = l.rsplit(' ').next()?.parse().ok()?;
            Some((code, count))
        })
        .filter(|(_, count)| *count > 0)
        .collect()
}

fn total(counts: &[(String, u64)]) -> u64 {
    counts.iter().map(|(_, n)| n).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contender_that_gives_up_revokes_its_lease_once() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let host = env::host_ports(&url)[0].clone();
    let holder = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let rival = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = LockKey::new(format!("review46-revokes-{unique}")).unwrap();
    let guard = holder.acquire(&key).await.unwrap();
    // Let the connections' probe leases be revoked first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = handled(&host, "LeaseRevoke").await;
    let tries = 20;
    for _ in 0..tries {
        // Spaced past the spare lease's freshness: each try is granted a lease of its own.
        assert!(rival.try_acquire(&key).await.unwrap().is_none());
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = handled(&host, "LeaseRevoke").await;
    let revokes = total(&after) - total(&before);
    // One per try; two per try before.
    assert!(
        revokes < tries * 3 / 2,
        "{revokes} lease revocations for {tries} contended tries (before {before:?}, after \
         {after:?})"
    );
    guard.release().await.unwrap();
}
