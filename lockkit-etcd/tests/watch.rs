//! The holder's watch on its own key across broken links: a key deleted under the holder
//! (by an operator, `etcdctl del`, a forced unlock) is reported as lost although the
//! holder's connection was reset around the deletion, before and after, so that its
//! watch is reopened from an older revision and must still see the DELETE.

use std::time::Duration;

use lockkit_conformance::{ProxiedClients, env};
use lockkit_core::{LockKey, Locker, LostReason};
use lockkit_etcd::EtcdBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_away_across_link_resets_is_reported_lost() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ETCD_URL") else {
        return;
    };
    // A session long enough that brief resets never cost the etcd lease itself.
    let options = "session_ttl=6s&connect_timeout=2s";
    let admin = EtcdBackend::connect(&format!("{url}?{options}"))
        .await
        .unwrap();
    let (proxies, hosts) =
        ProxiedClients::<EtcdBackend>::start_proxies(&env::host_ports(&url)).await;
    let holder = Locker::new(
        EtcdBackend::connect(&format!("etcd://{hosts}?{options}"))
            .await
            .unwrap(),
    );
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let reset = || proxies.iter().for_each(|p| p.reset());
    let heal = || proxies.iter().for_each(|p| p.heal());
    for round in 0..8u64 {
        let key = LockKey::new(format!("etcd-watch/{unique}-{round}")).unwrap();
        let guard = holder
            .acquire(&key)
            .ttl(Duration::from_secs(600))
            .await
            .unwrap();
        // Break the link, delete the key while it is down, break it again as the watch
        // is being reopened: each round a little later.
        reset();
        let range = admin.lock_range(&key);
        admin
            .client()
            .delete(range, Some(etcd_client::DeleteOptions::new().with_prefix()))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        heal();
        tokio::time::sleep(Duration::from_millis(5 * round)).await;
        reset();
        tokio::time::sleep(Duration::from_millis(30)).await;
        heal();
        let reason = tokio::time::timeout(Duration::from_secs(30), guard.lost())
            .await
            .unwrap_or_else(|_| {
                panic!("round {round}: a key deleted under its holder was never reported lost")
            });
        assert_eq!(reason, LostReason::NotOurs, "round {round}");
        assert!(!guard.is_valid());
    }
}
