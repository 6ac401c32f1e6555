//! The lost signal.

use std::sync::{Arc, OnceLock};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::LostReason;

/// A one-shot, level-triggered signal that a hold is lost, with the reason.
///
/// Fired by the watchdog (renewal refused, lease ran out) or by a backend (session
/// expiry). Once fired it stays fired: a late subscriber sees it at once.
#[derive(Clone, Debug, Default)]
pub struct LossSignal {
    fired: CancellationToken,
    reason: Arc<OnceLock<LostReason>>,
    at: Arc<OnceLock<Instant>>,
}

impl LossSignal {
    /// A signal that has not fired.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fires the signal. The first reason given wins; later calls change nothing.
    pub fn fire(&self, reason: LostReason) {
        let first = self.reason.set(reason).is_ok();
        let _ = self.at.set(Instant::now());
        self.fired.cancel();
        if first {
            tracing::debug!(%reason, "lock lost");
        }
    }

    /// Whether the signal has fired.
    pub fn is_fired(&self) -> bool {
        self.fired.is_cancelled()
    }

    /// The reason, once fired.
    pub fn reason(&self) -> Option<LostReason> {
        if self.is_fired() {
            Some(self.reason.get().copied().unwrap_or(LostReason::NotOurs))
        } else {
            None
        }
    }

    /// When the signal fired (on the local monotonic clock), once it has.
    pub fn fired_at(&self) -> Option<Instant> {
        self.at.get().copied()
    }

    /// Resolves when the signal fires (at once if it already has).
    ///
    /// # Cancel safety
    /// Cancel safe: drop it and call again at any time.
    pub fn fired(&self) -> impl std::future::Future<Output = LostReason> + Send + 'static {
        let token = self.fired.clone();
        let reason = self.reason.clone();
        async move {
            token.cancelled_owned().await;
            reason.get().copied().unwrap_or(LostReason::NotOurs)
        }
    }
}
