//! The child-process helper: a lock holder in another process, so tests can SIGKILL or
//! SIGSTOP it.
//!
//! There is no separate binary to build: [`crate::suite!`] adds an ignored test,
//! `__lockkit_holder_child`, to the backend's own test binary, and [`HolderProcess::spawn`]
//! runs that binary again with only that test selected. The child builds a client from the
//! same harness, so it talks to the same servers with the same code as the parent.

use std::{io::Write, process::Stdio, time::Duration};

use lockkit_core::{FencingToken, LockKey};
use tokio::{
    io::{AsyncBufReadExt, BufReader, Lines},
    process::{Child, ChildStdout, Command},
};

use crate::Harness;

/// The name of the generated entry test.
pub const ENTRY_TEST: &str = "__lockkit_holder_child";
const KEY_VAR: &str = "LOCKKIT_HOLDER_KEY";
const TTL_VAR: &str = "LOCKKIT_HOLDER_TTL_MS";
const WATCHDOG_VAR: &str = "LOCKKIT_HOLDER_WATCHDOG";
const LINE_PREFIX: &str = "LOCKKIT-HOLDER";

tokio::task_local! {
    /// The libtest name of the entry test of the suite the running case belongs to.
    static ENTRY: String;
}

/// The libtest name of the entry test for a suite module (`module_path!()` of the suite).
pub fn entry_for(module_path: &str) -> String {
    let path = module_path.split_once("::").map_or("", |(_, rest)| rest);
    if path.is_empty() {
        ENTRY_TEST.to_owned()
    } else {
        format!("{path}::{ENTRY_TEST}")
    }
}

/// Runs `case` knowing which suite's entry test starts its child holders.
pub async fn with_entry<F: std::future::Future>(module_path: &str, case: F) -> F::Output {
    ENTRY.scope(entry_for(module_path), case).await
}

/// What the child should hold.
#[derive(Debug, Clone)]
pub struct HolderSpec {
    /// The key.
    pub key: LockKey,
    /// The lease.
    pub ttl: Duration,
    /// Whether the child's watchdog renews.
    pub watchdog: bool,
}

/// A child process holding a lock.
#[derive(Debug)]
pub struct HolderProcess {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    /// The token the child was granted.
    pub token: FencingToken,
}

impl HolderProcess {
    /// Starts the child and waits (up to 60 s) until it reports the lock held.
    ///
    /// # Panics
    /// When the suite's entry test is unknown (the case was not run through
    /// [`crate::suite!`]) or the child fails to take the lock: the case fails.
    pub async fn spawn(spec: &HolderSpec) -> HolderProcess {
        let entry = ENTRY
            .try_with(Clone::clone)
            .unwrap_or_else(|_| panic!("the holder entry is unknown: run cases through suite!"));
        let exe = std::env::current_exe()
            .unwrap_or_else(|e| panic!("cannot find the test binary to re-run: {e}"));
        let mut child = Command::new(exe)
            .args([
                entry.as_str(),
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KEY_VAR, spec.key.as_str())
            .env(TTL_VAR, spec.ttl.as_millis().to_string())
            .env(WATCHDOG_VAR, if spec.watchdog { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the holder child: {e}"));
        let stdout = child
            .stdout
            .take()
            .unwrap_or_else(|| panic!("the holder child has no stdout"));
        let mut lines = BufReader::new(stdout).lines();
        let held = tokio::time::timeout(Duration::from_secs(60), next_event(&mut lines))
            .await
            .unwrap_or_else(|_| panic!("the holder child did not take the lock within 60 s"))
            .unwrap_or_else(|| panic!("the holder child exited before taking the lock"));
        let token = held
            .strip_prefix("HELD ")
            .and_then(|t| t.parse().ok())
            .map(FencingToken::new)
            .unwrap_or_else(|| panic!("the holder child said `{held}` instead of HELD <token>"));
        HolderProcess {
            child,
            lines,
            token,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// SIGKILL: the child dies without releasing anything.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGSTOP: the child freezes, watchdog and all.
    pub async fn pause(&self) {
        signal(self.pid(), "STOP").await;
    }

    /// SIGCONT: the child runs again.
    pub async fn resume(&self) {
        signal(self.pid(), "CONT").await;
    }

    /// The next line the child reports (e.g. `LOST LeaseExpired`), within `within`.
    pub async fn next_event(&mut self, within: Duration) -> Option<String> {
        tokio::time::timeout(within, next_event(&mut self.lines))
            .await
            .ok()
            .flatten()
    }
}

async fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .await;
    assert!(
        status.is_ok_and(|s| s.success()),
        "kill -{name} {pid} failed"
    );
}

async fn next_event(lines: &mut Lines<BufReader<ChildStdout>>) -> Option<String> {
    while let Ok(Some(line)) = lines.next_line().await {
        // libtest may print `test name ... ` on the same line first.
        if let Some(at) = line.find(LINE_PREFIX) {
            return Some(line[at + LINE_PREFIX.len()..].trim().to_owned());
        }
    }
    None
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "\n{LINE_PREFIX} {line}");
    let _ = out.flush();
}

/// The child's side: does nothing unless started by [`HolderProcess::spawn`]. Takes the
/// lock, reports `HELD <token>`, reports `LOST <reason>` if the lock is lost, and otherwise
/// holds it until killed (giving up after 5 minutes, so no child outlives a broken test).
pub async fn child_main<H: Harness>(harness: &H) {
    let Ok(key) = std::env::var(KEY_VAR) else {
        return;
    };
    let ttl = std::env::var(TTL_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(30), Duration::from_millis);
    let watchdog = std::env::var(WATCHDOG_VAR).is_ok_and(|v| v == "1");
    let locker = harness.client().await;
    let mut acquire = locker
        .acquire(key.as_str())
        .ttl(ttl)
        .wait(Duration::from_secs(30));
    if !watchdog {
        acquire = acquire.no_watchdog();
    }
    let guard = match acquire.await {
        Ok(guard) => guard,
        Err(e) => {
            say(&format!("FAILED {e}"));
            return;
        }
    };
    say(&format!("HELD {}", guard.token()));
    tokio::select! {
        reason = guard.lost() => say(&format!("LOST {reason:?}")),
        _ = tokio::time::sleep(Duration::from_secs(300)) => {}
    }
    tokio::time::sleep(Duration::from_secs(300)).await;
    drop(guard);
}
