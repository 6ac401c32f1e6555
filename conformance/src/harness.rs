//! What a backend gives the suite: fresh clients, timings, and fault hooks.

use std::{fmt, time::Duration};

use async_trait::async_trait;
use lockkit_core::{LockKey, Locker};

/// Why a fault hook did not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookError {
    /// The harness does not offer this hook: the case is reported as skipped, visibly.
    Unsupported(String),
    /// The hook was tried and failed: the case fails.
    Failed(String),
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookError::Unsupported(why) => write!(f, "hook not supported: {why}"),
            HookError::Failed(why) => write!(f, "hook failed: {why}"),
        }
    }
}

/// Result of a fault hook.
pub type HookResult<T = ()> = Result<T, HookError>;

fn unsupported<T>(what: &str) -> HookResult<T> {
    Err(HookError::Unsupported(format!(
        "this harness offers no `{what}` hook"
    )))
}

/// A backend under test. Implement it once per backend (and per configuration: single
/// server, cluster, ensemble), then instantiate the suite with [`crate::suite!`].
///
/// Every hook has a default that declares it unsupported; cases that need a missing hook
/// are reported as SKIPPED in the test output, never silently passed.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// A short name for messages, e.g. `redis-single`.
    fn name(&self) -> String;

    /// A fresh client with its own connection or session, so that contention between two
    /// clients is real.
    async fn client(&self) -> Locker;

    /// The lease the suite uses when it waits for expiry: as short as the backend allows
    /// reliably (memory: 300 ms; ZooKeeper: its minimum session timeout).
    fn short_ttl(&self) -> Duration {
        Duration::from_millis(300)
    }

    /// Extra time a backend may take beyond a lease to free a key (ZooKeeper's session
    /// expiry is checked on ticks). Cases bound waits with `ttl + slack` and wide margins.
    fn expiry_slack(&self) -> Duration {
        Duration::from_millis(500)
    }

    /// At most this many cases of this harness run at once in one test process, for a
    /// server that cannot take the suite's concurrency (`RUST_TEST_THREADS`); `None`, the
    /// default: no bound. [`crate::run_case`] holds a permit, shared by every harness of
    /// the same [`Harness::name`] in the process (the first one's bound counts; 0 counts
    /// as 1), from after the harness is made until the case's runtime is shut down (or
    /// the case panics); a case's [`crate::CASE_LIMIT`] starts once it has its permit. A
    /// waiting case still takes one of the test threads.
    fn parallel_cases(&self) -> Option<usize> {
        None
    }

    /// Builds a client from a URL, to check URL validation.
    async fn connect(&self, url: &str) -> lockkit_core::Result<Locker> {
        let _ = url;
        Err(lockkit_core::Error::Config(
            "this harness does not build clients from URLs".into(),
        ))
    }

    /// URLs the backend must refuse with [`lockkit_core::Error::Config`]. Empty: skipped.
    fn malformed_urls(&self) -> Vec<String> {
        Vec::new()
    }

    /// Deletes `key` on the server behind its holder's back (e.g. `DEL`).
    async fn take_away(&self, key: &LockKey) -> HookResult {
        let _ = key;
        unsupported("take_away")
    }

    /// Kills the server-side connection or session of `client` (e.g. `CLIENT KILL`,
    /// ZooKeeper session expiry, MySQL `KILL`).
    async fn kill_connection(&self, client: &Locker) -> HookResult {
        let _ = client;
        unsupported("kill_connection")
    }

    /// Counts server-side state left for keys under `prefix`: lock entries, waiter
    /// registrations, subscriptions, contender nodes. Zero means nothing leaked.
    async fn residue(&self, prefix: &str) -> HookResult<usize> {
        let _ = prefix;
        unsupported("residue")
    }

    /// How many requests `client` (made by [`Harness::client`]) has sent to its servers so
    /// far, counted by the fault proxy in front of it ([`crate::FaultProxy::requests_seen`],
    /// summed over its proxies). Cases use it to tell a notified waiter from a polling one
    /// and a queued hand-off from a herd.
    async fn requests_sent(&self, client: &Locker) -> HookResult<u64> {
        let _ = client;
        unsupported("requests_sent")
    }

    /// How many times `client`'s waiters were woken by a notification from the server (a
    /// ZooKeeper watch firing), where the backend counts them. A herd shows here directly,
    /// unlike in [`Harness::requests_sent`], which keep-alives also raise when a loaded
    /// machine stretches the measuring window.
    async fn watch_wakeups(&self, client: &Locker) -> HookResult<u64> {
        let _ = client;
        unsupported("watch_wakeups")
    }

    /// Delays every chunk on `client`'s links by `delay` (zero heals), through its proxies.
    /// The randomized history test uses it to make replies late and operations time out.
    async fn delay_link(&self, client: &Locker, delay: Duration) -> HookResult {
        let _ = (client, delay);
        unsupported("delay_link")
    }

    /// Stalls (`cut = true`) or reopens (`cut = false`) `client`'s links: bytes are held,
    /// not dropped, so a reopened link goes on where it stopped.
    async fn cut_link(&self, client: &Locker, cut: bool) -> HookResult {
        let _ = (client, cut);
        unsupported("cut_link")
    }

    /// Whether clients in other processes share locks with this one (false for the
    /// in-process memory backend). Cross-process cases run the suite's helper as a child.
    fn cross_process(&self) -> bool {
        true
    }
}
