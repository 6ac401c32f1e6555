//! # lockkit-conformance
//!
//! The one behaviour suite every lockkit backend passes. Each case is a plain
//! `pub async fn case<H: Harness>(h: &H) -> Outcome` in [`cases`]; the [`suite!`] macro
//! instantiates one `#[test]` per case of the [`CATALOGUE`] for a backend, and
//! [`run_all`] runs them all for backend authors outside this workspace.
//!
//! ```ignore
//! // tests/conformance.rs of a backend crate
//! lockkit_conformance::suite!(Some(my_backend::TestHarness::new().await));
//! ```
//!
//! Besides the cases it ships the tools they use: a [`History`] checker (valid holds never
//! overlap; tokens strictly grow), a [`FaultProxy`] (cut, reset, delay, heal a TCP link),
//! a child-process lock holder ([`holder`]), and fenced/unfenced toy stores.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod bench;
pub mod cases;
pub mod env;
pub mod fenced;
mod file_harness;
pub mod fleet;
pub mod harness;
pub mod history;
pub mod holder;
pub mod ledger;
mod memory_harness;
mod own_redis;
pub mod proxy;
pub mod rng;
pub mod silence;
mod support;

use std::{
    collections::HashMap,
    future::Future,
    io::Write,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

pub use fenced::{FencedStore, StaleToken, UnfencedStore};
pub use file_harness::FileHarness;
pub use harness::{Harness, HookError, HookResult};
pub use history::{History, Violation};
pub use ledger::{Ledger, LedgerSummary};
pub use lockkit_core;
pub use memory_harness::MemoryHarness;
pub use own_redis::OwnRedis;
pub use proxy::{FaultProxy, LinkState, ProxiedClients};
pub use rng::{Rng, torture_seed};
pub use silence::SilencedLinks;
pub use support::{Check, Space};

/// How one case ended, when it did not fail (failing cases panic).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// The case could not run on this harness (a hook or capability is missing).
    Skipped(String),
}

/// The longest a single case may run before it fails.
pub const CASE_LIMIT: Duration = Duration::from_secs(120);

