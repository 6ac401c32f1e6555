//! `lockkit`: run a command under a distributed lock, or inspect one.

use std::{io::IsTerminal, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use lockkit::{
    Error, FencingToken, HolderIdentity, HolderInfo, LockGuard, LockKind, Locker,
    config::parse_duration,
};
use nix::sys::signal::Signal;
use tokio::signal::unix::SignalKind;

mod bench;
mod demo;
mod lab;
mod progress;
mod supervisor;

/// Sends the libraries' tracing to stderr: warnings and errors by default (a failed
/// renewal, a lost lock), spans with `-v`, everything with `-vv`, errors only with `-q`;
/// `RUST_LOG` (e.g. `RUST_LOG=lockkit=debug`) overrides the flags. Lock URLs never reach
/// the output: the libraries log keys, backends and tokens, not credentials.
fn install_diagnostics(verbose: u8, quiet: bool) {
    use tracing_subscriber::{EnvFilter, fmt::format::FmtSpan};
    // sqlx warns of every statement slower than a second, and a wait queued in the server
    // (`pg_advisory_lock`, `SELECT ... FOR UPDATE`) is one by design: not a warning here.
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn,sqlx::query=error",
        (false, 1) => "warn,sqlx::query=error,lockkit=debug",
        (false, _) => "debug,lockkit=trace",
    };
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| EnvFilter::try_new(v).ok())
        // Targets match by prefix: `lockkit` covers lockkit_core, lockkit_redis, ...
        .unwrap_or_else(|| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        // A span is printed when it closes, with its fields and how long it took.
        .with_span_events(FmtSpan::CLOSE)
        .try_init();
}

/// Installs the Prometheus exporter: lockkit's metrics at `http://addr/metrics`, the
/// `*_seconds` ones as histograms.
fn serve_metrics(addr: std::net::SocketAddr) -> Result<(), String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: [f64; 12] = [
        0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0, 60.0,
    ];
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .map_err(|e| e.to_string())?
        .install()
        .map_err(|e| e.to_string())
}

/// Exit code when the lock was lost while the command ran (EX_TEMPFAIL).
const LOST_EXIT: u8 = 75;

