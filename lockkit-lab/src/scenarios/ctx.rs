//! One run's state: its timeline, history, fenced store and observations.

use std::time::Duration;

use lockkit_core::{Consistency, FencingToken, LockGuard, LockKey, Locker, LostReason};
use tokio::time::Instant;

use crate::{
    Lab, LabError,
    report::{LostSignal, Observed, Stale},
    store::FencedStore,
    timeline::{Actor, Event, Mark, WriteOutcome},
};
use lockkit_conformance::{History, history::OpenHold};

/// One run's state: its timeline, history, fenced store and observations.
pub(super) struct Ctx<'a> {
    pub(super) lab: &'a Lab,
    pub(super) t0: Instant,
    pub(super) timeline: Vec<Event>,
    /// The next [`Mark::FaultBegins`] id.
    pub(super) faults: u32,
    pub(super) history: History,
    /// Where holders write (opened once the servers are up).
    pub(super) store: Option<FencedStore>,
    /// The writes the store accepted, by its guard's own answer: (token, value), in order.
    pub(super) accepted_writes: Vec<(u64, String)>,
    pub(super) key: LockKey,
    pub(super) holder_lost_at: Option<Instant>,
    pub(super) rival_at: Option<Instant>,
    pub(super) stale: Stale,
    pub(super) consistency: Option<Consistency>,
}

