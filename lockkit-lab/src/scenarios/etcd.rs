//! What the lab asks an etcd cluster: who leads, and whether it settled.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::Instant;

use crate::LabError;
use lockkit_conformance::env::host_ports;

/// One member's view: its own id and the leader's (`None` when it does not answer).
async fn member_status(addr: &str) -> Option<(u64, u64)> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(1));
    let ask = async {
        let mut client = Client::connect([format!("http://{addr}")], Some(options))
            .await
            .ok()?;
        let status = client.status().await.ok()?;
        Some((status.header()?.member_id(), status.leader()))
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}

/// The etcd instance (`etcd-N`) that leads the cluster, and its address.
pub(super) async fn etcd_leader(url: &str) -> Result<(String, String), LabError> {
    for _ in 0..50 {
        for (i, addr) in host_ports(url).iter().enumerate() {
            if let Some((me, leader)) = member_status(addr).await
                && me == leader
            {
                return Ok((format!("etcd-{}", i + 1), addr.clone()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(LabError::new(format!("no leader among {url}")))
}

/// Waits until every member answers and all name the same leader.
pub(super) async fn etcd_settled(url: &str) -> Result<String, LabError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut views = Vec::new();
        for addr in host_ports(url) {
            views.push(member_status(&addr).await);
        }
        let leaders: Vec<u64> = views.iter().flatten().map(|(_, l)| *l).collect();
        let agreed = views.iter().all(Option::is_some)
            && leaders
                .first()
                .is_some_and(|l| *l != 0 && leaders.iter().all(|x| x == l));
        let modes: Vec<&str> = views
            .iter()
            .map(|v| match v {
                Some((me, leader)) if me == leader => "leader",
                Some(_) => "follower",
                None => "down",
            })
            .collect();
        if agreed {
            return Ok(modes.join(", "));
        }
        if Instant::now() > deadline {
            return Err(LabError::new(format!(
                "the cluster did not settle in 30 s: {}",
                modes.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
