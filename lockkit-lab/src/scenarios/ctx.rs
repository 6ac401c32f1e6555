//! One run's state: its timeline, history, fenced store and observations.

use std::time::Duration;

use lockkit_core::{Consistency, FencingToken, LockGuard, LockKey, Locker, LostReason};
use tokio::time::Instant;

use crate::{
    Lab, LabError,
    report::{LostSignal, Observed, Stale},
    store::FencedStore,
};
use lockkit_conformance::{History, history::OpenHold};

/// One run's state: its timeline, history, fenced store and observations.
pub(super) struct Ctx<'a> {
    pub(super) lab: &'a Lab,
    pub(super) t0: Instant,
    pub(super) timeline: Vec<(Duration, String)>,
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
    pub(super) fn note(&mut self, text: impl Into<String>) {
        self.note_at(Instant::now(), text);
    }

    /// Notes something that happened at `instant` (the timeline is sorted by time).
    pub(super) fn note_at(&mut self, instant: Instant, text: impl Into<String>) {
        let text = text.into();
        let at = instant.saturating_duration_since(self.t0);
        if self.lab.live {
            println!("  {:>7.3}s  {text}", at.as_secs_f64());
        }
        self.timeline.push((at, text));
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
    pub(super) async fn write(&mut self, who: &str, token: FencingToken) -> Result<(), LabError> {
        match self.store()?.write(token, who).await? {
            Ok(()) => {
                self.accepted_writes.push((token.get(), who.to_owned()));
                self.note(format!("{who} writes with token {token}: accepted"));
                Ok(())
            }
            Err(stale) => Err(LabError::new(format!(
                "{who} holds the lock but its write was refused: {stale}"
            ))),
        }
    }

    /// A fenced write by a holder that has been superseded.
    pub(super) async fn stale_write(
        &mut self,
        who: &str,
        token: FencingToken,
    ) -> Result<(), LabError> {
        match self.store()?.write(token, who).await? {
            Ok(()) => {
                self.accepted_writes.push((token.get(), who.to_owned()));
                self.stale = Stale::Accepted;
                self.note(format!(
                    "{who} writes with stale token {token}: ACCEPTED (fencing failed)"
                ));
            }
            Err(stale) => {
                self.stale = Stale::Refused;
                self.note(format!(
                    "{who} writes with token {token}: refused ({stale})"
                ));
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
        self.note(format!("rival granted, token {}", guard.token()));
    }

    /// The holder's guard fired (or was found) lost.
    pub(super) fn holder_lost(&mut self, guard: &LockGuard, reason: LostReason) {
        let at = guard.lost_at().unwrap_or_else(Instant::now);
        self.holder_lost_at.get_or_insert(at);
        self.note_at(at, format!("holder's guard fired lost ({reason:?})"));
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
                self.note(format!("rival refused: {e}"));
                None
            }
            Err(_) => {
                self.note(format!(
                    "rival got no answer within {:.0} s (attempt cancelled)",
                    limit.as_secs_f64()
                ));
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
