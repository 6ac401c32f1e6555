//! Mixed fleets: lockkit clients beside other clients (kazoo, redis-py, rslock, etcdctl)
//! on the same keys, each holder recording its critical sections in a shared [`Ledger`].

use std::time::Duration;

use lockkit_core::Locker;
use tokio::time::Instant;

use crate::{Ledger, Rng};

/// Far longer than any wait of a fleet needs: every hold lasts [`HOLD_AT_MOST`] at most.
pub const FLEET_WAIT: Duration = Duration::from_secs(30);

/// The longest hold of a fleet's holder.
pub const HOLD_AT_MOST: Duration = Duration::from_millis(30);

/// One lockkit task of a fleet, named `who` (`lockkit-<n>`), until `until`: picks one of
/// `keys` (the ledger names them by index), then tries it, waits for it, or starts a wait
/// and drops it after up to 40 ms (which must leave nothing held), holds what it got for up
/// to [`HOLD_AT_MOST`] and releases it. Answers its holds.
///
/// # Panics
/// When a wait of [`FLEET_WAIT`] is not granted, an operation fails, or the ledger cannot
/// be written: each a failure of the fleet's test.
pub async fn lockkit_holder(
    locker: Locker,
    keys: Vec<String>,
    ledger: std::sync::Arc<Ledger>,
    who: String,
    seed: u64,
    until: Instant,
) -> usize {
    let mut rng = Rng(seed);
    let mut holds = 0;
    while Instant::now() < until {
        let index = rng.below(keys.len() as u64) as usize;
        let key = keys[index].as_str();
        let guard = match rng.below(10) {
            0 => match locker.acquire(key).try_now().await {
                Ok(Some(guard)) => guard,
                Ok(None) => continue,
                Err(error) => panic!("{who}: a try failed: {error}"),
            },
            1 | 2 => {
                let cut = Duration::from_millis(rng.below(40));
                match tokio::time::timeout(cut, locker.acquire(key).wait(FLEET_WAIT)).await {
                    Ok(Ok(guard)) => guard,
                    Ok(Err(error)) => panic!("{who}: a wait failed: {error}"),
                    Err(_) => continue,
                }
            }
            _ => match locker.acquire(key).wait(FLEET_WAIT).await {
                Ok(guard) => guard,
                Err(error) => panic!("{who}: not granted within {FLEET_WAIT:?}: {error}"),
            },
        };
        let index = index.to_string();
        if let Err(error) = ledger.enter(&index, &who) {
            panic!("{who}: the ledger: {error}");
        }
        tokio::time::sleep(rng.duration(HOLD_AT_MOST)).await;
        if let Err(error) = ledger.exit(&index, &who) {
            panic!("{who}: the ledger: {error}");
        }
        if let Err(error) = guard.release().await {
            panic!("{who}: a release failed: {error}");
        }
        holds += 1;
    }
    holds
}

/// A holder of another client in a fleet, recording its holds in the fleet's ledger.
#[derive(Debug)]
pub enum Peer {
    /// A process (kazoo, redis-py, an `etcdctl` loop) that prints what it did and exits
    /// with success.
    Process(std::process::Child),
    /// A task of this process (rslock) that answers its holds.
    Task(tokio::task::JoinHandle<usize>),
}

/// One run of a mixed fleet: its keys, its ledger, its seed and when it stops.
#[derive(Debug)]
pub struct Fleet {
    /// The keys contended for (the ledger names them by index): `mixed-<seed>-<n>`.
    pub keys: Vec<String>,
    /// Where every holder records its critical sections.
    pub ledger: std::sync::Arc<Ledger>,
    /// The run's seed ([`crate::torture_seed`]), printed when the fleet is made.
    pub seed: u64,
    /// When the holders stop taking keys.
    pub until: Instant,
}

impl Fleet {
    /// A fleet on `keys` keys, for `run` seconds from now, named `name` in what it prints.
    ///
    /// # Panics
    /// When the ledger cannot be made.
    pub fn new(name: &str, keys: usize, run: Duration) -> Fleet {
        let seed = crate::torture_seed();
        eprintln!("{name}: LOCKKIT_TORTURE_SEED={seed}");
        let ledger = Ledger::new().unwrap_or_else(|error| panic!("a ledger: {error}"));
        Fleet {
            keys: (0..keys).map(|n| format!("mixed-{seed:x}-{n}")).collect(),
            ledger: std::sync::Arc::new(ledger),
            seed,
            until: Instant::now() + run,
        }
    }

