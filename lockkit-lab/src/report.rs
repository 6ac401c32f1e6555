//! What a scenario expects, what a run observed, and the report that compares them.

use std::{fmt, time::Duration};

use lockkit_core::Consistency;

use lockkit_conformance::Violation;

use crate::timeline::Event;

/// When the first holder's guard fired lost, relative to a rival's grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostSignal {
    /// Fired before any rival was granted (or no rival was granted at all).
    BeforeRival,
    /// Fired, but only after a rival was granted (a pause or an unseen server loss).
    AfterRival,
    /// Never fired: the lock was kept.
    Never,
}

impl fmt::Display for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostSignal::BeforeRival => "yes, before a rival's grant",
            LostSignal::AfterRival => "yes, after a rival's grant",
            LostSignal::Never => "no (lock kept)",
        })
    }
}

/// What happened to a write made with a superseded holder's token after the newer holder
/// wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// The fenced store refused it.
    Refused,
    /// The fenced store accepted it: fencing failed.
    Accepted,
    /// Nobody was superseded while holding (the lock was kept, then released).
    NoStaleHolder,
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stale::Refused => "yes",
            Stale::Accepted => "NO: accepted",
            Stale::NoStaleHolder => "n/a (no stale holder)",
        })
    }
}

/// What a scenario expects of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// Two holders at once.
    pub double_grant: bool,
    /// The first holder's loss signal.
    pub lost: LostSignal,
    /// The stale holder's write.
    pub stale: Stale,
}

/// What a run saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The history checker found overlapping holds.
    pub double_grant: bool,
    /// The first holder's loss signal.
    pub lost: LostSignal,
    /// The stale holder's write.
    pub stale: Stale,
    /// Violations the history checker found (overlaps and tokens that did not grow).
    pub violations: Vec<Violation>,
}

/// The result of one scenario run.
#[derive(Debug, Clone)]
pub struct Report {
    /// Scenario id, e.g. `holder-paused`.
    pub scenario: &'static str,
    /// Backend label, e.g. `redis`.
    pub backend: &'static str,
    /// The backend's declared consistency, once connected.
    pub consistency: Option<Consistency>,
    /// What was expected.
    pub expect: Expect,
    /// What was seen, if the run got far enough to judge.
    pub observed: Option<Observed>,
    /// The timeline: offset from the start, what kind of thing happened, and what.
    pub timeline: Vec<Event>,
    /// Why the run failed (empty when it passed).
    pub problems: Vec<String>,
    /// How long it took, restoring the servers included.
    pub elapsed: Duration,
}

impl Report {
    /// Whether the run saw exactly what it expects, within the time limit.
    pub fn passed(&self) -> bool {
        self.problems.is_empty() && self.observed.is_some()
    }

    /// `scenario/backend`.
    pub fn name(&self) -> String {
        format!("{}/{}", self.scenario, self.backend)
    }
}

