//! Holds whose reentrancy is counted in this process, for backends where a session or a
//! connection is the hold (a ZooKeeper node, a `SELECT … FOR UPDATE` transaction): the
//! registry by owner and key, and the count (depth, the acquisitions behind it, the lease).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::time::Instant;
use uuid::Uuid;

use crate::{AcquireRequest, AttemptLedger, Error, Grant, LockKey, OwnerId, Result};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The holds of one backend instance, by owner and key. A grant carries its hold (of type
/// `H`) as [`Grant::state`]; [`LocalHolds::held_of`] accepts it only while it is still the
/// registered hold of that owner and key, so a grant of an ended hold can never act on a
/// newer one.
#[derive(Debug)]
pub struct LocalHolds<H> {
    map: Mutex<HashMap<(OwnerId, LockKey), Arc<H>>>,
}

impl<H> Default for LocalHolds<H> {
    fn default() -> Self {
        LocalHolds {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<H: Send + Sync + 'static> LocalHolds<H> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The registered hold of `owner` on `key`.
    pub fn get(&self, owner: OwnerId, key: &LockKey) -> Option<Arc<H>> {
        lock(&self.map).get(&(owner, key.clone())).cloned()
    }

    /// Registers `hold` as `owner`'s hold on `key`, replacing any earlier one.
    pub fn insert(&self, owner: OwnerId, key: LockKey, hold: Arc<H>) {
        lock(&self.map).insert((owner, key), hold);
    }

    /// Forgets `hold` if it is still the registered one (a newer hold stays).
    pub fn forget(&self, owner: OwnerId, key: &LockKey, hold: &H) {
        let mut map = lock(&self.map);
        let entry = (owner, key.clone());
        if map
            .get(&entry)
            .is_some_and(|h| std::ptr::eq(Arc::as_ptr(h), hold))
        {
            map.remove(&entry);
        }
    }

    /// The hold behind `grant`, if it is the registered hold of its owner and key.
    ///
    /// # Errors
    /// [`Error::NotHeld`] otherwise: the grant came from another backend instance, or its
    /// hold ended (and perhaps a newer one began).
    pub fn held_of(&self, grant: &Grant) -> Result<Arc<H>> {
        let not_held = || Error::NotHeld {
            key: grant.key.clone(),
        };
        let held = grant
            .state
            .clone()
            .and_then(|state| state.downcast::<H>().ok())
            .ok_or_else(not_held)?;
        match lock(&self.map).get(&(grant.owner, grant.key.clone())) {
            Some(current) if Arc::ptr_eq(current, &held) => Ok(held),
            _ => Err(not_held()),
        }
    }

    /// Every registered hold (to end them all when the backend closes).
    pub fn all(&self) -> Vec<Arc<H>> {
        lock(&self.map).values().cloned().collect()
    }

    /// Some registered hold on `key`, whoever owns it.
    pub fn any_on(&self, key: &LockKey) -> Option<Arc<H>> {
        lock(&self.map)
            .iter()
            .find(|((_, k), _)| k == key)
            .map(|(_, h)| h.clone())
    }
}

/// What [`HoldCount::release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountRelease {
    /// A retried release that took effect already: nothing changed.
    Retried {
        /// Holds left.
        remaining: u32,
    },
    /// One hold given back; others are left.
    Partial {
        /// Holds left.
        remaining: u32,
    },
    /// The last hold given back: the backend now lets the lock go.
    Last,
    /// No hold was left to give back.
    Empty,
}

#[derive(Debug)]
struct Count {
    depth: u32,
    attempts: AttemptLedger,
    lease_until: Instant,
}

/// The reentrancy count of one hold: depth, the acquisitions behind it (so a retried
/// acquisition or release takes effect once) and the lease, changed together under one
/// lock.
#[derive(Debug)]
pub struct HoldCount(Mutex<Count>);

impl HoldCount {
    /// The count of a hold `req` was just granted, its lease counted from `granted_at`.
    pub fn new(req: &AcquireRequest, granted_at: Instant) -> Self {
        let mut attempts = AttemptLedger::new();
        attempts.add(req.attempt);
        HoldCount(Mutex::new(Count {
            depth: 1,
            attempts,
            lease_until: crate::options::lease_end(granted_at, req.ttl),
        }))
    }

    /// Adds `req`'s hold (or finds the one its attempt added already), makes the lease at
    /// least `req.ttl` from `start` (never shorter: other guards rely on it) and returns
    /// the depth. `None` when the hold is over: `ended` (the backend knows it lost it), the
    /// last hold was released meanwhile, or the lease ran out before `start`.
    pub fn reenter(&self, req: &AcquireRequest, start: Instant, ended: bool) -> Option<u32> {
        let mut count = lock(&self.0);
        if count.depth == 0 || start >= count.lease_until || ended {
            return None;
        }
        count.lease_until = count
            .lease_until
            .max(crate::options::lease_end(start, req.ttl));
        if !count.attempts.has(req.attempt) {
            count.attempts.add(req.attempt);
            count.depth += 1;
        }
        Some(count.depth)
    }

    /// Gives back the hold `attempt` added (the nil attempt: any one hold).
    pub fn release(&self, attempt: Uuid) -> CountRelease {
        let mut count = lock(&self.0);
        let depth = count.depth;
        if depth == 0 {
            return CountRelease::Empty;
        }
        if !count.attempts.take(attempt, depth) {
            return CountRelease::Retried { remaining: depth };
        }
        count.depth -= 1;
        match count.depth {
            0 => CountRelease::Last,
            remaining => CountRelease::Partial { remaining },
        }
    }

    /// The current depth.
    pub fn depth(&self) -> u32 {
        lock(&self.0).depth
    }

    /// The end of the lease as this process counts it.
    pub fn lease_until(&self) -> Instant {
        lock(&self.0).lease_until
    }

    /// Moves the end of the lease to `until` if that is later (never shortens it).
    pub fn extend_lease(&self, until: Instant) {
        let mut count = lock(&self.0);
        count.lease_until = count.lease_until.max(until);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{FencingToken, LossSignal};

    fn request(ttl: Duration) -> AcquireRequest {
        AcquireRequest::new(
            LockKey::new("local").expect("a valid key"),
            OwnerId::new(Uuid::new_v4(), 1),
            ttl,
            LossSignal::new(),
        )
    }

    #[test]
    fn a_retried_reentry_or_release_takes_effect_once() {
        let now = Instant::now();
        let first = request(Duration::from_secs(10));
        let count = HoldCount::new(&first, now);
        let second = request(Duration::from_secs(10));
        assert_eq!(count.reenter(&second, now, false), Some(2));
        assert_eq!(
            count.reenter(&second, now, false),
            Some(2),
            "retried re-entry"
        );
        assert_eq!(
            count.release(second.attempt),
            CountRelease::Partial { remaining: 1 }
        );
        assert_eq!(
            count.release(second.attempt),
            CountRelease::Retried { remaining: 1 }
        );
        assert_eq!(count.release(first.attempt), CountRelease::Last);
        assert_eq!(count.release(first.attempt), CountRelease::Empty);
        assert_eq!(
            count.reenter(&request(Duration::from_secs(1)), now, false),
            None
        );
    }

    #[test]
    fn a_shorter_reentry_never_shortens_the_lease_and_an_ended_hold_is_not_reentered() {
        let now = Instant::now();
        let count = HoldCount::new(&request(Duration::from_secs(30)), now);
        count.reenter(&request(Duration::from_secs(1)), now, false);
        assert_eq!(count.lease_until(), now + Duration::from_secs(30));
        count.extend_lease(now + Duration::from_secs(5));
        assert_eq!(count.lease_until(), now + Duration::from_secs(30));
        assert_eq!(
            count.reenter(&request(Duration::from_secs(1)), now, true),
            None
        );
        let late = now + Duration::from_secs(30);
        assert_eq!(
            count.reenter(&request(Duration::from_secs(1)), late, false),
            None
        );
        assert_eq!(count.depth(), 2);
    }

    #[test]
    fn a_grant_acts_only_on_the_hold_still_registered() {
        let holds: LocalHolds<u32> = LocalHolds::new();
        let req = request(Duration::from_secs(1));
        let old = Arc::new(1u32);
        holds.insert(req.owner, req.key.clone(), old.clone());
        let grant =
            Grant::new(&req, FencingToken::new(1), 1, Instant::now()).with_state(old.clone());
        assert!(holds.held_of(&grant).is_ok());
        holds.insert(req.owner, req.key.clone(), Arc::new(2u32));
        assert!(matches!(holds.held_of(&grant), Err(Error::NotHeld { .. })));
        holds.forget(req.owner, &req.key, &old);
        assert_eq!(holds.get(req.owner, &req.key).as_deref(), Some(&2));
        assert_eq!(holds.any_on(&req.key).as_deref(), Some(&2));
    }
}