#[derive(Parser, Debug)]
#[command(
    name = "lockkit",
    version,
    about = "Distributed locks from the command line: flock(1) across machines",
    long_about = "Distributed locks from the command line.\n\nThe backend comes from --url or \
                  $LOCKKIT_URL (memory://, file:///dir, redis://, redis+cluster://, redlock://, \
                  zk://, mysql://, postgres://, etcd://); without either, a lock directory under the system's \
                  temporary directory is used: fine for locks alone, but it may be a tmpfs, emptied \
                  at every boot (and cleaned of old files), so fencing tokens start again from the wall clock; \
                  for tokens that must keep growing, use a directory on a disk, e.g. \
                  file:///var/lib/<app>/locks."
)]
struct Cli {
    /// Backend URL (default: $LOCKKIT_URL, else a lock directory in the temp directory,
    /// whose fencing tokens may start again after a reboot).
    #[arg(long, global = true, env = "LOCKKIT_URL")]
    url: Option<String>,
    /// More diagnostics on stderr: -v shows lockkit's spans (each acquire, renew and
    /// release with its key, token, outcome and timing), -vv traces. `RUST_LOG`, when set,
    /// decides instead.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors on stderr (a lost lock is one); by default warnings too (a failed
    /// renewal).
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand, Debug)]
enum Commands {
    /// Internal: the supervisor `run` starts between itself and CMD.
    #[command(name = "__supervise", hide = true)]
    Supervise {
        #[arg(long)]
        grace_ms: u64,
        /// The pid of the lockkit that started the supervisor.
        #[arg(long)]
        parent: u32,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Run CMD only while holding KEY; the lease is renewed while CMD runs.
    ///
    /// CMD gets LOCKKIT_KEY and LOCKKIT_TOKEN (the fencing token). If the lock is lost, CMD
    /// gets SIGTERM, then SIGKILL after --grace, and lockkit exits 75. A wait that times out
    /// exits 1 (see --conflict-exit-code). Otherwise lockkit exits with CMD's code. SIGINT
    /// and SIGTERM are passed on to CMD (SIGHUP too: a closed terminal ends CMD as it
    /// chooses, and lockkit releases the lock). The lock is released on every exit path.
    Run {
        /// The lock's name.
        #[arg(long)]
        key: String,
        /// Lease (renewed while CMD runs), e.g. 30s [default: the URL's `?ttl=`, else 30s].
        #[arg(long, value_parser = duration)]
        ttl: Option<Duration>,
        /// How long to wait for the lock (default: until granted); 0 tries once.
        #[arg(long, value_parser = duration)]
        wait: Option<Duration>,
        /// Stop renewing after this long; the lock then runs out and CMD is stopped.
        #[arg(long, value_parser = duration)]
        max_hold: Option<Duration>,
        /// Time between SIGTERM and SIGKILL when the lock is lost.
        #[arg(long, default_value = "5s", value_parser = duration)]
        grace: Duration,
        /// Exit code when the lock could not be taken in time.
        #[arg(long, default_value_t = 1)]
        conflict_exit_code: u8,
        /// Take KEY as a read lock: other `--read` runs share it, a `--write` run (or a
        /// plain one) excludes them, and a waiting writer keeps new readers out.
        #[arg(long, conflicts_with_all = ["write", "permits"])]
        read: bool,
        /// Take KEY as the write lock of a read-write lock (excludes readers and writers).
        #[arg(long, conflicts_with = "permits")]
        write: bool,
        /// Take one of N permits of the semaphore KEY: at most N such runs at once (every
        /// run must give the same N).
        #[arg(long, value_name = "N")]
        permits: Option<u32>,
        /// Serve lockkit's metrics in Prometheus text form at http://ADDR/metrics while
        /// the command runs (acquisitions, wait and hold times, renewals, losses).
        #[arg(long, value_name = "ADDR")]
        metrics_addr: Option<std::net::SocketAddr>,
        /// The command and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Measure the backend: its own round trip, uncontended acquire+release latency
    /// (p50/p99/p99.9), throughput, and hot-key handoff, printed as ratios.
    Bench {
        /// Concurrent clients (throughput) and waiters (handoff).
        #[arg(long, default_value_t = 16)]
        clients: u32,
        /// Distinct keys for the throughput run.
        #[arg(long, default_value_t = 1000)]
        keys: u32,
        /// Length of the throughput run.
        #[arg(long, default_value = "3s", value_parser = duration)]
        duration: Duration,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Tell, by running it, why stock deductions need a lock and a fencing token.
    Demo {
        #[command(subcommand)]
        story: Story,
    },
    /// Break something real and watch what a backend does: a frozen holder, a frozen or
    /// killed server, a cut link, a failover, a Redlock master that forgot (docs/cap.md).
    ///
    /// Runs against the private servers of scripts/services.sh (pausing, killing and
    /// restarting them; it restores them afterwards) and prints each scenario's timeline
    /// and the history check. Exits 1 if any run differs from what it expects.
    Lab {
        /// A scenario id (see --list), or `all`.
        #[arg(default_value = "all")]
        scenario: String,
        /// Only this backend (e.g. redis, zk, mysql-row).
        #[arg(long)]
        backend: Option<String>,
        /// List the scenarios and backends.
        #[arg(long)]
        list: bool,
        /// Write the table of results into this Markdown file, between its lab markers,
        /// and each run's timeline picture into lab/ beside it (scripts/cap.sh uses it for
        /// docs/cap.md and docs/lab/); needs a run of every scenario.
        #[arg(long)]
        update: Option<PathBuf>,
        /// Also draw each run's timeline as an SVG picture in this directory
        /// (SCENARIO-BACKEND.svg).
        #[arg(long, value_name = "DIR")]
        svg: Option<PathBuf>,
    },
    /// Fence a write from a shell job: run CMD only if TOKEN is not older than the newest
    /// token accepted for RESOURCE, with the fence held while CMD runs, so no stale writer
    /// can write in between (exit: CMD's code); refuse (exit 1, naming the newer token)
    /// otherwise. The store is the --url's: file:///dir (RESOURCE is a file name in dir;
    /// the fence's flock is held), mysql:// or postgres:// (the resource's row of
    /// `lockkit_fences` is locked). The bar is raised before CMD runs and stays raised
    /// whatever CMD's exit: CMD's writes are its own and cannot be rolled back.
    ///
    /// Without CMD it only checks and raises the bar (redis:// too): a write made after it
    /// can still land after a newer holder's, so give the write as CMD where you can.
    ///
    /// In a `lockkit run` job: `lockkit fence --resource orders-42 --token "$LOCKKIT_TOKEN"
    /// -- ./write-the-order.sh`.
    Fence {
        /// The resource the write goes to (a key, a table row's name, a file).
        #[arg(long)]
        resource: String,
        /// The writer's fencing token (`$LOCKKIT_TOKEN` under `lockkit run`).
        #[arg(long)]
        token: u64,
        /// The write, run under the fence.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Show who holds KEY: the holder's host, pid and program, when it took the lock,
    /// depth, token, lease left, and waiters where the backend can count them.
    Status {
        /// The lock's name.
        #[arg(long)]
        key: String,
        /// Print one JSON object (one per line with --watch).
        #[arg(long)]
        json: bool,
        /// Keep watching: print again whenever the answer changes, checking every
        /// interval (e.g. `1s`), until interrupted.
        #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "1s", value_parser = duration)]
        watch: Option<Duration>,
    },
}

#[derive(Subcommand, Debug)]
enum Story {
    /// WORKERS concurrent workers each sell 3 items of a stock of STOCK: first without a
    /// lock, then under the lock, then with a worker paused past its lease.
    Stock {
        /// Concurrent workers.
        #[arg(long, default_value_t = 30)]
        workers: u32,
        /// Items in stock at the start.
        #[arg(long, default_value_t = 100)]
        stock: i64,
    },
}

/// Runs `command` to its end; its exit code (128 + n for a signal), or 127 if it cannot
/// start.
fn run_to_end(command: &[String]) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    let Some((program, args)) = command.split_first() else {
        return 0;
    };
    match std::process::Command::new(program).args(args).status() {
        Ok(status) => status
            .code()
            .or_else(|| status.signal().map(|n| 128 + n))
            .unwrap_or(1),
        Err(e) => {
            eprintln!("lockkit: cannot start `{program}`: {e}");
            127
        }
    }
}

/// CMD of `lockkit fence`, run while a SQL fence's transaction holds the resource's row: its
/// exit code, whatever it is (the raise was committed before, and CMD's writes are its own,
/// so there is nothing to roll back).
async fn command_in_fence(command: Vec<String>) -> std::result::Result<i32, lockkit::BoxError> {
    Ok(tokio::task::spawn_blocking(move || run_to_end(&command))
        .await
        .unwrap_or(1))
}

/// `lockkit fence`: CMD's exit code (0 without CMD) when `token` is admitted for
/// `resource`, 1 when a newer token already wrote, 2 when the store cannot be used.
async fn fence(url: &str, resource: &str, token: FencingToken, command: &[String]) -> ExitCode {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    let code = |code: i32| ExitCode::from(u8::try_from(code).unwrap_or(1));
    // The SQL fences alike: raise (and commit) the bar, then run CMD in a transaction that
    // holds the resource's row.
    macro_rules! sql_fence {
        ($fence:ty) => {
            match <$fence>::connect(url).await {
                Ok(fence) => match fence.admit(token, resource).await {
                    Ok(()) if command.is_empty() => Ok(0),
                    Ok(()) => {
                        let command = command.to_vec();
                        fence
                            .write(token, resource, move |_| {
                                Box::pin(command_in_fence(command))
                            })
                            .await
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            }
        };
    }
    let outcome: lockkit::Result<i32> = match scheme {
        "file" => {
            let dir = match lockkit::FileBackend::dir_of_url(url) {
                Ok(dir) => dir,
                Err(e) => {
                    eprintln!("lockkit: a file:// fence needs a local directory: {e}");
                    return ExitCode::from(2);
                }
            };
            if resource.is_empty() || resource.contains('/') || resource.starts_with('.') {
                eprintln!(
                    "lockkit: with a file:// store, --resource is a file name in {} \
                     (no `/`, not starting with `.`)",
                    dir.display()
                );
                return ExitCode::from(2);
            }
            let path = dir.join(resource);
            let command = command.to_vec();
            tokio::task::spawn_blocking(move || {
                lockkit::fence::FileFence::new().run(token, path, || Ok(run_to_end(&command)))
            })
            .await
            .unwrap_or_else(|e| {
                Err(Error::backend(
                    "fence",
                    false,
                    format!("the fence task died: {e}"),
                ))
            })
        }
        "redis" | "rediss" => {
            if !command.is_empty() {
                eprintln!(
                    "lockkit: a Redis fence cannot be held while a command runs: fence the \
                     write itself (lockkit::fence::RedisFence), or use a file:// or mysql:// fence"
                );
                return ExitCode::from(2);
            }
            match lockkit::fence::RedisFence::connect(url).await {
                Ok(fence) => fence.admit(token, resource).await.map(|()| 0),
                Err(e) => Err(e),
            }
        }
        // CMD is another process: its writes are not part of the fence's transaction, so the
        // raise is committed before CMD runs (`admit`), and nothing CMD does (failing half-way,
        // lockkit being killed while it runs) can take it back; then CMD runs in a second
        // transaction that holds the row, so no other fenced writer runs in between.
        "mysql" | "mariadb" => sql_fence!(lockkit::fence::MysqlFence),
        "postgres" | "postgresql" => sql_fence!(lockkit::fence::PostgresFence),
        _ => {
            eprintln!(
                "lockkit: `lockkit fence` keeps its fence in file:///dir, mysql://, postgres:// or \
                 redis://; \
                 `{}` is none of those",
                lockkit::config::redact_url(url)
            );
            return ExitCode::from(2);
        }
    };
    match outcome {
        Ok(status) => {
            if command.is_empty() {
                println!("accepted token {token} for `{resource}`");
            }
            code(status)
        }
        Err(e @ Error::Fenced { .. }) => {
            eprintln!("lockkit: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("lockkit: {e}");
            ExitCode::from(2)
        }
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration("duration", text).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    if lockkit_lab::child_requested() {
        // The lab's child holder (started by `lockkit lab` itself).
        let code = lockkit_lab::child_main(lab::connector()).await;
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    install_diagnostics(cli.verbose, cli.quiet);
    if let Commands::Supervise {
        grace_ms,
        parent,
        command,
    } = &cli.command
    {
        return supervisor::main(Duration::from_millis(*grace_ms), *parent, command).await;
    }
    if let Commands::Lab {
        scenario,
        backend,
        list,
        update,
        svg,
    } = &cli.command
    {
        let out = lab::Output {
            update: update.as_deref(),
            svg: svg.as_deref(),
        };
        return lab::main(scenario, backend.as_deref(), *list, out).await;
    }
    let url = cli
        .url
        .filter(|u| !u.is_empty())
        .unwrap_or_else(lockkit::default_url);
    if let Commands::Fence {
        resource,
        token,
        command,
    } = &cli.command
    {
        return fence(&url, resource, FencingToken::new(*token), command).await;
    }
    let locker = match lockkit::connect(&url).await {
        Ok(locker) => locker,
        Err(e) => {
            let shown = lockkit::config::redact_url(&url);
            eprintln!("lockkit: cannot use `{shown}`: {e}");
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Commands::Run {
            key,
            ttl,
            wait,
            max_hold,
            grace,
            conflict_exit_code,
            read,
            write,
            permits,
            metrics_addr,
            command,
        } => {
            if let Some(addr) = metrics_addr
                && let Err(e) = serve_metrics(addr)
            {
                eprintln!("lockkit: cannot serve metrics at {addr}: {e}");
                return ExitCode::from(2);
            }
            let ttl = ttl.unwrap_or(locker.options().ttl);
            let kind = match (read, write, permits) {
                (true, _, _) => Hold::Read,
                (_, true, _) => Hold::Write,
                (_, _, Some(permits)) => Hold::Permit(permits),
                _ => Hold::Lock,
            };
            let job = Job {
                key: &key,
                kind,
                ttl,
                wait,
                max_hold,
                grace,
                conflict_exit_code,
            };
            run(&locker, &job, &command).await
        }
        Commands::Status { key, json, watch } => match watch {
            None => status(&locker, &key, json).await,
            Some(every) => watch_status(&locker, &key, json, every).await,
        },
        Commands::Lab { .. } | Commands::Supervise { .. } | Commands::Fence { .. } => {
            ExitCode::from(2)
        }
        Commands::Bench {
            clients,
            keys,
            duration,
            json,
        } => match bench::run(&url, clients, keys, duration).await {
            Ok(figures) => {
                println!("{}", if json { figures.json() } else { figures.text() });
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("lockkit: the benchmark failed: {e}");
                ExitCode::from(2)
            }
        },
        Commands::Demo {
            story: Story::Stock { workers, stock },
        } => match demo::stock(&url, workers, stock).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lockkit: the demo failed: {e}");
                ExitCode::from(2)
            }
        },
    }
}

async fn status(locker: &Locker, key: &str, json: bool) -> ExitCode {
    match locker.holders(key).await {
        Ok(holders) => {
            println!("{}", describe(key, &holders, json));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lockkit: {e}");
            ExitCode::from(2)
        }
    }
}

/// `status --watch`: prints the answer at once and again each time it changes (the lease
/// left aside, which changes on every look), until interrupted (Ctrl-C). A failed look is reported
/// once and retried.
async fn watch_status(locker: &Locker, key: &str, json: bool, every: Duration) -> ExitCode {
    let every = every.max(Duration::from_millis(50));
    let mut last: Option<String> = None;
    let mut failing = false;
    // One Ctrl-C future for the whole watch: a signal during a slow look is not missed.
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        match locker.holders(key).await {
            Ok(holders) => {
                failing = false;
                let mut steady = holders.clone();
                for info in &mut steady {
                    info.ttl_left = None;
                }
                let fingerprint = format!("{steady:?}");
                if last.as_deref() != Some(fingerprint.as_str()) {
                    println!("{}", describe(key, &holders, json));
                    last = Some(fingerprint);
                }
            }
            Err(e) if !failing => {
                eprintln!("lockkit: {e} (still watching)");
                failing = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = &mut interrupted => return ExitCode::SUCCESS,
        }
    }
}

/// One line about `key`'s holders (a lock's holder or writer, readers, permits): JSON, or
/// text for people. The JSON keeps the first holder's fields at the top level, as before
/// read-write locks and semaphores, and lists every holder under `holders`.
fn describe(key: &str, holders: &[HolderInfo], json: bool) -> String {
    let Some(first) = holders.first() else {
        return if json {
            serde_json::json!({ "key": key, "held": false, "holders": [] }).to_string()
        } else {
            format!("{}: free", key.escape_debug())
        };
    };
    if json {
        let mut object = holder_json(first);
        object["key"] = key.into();
        object["held"] = true.into();
        object["holders"] = holders.iter().map(holder_json).collect();
        if let Some(limit) = first.kind.and_then(LockKind::limit) {
            object["permits"] = limit.into();
        }
        return object.to_string();
    }
    let waiters = first
        .waiters
        .map_or_else(String::new, |n| format!(", {n} waiting"));
    let what = match first.kind {
        None | Some(LockKind::Exclusive) => "held".to_owned(),
        Some(LockKind::Write) => "held for writing".to_owned(),
        Some(LockKind::Read) => format!(
            "read by {} holder{}",
            holders.len(),
            if holders.len() == 1 { "" } else { "s" }
        ),
        Some(kind) => format!(
            "{} of {} permits held",
            holders.len(),
            kind.limit().map_or_else(|| "?".into(), |n| n.to_string())
        ),
    };
    let each: Vec<String> = holders.iter().map(holder_text).collect();
    let by = if holders.len() == 1 { "by" } else { "by:" };
    format!(
        "{}: {what} {by} {}{waiters}",
        key.escape_debug(),
        each.join("; ")
    )
}

/// One holder as a JSON object.
fn holder_json(info: &HolderInfo) -> serde_json::Value {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let identity = info.identity.as_ref();
    serde_json::json!({
        "holder": info.owner,
        "kind": info.kind.map_or("lock", LockKind::name),
        "host": identity.map(|i| i.host.as_str()),
        "pid": identity.map(|i| i.pid),
        "program": identity.map(|i| i.program.as_str()),
        "requested_at_ms": identity.map(HolderIdentity::requested_at_ms),
        "lockkit_version": identity.map(|i| i.version.as_str()),
        "depth": info.depth,
        "token": info.token.map(|t| t.get()),
        "lease_left_ms": info.ttl_left.map(ms),
        "waiters": info.waiters,
    })
}

/// One holder for people: who, depth, token, lease left.
fn holder_text(info: &HolderInfo) -> String {
    let token = info.token.map_or_else(|| "?".into(), |t| t.to_string());
    let left = info
        .ttl_left
        .map_or_else(|| "?".into(), |d| format!("{} ms", d.as_millis()));
    // Keys and holders may carry any printable text (a foreign client's value): escape
    // what a terminal would otherwise interpret.
    let who = match &info.identity {
        Some(identity) => {
            let asked = std::time::SystemTime::now()
                .duration_since(identity.requested_at)
                .map_or_else(|_| "?".into(), |d| format!("{} s", d.as_secs()));
            format!(
                "{} pid {} on {} (owner {}, asked {asked} ago)",
                identity.program.escape_debug(),
                identity.pid,
                identity.host.escape_debug(),
                info.owner.escape_debug()
            )
        }
        None => format!("{} (not identified)", info.owner.escape_debug()),
    };
    format!(
        "{who}, depth {}, token {token}, lease left {left}",
        info.depth
    )
}

/// What `lockkit run` takes.
#[derive(Debug, Clone, Copy)]
enum Hold {
    Lock,
    Read,
    Write,
    Permit(u32),
}

/// The options of one `lockkit run`.
struct Job<'a> {
    key: &'a str,
    kind: Hold,
    ttl: Duration,
    wait: Option<Duration>,
    max_hold: Option<Duration>,
    grace: Duration,
    conflict_exit_code: u8,
}

async fn run(locker: &Locker, job: &Job<'_>, command: &[String]) -> ExitCode {
    let Job {
        key,
        kind,
        ttl,
        wait,
        max_hold,
        grace,
        conflict_exit_code,
    } = *job;
    let acquire = match kind {
        Hold::Lock => locker.acquire(key),
        Hold::Read => locker.read(key),
        Hold::Write => locker.write(key),
        Hold::Permit(permits) => locker.semaphore(key, permits).acquire(),
    };
    let mut acquire = acquire.ttl(ttl);
    if let Some(wait) = wait {
        acquire = acquire.wait(wait);
    }
    if let Some(max_hold) = max_hold {
        acquire = acquire.max_hold(max_hold);
    }
    // Listen before anything can be signalled: a signal during the wait gives up the wait,
    // one while CMD runs is passed on to it.
    // SIGHUP too: a closed terminal must not kill lockkit (its lock would stay held until
    // its lease ran out); it is passed on to CMD like the others.
    // SIGCONT: lockkit ran again after being stopped (see `supervise`).
    let (Ok(interrupts), Ok(terms), Ok(hangups), Ok(continues)) = (
        tokio::signal::unix::signal(SignalKind::interrupt()),
        tokio::signal::unix::signal(SignalKind::terminate()),
        tokio::signal::unix::signal(SignalKind::hangup()),
        tokio::signal::unix::signal(SignalKind::from_raw(Signal::SIGCONT as i32)),
    ) else {
        eprintln!("lockkit: cannot listen for signals");
        return ExitCode::from(2);
    };
    let mut signals = Signals {
        interrupts,
        terms,
        hangups,
        continues,
    };
    let spinner = spin(locker.clone(), key.to_owned());
    let acquired = tokio::select! {
        acquired = acquire => acquired,
        _ = signals.interrupts.recv() => return ExitCode::from(128 + 2),
        _ = signals.terms.recv() => return ExitCode::from(128 + 15),
        _ = signals.hangups.recv() => return ExitCode::from(128 + 1),
    };
    spinner.abort();
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[2K");
    }
    let guard = match acquired {
        Ok(guard) => guard,
        Err(Error::Timeout { waited, .. }) => {
            let holder = locker
                .inspect(key)
                .await
                .ok()
                .flatten()
                .map(|h| h.owner)
                .unwrap_or_default();
            eprintln!("lockkit: `{key}` is held by {holder}; gave up after {waited:?}");
            return ExitCode::from(conflict_exit_code);
        }
        Err(e) => {
            eprintln!("lockkit: cannot lock `{key}`: {e}");
            return ExitCode::from(2);
        }
    };
    let code = supervise(&guard, key, grace, command, &mut signals).await;
    match guard.release().await {
        Ok(_) | Err(Error::Lost { .. }) => {}
        Err(e) => eprintln!("lockkit: releasing `{key}` failed (its lease will run out): {e}"),
    }
    code
}

/// While waiting on a terminal, shows who holds the lock; silent otherwise.
fn spin(locker: Locker, key: String) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if !std::io::stderr().is_terminal() {
            return;
        }
        let frames = ['|', '/', '-', '\\'];
        let started = std::time::Instant::now();
        for frame in frames.iter().cycle() {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let holder = match locker.inspect(key.as_str()).await {
                Ok(Some(info)) => format!(
                    "held by {} (token {})",
                    info.owner,
                    info.token.map_or_else(|| "?".into(), |t| t.to_string())
                ),
                Ok(None) => "free".into(),
                Err(e) => e.to_string(),
            };
            eprint!(
                "\r\x1b[2K{frame} waiting {:.0?} for `{key}`: {holder}",
                started.elapsed()
            );
        }
    })
}

/// The signals `lockkit run` passes on to CMD (and that end a wait).
struct Signals {
    interrupts: tokio::signal::unix::Signal,
    terms: tokio::signal::unix::Signal,
    hangups: tokio::signal::unix::Signal,
    /// lockkit ran again after it was stopped.
    continues: tokio::signal::unix::Signal,
}

/// How often `lockkit run` tells its supervisor that the lock still holds (see
/// [`supervise`]): the longest a CMD stopped while lockkit was held by a debugger stays
/// stopped after lockkit runs again.
const AFFIRM_EVERY: Duration = Duration::from_millis(250);

/// Runs the command while the guard holds. Stops it, with everything it started, if the
/// lock is lost, and already `grace` before the lease could run out unconfirmed (so that
/// SIGKILL, if it comes to that, lands before the lease ends), capped at a third of the
/// lease so a healthy watchdog never triggers it. While lockkit is stopped its supervisor
/// stops CMD too; when lockkit runs again, CMD continues only if the lock still holds past
/// that margin (else it is stopped for good, as for a lost lock).
async fn supervise(
    guard: &LockGuard,
    key: &str,
    grace: Duration,
    command: &[String],
    signals: &mut Signals,
) -> ExitCode {
    let program = command.first().map_or("", String::as_str);
    let env = [
        ("LOCKKIT_KEY", key.to_owned()),
        ("LOCKKIT_TOKEN", guard.token().to_string()),
    ];
    let mut cmd = match supervisor::Supervised::start(command, grace, &env) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("lockkit: cannot run `{program}`: {e}");
            return ExitCode::from(127);
        }
    };
    let margin = grace.min(guard.grant().ttl / 3);
    let lost = guard.lost();
    tokio::pin!(lost);
    let holds = || {
        guard.valid_until().is_some_and(|until| {
            until
                .checked_sub(margin)
                .is_some_and(|s| s > tokio::time::Instant::now())
        })
    };
    // While the lock holds, lockkit says so to the supervisor now and then (SIGUSR2), not
    // only at SIGCONT: a lockkit held by a debugger or `strace` (a tracing stop) runs again
    // without one, and CMD, stopped meanwhile, would stay stopped for good.
    let mut affirm = tokio::time::interval(AFFIRM_EVERY);
    affirm.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Re-read every turn: each renewal moves the deadline.
        let stop_at = guard
            .valid_until()
            .map_or_else(tokio::time::Instant::now, |until| {
                until.checked_sub(margin).unwrap_or(until)
            });
        let why = tokio::select! {
            code = cmd.wait() => {
                cmd.sweep(sweep_grace(guard, grace)).await;
                return ExitCode::from(code);
            }
            reason = &mut lost => format!("lost `{key}` ({reason})"),
            () = tokio::time::sleep_until(stop_at) => {
                match guard.valid_until() {
                    Some(until) if until.checked_sub(margin).is_some_and(|s| s > tokio::time::Instant::now()) => continue,
                    _ => format!("the lease of `{key}` ends within {margin:?} unconfirmed"),
                }
            }
            _ = signals.interrupts.recv() => {
                cmd.signal(Signal::SIGINT);
                continue;
            }
            _ = signals.terms.recv() => {
                cmd.signal(Signal::SIGTERM);
                continue;
            }
            _ = signals.hangups.recv() => {
                cmd.signal(Signal::SIGHUP);
                continue;
            }
            _ = signals.continues.recv() => {
                if holds() {
                    cmd.affirm();
                }
                // Otherwise the deadline (or the loss) stops CMD on the next turn.
                continue;
            }
            _ = affirm.tick() => {
                if holds() {
                    cmd.affirm();
                }
                continue;
            }
        };
        eprintln!("lockkit: {why}; stopping `{program}` and everything it started");
        cmd.stop(grace).await;
        cmd.sweep(sweep_grace(guard, grace)).await;
        return ExitCode::from(LOST_EXIT);
    }
}

/// How long what the sweep finds below lockkit may take to stop after its SIGTERM: `grace`,
/// but no longer than the lock still holds; `None` once it holds no more (the sweep then
/// kills at once: processes stopped while lockkit was must not run again without the lock).
fn sweep_grace(guard: &LockGuard, grace: Duration) -> Option<Duration> {
    let left = guard
        .valid_until()?
        .checked_duration_since(tokio::time::Instant::now())?;
    (!left.is_zero()).then(|| left.min(grace))
}
