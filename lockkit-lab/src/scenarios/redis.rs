//! Plans for Redis and Redlock: a frozen or restarted server, a failover, masters lost.

use std::{net::SocketAddr, time::Duration};

use tokio::time::Instant;

use crate::{Context, LabError, servers::redis_command, timeline::Actor};
use lockkit_conformance::{FaultProxy, env::host_ports};

use super::{ctx::*, steps::*};

pub(super) async fn redis_paused(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(3);
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    let paused = Instant::now();
    ctx.lab.services.act("pause", &["redis-single"]).await?;
    let frozen = ctx.fault_at(paused, "Redis frozen (SIGSTOP)", "Redis server SIGSTOPped");
    let during = ctx
        .attempt(&rival, ttl, Duration::from_secs(2), Duration::from_secs(5))
        .await;
    let during = during.map(|g| ctx.open("rival (during the pause)", g));
    await_lost(ctx, &holder, ttl + Duration::from_secs(5)).await;
    let resume_at = paused + ttl + Duration::from_secs(1);
    tokio::time::sleep_until(resume_at).await;
    ctx.lab.services.act("resume", &["redis-single"]).await?;
    ctx.fault_ends(
        frozen,
        "resumed (SIGCONT)",
        "Redis server SIGCONTed (its clock moved on: the lease has run out)",
    );
    let rival_hold = match during {
        Some(hold) => hold,
        None => {
            let (guard, open) = rival_takes(
                ctx,
                &rival,
                ttl,
                Duration::from_secs(15),
                "the rival after the resume",
            )
            .await?;
            (guard, open)
        }
    };
    ctx.write(Actor::Rival, rival_hold.0.token()).await?;
    ctx.stale_write(Actor::Holder, holder.token()).await?;
    finish(ctx, Some((holder, holder_open)), Some(rival_hold)).await;
    Ok(())
}

pub(super) async fn redis_restarted(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(30);
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, false, "holder", |token| {
        format!(
            "holder granted token {} with a 30 s lease (between renewals for the rest of the run)",
            token
        )
    })
    .await?;
    let killed = Instant::now();
    ctx.lab.services.act("kill", &["redis-single"]).await?;
    let down = ctx.fault_at(
        killed,
        "Redis killed (SIGKILL)",
        "Redis SIGKILLed (no RDB, no AOF: the lock lived only in memory)",
    );
    ctx.lab.services.up(&["redis-single"]).await?;
    ctx.fault_ends(down, "restarted, empty", "Redis restarted, empty");
    let rival = ctx.lab.locker(url).await?;
    let (guard, rival_open) = rival_takes(
        ctx,
        &rival,
        ttl,
        Duration::from_secs(10),
        "the rival after the restart",
    )
    .await?;
    ctx.write(Actor::Rival, guard.token()).await?;
    renew_through(ctx, &holder, ttl).await;
    ctx.stale_write(Actor::Holder, holder.token()).await?;
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}

pub(super) async fn redis_aof_restarted(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(10);
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a 10 s lease, watchdog on",
            token
        )
    })
    .await?;
    let killed = Instant::now();
    ctx.lab.services.act("kill", &["redis-aof"]).await?;
    let down = ctx.fault_at(
        killed,
        "Redis killed (SIGKILL)",
        "Redis (appendfsync always) SIGKILLed",
    );
    ctx.lab.services.up(&["redis-aof"]).await?;
    ctx.fault_ends(
        down,
        "restarted from its AOF",
        "Redis restarted from its append-only file",
    );
    let rival = ctx.lab.locker(url).await?;
    kept(ctx, (holder, holder_open), &rival, ttl, None).await
}

