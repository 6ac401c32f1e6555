//! This client's holds, by owner, key and what is held: an owner's plain lock, read and
//! write holds of one key are separate holds (a downgrade is a read beside the owner's
//! write), and every permit is a hold of its own, found again only by the attempt that
//! took it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use lockkit_core::{
    Error, LockKey, LockKind, OwnerId, Result,
    spi::{Grant, LocalHolds},
};

use super::Held;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a hold is, among an owner's holds of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Slot {
    /// The plain lock (and any kind this crate does not know).
    Lock,
    Read,
    Write,
    /// A permit, by the attempt that took it (permits are never reentrant).
    Permit(u128),
}

impl Slot {
    /// The slot of a hold of `kind` taken by the attempt whose id is `attempt` (as 128
    /// bits).
    pub(crate) fn of(kind: LockKind, attempt: u128) -> Slot {
        match kind {
            LockKind::Read => Slot::Read,
            LockKind::Write => Slot::Write,
            LockKind::Permit { .. } => Slot::Permit(attempt),
            _ => Slot::Lock,
        }
    }
}

/// The live holds of one backend instance: [`LocalHolds`] for an owner's plain lock, read
/// and write, and the permits by attempt. A grant carries its hold as [`Grant::state`];
/// [`Holds::held_of`] accepts it only while it is still the registered hold of its owner,
/// key and slot, so a grant of an ended hold never acts on a newer one.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    plain: LocalHolds<Held>,
    reads: LocalHolds<Held>,
    writes: LocalHolds<Held>,
    permits: Mutex<HashMap<u128, Arc<Held>>>,
}

impl Holds {
    /// The registry of a slot's holds; `None` for permits (kept by attempt).
    fn registry(&self, slot: Slot) -> Option<&LocalHolds<Held>> {
        match slot {
            Slot::Lock => Some(&self.plain),
            Slot::Read => Some(&self.reads),
            Slot::Write => Some(&self.writes),
            Slot::Permit(_) => None,
        }
    }

    /// The registered hold of `owner` on `key` in `slot`.
    pub(crate) fn get(&self, owner: OwnerId, key: &LockKey, slot: Slot) -> Option<Arc<Held>> {
        match (self.registry(slot), slot) {
            (Some(registry), _) => registry.get(owner, key),
            (None, Slot::Permit(attempt)) => lock(&self.permits)
                .get(&attempt)
                .filter(|h| h.owner == owner && h.key == *key)
                .cloned(),
            (None, _) => None,
        }
    }

    /// Registers `hold`, replacing any earlier hold of its owner, key and slot.
    pub(crate) fn insert(&self, owner: OwnerId, key: LockKey, slot: Slot, hold: Arc<Held>) {
        match (self.registry(slot), slot) {
            (Some(registry), _) => registry.insert(owner, key, hold),
            (None, Slot::Permit(attempt)) => {
                lock(&self.permits).insert(attempt, hold);
            }
            (None, _) => {}
        }
    }

    /// Forgets `hold` if it is still the registered one (a newer hold stays).
    pub(crate) fn forget(&self, owner: OwnerId, key: &LockKey, slot: Slot, hold: &Held) {
        match (self.registry(slot), slot) {
            (Some(registry), _) => registry.forget(owner, key, hold),
            (None, Slot::Permit(attempt)) => {
                let mut permits = lock(&self.permits);
                if permits
                    .get(&attempt)
                    .is_some_and(|h| std::ptr::eq(Arc::as_ptr(h), hold))
                {
                    permits.remove(&attempt);
                }
            }
            (None, _) => {}
        }
    }

    /// The hold behind `grant`, if it is still the registered hold of its owner, key and
    /// slot.
    ///
    /// # Errors
    /// [`Error::NotHeld`] otherwise: the grant came from another backend instance, or its
    /// hold ended (and perhaps a newer one began).
    pub(crate) fn held_of(&self, grant: &Grant) -> Result<Arc<Held>> {
        let slot = Slot::of(grant.kind, grant.attempt.as_u128());
        if let Some(registry) = self.registry(slot) {
            return registry.held_of(grant);
        }
        let held = grant
            .state
            .clone()
            .and_then(|state| state.downcast::<Held>().ok())
            .filter(|held| held.key == grant.key && held.owner == grant.owner);
        let current = self.get(grant.owner, &grant.key, slot);
        match (held, current) {
            (Some(held), Some(current)) if Arc::ptr_eq(&held, &current) => Ok(held),
            _ => Err(Error::NotHeld {
                key: grant.key.clone(),
            }),
        }
    }
}

/// What a write hold knows of its owner's downgraded reads (unused for other kinds).
#[derive(Debug, Default)]
pub(crate) struct WriteState {
    /// The owner let the write go.
    released: bool,
    /// Downgraded reads taken or being taken that are not over.
    reads: u32,
}

impl WriteState {
    /// The owner lets the write go: true when a downgraded read still relies on it (the
    /// write key then stays, marked, until the last such read is over).
    pub(crate) fn let_go(state: &Mutex<WriteState>) -> bool {
        let mut state = lock(state);
        state.released = true;
        state.reads > 0
    }
}

/// A read an owner takes while it writes the key (a downgrade), and the write it relies
/// on: etcd cannot give the read key the write key's place in the queue, so the write key
/// stays while the read lasts (marked [`crate::path::DOWNGRADED`] once the write is let
/// go, so that other readers may join) and goes when the read is over.
#[derive(Debug)]
pub(crate) struct Downgrade {
    /// The owner's write hold.
    pub(crate) write: Arc<Held>,
    over: std::sync::atomic::AtomicBool,
}

impl Downgrade {
    /// A downgrade of `write`, unless its owner let it go already.
    pub(crate) fn take(write: Arc<Held>) -> Option<Downgrade> {
        {
            let mut state = lock(&write.readers);
            if state.released {
                return None;
            }
            state.reads += 1;
        }
        Some(Downgrade {
            write,
            over: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The read is over (released, lost, or never granted); once only. True when the
    /// write was let go and no other downgraded read relies on it: its key must go now.
    pub(crate) fn end(&self) -> bool {
        if self.over.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return false;
        }
        let mut state = lock(&self.write.readers);
        state.reads = state.reads.saturating_sub(1);
        state.reads == 0 && state.released
    }
}

impl Drop for Downgrade {
    /// A read that never got its hold (given up, cancelled) relies on the write no more.
    fn drop(&mut self) {
        if self.end() {
            self.write.lease.releasing();
            self.write.lease.end();
        }
    }
}
