//! Metrics through the `metrics` facade (feature `metrics`): whichever recorder the
//! application installs (a Prometheus exporter, say) receives them; without the feature, or
//! without a recorder, recording costs nothing.
//!
//! Every metric is labelled by `backend` (the URL scheme). Keys are not labels unless
//! [`label_keys`] turns them on: they are unbounded (a series per key), so do that only
//! when the keys are few and fixed. Then the counters and histograms (not the gauges) also
//! carry `key`.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `lockkit_acquisitions_total` | counter | `backend`, `outcome` (granted, busy, timeout, error) |
//! | `lockkit_acquire_wait_seconds` | histogram | `backend` |
//! | `lockkit_hold_seconds` | histogram | `backend` (from grant to release) |
//! | `lockkit_renewals_total` | counter | `backend`, `outcome` (renewed, not held, failed, unanswered) |
//! | `lockkit_losses_total` | counter | `backend`, `reason` |
//! | `lockkit_holds` | gauge | `backend` (holds alive in this process) |
//! | `lockkit_waiters` | gauge | `backend` (acquisitions under way in this process) |

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use crate::{LockKey, LostReason};

static KEY_LABELS: AtomicBool = AtomicBool::new(false);

/// Whether the counters and histograms recorded from now on carry a `key` label (off by
/// default; process-wide). Every distinct key becomes a series of its own in each metric:
/// turn it on only for a small, fixed set of keys.
pub fn label_keys(on: bool) {
    KEY_LABELS.store(on, Ordering::Relaxed);
}

/// The `key` label for `key`, when [`label_keys`] is on.
pub(crate) fn key_label(key: &LockKey) -> Option<String> {
    KEY_LABELS
        .load(Ordering::Relaxed)
        .then(|| key.as_str().to_owned())
}

/// Records with the labels given, plus `key` when there is one.
#[cfg(feature = "metrics")]
macro_rules! with_key {
    ($kind:ident, $name:expr, $key:expr, $($label:expr => $value:expr),*) => {
        match $key {
            Some(key) => metrics::$kind!($name, $($label => $value,)* "key" => key.to_owned()),
            None => metrics::$kind!($name, $($label => $value),*),
        }
    };
}

/// An acquisition ended with `outcome` after `waited`.
pub(crate) fn acquisition(
    backend: &'static str,
    key: Option<&str>,
    outcome: &'static str,
    waited: Duration,
) {
    #[cfg(feature = "metrics")]
    {
        with_key!(counter, "lockkit_acquisitions_total", key, "backend" => backend, "outcome" => outcome)
            .increment(1);
        with_key!(histogram, "lockkit_acquire_wait_seconds", key, "backend" => backend)
            .record(waited.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, outcome, waited);
}

/// A hold was given up after `held` (the last release of a guard).
pub(crate) fn released(backend: &'static str, key: &LockKey, held: Duration) {
    #[cfg(feature = "metrics")]
    with_key!(histogram, "lockkit_hold_seconds", key_label(key), "backend" => backend)
        .record(held.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, held);
}

/// A renewal ended with `outcome`.
pub(crate) fn renewal(backend: &'static str, key: &LockKey, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    with_key!(counter, "lockkit_renewals_total", key_label(key), "backend" => backend, "outcome" => outcome)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, outcome);
}

/// A hold was lost while held.
pub(crate) fn lost(backend: &'static str, key: &LockKey, reason: LostReason) {
    #[cfg(feature = "metrics")]
    with_key!(counter, "lockkit_losses_total", key_label(key), "backend" => backend, "reason" => reason_label(reason))
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, reason);
}

#[cfg(feature = "metrics")]
fn reason_label(reason: LostReason) -> &'static str {
    match reason {
        LostReason::LeaseExpired => "lease_expired",
        LostReason::NotOurs => "not_ours",
        LostReason::SessionLost => "session_lost",
    }
}

/// Counts one in a gauge (`lockkit_holds` or `lockkit_waiters`) until it ends: at
/// [`Gauged::end`] or when dropped, whichever comes first.
pub(crate) struct Gauged {
    #[cfg(feature = "metrics")]
    gauge: metrics::Gauge,
    ended: std::sync::atomic::AtomicBool,
}

impl Gauged {
    fn new(name: &'static str, backend: &'static str) -> Self {
        #[cfg(feature = "metrics")]
        {
            let gauge = metrics::gauge!(name, "backend" => backend);
            gauge.increment(1.0);
            Gauged {
                gauge,
                ended: std::sync::atomic::AtomicBool::new(false),
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, backend);
            Gauged {
                ended: std::sync::atomic::AtomicBool::new(false),
            }
        }
    }

    /// One hold alive in this process.
    pub(crate) fn hold(backend: &'static str) -> Self {
        Self::new("lockkit_holds", backend)
    }

    /// One acquisition under way in this process.
    pub(crate) fn waiter(backend: &'static str) -> Self {
        Self::new("lockkit_waiters", backend)
    }

    /// Counts it off now (once), although its owner may live on for a moment (a hold's
    /// keeper task that has yet to see the release).
    pub(crate) fn end(&self) {
        if !self.ended.swap(true, std::sync::atomic::Ordering::SeqCst) {
            #[cfg(feature = "metrics")]
            self.gauge.decrement(1.0);
        }
    }
}

impl Drop for Gauged {
    fn drop(&mut self) {
        self.end();
    }
}
