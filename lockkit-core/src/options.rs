//! Per-acquisition options and their validation.

use std::time::Duration;

use crate::{BackendInfo, Error, MAX_TTL, Result};

/// The default lease: long enough for a GC pause, short enough that a dead holder does
/// not block others for long. The watchdog keeps a live holder's lease alive.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// How a hold is taken and kept. Build it with [`crate::Locker::acquire`]'s builder, or set
/// defaults with [`crate::Locker::with_options`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockOptions {
    /// The lease. Zero is refused.
    pub ttl: Duration,
    /// How long `acquire` waits for a busy lock; `None` waits until granted.
    /// `try_acquire` always uses zero.
    pub wait: Option<Duration>,
    /// Whether a watchdog renews the lease while the guard lives.
    pub watchdog: bool,
    /// Renewal period; `None` means a third of the TTL.
    pub renew_every: Option<Duration>,
    /// Stop renewing once the lock has been held this long: the lease then runs out and
    /// the guard reports lost. `None`: renew for as long as the guard lives.
    pub max_hold: Option<Duration>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            ttl: DEFAULT_TTL,
            wait: None,
            watchdog: true,
            renew_every: None,
            max_hold: None,
        }
    }
}

impl LockOptions {
    /// The renewal period in force.
    pub fn renew_period(&self) -> Duration {
        self.renew_every.unwrap_or(self.ttl / 3)
    }

    /// The renewal period of a lease of `ttl` (one `extend` set): `renew_every` while it is
    /// below `ttl`, else a third of `ttl`. An `extend` to a lease shorter than
    /// `renew_every` renewed it only after it had run out, and the guard reported a live
    /// hold lost (helper-34's review).
    pub fn renew_period_for(&self, ttl: Duration) -> Duration {
        self.renew_every
            .filter(|every| *every < ttl)
            .unwrap_or(ttl / 3)
    }

    /// Checks the options against lockkit's rules and the backend's limits, before any I/O.
    ///
    /// # Errors
    /// [`Error::InvalidTtl`] or [`Error::Config`], saying what range is accepted.
    pub fn validate(&self, info: &BackendInfo) -> Result<()> {
        validate_ttl(self.ttl, info)?;
        if self.watchdog {
            let period = self.renew_period();
            if period.is_zero() || period >= self.ttl {
                return Err(Error::Config(format!(
                    "renewal period {period:?} must be above zero and below the ttl {:?}; \
                     a third of the ttl is a good choice",
                    self.ttl
                )));
            }
        }
        if self.max_hold.is_some_and(|m| m.is_zero()) {
            return Err(Error::Config(
                "max_hold of zero would never let the lock be held; leave it unset or give a \
                 positive duration"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// `start + ttl`, with `ttl` taken as at most [`MAX_TTL`]: the end of a lease that never
/// overflows an instant, whatever a caller of a backend's SPI passed (the [`crate::Locker`]
/// refuses a TTL above [`MAX_TTL`] before it reaches a backend; a backend driven directly
/// with `Duration::MAX` panicked where it added the TTL to a clock).
pub fn lease_end<I: std::ops::Add<Duration, Output = I>>(start: I, ttl: Duration) -> I {
    start + ttl.min(MAX_TTL)
}

/// Checks one TTL against lockkit's and the backend's limits.
///
/// # Errors
/// [`Error::InvalidTtl`] naming the accepted range.
pub fn validate_ttl(ttl: Duration, info: &BackendInfo) -> Result<()> {
    let caps = &info.capabilities;
    let max = caps.max_ttl.map_or(MAX_TTL, |max| max.min(MAX_TTL));
    // Formatted only for an error: this runs on every acquisition.
    let range = || format!("{:?} ..= {:?}", caps.min_ttl, max);
    if ttl.is_zero() {
        return Err(Error::InvalidTtl {
            ttl,
            reason: format!(
                "a zero lease would expire before it is granted; `{}` accepts {}",
                info.scheme,
                range()
            ),
        });
    }
    if ttl < caps.min_ttl || ttl > max {
        return Err(Error::InvalidTtl {
            ttl,
            reason: format!("`{}` accepts leases of {}", info.scheme, range()),
        });
    }
    Ok(())
}
