//! The process tree of `lockkit run`: CMD in a process group of its own, watched by a
//! small supervisor process (this binary, `lockkit __supervise`) that outlives lockkit.
//!
//! ```text
//! lockkit run ──signals──> lockkit __supervise ──> CMD (leader of its own group)
//!                                                     └─ grandchildren (same group)
//! ```
//!
//! - Signals for CMD go to its whole group, so grandchildren get them too, and a terminal's
//!   Ctrl-C reaches CMD once (through lockkit), not twice.
//! - When CMD exits, whatever it left running is stopped: nothing of it runs on once the
//!   lock is released.
//! - If lockkit dies, even by SIGKILL, the supervisor (re-parented) stops the group within
//!   100 ms (SIGTERM, then SIGKILL after the grace): no command outlives its lock.
//! - CMD is not in the terminal's foreground group: a CMD that reads the terminal is
//!   stopped by SIGTTIN; give it input through a pipe or a file.
//! - Stopping reaches beyond CMD's group: on Linux the supervisor is a child subreaper, so
//!   every process CMD started stays below it (a grandchild that moved to a group of its
//!   own, as GNU `timeout` does, or left the session with `setsid`, is adopted by the
//!   supervisor when its parent dies), and a stop signals every descendant, not only the
//!   group.
//!
//! - If lockkit is stopped (Ctrl-Z in a terminal stops lockkit alone, CMD being outside the
//!   terminal's foreground group; `kill -STOP`; a debugger), it renews nothing, and its
//!   lease may run out and the lock go to another client: the supervisor stops CMD and
//!   every process below it (SIGSTOP) within 100 ms, and continues them (SIGCONT) only when
//!   lockkit, running again, finds its lock still held (and says so with SIGUSR2);
//!   otherwise lockkit stops them for good.
//! - lockkit is a child subreaper too: if the supervisor alone dies (SIGKILL), CMD and what
//!   it started are re-parented to lockkit, which stops them before releasing the lock
//!   (`Supervised::sweep`).
//!
//! What no supervisor can contain: side effects already made, and (outside Linux) a
//! process that leaves the group. Pass `LOCKKIT_TOKEN` with every write, so that storage
//! refuses a writer whose lock is gone.

use std::{
    os::unix::process::ExitStatusExt,
    process::{ExitCode, ExitStatus},
    time::Duration,
};

use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use tokio::{
    process::{Child, Command},
    signal::unix::SignalKind,
};

/// The hidden subcommand that runs the supervisor.
pub const SUBCOMMAND: &str = "__supervise";

/// A process's exit as a shell reports it: its code, or 128 + the signal that ended it.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(255),
        (None, None) => 1,
    }
}

/// Sends `signal` to process group `group`; false once the group is empty.
pub fn signal_group(group: Pid, signal: Option<Signal>) -> bool {
    killpg(group, signal).is_ok()
}

/// The live processes below this one (children, theirs, and so on), read from `/proc`;
/// reaps, on the way, the zombies among its own children other than `cmd` (orphans it
/// adopted as a subreaper). Empty where `/proc` cannot be read.
fn descendants(cmd: Pid) -> Vec<Pid> {
    let me = nix::unistd::getpid();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    // (pid, parent, zombie) of every process.
    let mut all = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: comm may hold anything, so read after its last `)`.
        let mut fields = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace();
        let (Some(state), Some(Ok(parent))) = (fields.next(), fields.next().map(str::parse)) else {
            continue;
        };
        all.push((
            Pid::from_raw(pid),
            Pid::from_raw(parent),
            state == "Z" || state == "X",
        ));
    }
    let mut found = Vec::new();
    let mut parents = vec![me];
    while let Some(parent) = parents.pop() {
        for &(pid, _, zombie) in all.iter().filter(|(_, p, _)| *p == parent) {
            if zombie {
                if parent == me && pid != cmd {
                    let _ =
                        nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
                }
                continue;
            }
            if !found.contains(&pid) {
                found.push(pid);
                parents.push(pid);
            }
        }
    }
    found
}

