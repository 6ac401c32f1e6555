//! The acquisitions behind an owner's holds on one key, so a retried acquisition or
//! release takes effect once (see [`crate::AcquireRequest::attempt`]).

use uuid::Uuid;

/// The attempt ids whose acquisitions hold a key now, for backends that keep the hold
/// count themselves (in memory, in a file, in a table row, in a local registry).
///
/// - An acquisition whose attempt is already recorded took effect: grant it again at the
///   same depth ([`AttemptLedger::has`]).
/// - A release gives back a hold only for an attempt recorded here, once
///   ([`AttemptLedger::take`]); the nil attempt, and holds the ledger never saw (state
///   written before ledgers existed), are released unconditionally.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptLedger(Vec<Uuid>);

impl AttemptLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        AttemptLedger::default()
    }

    /// Whether `attempt` already added a hold that is still there (never for the nil
    /// attempt).
    pub fn has(&self, attempt: Uuid) -> bool {
        !attempt.is_nil() && self.0.contains(&attempt)
    }

    /// Records the hold `attempt` added (the nil attempt is not recorded).
    pub fn add(&mut self, attempt: Uuid) {
        if !attempt.is_nil() && !self.0.contains(&attempt) {
            self.0.push(attempt);
        }
    }

    /// Whether a release of the hold `attempt` added should take effect now, with `depth`
    /// holds on the key; forgets the attempt if so. False for a recorded attempt released
    /// already: a retried release.
    pub fn take(&mut self, attempt: Uuid, depth: u32) -> bool {
        if attempt.is_nil() {
            return true;
        }
        if let Some(at) = self.0.iter().position(|a| *a == attempt) {
            self.0.remove(at);
            return true;
        }
        // Holds the ledger never saw can only be released this way.
        self.0.len() < usize::try_from(depth).unwrap_or(usize::MAX)
    }

    /// Forgets every attempt (the key was let go).
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Reads [`AttemptLedger::render`]'s text; unreadable ids are skipped.
    pub fn parse(text: &str) -> Self {
        AttemptLedger(
            text.split(',')
                .filter_map(|id| Uuid::try_parse(id.trim()).ok())
                .collect(),
        )
    }

    /// The ids as text without spaces (`-` when empty), for storage beside the hold count.
    pub fn render(&self) -> String {
        if self.0.is_empty() {
            return "-".to_owned();
        }
        self.0
            .iter()
            .map(|id| id.simple().to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retried_acquisitions_and_releases_count_once() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let mut ledger = AttemptLedger::new();
        ledger.add(a);
        assert!(ledger.has(a));
        ledger.add(a);
        ledger.add(b);
        assert!(ledger.take(b, 2));
        assert!(!ledger.take(b, 1), "a retried release takes effect once");
        assert!(
            ledger.take(Uuid::nil(), 1),
            "the nil attempt always releases"
        );
        assert!(!ledger.has(Uuid::nil()));
        let legacy = AttemptLedger::parse("-");
        assert!(legacy.clone().take(a, 1), "a hold the ledger never saw");
        assert_eq!(AttemptLedger::parse(&ledger.render()), ledger);
        assert_eq!(AttemptLedger::new().render(), "-");
    }
}
