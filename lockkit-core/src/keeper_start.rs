//! One timer for the holds whose keeper is not yet due.
//!
//! Every hold needs a keeper (the watchdog's renewals and the local expiry), but most holds
//! are released long before their first renewal. A task spawned per hold costs the
//! uncontended path a spawn, a timer and the wake-ups of an idle worker thread that steals
//! the new task. So a hold on a multi-thread runtime waits here, as an entry in one shared
//! map, until its keeper is first due; only then is the keeper spawned, on the hold's own
//! runtime. Redisson does the same with one timer for all of its renewals.
//!
//! One thread of its own (`lockkit-keepers`) serves the process, not a task: a task would
//! live on one runtime, and a runtime whose workers are all blocked (or that shuts down)
//! would then hold back the keepers of every other runtime's holds. The thread sleeps until
//! the earliest entry is due and is woken only when an entry earlier than the one it sleeps
//! for arrives: holds of one TTL arrive in due order, so a stream of short holds wakes it at
//! most once per renewal period. A hold that ends before it is due removes its entry and
//! never gets a task.
//!
//! Holds on a current-thread runtime never wait here: such a runtime runs tasks only while
//! it is driven, and its clock may be paused, so they get their keeper at once, as before.
//! If the thread cannot be started, holds get their keeper at once too. The thread never
//! drops the last reference to a hold (see `HoldShared::start_keeper`): a backend's grant
//! may need a runtime to be dropped in. A child made by `fork` without `exec` has no timer
//! thread (nor any of its runtimes' threads): it must not use its parent's lockers.

use std::{
    collections::BTreeMap,
    sync::{Condvar, Mutex, MutexGuard, Weak},
    time::Instant,
};

/// Where an entry sits in the map: its due time and a sequence number (unique).
pub(crate) type EntryKey = (Instant, u64);

/// A hold that waits for its keeper.
pub(crate) trait Deferred: Send + Sync + 'static {
    /// Starts the keeper now (once; later calls do nothing).
    fn start_keeper(self: std::sync::Arc<Self>);
}

struct Timers {
    entries: BTreeMap<EntryKey, Weak<dyn Deferred>>,
    next_seq: u64,
    /// The due time the thread sleeps until (`None`: it waits for a wake, or is busy and
    /// reads the map again before it sleeps).
    armed: Option<Instant>,
    /// The thread runs.
    running: bool,
    /// A start of the thread failed (said once).
    spawn_failed: bool,
}

static TIMERS: Mutex<Timers> = Mutex::new(Timers {
    entries: BTreeMap::new(),
    next_seq: 0,
    armed: None,
    running: false,
    spawn_failed: false,
});

/// Wakes the thread: an entry earlier than `armed` arrived.
static WAKE: Condvar = Condvar::new();

fn timers() -> MutexGuard<'static, Timers> {
    // A poisoned map only means a thread panicked while it held plain data.
    TIMERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether holds started on `runtime` wait here (multi-thread runtimes) rather than get
/// their keeper at once.
pub(crate) fn defers_on(runtime: &tokio::runtime::Handle) -> bool {
    matches!(
        runtime.runtime_flavor(),
        tokio::runtime::RuntimeFlavor::MultiThread
    )
}

/// Puts `hold` in the map until `due`; returns its entry, for [`forget`], or `None` if the
/// timer thread could not be started (the caller then starts the keeper itself). The caller
/// must have checked [`defers_on`].
pub(crate) fn defer(due: tokio::time::Instant, hold: Weak<dyn Deferred>) -> Option<EntryKey> {
    let due = due.into_std();
    let mut timers = timers();
    if !timers.running {
        let started = std::thread::Builder::new()
            .name("lockkit-keepers".into())
            .spawn(run);
        if let Err(error) = started {
            if !timers.spawn_failed {
                timers.spawn_failed = true;
                tracing::warn!(%error, "could not start the keepers' timer thread; holds get their keeper task at once");
            }
            return None;
        }
        timers.running = true;
    }
    let key = (due, timers.next_seq);
    timers.next_seq += 1;
    timers.entries.insert(key, hold);
    if timers.armed.is_none_or(|armed| due < armed) {
        WAKE.notify_one();
    }
    Some(key)
}

/// Removes an entry (its hold ended or its keeper started). Never wakes the thread: it
/// finds out at its next wake that the entry is gone.
pub(crate) fn forget(key: EntryKey) {
    timers().entries.remove(&key);
}

/// Starts every waiting hold's keeper now (after a resume: their due times, on the monotonic
/// clock, did not count the suspend, and their leases may have run out in it).
pub(crate) fn start_all() {
    let holds = std::mem::take(&mut timers().entries);
    WAKE.notify_one();
    for hold in holds.into_values() {
        if let Some(hold) = hold.upgrade() {
            let started =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hold.start_keeper()));
            if started.is_err() {
                tracing::error!("a hold's keeper could not be started (a panic)");
            }
        }
    }
}

/// The timer thread: starts each hold's keeper when it is due.
fn run() {
    let mut timers = timers();
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        while let Some(entry) = timers.entries.first_entry() {
            if entry.key().0 > now {
                break;
            }
            due.push(entry.remove());
        }
        if !due.is_empty() {
            // Busy: every new entry is read again before the next sleep.
            timers.armed = None;
            drop(timers);
            for hold in due {
                if let Some(hold) = hold.upgrade() {
                    // Nothing here should panic; if something does, the other holds must
                    // still get their keepers.
                    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        hold.start_keeper()
                    }));
                    if started.is_err() {
                        tracing::error!("a hold's keeper could not be started (a panic)");
                    }
                }
            }
            timers = self::timers();
            continue;
        }
        let next = timers.entries.first_key_value().map(|(key, _)| key.0);
        timers.armed = next;
        timers = match next {
            Some(next) => {
                WAKE.wait_timeout(timers, next.saturating_duration_since(now))
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0
            }
            None => WAKE
                .wait(timers)
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        };
    }
}
