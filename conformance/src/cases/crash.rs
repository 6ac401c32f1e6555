//! Crashed and frozen holders, in real child processes.

use std::time::Duration;

use tokio::time::Instant;

use super::{assert_busy, generous_wait};
use crate::{
    Check, Harness, Outcome, Space,
    holder::{HolderProcess, HolderSpec},
};

fn needs_processes<H: Harness>(h: &H) -> Option<Outcome> {
    (!h.cross_process())
        .then(|| Outcome::Skipped("the backend does not share locks across processes".into()))
}

/// A SIGKILLed holder frees its key within its lease (plus the backend's slack).
pub async fn killed_holder_frees_key_within_ttl<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_processes(h) {
        return skip;
    }
    let space = Space::new("killed_holder_frees_key_within_ttl");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let mut child = HolderProcess::spawn(&HolderSpec {
        key: key.clone(),
        ttl,
        watchdog: true,
        permits: 0,
    })
    .await;
    let parent = h.client().await;
    assert_busy(&parent, &key, "while the child holds").await;
    child.kill().await;
    let killed = Instant::now();
    let guard = parent
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("acquire after SIGKILL");
    let freed_after = killed.elapsed();
    let bound = ttl + h.expiry_slack() + Duration::from_secs(2);
    assert!(
        freed_after < bound,
        "the key was freed {freed_after:?} after the kill; bound {bound:?}"
    );
    assert!(guard.token() > child.token);
    guard.release().await.check("release");
    Outcome::Passed
}

/// A SIGSTOPped holder loses its key to a rival once its lease runs out, and its guard
/// reports the loss when it resumes.
pub async fn stopped_holder_loses_key_and_reports_lost<H: Harness>(h: &H) -> Outcome {
    if let Some(skip) = needs_processes(h) {
        return skip;
    }
    let space = Space::new("stopped_holder_loses_key_and_reports_lost");
    let key = space.key("k");
    let ttl = h.short_ttl();
    let mut child = HolderProcess::spawn(&HolderSpec {
        key: key.clone(),
        ttl,
        watchdog: true,
        permits: 0,
    })
    .await;
    child.pause().await;
    let parent = h.client().await;
    let rival = parent
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("rival while the holder is frozen");
    assert!(rival.token() > child.token);
    child.resume().await;
    let event = child
        .next_event(ttl * 4 + Duration::from_secs(10))
        .await
        .check("the resumed holder said nothing");
    assert!(
        event.starts_with("LOST"),
        "the resumed holder reported `{event}` instead of LOST"
    );
    rival.release().await.check("release");
    Outcome::Passed
}
