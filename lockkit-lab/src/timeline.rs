//! One run's timeline: what happened when, as text for people and as a kind for pictures.

use std::time::Duration;

/// Who an event belongs to: the first holder or the rival that wants the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Actor {
    /// The first holder (and, in the failover scenario, the earlier holder before it).
    Holder,
    /// The rival that asks for the key while or after something breaks.
    Rival,
}

impl Actor {
    /// `holder` or `rival`.
    pub fn name(self) -> &'static str {
        match self {
            Actor::Holder => "holder",
            Actor::Rival => "rival",
        }
    }
}

/// What a fenced store did with a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Accepted from a current holder.
    Accepted,
    /// Refused: the token was older than the newest the store had seen.
    Refused,
    /// Accepted although the writer had been superseded: fencing failed.
    StaleAccepted,
}

/// What kind of thing an [`Event`] is (what a picture draws for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    /// Context for the text timeline only (set-up, a measurement).
    Note,
    /// `who` was granted the key with `token`.
    Granted {
        /// The new holder.
        who: Actor,
        /// Its fencing token.
        token: u64,
    },
    /// `who` renewed its lease.
    Renewed {
        /// The renewing holder.
        who: Actor,
    },
    /// `who` tried to renew and the server said no.
    RenewFailed {
        /// The renewing holder.
        who: Actor,
    },
    /// `who`'s lease deadline passed without a renewal (the hold is over, whatever the
    /// holder believes).
    LeaseEnds {
        /// The holder whose lease ran out.
        who: Actor,
    },
    /// `who`'s guard fired lost.
    Lost {
        /// The holder that was told.
        who: Actor,
    },
    /// `who` released the key.
    Released {
        /// The holder that released.
        who: Actor,
    },
    /// `who` asked for the key and did not get it (busy, refused, no answer).
    Denied {
        /// Who asked.
        who: Actor,
        /// Why, in a few words.
        label: String,
    },
    /// `who` wrote to the fenced store with `token`.
    Write {
        /// The writer.
        who: Actor,
        /// The token it wrote with.
        token: u64,
        /// What the store did.
        outcome: WriteOutcome,
    },
    /// Something the lab broke, from now on (a pause, a kill, a cut link); `id` pairs it
    /// with its [`Mark::FaultEnds`].
    FaultBegins {
        /// Pairs the beginning with the end.
        id: u32,
        /// What broke, in a few words.
        label: String,
    },
    /// The fault `id` is over (resumed, restarted, healed).
    FaultEnds {
        /// The [`Mark::FaultBegins`] this ends.
        id: u32,
        /// What ended it, in a few words.
        label: String,
    },
    /// Something the servers did (a restart, a promotion, a lease running out there).
    Server {
        /// What, in a few words.
        label: String,
    },
}

/// One moment of a run: when, what kind, and the sentence the text timeline prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Offset from the start of the run.
    pub at: Duration,
    /// What kind of thing happened.
    pub mark: Mark,
    /// What happened, in a sentence.
    pub text: String,
}

impl Event {
    /// An event at `at`.
    pub fn new(at: Duration, mark: Mark, text: impl Into<String>) -> Self {
        Event {
            at,
            mark,
            text: text.into(),
        }
    }
}
