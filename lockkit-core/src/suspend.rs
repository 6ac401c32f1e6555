//! Time the machine spent suspended, which the monotonic clock does not count.
//!
//! Leases are timed on the monotonic clock (`tokio::time::Instant`, `CLOCK_MONOTONIC` on
//! Linux), which stands still while the machine is suspended (a laptop's lid closed, a VM
//! suspended to disk), while the server's lease runs on: after the resume a guard would call
//! itself valid for as long as it had left before, its server-side lease long gone.
//! `CLOCK_BOOTTIME` goes on counting through a suspend; the difference between the two
//! clocks grows by exactly the time suspended, and each lease deadline is moved earlier by
//! the growth since it was set.

use std::time::Duration;

/// How long the machine has spent suspended since it booted: `CLOCK_BOOTTIME` minus
/// `CLOCK_MONOTONIC` (Linux and Android); zero where that cannot be told. Only its growth
/// means anything.
pub(crate) fn suspended() -> Duration {
    let measured = measure();
    #[cfg(test)]
    READINGS.with(|readings| readings.set(readings.get() + 1));
    #[cfg(test)]
    let measured = measured + PRETENDED.with(std::cell::Cell::get);
    measured
}

/// An instant on the monotonic clock, stamped with the machine's suspended time when it was
/// taken: for a deadline a backend counts from what it last heard from a server
/// ([`crate::LockBackend::validity_bound`]: a ZooKeeper session, an etcd lease kept alive),
/// which runs on on the server while the machine is suspended and the monotonic clock
/// stands still.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    at: tokio::time::Instant,
    suspended: Duration,
}

impl Stamp {
    /// `at` (an instant read just before: a request's sending), stamped with the suspended
    /// time now. A suspend between `at` and now is not counted.
    pub fn new(at: tokio::time::Instant) -> Self {
        Stamp {
            at,
            suspended: suspended(),
        }
    }

    /// The instant, as it was read (not moved by a suspend since).
    pub fn instant(&self) -> tokio::time::Instant {
        self.at
    }

    /// `after` past the instant, on the monotonic clock as it stands now: earlier by the
    /// time the machine has spent suspended since the stamp. Two calls may differ by the
    /// measure's jitter (nanoseconds, more for a preempted reading): compare it with the
    /// clock, not with an earlier result.
    pub fn deadline(&self, after: Duration) -> tokio::time::Instant {
        let deadline = self.at + after;
        let slept = suspended().saturating_sub(self.suspended);
        if slept.is_zero() {
            return deadline;
        }
        // Past the clock's earliest instant: long over.
        deadline
            .checked_sub(slept)
            .unwrap_or_else(|| deadline.min(tokio::time::Instant::now()))
    }
}

/// Wakes the keepers when a resume is noticed.
static RESUMED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Resolves when the machine is noticed to have been suspended (for more than 100 ms), at
/// most a second after it resumes: keepers' timers sleep on the monotonic clock, which
/// does not count the suspend, and would fire the loss signal of a hold whose lease ran
/// out meanwhile only at their next wake. The first call starts the thread that watches
/// (`lockkit-resume`, one per process, waking once a second); if it cannot start, this
/// never resolves.
pub(crate) fn resumed() -> tokio::sync::futures::Notified<'static> {
    static WATCHING: std::sync::Once = std::sync::Once::new();
    WATCHING.call_once(|| {
        let started = std::thread::Builder::new()
            .name("lockkit-resume".into())
            .spawn(watch);
        if let Err(error) = started {
            tracing::warn!(%error, "could not start the thread that notices resumes; a hold lost in a suspend is reported at its keeper's next wake");
        }
    });
    RESUMED.notified()
}

/// Polls the suspended time once a second and wakes the keepers when it grew by more than
/// the measure's jitter.
fn watch() {
    let mut last = suspended();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = suspended();
        if now.saturating_sub(last) > Duration::from_millis(100) {
            RESUMED.notify_waiters();
            crate::keeper_start::start_all();
        }
        last = last.max(now);
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn measure() -> Duration {
    use rustix::time::{ClockId, clock_gettime};
    let read = |id| {
        let t = clock_gettime(id);
        Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        )
    };
    // The two readings are a few hundred nanoseconds apart, or more when the thread is
    // preempted between them: read until a pair brackets the boot-time reading closely,
    // so the difference does not grow by a preemption.
    let mut best: Option<(Duration, Duration)> = None;
    for _ in 0..4 {
        let before = read(ClockId::Monotonic);
        let boot = read(ClockId::Boottime);
        let after = read(ClockId::Monotonic);
        let spread = after.saturating_sub(before);
        let gap = boot.saturating_sub(before);
        if best.is_none_or(|(best_spread, _)| spread < best_spread) {
            best = Some((spread, gap));
        }
        if spread < Duration::from_micros(50) {
            break;
        }
    }
    best.map_or(Duration::ZERO, |(_, gap)| gap)
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn measure() -> Duration {
    Duration::ZERO
}

#[cfg(test)]
thread_local! {
    /// Suspended time the tests pretend (per thread: a current-thread runtime's guards
    /// and keepers run on the test's own thread).
    static PRETENDED: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

#[cfg(test)]
thread_local! {
    /// How many times this thread read the suspended time (tests: its cost is counted).
    static READINGS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times this thread has read the suspended time (tests).
#[cfg(test)]
pub(crate) fn readings() -> u64 {
    READINGS.with(std::cell::Cell::get)
}

/// Pretends a resume was noticed: wakes every keeper waiting in [`resumed`] (tests).
#[cfg(test)]
pub(crate) fn pretend_resumed() {
    RESUMED.notify_waiters();
}

/// Pretends, on this thread, that the machine was suspended for `time` more (tests).
#[cfg(test)]
pub(crate) fn pretend_suspended(time: Duration) {
    PRETENDED.with(|pretended| pretended.set(pretended.get() + time));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suspended_time_does_not_grow_while_the_machine_runs() {
        let first = suspended();
        std::thread::sleep(Duration::from_millis(50));
        let grown = suspended().saturating_sub(first);
        // The readings' jitter only (a preempted read at worst), never the 50 ms slept.
        assert!(grown < Duration::from_millis(20), "grew by {grown:?}");
    }

    /// A deadline a backend counts from what it last heard is moved earlier by a suspend
    /// since, as a guard's lease deadline is.
    #[test]
    fn a_stamped_deadline_moves_earlier_by_a_suspend_since() {
        let heard = Stamp::new(tokio::time::Instant::now());
        let bound = heard.deadline(Duration::from_secs(20));
        assert!(bound >= heard.instant() + Duration::from_millis(19_900));
        pretend_suspended(Duration::from_secs(30));
        let after = heard.deadline(Duration::from_secs(20));
        assert!(
            after <= tokio::time::Instant::now(),
            "still {:?} ahead after a 30 s suspend",
            after.saturating_duration_since(tokio::time::Instant::now())
        );
    }
}
