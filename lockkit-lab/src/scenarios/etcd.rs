//! What the lab asks an etcd cluster: who leads, and whether it settled. Through
//! `etcdctl` (installed with the servers by `services.sh`), so the lab builds without
//! etcd's client library.

use std::time::Duration;

use tokio::{process::Command, time::Instant};

use crate::LabError;
use lockkit_conformance::env::host_ports;

/// Whether the member at `addr` says it leads (`None` when it does not answer).
async fn leads(addr: &str) -> Option<bool> {
    let status = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args([
            &format!("--endpoints={addr}"),
            "--dial-timeout=1s",
            "--command-timeout=1s",
            "endpoint",
            "status",
        ])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(3), status)
        .await
        .ok()?
        .ok()?;
    if !output.status.success() {
        return None;
    }
    // `<endpoint>, <id>, <version>, <db size>, <is leader>, <is learner>, <term>, ...`
    let line = String::from_utf8_lossy(&output.stdout);
    match line.split(", ").nth(4)? {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// The etcd instance (`etcd-N`) that leads the cluster, and its address.
pub(super) async fn etcd_leader(url: &str) -> Result<(String, String), LabError> {
    for _ in 0..50 {
        for (i, addr) in host_ports(url).iter().enumerate() {
            if leads(addr).await == Some(true) {
                return Ok((format!("etcd-{}", i + 1), addr.clone()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(LabError::new(format!("no leader among {url}")))
}

/// Waits until every member answers and exactly one leads.
pub(super) async fn etcd_settled(url: &str) -> Result<String, LabError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut views = Vec::new();
        for addr in host_ports(url) {
            views.push(leads(&addr).await);
        }
        let modes: Vec<&str> = views
            .iter()
            .map(|v| match v {
                Some(true) => "leader",
                Some(false) => "follower",
                None => "down",
            })
            .collect();
        if views.iter().all(Option::is_some)
            && views.iter().filter(|v| **v == Some(true)).count() == 1
        {
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
