//! The lab's holder in another process, so it can be frozen with SIGSTOP.
//!
//! The parent starts [`super::ChildCommand`] with the lock's URL, key and lease and a fenced
//! store in the environment. The child takes the lock and reports on stdout, one line each:
//! `HELD <token> <valid-until>`, `VALID <valid-until>` whenever the watchdog moves its lease
//! deadline, `LOST <reason>` when its guard fires, and `WROTE accepted|refused ...` after
//! each `WRITE` line it reads on stdin (it writes with its token, as a holder does that
//! checked its lock before it was paused). Instants cross the process boundary as
//! CLOCK_MONOTONIC nanoseconds, the clock `Instant` reads on Linux.

use std::{process::Stdio, time::Duration};

use lockkit_core::{FencingToken, LockKey, Locker};
use nix::{
    sys::signal::{Signal, kill},
    time::{ClockId, clock_gettime},
    unistd::Pid,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
    time::Instant,
};

use super::{Connect, Context, Lab, LabError, store::FileFencedStore};

/// Set (to the lock's URL) in the child's environment.
pub const CHILD_VAR: &str = "LOCKKIT_LAB_CHILD_URL";
const KEY_VAR: &str = "LOCKKIT_LAB_CHILD_KEY";
const TTL_VAR: &str = "LOCKKIT_LAB_CHILD_TTL_MS";
const STORE_VAR: &str = "LOCKKIT_LAB_CHILD_STORE";
const PREFIX: &str = "LOCKKIT-LAB";

/// Whether this process was started as the lab's child holder.
pub fn child_requested() -> bool {
    std::env::var_os(CHILD_VAR).is_some()
}

fn monotonic_ns() -> i128 {
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec()))
        .unwrap_or(0)
}

fn to_ns(at: Instant) -> i128 {
    let (now_ns, now) = (monotonic_ns(), Instant::now());
    if at >= now {
        now_ns + (at - now).as_nanos() as i128
    } else {
        now_ns - (now - at).as_nanos() as i128
    }
}

fn from_ns(ns: i128) -> Instant {
    let (now_ns, now) = (monotonic_ns(), Instant::now());
    let delta = Duration::from_nanos(u64::try_from((ns - now_ns).unsigned_abs()).unwrap_or(0));
    if ns >= now_ns {
        now + delta
    } else {
        now.checked_sub(delta).unwrap_or(now)
    }
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{PREFIX} {line}");
    let _ = out.flush();
}

