//! One waiting acquisition per key at a time from one client, for backends whose release
//! wakes every waiter at once (pub/sub, `NOTIFY`, polling): the others of the client queue
//! here, in arrival order, and reach the server one by one. Without it, 16 tasks of one
//! client waiting on a key ran 16 acquisitions on the server at every release, for one
//! grant (Redis: 14 scripts per hold where 2 do).
//!
//! A gate is held from the moment a waiting acquisition starts to its outcome (a grant, an
//! error, its deadline), never while the lock is held. A waiter waits for the gate at most
//! [`GATE_PATIENCE`] and then goes to the server anyway, so an acquisition kept unpolled
//! (its future stored but no longer driven) holds the others up by that much at most.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    sync::{Mutex as AsyncMutex, OwnedMutexGuard},
    time::Instant,
};

use crate::LockKey;

/// How long a waiter waits for its key's gate before it goes to the server beside the
/// gate's holder. Long beside a handoff (well under a millisecond to a few), short beside a
/// wait a caller could notice.
pub(crate) const GATE_PATIENCE: Duration = Duration::from_secs(1);

/// The gates of one client, by key; a key's entry goes with its last user.
#[derive(Debug, Default)]
pub(crate) struct WaiterGates {
    gates: Mutex<HashMap<LockKey, Arc<AsyncMutex<()>>>>,
}

/// How waiting for a gate ended.
pub(crate) enum Entry {
    /// Through the gate: the only waiting acquisition of this client on the key (among
    /// those that wait for gates) until the pass is dropped.
    Passed(GatePass),
    /// The patience ran out first: go on without the gate.
    Impatient,
    /// `deadline` came first.
    DeadlinePassed,
}

/// The right to wait on the server for a key; dropped with the acquisition's outcome.
pub(crate) struct GatePass {
    gates: Arc<WaiterGates>,
    key: LockKey,
    gate: Option<Arc<AsyncMutex<()>>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl WaiterGates {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, Arc<AsyncMutex<()>>>> {
        self.gates.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the gate of `key`, until `deadline` or [`GATE_PATIENCE`], whichever
    /// comes first. Dropping the future meanwhile leaves the gate to the next waiter.
    pub(crate) async fn enter(self: &Arc<Self>, key: &LockKey, deadline: Instant) -> Entry {
        let gate = self.map().entry(key.clone()).or_default().clone();
        let free = gate.clone().try_lock_owned().ok();
        let mut pass = GatePass {
            gates: self.clone(),
            key: key.clone(),
            gate: Some(gate),
            guard: free,
        };
        if pass.guard.is_some() {
            return Entry::Passed(pass);
        }
        let Some(gate) = pass.gate.clone() else {
            return Entry::Impatient;
        };
        let patience = Instant::now() + GATE_PATIENCE;
        // Bound to a name, so that the waiting future (and its reference to the gate) is
        // gone before `pass` is dropped below: the entry is then forgotten if unused.
        let locked = tokio::time::timeout_at(deadline.min(patience), gate.lock_owned()).await;
        match locked {
            Ok(guard) => {
                pass.guard = Some(guard);
                Entry::Passed(pass)
            }
            Err(_) if deadline <= patience => Entry::DeadlinePassed,
            Err(_) => Entry::Impatient,
        }
    }

    /// Keys with a gate in use (for tests: entries must not outlive their users).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

impl Drop for GatePass {
    fn drop(&mut self) {
        // The next waiter may take the gate from here on.
        drop(self.guard.take());
        let Some(gate) = self.gate.take() else {
            return;
        };
        let mut map = self.gates.map();
        // The map's reference and ours: nobody else waits for or holds this gate, and
        // none can start to, since taking a reference needs the map's lock.
        if Arc::strong_count(&gate) == 2
            && map.get(&self.key).is_some_and(|g| Arc::ptr_eq(g, &gate))
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> LockKey {
        LockKey::new("k").unwrap()
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[tokio::test(start_paused = true)]
    async fn one_waiter_at_a_time_in_arrival_order() {
        let gates = Arc::new(WaiterGates::default());
        let Entry::Passed(first) = gates.enter(&key(), far()).await else {
            panic!("a free gate was refused");
        };
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for i in 0..3 {
            let (gates, order) = (gates.clone(), order.clone());
            waiting.push(tokio::spawn(async move {
                let Entry::Passed(pass) = gates.enter(&key(), far()).await else {
                    panic!("waiter {i} did not get through");
                };
                order.lock().unwrap().push(i);
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(pass);
            }));
            // Each one queued before the next arrives.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(order.lock().unwrap().is_empty(), "passed a held gate");
        drop(first);
        for task in waiting {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(gates.len(), 0, "the key's entry outlived its users");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gives_up_on_the_gate_at_its_patience_or_its_deadline() {
        let gates = Arc::new(WaiterGates::default());
        let Entry::Passed(held) = gates.enter(&key(), far()).await else {
            panic!("a free gate was refused");
        };
        let started = Instant::now();
        assert!(matches!(gates.enter(&key(), far()).await, Entry::Impatient));
        assert_eq!(started.elapsed(), GATE_PATIENCE);
        let started = Instant::now();
        let soon = started + Duration::from_millis(50);
        assert!(matches!(
            gates.enter(&key(), soon).await,
            Entry::DeadlinePassed
        ));
        assert_eq!(started.elapsed(), Duration::from_millis(50));
        // Other keys have gates of their own.
        let other = LockKey::new("other").unwrap();
        assert!(matches!(gates.enter(&other, far()).await, Entry::Passed(_)));
        assert_eq!(gates.len(), 1);
        drop(held);
        assert_eq!(gates.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_leaves_the_gate_to_the_next() {
        let gates = Arc::new(WaiterGates::default());
        let Entry::Passed(held) = gates.enter(&key(), far()).await else {
            panic!("a free gate was refused");
        };
        let dropped = tokio::spawn({
            let gates = gates.clone();
            async move { gates.enter(&key(), far()).await.is_passed() }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        dropped.abort();
        let next = tokio::spawn({
            let gates = gates.clone();
            async move { gates.enter(&key(), far()).await.is_passed() }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(held);
        assert!(next.await.unwrap(), "the gate went to the dropped waiter");
        assert_eq!(gates.len(), 0);
    }

    impl Entry {
        fn is_passed(&self) -> bool {
            matches!(self, Entry::Passed(_))
        }
    }
}
