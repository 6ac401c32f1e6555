//! A queued Redlock waiter's rounds that no message called for (its timer, which covers a
//! stale record on the leader, or another master's message) keep the leader's queue order:
//! a round that lands between a release naming another waiter and that waiter's grant on
//! the other masters would find a quorum of them free, and take the key from the waiter
//! the release named.

use std::sync::{Arc, Mutex, OnceLock};

use lockkit_core::spi::armed;
use tokio::time::Instant;

use crate::conn::{Channel, Mark, RoundGate};

/// What a queued waiter heard on the leader master's release channel, between its rounds.
pub(super) struct LeaderTurns {
    /// The waiter's id in the leader's queue.
    me: u64,
    /// The leader's release channel, once the wait subscribed to it.
    channel: OnceLock<Arc<Channel>>,
    /// Where the channel stood when the waiter's last round began.
    mark: Mutex<Option<Mark>>,
}

impl LeaderTurns {
    /// The turns of waiter `me`, before the wait subscribed.
    pub(super) fn new(me: u64) -> Arc<Self> {
        Arc::new(LeaderTurns {
            me,
            channel: OnceLock::new(),
            mark: Mutex::new(None),
        })
    }

    /// Records the leader's release channel (the first call only counts).
    pub(super) fn listen(&self, channel: Arc<Channel>) {
        let _ = self.channel.set(channel);
    }

    fn mark(&self) -> std::sync::MutexGuard<'_, Option<Mark>> {
        self.mark.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the next round goes now (see [`Channel::round_gate`]); a round goes
    /// before the wait subscribed, and the first round after it.
    pub(super) fn gate(&self) -> RoundGate {
        match (self.channel.get(), *self.mark()) {
            (Some(channel), Some(mark)) => channel.round_gate(mark, self.me),
            _ => RoundGate::Go,
        }
    }

    /// Holds a round back while [`Self::gate`] says so, until `until` at most; answers
    /// what the gate said last ([`RoundGate::Go`] once `until` passed).
    pub(super) async fn hold(&self, until: Instant) -> RoundGate {
        let Some(channel) = self.channel.get() else {
            return RoundGate::Go;
        };
        loop {
            // Listening before reading what was heard: nothing slips in between.
            let heard = armed(&channel.notify);
            match self.gate() {
                RoundGate::HoldUntil(end) => {
                    let end = end.min(until);
                    if end <= Instant::now() {
                        return RoundGate::Go;
                    }
                    tokio::select! {
                        () = heard => {}
                        () = tokio::time::sleep_until(end) => return RoundGate::Go,
                    }
                }
                other => return other,
            }
        }
    }

    /// A round begins (or is skipped): what the channel hears from now on decides the next.
    pub(super) fn round_begins(&self) {
        if let Some(channel) = self.channel.get() {
            *self.mark() = Some(channel.mark());
        }
    }
}
