//! The one child-holder protocol: a lock holder in another process, so a test or the lab
//! can SIGKILL or SIGSTOP it.
//!
//! The parent starts the child with a [`HolderSpec`] in its environment and a pipe on its
//! stdin and stdout. The child takes the lock and reports on stdout, one line each, after
//! [`PREFIX`]: `HELD <token> <valid-until>`, `VALID <valid-until>` whenever its lease
//! deadline moves, `LOST <reason>` when its guard fires, `FAILED <error>` if it could not
//! take the lock, and `WROTE <outcome>` after each `WRITE` line it reads on stdin. It
//! releases and exits when its stdin closes (or after five minutes, so no child outlives a
//! broken parent). Instants cross the process boundary as CLOCK_MONOTONIC nanoseconds, the
//! clock `Instant` reads on Linux.
//!
//! The suite's child is its own test binary run again: [`crate::suite!`] adds an ignored
//! test, `__lockkit_holder_child`, and [`HolderProcess::spawn`] runs the binary with only
//! that test selected, so the child talks to the same servers with the same code. The
//! lab's child is the `lockkit` binary ([`HolderProcess::start`] with any command).

use std::{process::Stdio, time::Duration};

use lockkit_core::{FencingToken, LockKey, Locker};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
    time::Instant,
};

use crate::Harness;

/// The name of the generated entry test.
pub const ENTRY_TEST: &str = "__lockkit_holder_child";
/// What starts every line of the protocol on the child's stdout.
pub const PREFIX: &str = "LOCKKIT-HOLDER";
const KEY_VAR: &str = "LOCKKIT_HOLDER_KEY";
const TTL_VAR: &str = "LOCKKIT_HOLDER_TTL_MS";
const WATCHDOG_VAR: &str = "LOCKKIT_HOLDER_WATCHDOG";
const PERMITS_VAR: &str = "LOCKKIT_HOLDER_PERMITS";
/// How long a child holds at most.
const GIVE_UP: Duration = Duration::from_secs(300);

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
    /// A permit of a semaphore of this many permits instead of the plain lock (0: the lock).
    pub permits: u32,
}

impl HolderSpec {
    /// The spec a parent put in this process's environment, if this process is a child.
    pub fn from_env() -> Option<HolderSpec> {
        let key = LockKey::new(std::env::var(KEY_VAR).ok()?).ok()?;
        let ttl = std::env::var(TTL_VAR)
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_millis);
        let watchdog = std::env::var(WATCHDOG_VAR).map_or(true, |v| v == "1");
        let permits = std::env::var(PERMITS_VAR)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Some(HolderSpec {
            key,
            ttl,
            watchdog,
            permits,
        })
    }

    fn apply(&self, command: &mut Command) {
        command
            .env(KEY_VAR, self.key.as_str())
            .env(TTL_VAR, self.ttl.as_millis().to_string())
            .env(WATCHDOG_VAR, if self.watchdog { "1" } else { "0" })
            .env(PERMITS_VAR, self.permits.to_string());
    }
}

fn monotonic_ns() -> i128 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    i128::from(now.tv_sec) * 1_000_000_000 + i128::from(now.tv_nsec)
}

