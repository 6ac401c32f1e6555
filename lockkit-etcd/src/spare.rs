//! One etcd lease granted ahead of need, so that an acquisition does not wait for a lease
//! grant (a Raft write of its own) before it creates its contender key.
//!
//! A contender takes the spare if it was granted less than one keep-alive interval ago
//! (a sixth of its TTL: its first keep-alive is due then, as a lease granted for the
//! contender would have its first one a sixth of the TTL after its grant), and the backend
//! grants the next spare in the background, beside the contender's own requests (etcd
//! batches concurrent proposals into one Raft round). A spare found older than that is
//! revoked in the background and the contender is granted a lease as before. A spare never
//! taken (a client that stopped acquiring) carries no key and expires on the cluster by
//! itself, within its TTL.
//!
//! Nothing changes for the hold: the lease is new, carries only its contender's key, and its
//! life on the cluster is counted from when its grant was sent, as for a lease granted on
//! the spot (`Lease::keep` is given that instant).

use std::{sync::Mutex, time::Duration};

use tokio::time::Instant;

/// A lease granted ahead of need: its id, the TTL the cluster granted (seconds), and when
/// its grant was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SpareLease {
    pub(crate) id: i64,
    pub(crate) ttl: i64,
    pub(crate) sent: Instant,
}

impl SpareLease {
    /// Whether the lease may still serve a contender at `now`: granted less than one
    /// keep-alive interval of its TTL ago.
    fn fresh_at(&self, now: Instant) -> bool {
        let ttl = Duration::from_secs(u64::try_from(self.ttl).unwrap_or(0));
        now < self.sent + crate::lease::keep_alive_every(ttl)
    }
}

#[derive(Default)]
struct Slot {
    lease: Option<SpareLease>,
    refilling: bool,
}

/// The spare lease of one backend, and whether its next grant is under way.
#[derive(Default)]
pub(crate) struct Spare {
    slot: Mutex<Slot>,
}

/// What [`Spare::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Taken {
    /// A fresh spare lease, for the contender.
    pub(crate) lease: Option<SpareLease>,
    /// A spare too old to serve (to revoke), if there was one.
    pub(crate) stale: Option<SpareLease>,
    /// Whether the caller should grant the next spare (no grant of one is under way).
    pub(crate) refill: bool,
}

impl Spare {
    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the spare lease for a contender if it is fresh at `now`; a stale one comes
    /// back in [`Taken::stale`]. Marks a refill as under way when none was and the slot is
    /// now empty (the caller must then call [`Spare::refilled`], whatever the grant gives).
    pub(crate) fn take(&self, now: Instant) -> Taken {
        let mut slot = self.slot();
        let (lease, stale) = match slot.lease.take() {
            Some(lease) if lease.fresh_at(now) => (Some(lease), None),
            stale => (None, stale),
        };
        let refill = !slot.refilling;
        slot.refilling = true;
        Taken {
            lease,
            stale,
            refill,
        }
    }

    /// Ends a refill: keeps `lease` as the spare if the slot is empty, or gives it back
    /// (to revoke) if it is not.
    pub(crate) fn refilled(&self, lease: Option<SpareLease>) -> Option<SpareLease> {
        let mut slot = self.slot();
        slot.refilling = false;
        match lease {
            Some(lease) if slot.lease.is_none() => {
                slot.lease = Some(lease);
                None
            }
            surplus => surplus,
        }
    }

    /// Offers `lease` (granted and never used: the connection's probe) as the spare;
    /// gives it back if there is one already.
    pub(crate) fn offer(&self, lease: SpareLease) -> Option<SpareLease> {
        let mut slot = self.slot();
        if slot.lease.is_some() {
            return Some(lease);
        }
        slot.lease = Some(lease);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: i64, sent: Instant) -> SpareLease {
        SpareLease { id, ttl: 6, sent }
    }

    #[tokio::test(start_paused = true)]
    async fn a_spare_serves_one_contender_within_its_first_keep_alive_interval() {
        let spare = Spare::default();
        let now = Instant::now();
        assert_eq!(spare.offer(lease(1, now)), None);
        assert_eq!(
            spare.offer(lease(2, now)),
            Some(lease(2, now)),
            "one spare at most"
        );
        let taken = spare.take(now + Duration::from_millis(999));
        assert_eq!(taken.lease, Some(lease(1, now)));
        assert!(taken.refill);
        // Taken once: the next contender finds none, and a refill is under way already.
        let again = spare.take(now);
        assert_eq!(
            (again.lease, again.stale, again.refill),
            (None, None, false)
        );
        assert_eq!(spare.refilled(Some(lease(3, now))), None);
        // A 6 s lease's first keep-alive is due 1 s after its grant: then it is stale.
        let late = spare.take(now + Duration::from_secs(1));
        assert_eq!((late.lease, late.stale), (None, Some(lease(3, now))));
        assert!(late.refill);
        assert_eq!(spare.refilled(None), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refill_that_finds_a_spare_gives_its_lease_back() {
        let spare = Spare::default();
        let now = Instant::now();
        assert!(spare.take(now).refill);
        assert_eq!(spare.offer(lease(1, now)), None);
        assert_eq!(spare.refilled(Some(lease(2, now))), Some(lease(2, now)));
        assert_eq!(spare.take(now).lease, Some(lease(1, now)));
    }
}