pub(super) async fn failover(ctx: &mut Ctx<'_>, url: &str, lagging: bool) -> Result<(), LabError> {
    let ttl = Duration::from_secs(5);
    let replica_url = ctx.lab.url("LOCKKIT_TEST_REDIS_REPLICA_URL")?.to_owned();
    let replica_addr = host_ports(&replica_url)
        .first()
        .cloned()
        .ok_or_else(|| LabError::new(format!("no host:port in {replica_url}")))?;
    let primary: SocketAddr = host_ports(url)
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| LabError::new(format!("no host:port in {url}")))?;
    let link = FaultProxy::start(primary)
        .await
        .context("starting the replication proxy")?;
    let (host, port) = (
        link.local_addr().ip().to_string(),
        link.local_addr().port().to_string(),
    );
    redis_command(&replica_addr, &["REPLICAOF", &host, &port]).await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !redis_command(&replica_addr, &["INFO", "replication"])
        .await?
        .contains("master_link_status:up")
    {
        if Instant::now() > deadline {
            return Err(LabError::new(
                "the replica did not sync through the proxy in 20 s",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ctx.server(
        "replica in sync",
        "the replica follows the primary through a TCP proxy, in sync",
    );
    let holder_locker = ctx.locker(url).await?;
    // An earlier holder's grant reaches the replica, fencing counter included, so the
    // promoted replica starts from an old counter rather than none.
    let (earlier, earlier_open) = take(
        ctx,
        &holder_locker,
        ttl,
        true,
        "the earlier holder",
        |token| format!("an earlier holder takes the key (token {token})"),
    )
    .await?;
    finish(ctx, Some((earlier, earlier_open)), None).await;
    let counter = format!("redisson_lock_token:{{{}}}", ctx.key);
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis_command(&replica_addr, &["GET", &counter])
        .await?
        .is_empty()
    {
        if Instant::now() > deadline {
            return Err(LabError::new(
                "the fencing counter never reached the replica",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ctx.note("it released; the replica has its lock's fencing counter");
    let stalled = if lagging {
        link.cut();
        Some(ctx.fault(
            "replication stalled",
            "replication link stalls: the replica receives nothing more (lag, partition)",
        ))
    } else {
        None
    };
    let (holder, holder_open) = take(
        ctx,
        &holder_locker,
        ttl,
        true,
        "holder on the primary",
        |token| {
            format!(
                "holder granted token {} by the primary ({} s lease, watchdog on){}",
                token,
                ttl.as_secs(),
                if lagging {
                    ""
                } else {
                    "; the replica confirmed the grant (WAIT 1)"
                }
            )
        },
    )
    .await?;
    let killed = Instant::now();
    ctx.lab.services.act("kill", &["redis-primary"]).await?;
    ctx.fault_at(killed, "primary killed (SIGKILL)", "primary SIGKILLed");
    redis_command(&replica_addr, &["REPLICAOF", "NO", "ONE"]).await?;
    drop(link);
    let promoted = "replica promoted (REPLICAOF NO ONE); clients move to it";
    match stalled {
        Some(id) => ctx.fault_ends(id, "replica promoted", promoted),
        None => ctx.server("replica promoted", promoted),
    }
    let rival = ctx.lab.locker(&replica_url).await?;
    let rival_hold = if lagging {
        let (guard, open) = rival_takes(
            ctx,
            &rival,
            ttl,
            Duration::from_secs(10),
            "the rival on the promoted replica",
        )
        .await?;
        ctx.write(Actor::Rival, guard.token()).await?;
        await_lost(ctx, &holder, ttl + Duration::from_secs(5)).await;
        (guard, open)
    } else {
        let busy = expect_busy(ctx, &rival).await?;
        let busy = busy.map(|g| ctx.open("rival (early)", g));
        match busy {
            Some(hold) => hold,
            None => {
                let (guard, open) = race(
                    ctx,
                    &holder,
                    &rival,
                    ttl,
                    ttl * 3,
                    "the replicated lease ran out on the new primary",
                )
                .await?;
                ctx.write(Actor::Rival, guard.token()).await?;
                (guard, open)
            }
        }
    };
    ctx.stale_write(Actor::Holder, holder.token()).await?;
    finish(ctx, Some((holder, holder_open)), Some(rival_hold)).await;
    Ok(())
}

pub(super) async fn redlock_two_down(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(5);
    let holder_locker = ctx.locker(url).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} by the 5 masters ({} s lease, watchdog on)",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    let killed = Instant::now();
    ctx.lab
        .services
        .act("kill", &["redlock-4", "redlock-5"])
        .await?;
    ctx.fault_at(
        killed,
        "masters 4, 5 killed",
        "masters 4 and 5 SIGKILLed (3 of 5 left: still a quorum)",
    );
    let during = ctx
        .attempt(&rival, ttl, Duration::from_secs(2), Duration::from_secs(6))
        .await;
    let during = during.map(|g| ctx.open("rival", g));
    kept(ctx, (holder, holder_open), &rival, ttl, during).await
}

pub(super) async fn redlock_restarted_empty(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(30);
    let killed = Instant::now();
    ctx.lab
        .services
        .act("kill", &["redlock-4", "redlock-5"])
        .await?;
    let two_down = ctx.fault_at(killed, "masters 4, 5 killed", "masters 4 and 5 SIGKILLed");
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(
        ctx,
        &holder_locker,
        ttl,
        false,
        "holder on masters 1-3",
        |token| {
            format!(
                "holder granted token {} by masters 1, 2, 3 (a quorum of 5); 30 s lease",
                token
            )
        },
    )
    .await?;
    ctx.lab.services.up(&["redlock-4", "redlock-5"]).await?;
    ctx.fault_ends(two_down, "4, 5 back, empty", "masters 4 and 5 back, empty");
    let killed = Instant::now();
    ctx.lab.services.act("kill", &["redlock-3"]).await?;
    let three = ctx.fault_at(killed, "master 3 killed", "master 3 SIGKILLed");
    ctx.lab.services.up(&["redlock-3"]).await?;
    ctx.fault_ends(
        three,
        "3 back, empty",
        "master 3 restarted without persistence: it forgot the grant",
    );
    let rival = ctx.lab.locker(url).await?;
    let (guard, rival_open) = rival_takes(
        ctx,
        &rival,
        ttl,
        Duration::from_secs(10),
        "the rival on masters 3, 4, 5",
    )
    .await?;
    ctx.write(Actor::Rival, guard.token()).await?;
    renew_through(ctx, &holder, ttl).await;
    ctx.stale_write(Actor::Holder, holder.token()).await?;
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}