    /// Runs `tasks_per_locker` [`lockkit_holder`] tasks (named `lockkit-<client>.<task>`)
    /// on each of `lockers` until the fleet stops, then waits for `peers`, holders of other
    /// clients that record their holds in the same ledger; then reads the ledger back. Answers its summary, after checking
    /// that it names every lockkit hold and that lockkit and `peer_kind` (the name before
    /// the `-` of the peers' records) both held.
    ///
    /// # Panics
    /// On two holders of one key at once (the ledger's line), a lockkit task that failed, a
    /// peer that failed (with what it printed), or a kind of client that never held.
    pub async fn run_beside_peers(
        &self,
        lockers: &[Locker],
        tasks_per_locker: usize,
        peers: Vec<Peer>,
        peer_kind: &str,
    ) -> crate::LedgerSummary {
        let mut rng = Rng(self.seed);
        let mut tasks = Vec::new();
        for (client, locker) in lockers.iter().enumerate() {
            for task in 0..tasks_per_locker {
                tasks.push(tokio::spawn(lockkit_holder(
                    locker.clone(),
                    self.keys.clone(),
                    self.ledger.clone(),
                    format!("lockkit-{client}.{task}"),
                    rng.next_u64(),
                    self.until,
                )));
            }
        }
        let mut lockkit_holds = 0;
        for task in tasks {
            match task.await {
                Ok(holds) => lockkit_holds += holds,
                Err(error) => panic!("a lockkit task failed (its message is above): {error}"),
            }
        }
        let mut said = Vec::new();
        for peer in peers {
            said.push(match peer {
                Peer::Task(task) => match task.await {
                    Ok(holds) => holds.to_string(),
                    Err(error) => panic!("a peer task failed (its message is above): {error}"),
                },
                Peer::Process(child) => {
                    tokio::task::spawn_blocking(move || match child.wait_with_output() {
                        Ok(out) => {
                            let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                            assert!(out.status.success(), "a peer failed: {said}");
                            said
                        }
                        Err(error) => panic!("a peer could not be waited for: {error}"),
                    })
                    .await
                    .unwrap_or_else(|error| panic!("waiting for a peer: {error}"))
                }
            });
        }
        let summary = self
            .ledger
            .check()
            .unwrap_or_else(|violation| panic!("{violation}"));
        eprintln!(
            "lockkit holds {lockkit_holds}, peers said {said:?}; ledger: {:?}",
            summary.holds
        );
        assert_eq!(summary.of("lockkit"), lockkit_holds);
        // Each peer says how often it held (the last line a process prints): every one of
        // those holds must be in the ledger, or some went unchecked.
        let peers_held: usize = said
            .iter()
            .map(|said| {
                said.lines()
                    .last()
                    .and_then(|last| last.trim().parse::<usize>().ok())
                    .unwrap_or_else(|| panic!("a peer did not say how often it held: {said:?}"))
            })
            .sum();
        let recorded: usize = summary.holds.values().sum::<usize>() - lockkit_holds;
        assert_eq!(
            peers_held, recorded,
            "the peers said they held {peers_held} times, the ledger shows {recorded}: {:?}",
            summary.holds
        );
        assert!(
            summary.of("lockkit") > 0 && summary.of(peer_kind) > 0,
            "both lockkit and {peer_kind} must have held: {:?}",
            summary.holds
        );
        summary
    }

    /// Asserts that `locker` (a fresh client) takes each key at once: nothing is left held
    /// after the fleet stopped.
    ///
    /// # Panics
    /// When a key is held, or a try or release fails.
    pub async fn assert_all_free(&self, locker: &Locker) {
        for key in &self.keys {
            match locker.acquire(key.as_str()).try_now().await {
                Ok(Some(guard)) => {
                    if let Err(error) = guard.release().await {
                        panic!("releasing {key} after the fleet: {error}");
                    }
                }
                Ok(None) => panic!("{key} is still held after the fleet stopped"),
                Err(error) => panic!("trying {key} after the fleet: {error}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that says it held more often than the ledger shows held without writing
    /// some of its critical sections down: those could have overlapped anyone's unseen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[should_panic(expected = "the peers said they held")]
    async fn a_peer_that_held_without_recording_fails_the_fleet() {
        let fleet = Fleet::new("review 52", 1, Duration::from_millis(200));
        let locker = Locker::new(lockkit_core::MemoryBackend::new());
        let ledger = fleet.ledger.clone();
        let peer = Peer::Task(tokio::spawn(async move {
            // One hold written down, two more not.
            ledger.enter("0", "other-1").unwrap();
            ledger.exit("0", "other-1").unwrap();
            3
        }));
        fleet
            .run_beside_peers(&[locker], 1, vec![peer], "other")
            .await;
    }
}
