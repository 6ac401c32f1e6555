//! Fencing tokens.

use std::time::Duration;

use lockkit_core::FencingToken;

use super::{LONG_TTL, generous_wait};
use crate::{
    Check, FencedStore, Harness, History, Outcome, Space, UnfencedStore,
    holder::{HolderProcess, HolderSpec},
};

/// Successive holders get strictly growing tokens.
pub async fn tokens_strictly_increase<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("tokens_strictly_increase");
    let key = space.key("k");
    let clients = [h.client().await, h.client().await];
    let mut last: Option<FencingToken> = None;
    for round in 0..10 {
        let guard = clients[round % 2]
            .try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("acquire")
            .check("free key");
        if let Some(previous) = last {
            assert!(
                guard.token() > previous,
                "round {round}: {} after {previous}",
                guard.token()
            );
        }
        last = Some(guard.token());
        guard.release().await.check("release");
    }
    Outcome::Passed
}

/// Under concurrency, grant order and token order agree and holds never overlap.
pub async fn tokens_increase_under_concurrency<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("tokens_increase_under_concurrency");
    let key = space.key("k");
    let history = History::new();
    let mut tasks = Vec::new();
    for c in 0..4 {
        let client = h.client().await;
        let (key, history) = (key.clone(), history.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let guard = client
                    .acquire(&key)
                    .ttl(LONG_TTL)
                    .wait(Duration::from_secs(60))
                    .await
                    .check("acquire");
                let open = history.begin(format!("client {c}"), &guard);
                tokio::task::yield_now().await;
                history.end(open, &guard);
                guard.release().await.check("release");
            }
        }));
    }
    for task in tasks {
        task.await.check("worker");
    }
    assert_eq!(history.records().len(), 80);
    history.assert_linear();
    Outcome::Passed
}

/// A holder that stalls past its lease (here: it stops renewing, as a paused process
/// would) writes after a rival took over: the fenced store refuses the stale write, while
/// the unfenced control accepts it and ends corrupted.
pub async fn paused_holder_fenced_write_is_rejected<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("paused_holder_fenced_write_is_rejected");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    let (fenced, unfenced) = (FencedStore::new(), UnfencedStore::new());
    let paused = a
        .try_acquire(&key)
        .ttl(h.short_ttl())
        .no_watchdog()
        .await
        .check("acquire")
        .check("free key");
    fenced
        .write(paused.token(), "paused: before the pause")
        .check("first write");
    unfenced.write("paused: before the pause");
    let rival = b
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("rival after the lease ran out");
    fenced.write(rival.token(), "rival").check("rival's write");
    unfenced.write("rival");
    // The paused holder wakes up and writes, unaware.
    let stale = fenced.write(paused.token(), "paused: stale");
    assert!(stale.is_err(), "the fenced store accepted a stale write");
    unfenced.write("paused: stale");
    assert_eq!(fenced.values().last().map(String::as_str), Some("rival"));
    assert_eq!(
        unfenced.values().last().map(String::as_str),
        Some("paused: stale"),
        "the unfenced control should show the corruption fencing prevents"
    );
    assert!(
        !paused.is_valid(),
        "the paused holder's guard must report the loss"
    );
    rival.release().await.check("release");
    Outcome::Passed
}

/// Tokens keep growing after a holder crashed without releasing.
pub async fn tokens_grow_after_holder_crash<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("tokens_grow_after_holder_crash");
    let key = space.key("k");
    let crashed_token = if h.cross_process() {
        let mut child = HolderProcess::spawn(&HolderSpec {
            key: key.clone(),
            ttl: h.short_ttl(),
            watchdog: true,
            permits: 0,
        })
        .await;
        child.kill().await;
        child.token
    } else {
        // In one process, a crash is a holder that vanishes without releasing or renewing.
        let client = h.client().await;
        let guard = client
            .try_acquire(&key)
            .ttl(h.short_ttl())
            .no_watchdog()
            .await
            .check("acquire")
            .check("free key");
        let token = guard.token();
        std::mem::forget(guard);
        token
    };
    let after = h
        .client()
        .await
        .acquire(&key)
        .wait(generous_wait(h))
        .await
        .check("acquire after the crash");
    assert!(
        after.token() > crashed_token,
        "{} is not above the crashed holder's {crashed_token}",
        after.token()
    );
    after.release().await.check("release");
    Outcome::Passed
}