/// Compares an observation with the expectation; returns the mismatches, worded loudly.
pub(crate) fn judge(expect: &Expect, seen: &Observed) -> Vec<String> {
    let mut problems = Vec::new();
    match (expect.double_grant, seen.double_grant) {
        (true, false) => problems.push(
            "EXPECTED A DOUBLE GRANT AND SAW NONE: the scenario did not reproduce the hazard it \
             exists to show (or the checker is blind to it)"
                .to_owned(),
        ),
        (false, true) => problems.push(format!(
            "UNEXPECTED DOUBLE GRANT: {}",
            seen.violations
                .iter()
                .filter(|v| matches!(v, Violation::Overlap { .. }))
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        )),
        _ => {}
    }
    for v in &seen.violations {
        if matches!(v, Violation::TokenNotIncreasing { .. }) {
            problems.push(format!("FENCING TOKEN DID NOT GROW: {v}"));
        }
    }
    if expect.lost != seen.lost {
        problems.push(format!(
            "lost signal: expected `{}`, saw `{}`",
            expect.lost, seen.lost
        ));
    }
    if seen.stale == Stale::Accepted {
        problems.push("A STALE WRITE WAS ACCEPTED: fencing failed".to_owned());
    } else if expect.stale != seen.stale {
        problems.push(format!(
            "stale write: expected `{}`, saw `{}`",
            expect.stale, seen.stale
        ));
    }
    problems
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "== {} ==", self.name())?;
        for event in &self.timeline {
            writeln!(f, "  {:>7.3}s  {}", event.at.as_secs_f64(), event.text)?;
        }
        match &self.observed {
            Some(seen) => {
                writeln!(
                    f,
                    "  double grant: {} (expected {})",
                    yes_no(seen.double_grant),
                    yes_no(self.expect.double_grant)
                )?;
                for v in &seen.violations {
                    writeln!(f, "    checker: {v}")?;
                }
                writeln!(
                    f,
                    "  lost signalled: {} (expected {})",
                    seen.lost, self.expect.lost
                )?;
                writeln!(
                    f,
                    "  stale write refused: {} (expected {})",
                    seen.stale, self.expect.stale
                )?;
            }
            None => writeln!(f, "  (the run stopped before it could be judged)")?,
        }
        if self.problems.is_empty() {
            writeln!(
                f,
                "  verdict: as expected ({:.1} s)",
                self.elapsed.as_secs_f64()
            )
        } else {
            writeln!(f, "  verdict: FAILED ({:.1} s)", self.elapsed.as_secs_f64())?;
            for p in &self.problems {
                writeln!(f, "    - {p}")?;
            }
            Ok(())
        }
    }
}

pub(crate) fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(double_grant: bool, lost: LostSignal, stale: Stale) -> Observed {
        Observed {
            double_grant,
            lost,
            stale,
            violations: Vec::new(),
        }
    }

    const HAZARD: Expect = Expect {
        double_grant: true,
        lost: LostSignal::AfterRival,
        stale: Stale::Refused,
    };
    const SAFE: Expect = Expect {
        double_grant: false,
        lost: LostSignal::BeforeRival,
        stale: Stale::Refused,
    };

    #[test]
    fn a_run_that_matches_passes() {
        assert!(judge(&HAZARD, &seen(true, LostSignal::AfterRival, Stale::Refused)).is_empty());
        assert!(judge(&SAFE, &seen(false, LostSignal::BeforeRival, Stale::Refused)).is_empty());
    }

    #[test]
    fn a_missing_expected_double_grant_fails_loudly() {
        let problems = judge(
            &HAZARD,
            &seen(false, LostSignal::AfterRival, Stale::Refused),
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("EXPECTED A DOUBLE GRANT AND SAW NONE"));
    }

    #[test]
    fn an_unexpected_double_grant_fails_loudly() {
        let mut observed = seen(true, LostSignal::BeforeRival, Stale::Refused);
        observed.violations.push(Violation::Overlap {
            key: "k".into(),
            first: ("a".into(), 1),
            second: ("b".into(), 2),
        });
        let problems = judge(&SAFE, &observed);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("UNEXPECTED DOUBLE GRANT: double grant on `k`"));
    }

    #[test]
    fn an_accepted_stale_write_and_a_shrinking_token_always_fail() {
        let mut observed = seen(true, LostSignal::AfterRival, Stale::Accepted);
        observed.violations.push(Violation::TokenNotIncreasing {
            key: "k".into(),
            earlier: 5,
            later: 1,
        });
        let problems = judge(&HAZARD, &observed);
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("A STALE WRITE WAS ACCEPTED"))
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("FENCING TOKEN DID NOT GROW"))
        );
    }

    #[test]
    fn a_wrong_lost_signal_fails() {
        let problems = judge(&SAFE, &seen(false, LostSignal::Never, Stale::NoStaleHolder));
        assert_eq!(problems.len(), 2, "{problems:?}");
    }
}
