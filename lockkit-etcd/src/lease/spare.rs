//! One etcd lease granted ahead of need, so that an acquisition does not wait for a lease
//! grant (a Raft write of its own) before it creates its contender key.
//!
//! A client that acquires often (two acquisitions within [`FRESH_FOR`]) keeps one spare: a
//! contender takes it if it was granted less than [`FRESH_FOR`] ago (and less than one
//! keep-alive interval, a sixth of its TTL, when that is shorter), and the backend grants
//! the next one in the background, beside the contender's own requests. A client that
//! acquires seldom keeps none and is granted a lease per contender, as before. A spare
//! found too old is revoked in the background. A spare the cluster no longer knows
//! (revoked by someone, lost in a restore) fails the contender's creation with nothing
//! written, and the contender is then granted a lease of its own. A spare left when the
//! client stops (or is dropped) carries no key and expires on the cluster within its TTL.
//!
//! Nothing changes for the hold: the lease is new, carries only its contender's key, and its
//! life on the cluster is counted from when its grant was sent (`Lease::keep` is given that
//! instant). The age bound keeps it close to a lease granted on the spot: etcd before 3.5.8
//! (etcd-io/etcd#15247) lets a leader that was frozen for longer than a lease's TTL revoke,
//! when it resumes, a lease it granted before it froze, so an old spare would widen that
//! window.

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

/// How old a spare may be to serve a contender, and how close two acquisitions must come
/// for the client to keep a spare.
pub(crate) const FRESH_FOR: Duration = Duration::from_millis(500);

impl SpareLease {
    /// Whether the lease may still serve a contender at `now`: granted less than
    /// [`FRESH_FOR`] and less than one keep-alive interval of its TTL ago.
    fn fresh_at(&self, now: Instant) -> bool {
        let ttl = Duration::from_secs(u64::try_from(self.ttl).unwrap_or(0));
        now < self.sent + FRESH_FOR.min(super::keep_alive_every(ttl))
    }
}

#[derive(Default)]
struct Slot {
    lease: Option<SpareLease>,
    refilling: bool,
    /// When a contender last looked for a spare.
    last_take: Option<Instant>,
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
    /// back in [`Taken::stale`]. When the last contender looked less than [`FRESH_FOR`]
    /// ago and no refill is under way, marks one as under way (the caller must then call
    /// [`Spare::refilled`], whatever the grant gives).
    pub(crate) fn take(&self, now: Instant) -> Taken {
        let mut slot = self.slot();
        let (lease, stale) = match slot.lease.take() {
            Some(lease) if lease.fresh_at(now) => (Some(lease), None),
            stale => (None, stale),
        };
        let often = slot
            .last_take
            .is_some_and(|last| now.saturating_duration_since(last) < FRESH_FOR);
        slot.last_take = Some(now);
        let refill = often && !slot.refilling;
        slot.refilling |= refill;
        Taken {
            lease,
            stale,
            refill,
        }
    }

    /// The spare lease's id, if there is one.
    pub(crate) fn peek(&self) -> Option<i64> {
        self.slot().lease.map(|lease| lease.id)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: i64, sent: Instant) -> SpareLease {
        SpareLease { id, ttl: 6, sent }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_acquires_often_keeps_one_fresh_spare() {
        let spare = Spare::default();
        let t0 = Instant::now();
        // The first contender finds none, and one acquisition says nothing of the rate.
        assert_eq!(
            spare.take(t0),
            Taken {
                lease: None,
                stale: None,
                refill: false
            }
        );
        // A second within FRESH_FOR: refill (once, while it is under way).
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(
            spare.take(t1),
            Taken {
                lease: None,
                stale: None,
                refill: true
            }
        );
        assert!(!spare.take(t1).refill, "one refill at a time");
        assert_eq!(spare.refilled(Some(lease(1, t1))), None);
        // Taken once, within FRESH_FOR of its grant.
        let t2 = t1 + FRESH_FOR - Duration::from_millis(1);
        let taken = spare.take(t2);
        assert_eq!(
            (taken.lease, taken.stale, taken.refill),
            (Some(lease(1, t1)), None, true)
        );
        assert_eq!(spare.take(t2).lease, None, "a spare serves one contender");
        // A refill that finds the slot full gives its lease back.
        assert_eq!(spare.refilled(Some(lease(2, t2))), None);
        assert_eq!(spare.refilled(Some(lease(3, t2))), Some(lease(3, t2)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_old_spare_is_handed_back_and_a_slow_client_keeps_none() {
        let spare = Spare::default();
        let t0 = Instant::now();
        let _ = spare.take(t0);
        assert!(spare.take(t0).refill);
        assert_eq!(spare.refilled(Some(lease(1, t0))), None);
        // FRESH_FOR later: too old to serve, and the client is not acquiring often.
        let late = t0 + FRESH_FOR;
        assert_eq!(
            spare.take(late),
            Taken {
                lease: None,
                stale: Some(lease(1, t0)),
                refill: false
            }
        );
        // A lease of a 1 s TTL (a keep-alive interval of 166 ms) is stale sooner.
        let short = SpareLease {
            id: 2,
            ttl: 1,
            sent: late,
        };
        assert!(short.fresh_at(late + Duration::from_millis(100)));
        assert!(!short.fresh_at(late + Duration::from_millis(170)));
    }
}
