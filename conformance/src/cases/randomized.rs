//! The randomized history test: many owners on a few keys doing random acquisitions (random
//! TTL and wait), re-entries with shorter and longer TTLs, extensions up and down, releases,
//! drops and cancellations mid-acquire, while the links of their clients are delayed and
//! stalled at random. Every hold's believed-valid interval goes into a [`History`](crate::History); the
//! case fails on two owners believing they hold one key at once, on a new holder's token
//! that does not grow, and on a key left held at the end.
//!
//! Seeded: `LOCKKIT_TORTURE_SEED=<n>` replays a run (the seed is printed on failure), and
//! `LOCKKIT_TORTURE_SECS=<n>` sets how long the random phase lasts (default 8 s).

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use lockkit_core::{Error, LockGuard, LockKey, Locker, Owner};
use tokio::time::Instant;

use super::{assert_free, generous_wait};
use crate::{
    Check, Harness, HookError, Outcome, Space,
    history::OpenHold,
    rng::{Rng, env_u64, torture_seed},
};

const CLIENTS: usize = 3;
const OWNERS_PER_CLIENT: usize = 2;
const KEYS: usize = 3;

/// One owner's hold on one key: its guards (one per depth) and its open history record.
struct Held {
    guards: Vec<LockGuard>,
    record: OpenHold,
}

/// What one actor (an explicit owner on one client) does, and what it holds.
struct Actor {
    name: String,
    /// The owner's name in the history: actors sharing an owner hold its key together
    /// (reentrantly), which is one holder.
    holder: String,
    owner: Owner,
    held: HashMap<usize, Held>,
    rng: Rng,
}

struct World {
    keys: Vec<LockKey>,
    ttls: Vec<Duration>,
    short: Duration,
    history: crate::History,
    log: std::sync::Mutex<Vec<String>>,
}

impl World {
    fn note(&self, line: String) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if log.len() >= 400 {
            log.remove(0);
        }
        log.push(line);
    }
}

impl Actor {
    /// Closes the record of a hold that is over (released, dropped or lost).
    fn close(&mut self, world: &World, key: usize, why: &str) {
        if let Some(held) = self.held.remove(&key) {
            if let Some(last) = held.guards.last() {
                world.history.end(held.record, last);
                world.note(format!(
                    "{} {} key{key} token {}",
                    self.name,
                    why,
                    last.token()
                ));
            }
            // Guards of a hold that is over: dropping them releases in the background,
            // owner-checked, or does nothing for a lost hold.
            drop(held.guards);
        }
    }

    /// Forgets holds that are no longer valid: their belief ended at `lost_at`.
    fn sweep(&mut self, world: &World) {
        let lost: Vec<usize> = self
            .held
            .iter()
            .filter(|(_, h)| h.guards.last().is_none_or(|g| !g.is_valid()))
            .map(|(k, _)| *k)
            .collect();
        for key in lost {
            self.close(world, key, "lost");
        }
    }