impl Ctx<'_> {
    /// Notes context (drawn in no picture) that happens now.
    pub(super) fn note(&mut self, text: impl Into<String>) {
        self.mark_at(Instant::now(), Mark::Note, text);
    }

    /// Records `mark`, said as `text`, now.
    pub(super) fn mark(&mut self, mark: Mark, text: impl Into<String>) {
        self.mark_at(Instant::now(), mark, text);
    }

    /// Records `mark`, said as `text`, at `instant` (the timeline is sorted by time).
    pub(super) fn mark_at(&mut self, instant: Instant, mark: Mark, text: impl Into<String>) {
        let text = text.into();
        let at = instant.saturating_duration_since(self.t0);
        if self.lab.live {
            println!("  {:>7.3}s  {text}", at.as_secs_f64());
        }
        self.timeline.push(Event::new(at, mark, text));
    }

    /// Records that the lab broke something at `instant` (`label`: a few words for the
    /// picture, `text`: the timeline's sentence); returns the id that ends it.
    pub(super) fn fault_at(
        &mut self,
        instant: Instant,
        label: &str,
        text: impl Into<String>,
    ) -> u32 {
        let id = self.faults;
        self.faults += 1;
        let label = label.to_owned();
        self.mark_at(instant, Mark::FaultBegins { id, label }, text);
        id
    }

    /// Records that the lab broke something now; see [`Ctx::fault_at`].
    pub(super) fn fault(&mut self, label: &str, text: impl Into<String>) -> u32 {
        self.fault_at(Instant::now(), label, text)
    }

    /// Records that the fault `id` is over now.
    pub(super) fn fault_ends(&mut self, id: u32, label: &str, text: impl Into<String>) {
        let label = label.to_owned();
        self.mark(Mark::FaultEnds { id, label }, text);
    }

    /// Records something the servers did now.
    pub(super) fn server(&mut self, label: &str, text: impl Into<String>) {
        let label = label.to_owned();
        self.mark(Mark::Server { label }, text);
    }

    /// Records `who`'s grant of `token`, now.
    pub(super) fn granted(&mut self, who: Actor, token: FencingToken, text: impl Into<String>) {
        self.granted_at(Instant::now(), who, token, text);
    }

    /// Records `who`'s grant of `token`, at `instant`.
    pub(super) fn granted_at(
        &mut self,
        instant: Instant,
        who: Actor,
        token: FencingToken,
        text: impl Into<String>,
    ) {
        let token = token.get();
        self.mark_at(instant, Mark::Granted { who, token }, text);
    }

    /// Records `who`'s attempt that did not get the key.
    pub(super) fn denied(&mut self, who: Actor, label: &str, text: impl Into<String>) {
        let label = label.to_owned();
        self.mark(Mark::Denied { who, label }, text);
    }

    /// Records a write to the fenced store.
    pub(super) fn wrote(
        &mut self,
        who: Actor,
        token: FencingToken,
        outcome: WriteOutcome,
        text: impl Into<String>,
    ) {
        let token = token.get();
        self.mark(
            Mark::Write {
                who,
                token,
                outcome,
            },
            text,
        );
    }

    pub(super) async fn locker(&mut self, url: &str) -> Result<Locker, LabError> {
        let locker = self.lab.locker(url).await?;
        self.consistency = Some(locker.info().consistency);
        Ok(locker)
    }

    /// The store holders write to.
    pub(super) fn store(&self) -> Result<&FencedStore, LabError> {
        self.store
            .as_ref()
            .ok_or_else(|| LabError::new("the fenced store was not opened"))
    }

    /// A fenced write by a current holder: must be accepted.
    pub(super) async fn write(&mut self, who: Actor, token: FencingToken) -> Result<(), LabError> {
        let who_name = who.name();
        match self.store()?.write(token, who_name).await? {
            Ok(()) => {
                self.accepted_writes
                    .push((token.get(), who_name.to_owned()));
                self.wrote(
                    who,
                    token,
                    WriteOutcome::Accepted,
                    format!("{who_name} writes with token {token}: accepted"),
                );
                Ok(())
            }
            Err(stale) => Err(LabError::new(format!(
                "{who_name} holds the lock but its write was refused: {stale}"
            ))),
        }
    }

    /// A fenced write by a holder that has been superseded.
    pub(super) async fn stale_write(
        &mut self,
        who: Actor,
        token: FencingToken,
    ) -> Result<(), LabError> {
        let who_name = who.name();
        match self.store()?.write(token, who_name).await? {
            Ok(()) => {
                self.accepted_writes
                    .push((token.get(), who_name.to_owned()));
                self.stale = Stale::Accepted;
                self.wrote(
                    who,
                    token,
                    WriteOutcome::StaleAccepted,
                    format!(
                        "{who_name} writes with stale token {token}: ACCEPTED (fencing failed)"
                    ),
                );
            }
            Err(stale) => {
                self.stale = Stale::Refused;
                self.wrote(
                    who,
                    token,
                    WriteOutcome::Refused,
                    format!("{who_name} writes with token {token}: refused ({stale})"),
                );
            }
        }
        Ok(())
    }

    /// Opens the history record of `guard`, held by `who`.
    pub(super) fn open(&mut self, who: &str, guard: LockGuard) -> Hold {
        let open = self.history.begin(who, &guard);
        (guard, open)
    }

    /// A rival was granted: record it.
    pub(super) fn rival_granted(&mut self, guard: &LockGuard) {
        let now = Instant::now();
        self.rival_at.get_or_insert(now);
        self.granted_at(
            now,
            Actor::Rival,
            guard.token(),
            format!("rival granted, token {}", guard.token()),
        );
    }

    /// The holder's guard fired (or was found) lost.
    pub(super) fn holder_lost(&mut self, guard: &LockGuard, reason: LostReason) {
        let at = guard.lost_at().unwrap_or_else(Instant::now);
        self.holder_lost_at.get_or_insert(at);
        self.mark_at(
            at,
            Mark::Lost { who: Actor::Holder },
            format!("holder's guard fired lost ({reason:?})"),
        );
    }

    /// Tries to take the key during an outage, for at most `limit`; notes the outcome and
    /// returns a grant if there was one.
    pub(super) async fn attempt(
        &mut self,
        locker: &Locker,
        ttl: Duration,
        wait: Duration,
        limit: Duration,
    ) -> Option<LockGuard> {
        let key = self.key.clone();
        let tried = tokio::time::timeout(limit, locker.acquire(&key).ttl(ttl).wait(wait)).await;
        match tried {
            Ok(Ok(guard)) => {
                self.rival_granted(&guard);
                Some(guard)
            }
            Ok(Err(e)) => {
                self.denied(Actor::Rival, "refused", format!("rival refused: {e}"));
                None
            }
            Err(_) => {
                self.denied(
                    Actor::Rival,
                    "no answer",
                    format!(
                        "rival got no answer within {:.0} s (attempt cancelled)",
                        limit.as_secs_f64()
                    ),
                );
                None
            }
        }
    }

    pub(super) fn observed(&self) -> Observed {
        let violations = self.history.violations();
        let double_grant = violations
            .iter()
            .any(|v| matches!(v, lockkit_conformance::Violation::Overlap { .. }));
        let lost = match (self.holder_lost_at, self.rival_at) {
            (None, _) => LostSignal::Never,
            (Some(lost), Some(rival)) if rival < lost => LostSignal::AfterRival,
            (Some(_), _) => LostSignal::BeforeRival,
        };
        Observed {
            double_grant,
            lost,
            stale: self.stale,
            violations,
        }
    }
}

/// A hold and its open history record.
pub(super) type Hold = (LockGuard, OpenHold);