/// The list of every case, as `module::case`, in one place. Everything else is generated
/// from it: [`CATALOGUE`], [`run_all`] and the tests of [`suite!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __with_catalogue {
    ($callback:ident { $($args:tt)* }) => {
        $crate::$callback! { { $($args)* }
            exclusion::acquire_release_reacquire,
            exclusion::contended_try_acquire_is_none,
            exclusion::independent_keys_do_not_contend,
            exclusion::counter_is_exact_under_contention,
            exclusion::release_relock_loop,
            exclusion::child_process_hold_blocks_parent,
            lease::unrenewed_lease_expires,
            lease::watchdog_keeps_lease_alive,
            lease::renewal_stops_on_release,
            lease::renewal_stops_on_drop,
            lease::max_hold_caps_renewal,
            lease::extend_moves_expiry,
            lease::extend_after_expiry_is_lost,
            lease::renew_after_release_is_not_held,
            lease::validity_tracks_the_lease,
            lease::expired_lease_is_gone,
            lease::extend_sets_the_watchdog_ttl,
            lease::extend_to_a_shorter_ttl_keeps_renewing,
            lease::extend_below_renew_every_keeps_renewing,
            ownership::foreign_release_is_refused,
            ownership::a_dropped_release_leaves_no_orphan,
            ownership::a_release_on_a_cut_link_ends,
            ownership::foreign_renew_is_refused,
            ownership::late_release_spares_next_holder,
            ownership::double_release_is_harmless,
            ownership::inspect_reports_holder,
            ownership::inspect_free_key_is_none,
            fencing::tokens_strictly_increase,
            fencing::tokens_increase_under_concurrency,
            fencing::paused_holder_fenced_write_is_rejected,
            fencing::tokens_grow_after_holder_crash,
            reentrancy::same_owner_needs_as_many_releases,
            reentrancy::nested_holds_keep_token,
            reentrancy::other_owner_on_same_connection_is_excluded,
            reentrancy::loss_invalidates_every_depth,
            reentrancy::plain_acquire_is_not_reentrant,
            reentrancy::reenter_from_guard,
            reentrancy::reentry_resets_lease,
            reentrancy::shorter_reentry_never_cuts_the_outer_lease,
            reentrancy::stale_guard_spares_the_owners_newer_hold,
            reentrancy::lost_owner_is_excluded_while_another_holds,
            reentrancy::concurrent_acquisitions_of_one_owner_keep_the_key,
            reentrancy::a_retried_attempt_takes_effect_once,
            reentrancy::cancelled_reentry_leaves_no_depth,
            reentrancy::longer_reentry_extends_the_lease,
            reentrancy::a_reentry_racing_the_last_release_is_granted,
            reentrancy::sibling_releases_never_fire_the_loss_signal,
            reentrancy::a_retried_attempt_keeps_the_lease_it_reports,
            waiting::zero_wait_returns_at_once,
            waiting::wait_times_out_near_deadline,
            waiting::waiter_is_woken_promptly_by_release,
            waiting::inspect_counts_waiters,
            waiting::waiter_acquires_after_holder_expires,
            waiting::cancelled_waiter_leaves_no_residue,
            waiting::cancelled_acquire_leaves_no_orphan,
            waiting::many_waiters_all_acquire,
            waiting::waiter_is_woken_when_holder_session_ends,
            waiting::waiter_does_not_poll_the_server,
            waiting::release_wakes_only_the_next_waiter,
            waiting::a_long_wait_yields_a_full_lease,
            waiting::a_wait_on_a_cut_link_ends,
            waiting::a_clients_waiters_reach_the_server_one_at_a_time,
            lost::lost_fires_when_taken_away,
            lost::late_subscriber_sees_loss_at_once,
            lost::no_false_alarm_for_idle_holder,
            lost::lost_fires_when_connection_killed,
            lost::lost_guard_release_returns_lost,
            lost::session_loss_is_pushed,
            lost::cut_off_holder_gives_up_before_a_rival_is_granted,
            crash::killed_holder_frees_key_within_ttl,
            crash::stopped_holder_loses_key_and_reports_lost,
            bad_input::empty_key_is_refused,
            bad_input::oversized_key_is_refused,
            bad_input::odd_keys_are_distinct_or_refused,
            bad_input::control_chars_are_refused,
            bad_input::zero_ttl_is_refused,
            bad_input::ttl_outside_backend_range_is_refused,
            bad_input::huge_ttls_are_refused_or_held,
            bad_input::invalid_options_are_refused,
            bad_input::bad_url_is_refused,
            randomized::histories_stay_linear,
            rw::unsupported_kinds_are_refused,
            rw::readers_share,
            rw::writer_excludes_readers_and_writers,
            rw::reads_reenter_and_writes_downgrade,
            rw::upgrade_is_refused,
            rw::a_cancelled_writer_leaves_no_marker,
            rw::a_cancelled_plain_lock_leaves_no_marker,
            rw::a_waiting_writer_keeps_out_its_own_owners_new_read,
            rw::a_short_reentry_given_back_keeps_the_longer_read,
            rw::waiting_writer_blocks_new_readers,
            rw::a_waiting_plain_lock_blocks_new_readers,
            rw::writer_is_not_starved_by_readers,
            rw::read_write_histories_stay_exclusive,
            rw::a_write_reentered_after_a_downgrade_keeps_its_token,
            semaphore::permits_bound_the_holders,
            semaphore::a_different_permit_count_is_refused,
            semaphore::permits_never_exceed_the_limit,
            semaphore::a_waiter_gets_the_permit_given_back,
            semaphore::a_killed_holders_permit_comes_back,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __catalogue_names {
    ({} $($module:ident :: $case:ident),* $(,)?) => {
        /// Every case, as `module::case`.
        pub const CATALOGUE: &[&str] = &[$(concat!(stringify!($module), "::", stringify!($case))),*];
    };
}

__with_catalogue!(__catalogue_names {});

#[doc(hidden)]
#[macro_export]
macro_rules! __run_all {
    ({} $($module:ident :: $case:ident),* $(,)?) => {
        /// Runs every case against `harness`, one after another, and reports each outcome;
        /// a failed case is reported with its panic message instead of aborting the run.
        pub async fn run_all<H: Harness>(harness: Arc<H>) -> Report {
            let mut report = Report::default();
            $(
                let h = harness.clone();
                let name = concat!(stringify!($module), "::", stringify!($case));
                let run = tokio::spawn(async move {
                    tokio::time::timeout(CASE_LIMIT, $crate::cases::$module::$case(&*h)).await
                });
                report.record(name, run.await);
            )*
            report
        }
    };
}

__with_catalogue!(__run_all {});

/// The outcome of [`run_all`].
#[derive(Debug, Default)]
pub struct Report {
    /// Cases that passed.
    pub passed: Vec<&'static str>,
    /// Cases skipped, with the reason.
    pub skipped: Vec<(&'static str, String)>,
    /// Cases that failed, with the message.
    pub failed: Vec<(&'static str, String)>,
}

impl Report {
    fn record(
        &mut self,
        name: &'static str,
        run: Result<Result<Outcome, tokio::time::error::Elapsed>, tokio::task::JoinError>,
    ) {
        match run {
            Ok(Ok(Outcome::Passed)) => self.passed.push(name),
            Ok(Ok(Outcome::Skipped(why))) => self.skipped.push((name, why)),
            Ok(Err(_)) => self
                .failed
                .push((name, format!("did not finish within {CASE_LIMIT:?}"))),
            Err(e) => self.failed.push((name, panic_message(e))),
        }
    }

    /// True when no case failed.
    pub fn is_success(&self) -> bool {
        self.failed.is_empty()
    }
}

fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panicked".into()),
        Err(e) => e.to_string(),
    }
}

/// Runs one case on a fresh multi-threaded runtime; used by [`suite!`].
///
/// `make` builds the harness (`None`: the servers are not configured; the case is
/// skipped loudly, or fails in CI through [`env::service_url`]).
pub fn run_case<H, M, C, F>(name: &str, suite_module: &str, make: M, case: C)
where
    H: Harness,
    M: Future<Output = Option<H>>,
    C: FnOnce(Arc<H>) -> F,
    F: Future<Output = Outcome>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot start a Tokio runtime: {e}"));
    let permit = runtime.block_on(async {
        let Some(harness) = make.await else {
            report_skip(
                name,
                "the harness is not configured (see the SKIPPED line above)",
            );
            return None;
        };
        let harness = Arc::new(harness);
        let label = harness.name();
        // Waiting for a permit is not the case's time: the limit starts once it has one.
        let permit = match harness.parallel_cases() {
            Some(bound) => Some(
                case_gate(&label, bound)
                    .acquire_owned()
                    .await
                    .unwrap_or_else(|e| panic!("the case gate of {label} is closed: {e}")),
            ),
            None => None,
        };
        let run = holder::with_entry(suite_module, case(harness));
        match tokio::time::timeout(CASE_LIMIT, run).await {
            Ok(Outcome::Passed) => {}
            Ok(Outcome::Skipped(why)) => report_skip(&format!("{name} on {label}"), &why),
            Err(_) => panic!("{name} on {label} did not finish within {CASE_LIMIT:?}"),
        }
        permit
    });
    // The permit is given back only once the case's tasks (its clients' sessions) are gone.
    runtime.shutdown_timeout(Duration::from_secs(5));
    drop(permit);
}

/// The semaphore bounding how many cases of the harness named `name` run at once in this
/// process ([`Harness::parallel_cases`]): made with `bound` permits by the first case of
/// that harness to ask. Tokio's semaphore serves every case's own runtime.
fn case_gate(name: &str, bound: usize) -> Arc<tokio::sync::Semaphore> {
    static GATES: OnceLock<Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>> = OnceLock::new();
    let mut gates = GATES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    gates
        .entry(name.to_owned())
        .or_insert_with(|| {
            let permits = bound.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
            Arc::new(tokio::sync::Semaphore::new(permits))
        })
        .clone()
}

/// Prints a skip to the real stderr, so the test harness's capture cannot hide it.
fn report_skip(what: &str, why: &str) {
    let _ = writeln!(
        std::io::stderr(),
        "lockkit-conformance: SKIPPED {what}: {why}"
    );
}

/// Runs the child-process helper if this process was started as one; used by [`suite!`].
pub fn run_holder_child<H, M>(make: M)
where
    H: Harness,
    M: Future<Output = Option<H>>,
{
    let Ok(runtime) = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    else {
        return;
    };
    runtime.block_on(async {
        if let Some(harness) = make.await {
            holder::child_main(&harness).await;
        }
    });
}

/// Fails unless every case of the [`CATALOGUE`] is a test of this test binary under
/// `suite_module` (give it `module_path!()`). [`suite!`] calls it; call it yourself if you
/// instantiate cases by hand.
pub fn assert_catalogue_instantiated(suite_module: &str) {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("no test binary: {e}"));
    let listing = std::process::Command::new(exe)
        .args(["--list", "--format", "terse"])
        .output()
        .unwrap_or_else(|e| panic!("cannot list the tests of this binary: {e}"));
    let listing = String::from_utf8_lossy(&listing.stdout);
    let prefix = suite_module
        .split_once("::")
        .map_or(String::new(), |(_, rest)| format!("{rest}::"));
    let missing: Vec<&str> = CATALOGUE
        .iter()
        .filter(|entry| {
            let case = entry.rsplit("::").next().unwrap_or(entry);
            !listing
                .lines()
                .any(|line| line == format!("{prefix}{case}: test"))
        })
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "this backend's suite omits {} conformance case(s): {missing:?}",
        missing.len()
    );
}

#[doc(hidden)]
#[macro_export]
macro_rules! __suite_tests {
    ({ $harness:expr } $($module:ident :: $case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::run_case(
                    concat!(stringify!($module), "::", stringify!($case)),
                    module_path!(),
                    async { $harness },
                    |h| async move { $crate::cases::$module::$case(&*h).await },
                );
            }
        )*

        #[test]
        fn catalogue_is_complete() {
            $crate::assert_catalogue_instantiated(module_path!());
        }

        #[test]
        #[ignore = "entry point of the conformance suite's child-process lock holder"]
        fn __lockkit_holder_child() {
            $crate::run_holder_child(async { $harness });
        }
    };
}

/// Instantiates the whole conformance suite for a backend: one `#[test]` per case, a test
/// that fails if any case of the catalogue is missing, and the child-process entry point.
///
/// The argument is an expression of type `Option<impl Harness>`, evaluated inside an async
/// block (it may `.await`), once per test. `None` means the backend's servers are not
/// configured: every case is skipped loudly, or fails in CI (use [`env::service_url`]).
/// Invoke it inside its own module so that test names read `module::case`.
#[macro_export]
macro_rules! suite {
    ($harness:expr) => {
        $crate::__with_catalogue!(__suite_tests { $harness });
    };
}
