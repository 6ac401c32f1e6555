//! Steps the plans share: take, keep, race, hand off and watch a lock.

use std::time::Duration;

use lockkit_core::{FencingToken, LockGuard, Locker};
use tokio::time::Instant;

use crate::{
    Context, LabError,
    timeline::{Actor, Mark},
};

use super::ctx::*;

/// Waits up to `within` for the guard to fire lost and records it.
pub(super) async fn await_lost(ctx: &mut Ctx<'_>, guard: &LockGuard, within: Duration) {
    if let Ok(reason) = tokio::time::timeout(within, guard.lost()).await {
        ctx.holder_lost(guard, reason);
    } else {
        ctx.note(format!(
            "holder's guard did not fire lost within {:.0} s",
            within.as_secs_f64()
        ));
    }
}

/// Renews until the server answers (a restarted server may refuse a few first attempts);
/// records a loss.
pub(super) async fn renew_through(ctx: &mut Ctx<'_>, guard: &LockGuard, ttl: Duration) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match guard.extend(ttl).await {
            Ok(()) => {
                ctx.mark(
                    Mark::Renewed { who: Actor::Holder },
                    format!("holder renews its lease ({} s): ok", ttl.as_secs()),
                );
                return true;
            }
            Err(e) if !guard.is_valid() || Instant::now() > deadline => {
                ctx.mark(
                    Mark::RenewFailed { who: Actor::Holder },
                    format!("holder renews its lease: {e}"),
                );
                if !guard.is_valid() {
                    let reason = guard.lost().await;
                    ctx.holder_lost(guard, reason);
                }
                return false;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The rival checks the key is still held (busy); a grant here is recorded.
pub(super) async fn expect_busy(
    ctx: &mut Ctx<'_>,
    rival: &Locker,
) -> Result<Option<LockGuard>, LabError> {
    let key = ctx.key.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match rival.try_acquire(&key).await {
            Ok(None) => {
                ctx.denied(
                    Actor::Rival,
                    "busy",
                    "rival tries: busy (the holder still has it)",
                );
                return Ok(None);
            }
            Ok(Some(guard)) => {
                ctx.rival_granted(&guard);
                return Ok(Some(guard));
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("rival try failed, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(LabError::new(format!("rival's try kept failing: {e}"))),
        }
    }
}

/// The holder takes the key, says so, and writes with its token.
pub(super) async fn take(
    ctx: &mut Ctx<'_>,
    locker: &Locker,
    ttl: Duration,
    watchdog: bool,
    what: &str,
    describe: impl FnOnce(FencingToken) -> String,
) -> Result<Hold, LabError> {
    let mut acquire = locker.acquire(&ctx.key).ttl(ttl);
    if !watchdog {
        acquire = acquire.no_watchdog();
    }
    let guard = acquire.await.context(what)?;
    ctx.granted(Actor::Holder, guard.token(), describe(guard.token()));
    let hold = ctx.open("holder", guard);
    ctx.write(Actor::Holder, hold.0.token()).await?;
    Ok(hold)
}

/// The lock was kept through the fault: the rival finds it busy, the holder renews and
/// writes, then releases, and the rival gets it with a greater token.
pub(super) async fn kept(
    ctx: &mut Ctx<'_>,
    holder: Hold,
    rival: &Locker,
    ttl: Duration,
    during: Option<Hold>,
) -> Result<(), LabError> {
    let busy = expect_busy(ctx, rival).await?;
    let busy = busy.map(|g| ctx.open("rival", g));
    if holder.0.is_valid() {
        if renew_through(ctx, &holder.0, ttl).await {
            ctx.write(Actor::Holder, holder.0.token()).await?;
        }
    } else {
        let reason = holder.0.lost().await;
        ctx.holder_lost(&holder.0, reason);
    }
    let token = holder.0.token();
    finish(ctx, Some(holder), during.or(busy)).await;
    let next = handoff(ctx, rival, ttl, token).await?;
    finish(ctx, None, Some(next)).await;
    Ok(())
}

/// The rival waits up to `wait` for the key and is granted it.
pub(super) async fn rival_takes(
    ctx: &mut Ctx<'_>,
    rival: &Locker,
    ttl: Duration,
    wait: Duration,
    what: &str,
) -> Result<Hold, LabError> {
    let guard = rival
        .acquire(&ctx.key)
        .ttl(ttl)
        .wait(wait)
        .await
        .context(what)?;
    ctx.rival_granted(&guard);
    Ok(ctx.open("rival", guard))
}

/// The rival waits up to `wait` for the key while the holder's guard may fire lost (up
/// to `lost_within`); both are recorded at the instants they happened.
pub(super) async fn race(
    ctx: &mut Ctx<'_>,
    holder: &LockGuard,
    rival: &Locker,
    ttl: Duration,
    lost_within: Duration,
    why: &str,
) -> Result<Hold, LabError> {
    let rival_wait = rival
        .acquire(ctx.key.clone())
        .ttl(ttl)
        .wait(Duration::from_secs(30));
    let (granted, lost) = tokio::join!(
        async {
            let granted = rival_wait.await;
            (granted, Instant::now())
        },
        tokio::time::timeout(lost_within, holder.lost())
    );
    match lost {
        Ok(reason) => ctx.holder_lost(holder, reason),
        Err(_) => ctx.note("holder's guard did not fire lost"),
    }
    let (guard, at) = granted;
    let guard = guard.context(format!("the rival ({why})"))?;
    ctx.rival_at.get_or_insert(at);
    ctx.granted_at(
        at,
        Actor::Rival,
        guard.token(),
        format!("rival granted token {} ({why})", guard.token()),
    );
    // The record starts when the grant came back, not after the holder's side settled.
    let open = ctx.history.begin_at("rival", &guard, at);
    Ok((guard, open))
}

/// Closes both holds in the history and releases them; a release of a hold still valid is
/// recorded.
pub(super) async fn finish(ctx: &mut Ctx<'_>, holder: Option<Hold>, rival: Option<Hold>) {
    let holds = [(Actor::Holder, holder), (Actor::Rival, rival)];
    for (who, (guard, open)) in holds
        .into_iter()
        .filter_map(|(who, hold)| hold.map(|h| (who, h)))
    {
        ctx.history.end(open, &guard);
        let valid = guard.is_valid();
        let released = tokio::time::timeout(Duration::from_secs(5), guard.release()).await;
        if valid && matches!(released, Ok(Ok(_))) {
            ctx.mark(Mark::Released { who }, format!("{} released", who.name()));
        }
    }
}

/// After the holder released: the rival must get the key with a greater token.
pub(super) async fn handoff(
    ctx: &mut Ctx<'_>,
    rival: &Locker,
    ttl: Duration,
    after: FencingToken,
) -> Result<Hold, LabError> {
    let guard = rival
        .acquire(&ctx.key)
        .ttl(ttl)
        .wait(Duration::from_secs(20))
        .await
        .context("the rival after the holder released")?;
    ctx.rival_granted(&guard);
    if guard.token() <= after {
        return Err(LabError::new(format!(
            "the rival's token {} is not greater than the holder's {after}",
            guard.token()
        )));
    }
    let open = ctx.history.begin("rival", &guard);
    Ok((guard, open))
}
