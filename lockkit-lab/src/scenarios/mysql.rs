//! Plans for the SQL databases (MySQL, PostgreSQL): the server restarted.

use std::time::Duration;

use tokio::time::Instant;

use crate::{LabError, report::LostSignal, timeline::Actor};

use super::{catalogue::ScenarioDef, ctx::*, steps::*};

/// The database of `def.touches` restarted mid-hold: a hold that is a committed lease row
/// is kept; one that is an open transaction or a session's advisory lock ends with its
/// connection.
pub(super) async fn database_restarted(
    ctx: &mut Ctx<'_>,
    url: &str,
    def: &ScenarioDef,
) -> Result<(), LabError> {
    let for_update = def.expect.lost != LostSignal::Never;
    let (instance, name) = match def.touches {
        ["postgres"] => ("postgres", "PostgreSQL"),
        _ => ("mariadb", "MariaDB"),
    };
    let ttl = if for_update {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
    };
    let holder_locker = ctx.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder granted token {} with a {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    let stopped = Instant::now();
    ctx.lab.services.act("restart", &[instance]).await?;
    let restart = ctx.fault_at(
        stopped,
        &format!("{name} restarting"),
        format!("{name} stopped and started"),
    );
    ctx.fault_ends(restart, "back", format!("{name} restarted"));
    let rival = ctx.lab.locker(url).await?;
    if for_update {
        // The rival asks at once; the holder's guard races it.
        let (guard, rival_open) = race(
            ctx,
            &holder,
            &rival,
            ttl,
            Duration::from_secs(20),
            if instance == "postgres" {
                "the restart ended the holder's session"
            } else {
                "the restart ended the holder's transaction"
            },
        )
        .await?;
        ctx.write(Actor::Rival, guard.token()).await?;
        ctx.stale_write(Actor::Holder, holder.token()).await?;
        finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
        return Ok(());
    }
    kept(ctx, (holder, holder_open), &rival, ttl, None).await
}
