//! Plans for ZooKeeper: the ensemble's leader paused or killed.

use std::time::Duration;

use tokio::time::Instant;

use crate::LabError;
use lockkit_conformance::env::{host_ports, zk_mode};

use super::{ctx::*, steps::*};

/// The ZooKeeper instance (`zk-N`) that is the ensemble's leader.
pub(super) async fn zk_leader(url: &str) -> Result<(String, String), LabError> {
    for _ in 0..50 {
        for (i, addr) in host_ports(url).iter().enumerate() {
            if zk_mode(addr).await.as_deref() == Some("leader") {
                return Ok((format!("zk-{}", i + 1), addr.clone()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(LabError::new(format!("no leader among {url}")))
}

/// Waits until every server of the ensemble is a leader or a follower.
pub(super) async fn zk_settled(url: &str) -> Result<String, LabError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut modes = Vec::new();
        for addr in host_ports(url) {
            modes.push(zk_mode(&addr).await.unwrap_or_else(|| "down".into()));
        }
        let leaders = modes.iter().filter(|m| *m == "leader").count();
        let all = modes.iter().all(|m| m == "leader" || m == "follower");
        if all && leaders == 1 {
            return Ok(modes.join(", "));
        }
        if Instant::now() > deadline {
            return Err(LabError::new(format!(
                "the ensemble did not settle in 30 s: {}",
                modes.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `action` is `pause` (SIGSTOP for 8 s, then SIGCONT) or `kill` (SIGKILL, then start).
pub(super) async fn zk_leader_outage(
    ctx: &mut Ctx<'_>,
    url: &str,
    action: &str,
) -> Result<(), LabError> {
    let ttl = if action == "pause" {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(10)
    };
    zk_settled(url).await?;
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} ({} s session and lease)",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    let (leader, addr) = zk_leader(url).await?;
    ctx.lab.services.act(action, &[leader.as_str()]).await?;
    let during = if action == "pause" {
        let resume_at = Instant::now() + Duration::from_secs(8);
        ctx.note(format!("leader {leader} ({addr}) SIGSTOPped"));
        tokio::time::sleep(Duration::from_secs(4)).await;
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(4))
            .await;
        tokio::time::sleep_until(resume_at).await;
        ctx.lab.services.act("resume", &[leader.as_str()]).await?;
        ctx.note(format!("{leader} SIGCONTed"));
        during
    } else {
        ctx.note(format!("leader {leader} ({addr}) SIGKILLed"));
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(6))
            .await;
        ctx.lab.services.up(&[leader.as_str()]).await?;
        ctx.note(format!("{leader} restarted"));
        during
    };
    let modes = zk_settled(url).await?;
    ctx.note(format!("ensemble settled: {modes}"));
    let during = during.map(|g| ctx.open("rival (during the outage)", g));
    kept(ctx, (holder, holder_open), &rival, ttl, during).await
}
