//! The lost signal.

use std::sync::{Arc, Mutex, OnceLock};

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
    on_fire: Arc<FireHooks>,
}

/// What runs once when the signal fires (see [`LossSignal::on_fire`]).
#[derive(Default)]
struct FireHooks(Mutex<Vec<Box<dyn FnOnce() + Send>>>);

impl std::fmt::Debug for FireHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FireHooks")
    }
}

impl FireHooks {
    fn take(&self) -> Vec<Box<dyn FnOnce() + Send>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
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
        for hook in self.on_fire.take() {
            hook();
        }
    }

    /// Runs `hook` once when the signal fires, on the thread that fires it, or at once if
    /// it already has. Hooks must be quick and must not fire this signal.
    pub(crate) fn on_fire(&self, hook: impl FnOnce() + Send + 'static) {
        self.on_fire
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(hook));
        // A fire that came before the push found no hook: run it here. Both take under the
        // lock, so it runs once.
        if self.is_fired() {
            for hook in self.on_fire.take() {
                hook();
            }
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