fn to_ns(at: Instant) -> i128 {
    let (now_ns, now) = (monotonic_ns(), Instant::now());
    if at >= now {
        now_ns + i128::try_from((at - now).as_nanos()).unwrap_or(i128::MAX / 2)
    } else {
        now_ns - i128::try_from((now - at).as_nanos()).unwrap_or(i128::MAX / 2)
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
    // A fresh line: libtest may have printed `test name ... ` without one.
    let _ = writeln!(out, "\n{PREFIX} {line}");
    let _ = out.flush();
}

/// The child's side: takes `spec`'s lock through `locker` and speaks the protocol until
/// its stdin closes. `write` performs a `WRITE` request with the hold's token and says how
/// it went. Returns the exit code: 0 after the parent closed stdin, 2 if the lock could not
/// be taken.
pub async fn serve(
    locker: &Locker,
    spec: &HolderSpec,
    mut write: impl AsyncFnMut(FencingToken) -> String,
) -> i32 {
    let mut acquire = if spec.permits == 0 {
        locker.acquire(spec.key.clone())
    } else {
        locker.semaphore(spec.key.clone(), spec.permits).acquire()
    }
    .ttl(spec.ttl)
    .wait(Duration::from_secs(30));
    if !spec.watchdog {
        acquire = acquire.no_watchdog();
    }
    let guard = match acquire.await {
        Ok(guard) => guard,
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
    let give_up = tokio::time::sleep(GIVE_UP);
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
                    let outcome = write(guard.token()).await;
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

/// The suite's child: does nothing unless started by [`HolderProcess::spawn`]; then
/// serves the spec with a client from `harness` (there is no store to write to).
pub async fn child_main<H: Harness>(harness: &H) {
    let Some(spec) = HolderSpec::from_env() else {
        return;
    };
    let locker = harness.client().await;
    serve(&locker, &spec, async |_| {
        "refused (the suite's child has no store)".to_owned()
    })
    .await;
}

/// The parent's handle on a child holder. Dropping it kills the child.
#[derive(Debug)]
pub struct HolderProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    /// The token the child was granted.
    pub token: FencingToken,
    /// When the parent heard of the grant.
    pub held_at: Instant,
    /// The last lease deadline the child reported.
    pub valid_until: Option<Instant>,
}

impl HolderProcess {
    /// The suite's child: runs this test binary again with only the suite's entry test,
    /// and waits (up to 60 s) until it reports the lock held.
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
        let mut command = Command::new(exe);
        command.args([
            entry.as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ]);
        Self::start(command, spec, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts `command` as a child holder of `spec` and waits up to `within` until it
    /// reports the lock held.
    ///
    /// # Errors
    /// When the command cannot start, or the child says anything but `HELD` first (or
    /// nothing in time).
    pub async fn start(
        mut command: Command,
        spec: &HolderSpec,
        within: Duration,
    ) -> Result<HolderProcess, String> {
        spec.apply(&mut command);
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the child holder: {e}"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or("the child holder has no stdout")?;
        let stdin = child.stdin.take();
        let mut holder = HolderProcess {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            token: FencingToken::new(0),
            held_at: Instant::now(),
            valid_until: None,
        };
        let Some(first) = holder.next_event(within).await else {
            let exited = holder.child.try_wait().ok().flatten();
            return Err(match exited {
                Some(status) => format!(
                    "the child holder exited ({status}) before taking the lock; see its stderr"
                ),
                None => format!(
                    "the child holder did not take the lock within {} s",
                    within.as_secs()
                ),
            });
        };
        let mut words = first.split_whitespace();
        if words.next() != Some("HELD") {
            return Err(format!(
                "the child holder said `{first}` instead of HELD <token>"
            ));
        }
        holder.held_at = Instant::now();
        holder.token = words
            .next()
            .and_then(|t| t.parse().ok())
            .map(FencingToken::new)
            .ok_or_else(|| format!("bad HELD line `{first}`"))?;
        holder.valid_until = words
            .next()
            .and_then(|v| v.parse().ok())
            .filter(|ns| *ns != 0)
            .map(from_ns);
        Ok(holder)
    }

    /// The child's process id, or 0 once it has been reaped.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// SIGKILL: the child dies without releasing anything.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGSTOP: the child freezes, watchdog and all.
    ///
    /// # Panics
    /// When the signal cannot be sent (the case fails).
    pub async fn pause(&self) {
        self.signal("STOP").await.unwrap_or_else(|e| panic!("{e}"));
    }

    /// SIGCONT: the child runs again.
    ///
    /// # Panics
    /// When the signal cannot be sent (the case fails).
    pub async fn resume(&self) {
        self.signal("CONT").await.unwrap_or_else(|e| panic!("{e}"));
    }

    /// Sends the signal `name` (`STOP`, `CONT`, `TERM`, `KILL`) to the child, at once and
    /// in process.
    ///
    /// # Errors
    /// An unknown signal name, a child that has exited, or a refused signal. Pid 0 (the
    /// caller's own process group) is never signalled.
    pub async fn signal(&self, name: &str) -> Result<(), String> {
        use rustix::process::{Pid, Signal, kill_process};
        let signal = match name {
            "STOP" => Signal::STOP,
            "CONT" => Signal::CONT,
            "TERM" => Signal::TERM,
            "KILL" => Signal::KILL,
            other => return Err(format!("unknown signal SIG{other}")),
        };
        let pid = i32::try_from(self.pid())
            .ok()
            .and_then(Pid::from_raw)
            .ok_or_else(|| format!("cannot send SIG{name}: the child holder has exited"))?;
        kill_process(pid, signal).map_err(|e| format!("kill -{name} {pid:?} failed: {e}"))
    }

    /// Asks the child to write with its token (it does so as soon as it runs).
    ///
    /// # Errors
    /// When the child's stdin is closed.
    pub async fn request_write(&mut self) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("the child's stdin is closed")?;
        let sent = async {
            stdin.write_all(b"WRITE\n").await?;
            stdin.flush().await
        };
        sent.await
            .map_err(|e| format!("writing to the child holder: {e}"))
    }

    /// The next line the child reports other than `VALID` (which updates
    /// [`HolderProcess::valid_until`]), e.g. `LOST LeaseExpired`, within `within`.
    pub async fn next_event(&mut self, within: Duration) -> Option<String> {
        let deadline = Instant::now() + within;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .ok()?
                .ok()??;
            // libtest may print `test name ... ` on the same line first.
            let Some(at) = line.find(PREFIX) else {
                continue;
            };
            let event = line[at + PREFIX.len()..].trim();
            if let Some(ns) = event.strip_prefix("VALID ") {
                if let Ok(ns) = ns.trim().parse() {
                    self.valid_until = Some(from_ns(ns));
                }
                continue;
            }
            return Some(event.to_owned());
        }
    }

    /// What the child reported so far (each within `quiet` of the last), keeping
    /// [`HolderProcess::valid_until`] current; the events other than `VALID`.
    pub async fn drain(&mut self, quiet: Duration) -> Vec<String> {
        let mut events = Vec::new();
        while let Some(event) = self.next_event(quiet).await {
            events.push(event);
        }
        events
    }

    /// Closes stdin (the child releases and exits) and waits up to 10 s, then kills it.
    pub async fn finish(mut self) {
        drop(self.stdin.take());
        let _ = self.signal("CONT").await;
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}