/// The child's side. Returns the process exit code: 0 after the parent closed stdin, 2 if
/// the lock could not be taken.
pub async fn child_main(connect: Connect) -> i32 {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let (url, key, store) = (var(CHILD_VAR), var(KEY_VAR), var(STORE_VAR));
    let ttl = Duration::from_millis(var(TTL_VAR).parse().unwrap_or(30_000));
    let store = FileFencedStore::new(store);
    let backend = match connect(url.clone()).await {
        Ok(b) => b,
        Err(e) => {
            say(&format!("FAILED connecting to {url}: {e}"));
            return 2;
        }
    };
    let locker = Locker::from_arc(backend);
    let guard = match locker
        .acquire(key.as_str())
        .ttl(ttl)
        .wait(Duration::from_secs(30))
        .await
    {
        Ok(g) => g,
        Err(e) => {
            say(&format!("FAILED {e}"));
            return 2;
        }
    };
    let mut last = guard.valid_until();
    say(&format!("HELD {} {}", guard.token(), last.map_or(0, to_ns)));
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut lost_reported = false;
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let give_up = tokio::time::sleep(Duration::from_secs(120));
    tokio::pin!(give_up);
    loop {
        tokio::select! {
            reason = &mut lost, if !lost_reported => {
                lost_reported = true;
                say(&format!("LOST {reason:?}"));
            }
            line = stdin.next_line() => match line {
                Ok(Some(line)) if line.trim() == "WRITE" => {
                    let valid = guard.is_valid();
                    let outcome = match store.write(guard.token(), "written by the child holder") {
                        Ok(Ok(())) => "accepted".to_owned(),
                        Ok(Err(stale)) => format!("refused ({stale})"),
                        Err(e) => format!("error {e}"),
                    };
                    say(&format!("WROTE {outcome} (guard valid: {valid})"));
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            },
            () = tokio::time::sleep(Duration::from_millis(20)) => {
                let now = guard.valid_until();
                if now != last && now.is_some() {
                    last = now;
                    say(&format!("VALID {}", now.map_or(0, to_ns)));
                }
            }
            () = &mut give_up => break,
        }
    }
    let _ = guard.release().await;
    0
}

/// The parent's handle on a child holder.
#[derive(Debug)]
pub(crate) struct ChildHolder {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    /// The token it was granted.
    pub token: FencingToken,
    /// When the parent heard of the grant.
    pub held_at: Instant,
    /// The last lease deadline it reported.
    pub valid_until: Option<Instant>,
}

impl ChildHolder {
    /// Starts the child and waits (up to 30 s) until it holds `key`.
    pub async fn spawn(
        lab: &Lab,
        url: &str,
        key: &LockKey,
        ttl: Duration,
        store: &FileFencedStore,
    ) -> Result<ChildHolder, LabError> {
        let mut child = Command::new(&lab.child.program)
            .args(&lab.child.args)
            .env(CHILD_VAR, url)
            .env(KEY_VAR, key.as_str())
            .env(TTL_VAR, ttl.as_millis().to_string())
            .env(STORE_VAR, store.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context(format!(
                "cannot start the child holder {}",
                lab.child.program.display()
            ))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| LabError::new("the child holder has no stdout"))?;
        let stdin = child.stdin.take();
        let mut holder = ChildHolder {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            token: FencingToken::new(0),
            held_at: Instant::now(),
            valid_until: None,
        };
        let first = holder
            .next_event(Duration::from_secs(30))
            .await
            .ok_or_else(|| LabError::new("the child holder said nothing within 30 s"))?;
        let mut words = first.split_whitespace();
        if words.next() != Some("HELD") {
            return Err(LabError::new(format!("the child holder said `{first}`")));
        }
        holder.held_at = Instant::now();
        holder.token = words
            .next()
            .and_then(|t| t.parse().ok())
            .map(FencingToken::new)
            .ok_or_else(|| LabError::new(format!("bad HELD line `{first}`")))?;
        holder.valid_until = words.next().and_then(|v| v.parse().ok()).map(from_ns);
        Ok(holder)
    }

    /// The child's pid.
    /// The child's pid, or 0 once it has been reaped (never signalled: pid 0 would be
    /// the lab's own process group).
    pub fn pid(&self) -> i32 {
        self.child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .unwrap_or(0)
    }

    /// Sends `signal` to the child.
    pub fn signal(&self, signal: Signal) -> Result<(), LabError> {
        let pid = self.pid();
        if pid <= 0 {
            return Err(LabError::new(format!(
                "cannot send {signal}: the child holder has exited"
            )));
        }
        kill(Pid::from_raw(pid), signal).context(format!("kill -{signal} {pid}"))
    }

    /// Asks the child to write with its token (it does so as soon as it runs).
    pub async fn request_write(&mut self) -> Result<(), LabError> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| LabError::new("the child's stdin is closed"))?;
        stdin
            .write_all(b"WRITE\n")
            .await
            .context("writing to the child")?;
        stdin.flush().await.context("writing to the child")
    }

    /// The next event other than `VALID` (which updates [`ChildHolder::valid_until`]).
    pub async fn next_event(&mut self, within: Duration) -> Option<String> {
        let deadline = Instant::now() + within;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .ok()?
                .ok()??;
            let Some(event) = line.strip_prefix(PREFIX).map(str::trim) else {
                continue;
            };
            if let Some(ns) = event.strip_prefix("VALID ") {
                if let Ok(ns) = ns.trim().parse() {
                    self.valid_until = Some(from_ns(ns));
                }
                continue;
            }
            return Some(event.to_owned());
        }
    }

    /// Reads what the child printed so far (within `quiet`), keeping the lease deadline
    /// current; returns the events other than `VALID`.
    pub async fn drain(&mut self, quiet: Duration) -> Vec<String> {
        let mut events = Vec::new();
        while let Some(e) = self.next_event(quiet).await {
            events.push(e);
        }
        events
    }

    /// Closes stdin (the child releases and exits) and waits up to 10 s, then kills it.
    pub async fn finish(mut self) {
        drop(self.stdin.take());
        let _ = self.signal(Signal::SIGCONT);
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}