    async fn step(&mut self, world: &World) {
        self.sweep(world);
        let key = self.rng.below(KEYS as u64) as usize;
        let ttl = self.rng.pick(&world.ttls);
        match (self.held.contains_key(&key), self.rng.below(10)) {
            // Take the key (or re-enter it), possibly giving up mid-way.
            (false, 0..=5) | (true, 0..=1) => {
                let wait = self
                    .rng
                    .pick(&[Duration::ZERO, world.short / 2, world.short * 2]);
                let mut acquire = self.owner.acquire(&world.keys[key]).ttl(ttl).wait(wait);
                if self.rng.below(4) == 0 {
                    acquire = acquire.no_watchdog();
                }
                let cancel_after = (self.rng.below(5) == 0).then(|| self.rng.duration(world.short));
                let outcome = match cancel_after {
                    Some(after) => match tokio::time::timeout(after, acquire).await {
                        Ok(outcome) => outcome,
                        Err(_) => {
                            world.note(format!("{} cancelled acquire key{key}", self.name));
                            return;
                        }
                    },
                    None => acquire.await,
                };
                let observed = Instant::now();
                match outcome {
                    Ok(guard) => {
                        world.note(format!(
                            "{} acquired key{key} ttl {ttl:?} depth {} token {}",
                            self.name,
                            guard.depth(),
                            guard.token()
                        ));
                        let same_hold = self
                            .held
                            .get(&key)
                            .and_then(|held| held.guards.last())
                            .is_some_and(|g| g.token() == guard.token() && g.is_valid());
                        if !same_hold {
                            // A new hold (the old one, if any, was lost meanwhile).
                            self.close(world, key, "lost before a new hold");
                        }
                        match self.held.get_mut(&key) {
                            Some(held) => held.guards.push(guard),
                            None => {
                                let record =
                                    world
                                        .history
                                        .begin_at(self.holder.clone(), &guard, observed);
                                self.held.insert(
                                    key,
                                    Held {
                                        guards: vec![guard],
                                        record,
                                    },
                                );
                            }
                        }
                    }
                    Err(Error::Timeout { .. }) => {}
                    Err(Error::Lost { .. }) => self.close(world, key, "lost on re-entry"),
                    // Injected faults make backend errors expected (a session that expired
                    // during a stall, a connection reset); contract errors are not.
                    Err(e @ Error::Backend { .. }) => {
                        world.note(format!("{} acquire key{key}: {e}", self.name));
                    }
                    Err(e) => panic!("{} acquire key{key}: unexpected error: {e}", self.name),
                }
            }
            (true, 2..=3) => {
                let Some(held) = self.held.get(&key) else {
                    return;
                };
                let i = self.rng.below(held.guards.len() as u64) as usize;
                match held.guards[i].extend(ttl).await {
                    Ok(()) => world.note(format!("{} extended key{key} to {ttl:?}", self.name)),
                    Err(Error::Lost { .. }) => self.close(world, key, "lost on extend"),
                    Err(Error::Backend { .. }) => {}
                    Err(e) => panic!("{} extend key{key}: unexpected error: {e}", self.name),
                }
            }
            (true, 4..=7) => {
                let Some(held) = self.held.get_mut(&key) else {
                    return;
                };
                let i = self.rng.below(held.guards.len() as u64) as usize;
                if held.guards.len() == 1 {
                    // The last guard: the belief ends before the release is sent.
                    let dropping = self.rng.below(3) == 0;
                    let Some(held) = self.held.remove(&key) else {
                        return;
                    };
                    let mut guards = held.guards;
                    let Some(guard) = guards.pop() else { return };
                    world.history.end(held.record, &guard);
                    world.note(format!(
                        "{} {} key{key} token {}",
                        self.name,
                        if dropping { "dropped" } else { "released" },
                        guard.token()
                    ));
                    if dropping {
                        drop(guard);
                    } else {
                        let _ = guard.release().await;
                    }
                } else {
                    let guard = held.guards.remove(i);
                    let _ = guard.release().await;
                }
            }
            _ => tokio::time::sleep(self.rng.duration(world.short / 2)).await,
        }
    }

    async fn finish(mut self, world: &World) {
        self.sweep(world);
        let keys: Vec<usize> = self.held.keys().copied().collect();
        for key in keys {
            if let Some(mut held) = self.held.remove(&key) {
                let Some(last) = held.guards.pop() else {
                    continue;
                };
                world.history.end(held.record, &last);
                for guard in held.guards {
                    let _ = guard.release().await;
                }
                let _ = last.release().await;
            }
        }
    }
}

/// Stalls and delays one client's links at random until `stop`, then heals them.
async fn chaos<H: Harness>(
    h: &H,
    client: &Locker,
    mut rng: Rng,
    short: Duration,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(rng.duration(short * 2)).await;
        let fault = rng.below(3);
        let length = rng.duration(short / 2);
        let applied = match fault {
            0 => h.delay_link(client, rng.duration(short / 8)).await,
            1 => h.cut_link(client, true).await,
            _ => Ok(()),
        };
        if matches!(applied, Err(HookError::Unsupported(_))) {
            return;
        }
        tokio::time::sleep(length).await;
        let _ = h.delay_link(client, Duration::ZERO).await;
        let _ = h.cut_link(client, false).await;
    }
}

