//! The lease granted ahead of need (`lockkit-etcd/src/lease/spare.rs`): a spare the cluster no
//! longer knows (revoked by an operator's script, lost in a restore) must not fail the
//! acquisition that takes it; the contender is granted a lease of its own instead.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::Locker;
use lockkit_etcd::EtcdBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_revoked_on_the_cluster_does_not_fail_the_acquisition_that_takes_it() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    let backend = EtcdBackend::connect(&format!("{url}?session_ttl=6s"))
        .await
        .unwrap();
    let mut admin = backend.client();
    let locker = Locker::new(backend.clone());
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = format!("etcd-spare/{unique}");
    // The spare must still be fresh (granted under half a second ago) when it is taken: a
    // slow moment can make a round miss that, so rounds go on until one takes a revoked
    // spare, each of them granted all the same.
    for round in 0..10 {
        // Two acquisitions close together: the client keeps a spare from then on.
        for _ in 0..2 {
            let guard = locker
                .try_acquire(&key)
                .ttl(Duration::from_secs(30))
                .await
                .unwrap()
                .expect("free");
            guard.release().await.unwrap();
        }
        let appeared = tokio::time::Instant::now() + Duration::from_secs(5);
        let spare = loop {
            if let Some(spare) = backend.spare_lease() {
                break spare;
            }
            assert!(
                tokio::time::Instant::now() < appeared,
                "no spare lease was granted"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        admin.lease_revoke(spare).await.unwrap();
        let guard = locker
            .try_acquire(&key)
            .ttl(Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("round {round}: an acquisition failed: {e}"))
            .expect("free");
        guard.release().await.unwrap();
        if backend.spares_lost() > 0 {
            return;
        }
    }
    panic!("no round took its revoked spare while it was fresh: the machine was too slow");
}
