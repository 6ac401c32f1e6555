//! When a backend last found one of its connections gone: the SQL backends' pools check
//! every connection before use for a while after one was (a server restart kills them all
//! at once), and only idle ones otherwise.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// The time a connection of one backend was last found gone, shared by its pools. Keep one
/// per backend: one server's restart should not make other backends' pools check every
/// connection.
#[derive(Debug)]
pub struct RecentLoss {
    since: Instant,
    /// Milliseconds from `since` to the last loss, plus one (zero: never).
    at: AtomicU64,
}

impl Default for RecentLoss {
    fn default() -> Self {
        Self::new()
    }
}

impl RecentLoss {
    /// No loss seen yet.
    pub fn new() -> Self {
        RecentLoss {
            since: Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    /// A connection was found gone now.
    pub fn note(&self) {
        self.at.store(self.now(), Ordering::Relaxed);
    }

    /// Whether a connection was found gone less than `window` ago (on the monotonic clock).
    pub fn within(&self, window: Duration) -> bool {
        let at = self.at.load(Ordering::Relaxed);
        at != 0 && u128::from(self.now().saturating_sub(at)) < window.as_millis()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_is_recent_until_its_window_has_passed() {
        let losses = RecentLoss::new();
        assert!(!losses.within(Duration::from_secs(3600)), "no loss yet");
        losses.note();
        assert!(losses.within(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(5));
        assert!(!losses.within(Duration::from_millis(1)));
    }
}
