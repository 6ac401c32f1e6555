//! Metrics through the `metrics` facade (feature `metrics`): whichever recorder the
//! application installs (a Prometheus exporter, say) receives them; without the feature, or
//! without a recorder, recording costs nothing.
//!
//! Every metric is labelled by `backend` (the URL scheme). Keys are not labels: they are
//! unbounded.
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

use std::time::Duration;

use crate::LostReason;

/// An acquisition ended with `outcome` after `waited`.
pub(crate) fn acquisition(backend: &'static str, outcome: &'static str, waited: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("lockkit_acquisitions_total", "backend" => backend, "outcome" => outcome)
            .increment(1);
        metrics::histogram!("lockkit_acquire_wait_seconds", "backend" => backend)
            .record(waited.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, outcome, waited);
}

/// A hold was given up after `held` (the last release of a guard).
pub(crate) fn released(backend: &'static str, held: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("lockkit_hold_seconds", "backend" => backend).record(held.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, held);
}

/// A renewal ended with `outcome`.
pub(crate) fn renewal(backend: &'static str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("lockkit_renewals_total", "backend" => backend, "outcome" => outcome)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, outcome);
}

/// A hold was lost while held.
pub(crate) fn lost(backend: &'static str, reason: LostReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!("lockkit_losses_total", "backend" => backend, "reason" => reason_label(reason))
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, reason);
}

#[cfg(feature = "metrics")]
fn reason_label(reason: LostReason) -> &'static str {
    match reason {
        LostReason::LeaseExpired => "lease_expired",
        LostReason::NotOurs => "not_ours",
        LostReason::SessionLost => "session_lost",
    }
}

/// Counts one in a gauge (`lockkit_holds` or `lockkit_waiters`) while it lives.
pub(crate) struct Gauged {
    #[cfg(feature = "metrics")]
    gauge: metrics::Gauge,
}

impl Gauged {
    fn new(name: &'static str, backend: &'static str) -> Self {
        #[cfg(feature = "metrics")]
        {
            let gauge = metrics::gauge!(name, "backend" => backend);
            gauge.increment(1.0);
            Gauged { gauge }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, backend);
            Gauged {}
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
}

impl Drop for Gauged {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        self.gauge.decrement(1.0);
    }
}
