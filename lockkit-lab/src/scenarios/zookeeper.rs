//! Plans for the Raft/Zab services (a ZooKeeper ensemble, an etcd cluster): the leader
//! paused or killed.

use std::time::Duration;

use tokio::time::Instant;

use crate::LabError;
use lockkit_conformance::env::{host_ports, zk_mode};

use super::{ctx::*, etcd::*, steps::*};

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

/// A replicated lock service whose leader the lab can find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Quorum {
    /// A ZooKeeper ensemble (`zk-N`).
    Zk,
    /// An etcd cluster (`etcd-N`).
    Etcd,
}

impl Quorum {
    /// The instance that leads, and its address.
    async fn leader(self, url: &str) -> Result<(String, String), LabError> {
        match self {
            Quorum::Zk => zk_leader(url).await,
            Quorum::Etcd => etcd_leader(url).await,
        }
    }

    /// Waits until every member answers and one leads; says what each is.
    async fn settled(self, url: &str) -> Result<String, LabError> {
        match self {
            Quorum::Zk => zk_settled(url).await,
            Quorum::Etcd => etcd_settled(url).await,
        }
    }

    /// What ends a dead holder's hold on this service.
    fn session(self) -> &'static str {
        match self {
            Quorum::Zk => "session",
            Quorum::Etcd => "etcd lease",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Quorum::Zk => "ensemble",
            Quorum::Etcd => "cluster",
        }
    }
}

/// `action` is `pause` (SIGSTOP for 8 s, then SIGCONT) or `kill` (SIGKILL, then start).
pub(super) async fn leader_outage(
    ctx: &mut Ctx<'_>,
    url: &str,
    action: &str,
    quorum: Quorum,
) -> Result<(), LabError> {
    let ttl = if action == "pause" {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(10)
    };
    quorum.settled(url).await?;
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} ({} s {} and lease)",
            token,
            ttl.as_secs(),
            quorum.session()
        )
    })
    .await?;
    let (leader, addr) = quorum.leader(url).await?;
    let broken = Instant::now();
    ctx.lab.services.act(action, &[leader.as_str()]).await?;
    let during = if action == "pause" {
        let resume_at = Instant::now() + Duration::from_secs(8);
        let frozen = ctx.fault_at(
            broken,
            "leader frozen (SIGSTOP)",
            format!("leader {leader} ({addr}) SIGSTOPped"),
        );
        tokio::time::sleep(Duration::from_secs(4)).await;
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(4))
            .await;
        tokio::time::sleep_until(resume_at).await;
        ctx.lab.services.act("resume", &[leader.as_str()]).await?;
        ctx.fault_ends(frozen, "resumed (SIGCONT)", format!("{leader} SIGCONTed"));
        during
    } else {
        let down = ctx.fault_at(
            broken,
            "leader killed (SIGKILL)",
            format!("leader {leader} ({addr}) SIGKILLed"),
        );
        let during = ctx
            .attempt(&rival, ttl, Duration::from_secs(3), Duration::from_secs(6))
            .await;
        ctx.lab.services.up(&[leader.as_str()]).await?;
        ctx.fault_ends(down, "restarted", format!("{leader} restarted"));
        during
    };
    let modes = quorum.settled(url).await?;
    let settled = format!("{} settled", quorum.group());
    ctx.server(&settled, format!("{settled}: {modes}"));
    let during = during.map(|g| ctx.open("rival (during the outage)", g));
    kept(ctx, (holder, holder_open), &rival, ttl, during).await
}