/// Sends `signal` to `group` (if any) and to every process below this one; false once
/// there is none left.
fn signal_all(group: Option<Pid>, cmd: Pid, signal: Option<Signal>) -> bool {
    let mut any = group.is_some_and(|group| signal_group(group, signal));
    for pid in descendants(cmd) {
        any |= nix::sys::signal::kill(pid, signal).is_ok();
    }
    any
}

/// Makes this process a child subreaper (Linux): the orphans of CMD's process tree are
/// re-parented to it rather than to init, so a stop still finds them.
pub fn adopt_orphans() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!(
            "lockkit: the supervisor cannot adopt orphans ({e}): a process CMD starts in a \
             session of its own may outlive the lock"
        );
    }
}

/// Whether process `pid` has a handler for `signal` (`SigCgt` in `/proc/<pid>/status`;
/// false where it cannot be told).
fn catches(pid: Pid, signal: Signal) -> bool {
    let bit = 1u64 << (signal as i32 - 1);
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & bit != 0)
    })
}

/// [`is_stopped`] of a pid as nix has it.
fn pid_is_stopped(pid: Pid) -> bool {
    u32::try_from(pid.as_raw()).is_ok_and(is_stopped)
}

/// Whether process `pid` is stopped (by a signal or a tracer), from `/proc` (Linux; false
/// where it cannot be told).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // `pid (comm) state ...`: comm may hold anything, so read after its last `)`.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "T" || state == "t")
    })
}

/// Stops what is left of CMD: its `group` and every other process below the supervisor
/// (`cmd` is CMD's pid): SIGTERM, then SIGKILL if anything is still there after `grace`.
/// Processes that were stopped (by their user, by job control) are continued after the
/// SIGTERM, so that they can act on it; those stopped because lockkit was are not brought
/// here (see [`main`]: they are killed).
pub async fn stop_group(group: Option<Pid>, cmd: Pid, grace: Duration) {
    if !signal_all(group, cmd, Some(Signal::SIGTERM)) {
        return;
    }
    signal_all(group, cmd, Some(Signal::SIGCONT));
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Signal again: a process started after the first round gets its SIGTERM too.
        if !signal_all(group, cmd, Some(Signal::SIGTERM)) {
            return;
        }
    }
    kill_all(group, cmd).await;
}

