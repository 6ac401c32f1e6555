//! A holder keeps its lock while a follower, and then the leader, of the 3-node ensemble
//! is killed. (Its own test binary: it stops and starts the shared ensemble's servers.)

use std::{process::Command, time::Duration};

use lockkit_conformance::env::{self, zk_mode};
use lockkit_core::{LockKey, Locker};
use lockkit_zk::ZkBackend;
use uuid::Uuid;

fn services(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .status()
        .unwrap();
    assert!(status.success(), "services.sh {args:?} failed");
}

/// (instance name, address) of the leader and of one follower.
async fn roles(nodes: &[String]) -> (String, String) {
    for _ in 0..100 {
        let mut leader = None;
        let mut follower = None;
        for (i, node) in nodes.iter().enumerate() {
            match zk_mode(node).await.as_deref() {
                Some("leader") => leader = Some(format!("zk-{}", i + 1)),
                Some("follower") => follower = Some(format!("zk-{}", i + 1)),
                _ => {}
            }
        }
        if let (Some(l), Some(f)) = (leader, follower) {
            return (l, f);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the ensemble has no leader");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_keeps_its_lock_through_follower_and_leader_failures() {
    let Some(url) = env::service_url("LOCKKIT_TEST_ZK_ENSEMBLE_URL") else {
        return;
    };
    let nodes = env::host_ports(&url);
    let url = format!("{url}?session_timeout=15s");
    let holder = Locker::new(ZkBackend::connect(&url).await.unwrap());
    let rival = Locker::new(ZkBackend::connect(&url).await.unwrap());
    let key = LockKey::new(format!("zk-ensemble/{}", Uuid::new_v4().simple())).unwrap();
    let guard = holder
        .acquire(&key)
        .ttl(Duration::from_secs(15))
        .await
        .unwrap();

    let (_, follower) = roles(&nodes).await;
    services(&["down", &follower]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        guard.is_valid(),
        "lost the lock when follower {follower} died"
    );
    assert!(rival.try_acquire(&key).await.unwrap().is_none());
    services(&["up", &follower]);

    let (leader, _) = roles(&nodes).await;
    services(&["down", &leader]);
    // A new leader is elected; clients reconnect within the session timeout.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let still_mine = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(None) = rival.try_acquire(&key).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    services(&["up", &leader]);
    assert!(
        still_mine.is_ok(),
        "the ensemble never answered after the leader died"
    );
    assert!(guard.is_valid(), "lost the lock when leader {leader} died");
    let token = guard.token();
    guard.release().await.unwrap();
    let next = rival
        .try_acquire(&key)
        .await
        .unwrap()
        .expect("free after release");
    assert!(next.token() > token);
    next.release().await.unwrap();
}
