//! Plans that work on any backend: a holder paused past its lease, a holder cut off.

use std::{net::SocketAddr, time::Duration};

use tokio::time::Instant;

use crate::{
    Context, LabError,
    child::{CHILD_VALUE, spawn_child},
    report::Stale,
    timeline::{Actor, Mark, WriteOutcome},
};
use lockkit_conformance::{FaultProxy, env::host_ports, history::HoldRecord};

use super::{ctx::*, steps::*};

/// A holder frozen past its lease: of the lock, or of the only permit of a semaphore of
/// `permits` = 1 permit (0: the lock).
pub(super) async fn holder_paused(
    ctx: &mut Ctx<'_>,
    url: &str,
    permits: u32,
) -> Result<(), LabError> {
    let ttl = Duration::from_secs(2);
    let key = ctx.key.clone();
    let store = ctx.store()?.clone();
    let mut child = spawn_child(ctx.lab, url, &key, ttl, &store, permits).await?;
    let (held_at, token) = (child.held_at, child.token);
    ctx.granted_at(
        held_at,
        Actor::Holder,
        token,
        format!(
            "holder (pid {}) granted token {} with a {} s lease, watchdog on",
            child.pid(),
            token,
            ttl.as_secs()
        ),
    );
    let rival = ctx.locker(url).await?;
    tokio::time::sleep(ttl / 2).await;
    let early = child.drain(Duration::from_millis(50)).await;
    if !early.is_empty() {
        return Err(LabError::new(format!(
            "the holder reported {early:?} before it was frozen"
        )));
    }
    child.signal("STOP").await.map_err(LabError::new)?;
    let paused = Instant::now();
    let frozen = ctx.fault_at(
        paused,
        "holder frozen (SIGSTOP)",
        "holder SIGSTOPped: no watchdog, no I/O (a GC pause, a swapped-out VM)",
    );
    let early = child.drain(Duration::from_millis(100)).await;
    if !early.is_empty() {
        return Err(LabError::new(format!(
            "the holder reported {early:?} before it was frozen"
        )));
    }
    if let Some(until) = child.valid_until {
        ctx.mark_at(
            until,
            Mark::LeaseEnds { who: Actor::Holder },
            "the frozen holder's lease deadline passes (on its own clock)",
        );
    }
    let acquire = if permits == 0 {
        rival.acquire(&key)
    } else {
        rival.semaphore(&key, permits).acquire()
    };
    let guard = acquire
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .await
        .context("the rival while the holder is frozen")?;
    ctx.rival_granted(&guard);
    ctx.note(format!(
        "  ... {:.2} s after the pause",
        paused.elapsed().as_secs_f64()
    ));
    let rival_open = ctx.history.begin("rival", &guard);
    ctx.write(Actor::Rival, guard.token()).await?;
    child.request_write().await.map_err(LabError::new)?;
    child.signal("CONT").await.map_err(LabError::new)?;
    ctx.fault_ends(
        frozen,
        "resumed (SIGCONT)",
        format!(
            "holder SIGCONTed; it writes with token {} as it meant to before the pause",
            child.token
        ),
    );
    let (mut wrote, mut lost) = (false, false);
    let deadline = Instant::now() + ttl * 3 + Duration::from_secs(10);
    while !(wrote && lost) {
        let Some(event) = child.next_event(deadline - Instant::now()).await else {
            break;
        };
        if let Some(rest) = event.strip_prefix("WROTE ") {
            wrote = true;
            let outcome = if rest.starts_with("refused") {
                ctx.stale = Stale::Refused;
                WriteOutcome::Refused
            } else if rest.starts_with("accepted") {
                ctx.accepted_writes
                    .push((child.token.get(), CHILD_VALUE.to_owned()));
                ctx.stale = Stale::Accepted;
                WriteOutcome::StaleAccepted
            } else {
                return Err(LabError::new(format!("the holder could not write: {rest}")));
            };
            ctx.wrote(
                Actor::Holder,
                child.token,
                outcome,
                format!("holder's write: {rest}"),
            );
        } else if let Some(reason) = event.strip_prefix("LOST ") {
            lost = true;
            ctx.holder_lost_at.get_or_insert(Instant::now());
            ctx.mark(
                Mark::Lost { who: Actor::Holder },
                format!("holder's guard fired lost on resume ({reason})"),
            );
        } else {
            ctx.note(format!("holder says: {event}"));
        }
    }
    if !wrote {
        // Its queued WRITE may still land after this: the store check could not count it.
        return Err(LabError::new("the holder never reported its write"));
    }
    ctx.history.push(HoldRecord {
        holder: "holder (child process)".into(),
        key: key.clone(),
        token: child.token,
        start: child.held_at,
        end: None,
        valid_until: child.valid_until,
    });
    finish(ctx, None, Some((guard, rival_open))).await;
    child.finish().await;
    Ok(())
}

pub(super) async fn cut_off(ctx: &mut Ctx<'_>, url: &str) -> Result<(), LabError> {
    let ttl = Duration::from_secs(3);
    let key = ctx.key.clone();
    let upstream: SocketAddr = host_ports(url)
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| LabError::new(format!("no host:port in {url}")))?;
    let proxy = FaultProxy::start(upstream)
        .await
        .context("starting the proxy")?;
    // Only host:port changes: credentials, path (database, chroot) and query stay.
    let upstream_text = upstream.to_string();
    if !url.contains(&upstream_text) {
        return Err(LabError::new(format!(
            "cannot route {url} through the proxy: `{upstream_text}` is not spelled in it"
        )));
    }
    let proxied = url.replacen(&upstream_text, &proxy.local_addr().to_string(), 1);
    let holder_locker = ctx.locker(&proxied).await?;
    let rival = ctx.lab.locker(url).await?;
    let (holder, holder_open) = take(ctx, &holder_locker, ttl, true, "holder", |token| {
        format!(
            "holder (through the proxy) granted token {}; {} s lease, watchdog on",
            token,
            ttl.as_secs()
        )
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    let cut = ctx.fault(
        "holder's link cut",
        "link cut: the holder's packets stall, the server hears nothing",
    );
    if let Ok(Some(info)) = rival.inspect(&key).await
        && let Some(left) = info.ttl_left
    {
        ctx.mark_at(
            Instant::now() + left,
            Mark::Server {
                label: "holder's lease runs out on the server".to_owned(),
            },
            "the holder's lease runs out on the server (its TTL as read after the cut)",
        );
    }
    let (guard, rival_open) = race(
        ctx,
        &holder,
        &rival,
        ttl,
        ttl * 3,
        "the server let the lease run out",
    )
    .await?;
    ctx.write(Actor::Rival, guard.token()).await?;
    ctx.stale_write(Actor::Holder, holder.token()).await?;
    proxy.heal();
    ctx.fault_ends(cut, "link healed", "link healed");
    finish(ctx, Some((holder, holder_open)), Some((guard, rival_open))).await;
    Ok(())
}