/// Kills what is left of CMD (SIGKILL to `group` and every process below the supervisor)
/// without letting it run again: the stop of processes stopped while lockkit was, whose
/// lock may be gone by now.
async fn kill_all(group: Option<Pid>, cmd: Pid) {
    // A process may still fork while dying: repeat until nothing is left.
    for _ in 0..100 {
        if !signal_all(group, cmd, Some(Signal::SIGKILL)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Ends what is left of CMD: as [`stop_group`] does, or, while CMD's processes are stopped
/// because lockkit was (`paused`), by SIGKILL, so they never run again without lockkit
/// saying its lock holds.
async fn end_all(paused: bool, group: Pid, grace: Duration) {
    if paused {
        kill_all(Some(group), group).await;
    } else {
        stop_group(Some(group), group, grace).await;
    }
}

/// The supervisor: starts CMD in a new process group, passes lockkit's signals on to the
/// whole group (SIGUSR1 means SIGKILL, to every process below the supervisor), and stops
/// the group and every other process below it when CMD exits or when lockkit goes away
/// (the supervisor is re-parented). While lockkit is stopped, every process below the
/// supervisor is stopped too (SIGSTOP), until lockkit, running again, says its lock still
/// holds (SIGUSR2, which lockkit sends every 250 ms while it holds, since a tracing stop
/// ends without SIGCONT; SIGCONT to them). Stopped so, they never run again otherwise: a
/// stop meanwhile (lockkit gone, or lockkit's SIGTERM and then SIGUSR1 when it ran again
/// without its lock) kills them where they stand. Exits with CMD's exit code (128 + n for a
/// signal).
///
/// `lockkit` is the pid of the lockkit that started it, passed on its command line: read
/// from the supervisor's own parent instead, a lockkit killed before that read would go
/// unnoticed (the supervisor would take its new parent, init or a subreaper, for lockkit).
pub async fn main(grace: Duration, lockkit: u32, command: &[String]) -> ExitCode {
    // Handlers replace the default actions, so these never end the supervisor itself.
    let listen = |kind: SignalKind| tokio::signal::unix::signal(kind);
    let (Ok(mut ints), Ok(mut terms), Ok(mut hups), Ok(mut kills), Ok(mut resumes)) = (
        listen(SignalKind::interrupt()),
        listen(SignalKind::terminate()),
        listen(SignalKind::hangup()),
        listen(SignalKind::user_defined1()),
        listen(SignalKind::user_defined2()),
    ) else {
        eprintln!("lockkit: the supervisor cannot handle signals");
        return ExitCode::from(2);
    };
    adopt_orphans();
    let Some((program, args)) = command.split_first() else {
        return ExitCode::from(2);
    };
    if std::os::unix::process::parent_id() != lockkit {
        eprintln!("lockkit: lockkit is gone (and the lock with it): `{program}` not started");
        return ExitCode::from(2);
    }
    let mut child = match Command::new(program).args(args).process_group(0).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("lockkit: cannot run `{program}`: {e}");
            return ExitCode::from(127);
        }
    };
    let Some(group) = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(Pid::from_raw)
    else {
        return ExitCode::from(2);
    };
    let mut orphaned = tokio::time::interval(Duration::from_millis(100));
    // CMD's processes were stopped because lockkit was.
    let mut paused = false;
    loop {
        tokio::select! {
            status = child.wait() => {
                // CMD is done: nothing it started may run on after the lock is released.
                end_all(paused, group, grace).await;
                return ExitCode::from(status.map_or(2, exit_code));
            }
            _ = orphaned.tick() => {
                // Reaps the orphans adopted meanwhile that have exited.
                let _ = descendants(group);
                if std::os::unix::process::parent_id() != lockkit {
                    // lockkit is gone (even by SIGKILL): so is the lock.
                    end_all(paused, group, grace).await;
                    let status = child.wait().await;
                    return ExitCode::from(status.map_or(2, exit_code));
                }
                if !paused && is_stopped(lockkit) {
                    // lockkit renews nothing while stopped: its lock may go to another
                    // client. CMD waits for lockkit to find it still held.
                    signal_all(Some(group), group, Some(Signal::SIGSTOP));
                    paused = true;
                }
            }
            _ = resumes.recv() => {
                // One sent just before lockkit was stopped again must not wake CMD.
                if paused && !is_stopped(lockkit) {
                    signal_all(Some(group), group, Some(Signal::SIGCONT));
                    paused = false;
                }
            }
            _ = ints.recv() => { signal_group(group, Some(Signal::SIGINT)); }
            _ = terms.recv() => {
                // While paused, CMD acts on it only once lockkit says its lock holds
                // (SIGUSR2); otherwise lockkit's SIGUSR1 kills it where it stands: a lock
                // gone while lockkit was stopped may be another client's by now.
                signal_group(group, Some(Signal::SIGTERM));
            }
            _ = hups.recv() => { signal_group(group, Some(Signal::SIGHUP)); }
            _ = kills.recv() => { signal_all(Some(group), group, Some(Signal::SIGKILL)); }
        }
    }
}

/// CMD running under a supervisor, as lockkit sees it.
pub struct Supervised {
    supervisor: Child,
    pid: Pid,
}

impl Supervised {
    /// Starts the supervisor (this binary again) for `command` with `env`. The supervisor
    /// runs in a process group of its own, so a terminal's signals reach CMD only through
    /// lockkit: once.
    ///
    /// # Errors
    /// A message saying what could not be started.
    pub fn start(
        command: &[String],
        grace: Duration,
        env: &[(&str, String)],
    ) -> Result<Supervised, String> {
        // lockkit adopts what the supervisor leaves behind, should the supervisor be killed
        // on its own: see `Supervised::sweep`.
        adopt_orphans();
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find the lockkit binary to supervise the command: {e}"))?;
        let supervisor = Command::new(exe)
            .arg(SUBCOMMAND)
            .arg("--grace-ms")
            .arg(grace.as_millis().to_string())
            .arg("--parent")
            .arg(std::process::id().to_string())
            .arg("--")
            .args(command)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the supervisor: {e}"))?;
        let pid = supervisor
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(Pid::from_raw)
            .ok_or("the supervisor has no pid")?;
        Ok(Supervised { supervisor, pid })
    }

    /// Passes `signal` on to CMD's whole group.
    pub fn signal(&self, signal: Signal) {
        let _ = nix::sys::signal::kill(self.pid, signal);
    }

    /// Tells the supervisor that lockkit's lock still holds (SIGUSR2: CMD, stopped while
    /// lockkit was, may run again), once the supervisor catches that signal: sent earlier,
    /// while it starts, the signal's default action would end it.
    pub fn affirm(&self) {
        if catches(self.pid, Signal::SIGUSR2) {
            self.signal(Signal::SIGUSR2);
        }
    }

    /// Waits for CMD's exit code (as the supervisor reports it).
    pub async fn wait(&mut self) -> u8 {
        self.supervisor.wait().await.map_or(2, exit_code)
    }

    /// Once the supervisor has exited: stops whatever still runs below lockkit (SIGTERM,
    /// SIGKILL after `grace`; with no `grace`, the lock being gone, SIGKILL at once and
    /// nothing continued: a process stopped because lockkit was must not run again). Nothing,
    /// when the supervisor ended as it should (it stops everything of CMD's first); CMD and
    /// what it started, when the supervisor was killed on its own (lockkit is a child
    /// subreaper, so they were re-parented to it), which would otherwise run on without the
    /// lock.
    pub async fn sweep(&self, grace: Option<Duration>) {
        match grace {
            Some(grace) => stop_group(None, self.pid, grace).await,
            None => kill_all(None, self.pid).await,
        }
    }

    /// Stops CMD's whole group: SIGTERM, SIGKILL after `grace`; returns when the supervisor
    /// has exited. A supervisor that does not act on that at once (stopped, or held by a
    /// debugger) is killed: what ran below it is re-parented to lockkit, for
    /// [`Self::sweep`] to stop. Before, lockkit waited for such a supervisor forever, with
    /// CMD running on without the lock (helper-45's finding 4).
    ///
    /// A supervisor found stopped while lockkit waits is killed at once, not after the
    /// grace: it passes no signal on, so CMD would get its SIGTERM only from the sweep, one
    /// grace later than the stop began, past the lease.
    pub async fn stop(&mut self, grace: Duration) {
        /// How long a running supervisor takes at most to kill what runs below it.
        const ANSWER: Duration = Duration::from_millis(200);
        /// How often lockkit looks whether the supervisor is stopped, while it waits.
        const LOOK: Duration = Duration::from_millis(50);
        self.signal(Signal::SIGTERM);
        let deadline = tokio::time::Instant::now() + grace;
        let pid = self.pid;
        let mut answered = false;
        while !pid_is_stopped(pid) {
            let until = (tokio::time::Instant::now() + LOOK).min(deadline);
            if tokio::time::timeout_at(until, self.supervisor.wait())
                .await
                .is_ok()
            {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                self.signal(Signal::SIGUSR1);
                answered = tokio::time::timeout(ANSWER, self.supervisor.wait())
                    .await
                    .is_ok();
                break;
            }
        }
        if !answered {
            self.signal(Signal::SIGKILL);
            let _ = self.supervisor.wait().await;
        }
    }
}
