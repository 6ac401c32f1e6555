//! The history checker: records holds and proves that valid holds never overlap and that
//! tokens strictly grow.

use std::{
    fmt,
    sync::{Arc, Mutex},
};

use lockkit_core::{FencingToken, LockGuard, LockKey};
use tokio::time::Instant;

/// One hold as observed by its holder: from the moment the grant came back to the moment
/// the holder stopped relying on it (before sending the release, or the local lease
/// deadline if it was lost).
#[derive(Debug, Clone)]
pub struct HoldRecord {
    /// Who held it (free text: client number, process).
    pub holder: String,
    /// The key.
    pub key: LockKey,
    /// The holder's token.
    pub token: FencingToken,
    /// Grant observed.
    pub start: Instant,
    /// Hold given up, or `None` if lost: a lost hold ended at an unknown point no later
    /// than its local lease deadline, recorded in `valid_until`.
    pub end: Option<Instant>,
    /// The last local lease deadline seen while valid.
    pub valid_until: Option<Instant>,
}

impl HoldRecord {
    /// The last instant the holder could believe it held the lock.
    pub fn believed_until(&self) -> Option<Instant> {
        match (self.end, self.valid_until) {
            (Some(end), Some(valid)) => Some(end.min(valid)),
            (end, valid) => end.or(valid),
        }
    }
}

/// A violation of the lock contract found in a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Two holds of one key overlapped in time.
    Overlap {
        /// The key.
        key: String,
        /// The earlier hold's holder and token.
        first: (String, u64),
        /// The later hold's holder and token.
        second: (String, u64),
    },
    /// A later holder got a token that is not greater than an earlier holder's.
    TokenNotIncreasing {
        /// The key.
        key: String,
        /// The earlier token.
        earlier: u64,
        /// The later token.
        later: u64,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Overlap { key, first, second } => write!(
                f,
                "double grant on `{key}`: {} (token {}) still held when {} (token {}) was granted",
                first.0, first.1, second.0, second.1
            ),
            Violation::TokenNotIncreasing {
                key,
                earlier,
                later,
            } => write!(
                f,
                "token did not grow on `{key}`: {later} was granted after {earlier}"
            ),
        }
    }
}

/// A thread-safe log of holds. Clone it into every task.
#[derive(Debug, Clone, Default)]
pub struct History {
    holds: Arc<Mutex<Vec<HoldRecord>>>,
}

/// An open hold in a [`History`]; close it with [`History::end`].
#[derive(Debug)]
#[must_use = "close the record with History::end"]
pub struct OpenHold {
    record: HoldRecord,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `holder` was just granted `guard`.
    pub fn begin(&self, holder: impl Into<String>, guard: &LockGuard) -> OpenHold {
        self.begin_at(holder, guard, Instant::now())
    }

    /// Records that `holder` was granted `guard` at `granted` (when the grant was observed
    /// earlier than the record is made).
    pub fn begin_at(
        &self,
        holder: impl Into<String>,
        guard: &LockGuard,
        granted: Instant,
    ) -> OpenHold {
        OpenHold {
            record: HoldRecord {
                holder: holder.into(),
                key: guard.key().clone(),
                token: guard.token(),
                start: granted,
                end: None,
                valid_until: guard.valid_until(),
            },
        }
    }

    /// Records that the holder stops relying on the lock now (call before releasing). A
    /// hold found lost ended when the loss was noticed (its local lease deadline at the
    /// latest).
    pub fn end(&self, open: OpenHold, guard: &LockGuard) {
        let mut record = open.record;
        if guard.is_valid() {
            record.end = Some(Instant::now());
            record.valid_until = guard.valid_until();
        } else if let Some(lost_at) = guard.lost_at() {
            record.end = Some(lost_at);
            record.valid_until = None;
        }
        self.push(record);
    }

    /// Adds a finished record directly (e.g. one reported by another process).
    pub fn push(&self, record: HoldRecord) {
        self.holds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }

    /// All records so far.
    pub fn records(&self) -> Vec<HoldRecord> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Checks the history: per key, holds ordered by grant must not overlap (a hold ends
    /// at the earlier of its release and its local lease deadline), and tokens must
    /// strictly grow in grant order.
    pub fn violations(&self) -> Vec<Violation> {
        check(self.records())
    }

    /// Panics with every violation listed, if there is any.
    pub fn assert_linear(&self) {
        let violations = self.violations();
        assert!(
            violations.is_empty(),
            "history has {} violation(s):\n{}",
            violations.len(),
            violations
                .iter()
                .map(|v| format!("  - {v}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Checks a list of records; see [`History::violations`].
pub fn check(mut records: Vec<HoldRecord>) -> Vec<Violation> {
    records.sort_by(|a, b| (a.key.as_str(), a.start).cmp(&(b.key.as_str(), b.start)));
    let mut violations = Vec::new();
    for pair in records.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.key != b.key {
            continue;
        }
        // The same holder going on with the same hold (it let go and took the key again
        // before its release reached the server): one holder, one token.
        let continued = a.holder == b.holder && a.token == b.token;
        if b.token <= a.token && !continued {
            violations.push(Violation::TokenNotIncreasing {
                key: a.key.to_string(),
                earlier: a.token.get(),
                later: b.token.get(),
            });
        }
    }
    // Overlap: each hold against every earlier hold of the same key still believed held.
    for (i, b) in records.iter().enumerate() {
        for a in records[..i].iter().filter(|a| a.key == b.key) {
            // One owner holding the key twice at once (reentrantly, from two tasks) is one
            // hold: one holder, one token.
            if a.holder == b.holder && a.token == b.token {
                continue;
            }
            if a.believed_until().is_some_and(|until| until > b.start) {
                violations.push(Violation::Overlap {
                    key: b.key.to_string(),
                    first: (a.holder.clone(), a.token.get()),
                    second: (b.holder.clone(), b.token.get()),
                });
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn rec(holder: &str, token: u64, start: Instant, ms: u64) -> HoldRecord {
        HoldRecord {
            holder: holder.into(),
            key: LockKey::new("k").unwrap(),
            token: FencingToken::new(token),
            start,
            end: Some(start + Duration::from_millis(ms)),
            valid_until: Some(start + Duration::from_secs(60)),
        }
    }

    #[test]
    fn clean_history_passes() {
        let t0 = Instant::now();
        let recs = vec![
            rec("a", 1, t0, 10),
            rec("b", 2, t0 + Duration::from_millis(10), 10),
        ];
        assert_eq!(check(recs), vec![]);
    }

    #[test]
    fn flags_overlap_and_token_regression() {
        let t0 = Instant::now();
        let recs = vec![
            rec("a", 5, t0, 100),
            rec("b", 4, t0 + Duration::from_millis(50), 10),
        ];
        let v = check(recs);
        assert!(
            v.iter().any(|v| matches!(v, Violation::Overlap { .. })),
            "{v:?}"
        );
        assert!(
            v.iter()
                .any(|v| matches!(v, Violation::TokenNotIncreasing { .. })),
            "{v:?}"
        );
    }

    #[test]
    fn a_lost_hold_counts_until_its_lease_deadline() {
        let t0 = Instant::now();
        let mut lost = rec("a", 1, t0, 0);
        lost.end = None;
        lost.valid_until = Some(t0 + Duration::from_millis(100));
        let recs = vec![lost, rec("b", 2, t0 + Duration::from_millis(50), 10)];
        assert_eq!(check(recs).len(), 1);
    }
}