/// Random operations by several owners on a few keys, with delayed and stalled links:
/// no two owners ever believe they hold one key at once, tokens grow for every new holder,
/// and nothing stays held at the end.
pub async fn histories_stay_linear<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("histories_stay_linear");
    let seed = torture_seed();
    let budget = Duration::from_secs(env_u64("LOCKKIT_TORTURE_SECS").unwrap_or(8));
    let short = h.short_ttl();
    let world = Arc::new(World {
        keys: (0..KEYS).map(|i| space.key(&format!("k{i}"))).collect(),
        ttls: vec![short, short * 2, short * 4],
        short,
        history: crate::History::new(),
        log: std::sync::Mutex::new(Vec::new()),
    });
    let mut rng = Rng(seed);
    let mut clients = Vec::new();
    let mut actors = Vec::new();
    for c in 0..CLIENTS {
        // Every other client lets its waiters of a key reach the server at once rather than
        // one at a time, so that the first owner's two actors race there too.
        let client = h.client().await;
        let client = if c % 2 == 1 {
            client.without_waiter_gates()
        } else {
            client
        };
        for o in 0..OWNERS_PER_CLIENT {
            // The first owner of each client is two concurrent actors: concurrent
            // acquisitions, re-entries and releases of one owner on one key.
            let owner = client.owner();
            let actors_of_owner = if o == 0 { 2 } else { 1 };
            for a in 0..actors_of_owner {
                actors.push(Actor {
                    name: format!("c{c}o{o}{}", ["", "b"][a]),
                    holder: format!("c{c}o{o}"),
                    owner: owner.clone(),
                    held: HashMap::new(),
                    rng: Rng(rng.next_u64()),
                });
            }
        }
        clients.push(client);
    }
    let deadline = Instant::now() + budget;
    let stop = Arc::new(AtomicBool::new(false));
    let run = async {
        let chaos_runs = clients
            .iter()
            .map(|client| chaos(h, client, Rng(rng.next_u64()), short, &stop));
        let actor_runs = actors.into_iter().map(|mut actor| {
            let world = world.clone();
            async move {
                while Instant::now() < deadline {
                    actor.step(&world).await;
                }
                actor
            }
        });
        let (_, actors) = tokio::join!(futures_join_all(chaos_runs.collect()), async {
            let actors = futures_join_all(actor_runs.collect()).await;
            stop.store(true, Ordering::Relaxed);
            actors
        });
        for actor in actors {
            actor.finish(&world).await;
        }
    };
    let limit = budget + generous_wait(h) * 4;
    let finished = tokio::time::timeout(limit, run).await.is_ok();
    let failure = |what: String| -> ! {
        let log = world
            .log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n  ");
        panic!(
            "randomized history on {} failed (replay with LOCKKIT_TORTURE_SEED={seed}): {what}\n\
             last operations:\n  {log}",
            h.name()
        )
    };
    if !finished {
        failure(format!("the run did not finish within {limit:?}"));
    }
    let violations = world.history.violations();
    if !violations.is_empty() {
        failure(
            violations
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        );
    }
    // Nothing stays held: every key is free once the background releases have run, well
    // before any lease could have run out on its own.
    let probe = h.client().await;
    for key in &world.keys {
        let mut free = false;
        let until = Instant::now() + short * 8 + h.expiry_slack();
        while Instant::now() < until {
            if let Some(guard) = probe.try_acquire(key).await.check("probe") {
                guard.release().await.check("release probe");
                free = true;
                break;
            }
            tokio::time::sleep(short / 10).await;
        }
        if !free {
            let holder = probe.inspect(key).await;
            failure(format!(
                "`{key}` was still held after every owner let go, by {holder:?}"
            ));
        }
        assert_free(&probe, key, "after the run").await;
    }
    let holds = world.history.records().len();
    eprintln!(
        "lockkit-conformance: histories_stay_linear on {}: seed {seed}, {holds} holds in {budget:?}, no violation",
        h.name()
    );
    Outcome::Passed
}

/// Runs futures concurrently and collects their outputs in order.
async fn futures_join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, fut) in pinned.iter_mut().enumerate() {
            if outputs[i].is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => outputs[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}
