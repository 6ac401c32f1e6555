//! A Redlock wait behind a holder in another format on the masters: rslock's and redsync's
//! Redlock hold the key as a plain `SET NX PX` string on each master and publish nothing
//! when they let go. Where a master sends keyspace notifications (see
//! [`ForeignWatch`]), the waiter hears the key's deletion there, and is woken once enough
//! masters let go for a quorum, instead of asking every master again every
//! [`FOREIGN_HOLDER_POLL`].

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use crate::{RedisBackend, conn::ForeignWatch, single::FOREIGN_HOLDER_POLL, wire::LockNames};

/// One wait's watches of the key on each master, and how many deletions wake it.
pub(super) struct ForeignHolders {
    names: LockNames,
    /// One per master, made with the master's first answer (a master not reached yet has
    /// none); `None` inside for a master that cannot watch.
    watches: Vec<OnceLock<Option<Arc<ForeignWatch>>>>,
    /// How many masters' deletions, heard since the wake-up was armed, wake the waiter:
    /// with the masters that granted in the last full round (and gave it back), a quorum;
    /// at least one.
    needed: AtomicUsize,
    /// The masters that answered the last full round busy with a holder in lockkit's or
    /// Redisson's format: its release is published there, and wakes the waiter (or names
    /// it at the leader), so they need no polling.
    published: AtomicUsize,
}

impl ForeignHolders {
    /// Watches of `names` on `masters` masters, of which `quorum` must grant.
    pub(super) fn new(names: LockNames, masters: usize, quorum: usize) -> Arc<Self> {
        Arc::new(ForeignHolders {
            names,
            watches: (0..masters).map(|_| OnceLock::new()).collect(),
            needed: AtomicUsize::new(quorum.max(1)),
            published: AtomicUsize::new(0),
        })
    }

    /// The watch of master `index` (`node`), made on first use.
    pub(super) fn watch(&self, index: usize, node: &RedisBackend) -> Option<Arc<ForeignWatch>> {
        self.watches
            .get(index)?
            .get_or_init(|| node.foreign_watch(&self.names.lock))
            .clone()
    }

    /// The watch of master `index`, if one was made.
    pub(super) fn made(&self, index: usize) -> Option<&Arc<ForeignWatch>> {
        self.watches.get(index)?.get()?.as_ref()
    }

    /// Whether master `index`'s last answer was a holder in another format.
    pub(super) fn seen_at(&self, index: usize) -> bool {
        self.made(index).is_some_and(|watch| watch.seen())
    }

    /// Whether master `index`'s last answer was a holder in another format whose deletion
    /// the waiter hears there.
    pub(super) fn hears_at(&self, index: usize) -> bool {
        self.made(index).is_some_and(|watch| watch.hears())
    }

    /// Records that master `index` did not answer the round (down, frozen, too slow): its
    /// last answer no longer says a holder in another format is there, nor that the
    /// waiter hears it let go, until it answers again.
    pub(super) fn unanswered(&self, index: usize) {
        if let Some(watch) = self.made(index) {
            watch.saw_foreign_holder(false);
        }
    }

    /// How many masters' deletions wake the waiter (see [`ForeignHolders::needed`]).
    pub(super) fn needed(&self) -> usize {
        self.needed.load(Ordering::Acquire)
    }

    /// Records a full round's answer: `granted` masters granted (and gave it back), and
    /// `published` answered busy with a holder in lockkit's or Redisson's format.
    pub(super) fn round_granted(&self, granted: usize, published: usize, quorum: usize) {
        self.needed
            .store(quorum.saturating_sub(granted).max(1), Ordering::Release);
        self.published.store(published, Ordering::Release);
    }

    /// How long a busy round's waiter may sleep, from `lease_left`: while a master's last
    /// answer was a holder in another format and fewer masters than
    /// [`ForeignHolders::needed`] are heard letting go (by their keyspace notifications,
    /// or by the release messages of a holder in lockkit's or Redisson's format there), it
    /// looks again within [`FOREIGN_HOLDER_POLL`], as a wait without notifications does.
    pub(super) fn pace(&self, lease_left: Option<Duration>) -> Option<Duration> {
        let made = || self.watches.iter().filter_map(|w| w.get()?.as_ref());
        let foreign = made().any(|watch| watch.seen());
        let hearing =
            made().filter(|watch| watch.hears()).count() + self.published.load(Ordering::Acquire);
        if foreign && hearing < self.needed() {
            Some(lease_left.map_or(FOREIGN_HOLDER_POLL, |left| left.min(FOREIGN_HOLDER_POLL)))
        } else {
            lease_left
        }
    }
}
