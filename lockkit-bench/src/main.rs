//! `peerbench`: lockkit beside its peers and beside each server's floor, measured in one
//! run on the same private servers (`scripts/perf.sh` runs it and writes the table into
//! `docs/performance.md`).
//!
//! Per backend it measures, in batches interleaved between the clients so that all of them
//! see the same moments of a noisy machine: uncontended acquire+release on one key and on a
//! new key each time, the wake of one blocked waiter, a 16-client handoff, and throughput
//! over 1,000 keys with 32 tasks. Peers: rslock 0.10 (in-process), redis-py's `Lock`,
//! kazoo's `Lock` and Apache Curator's `InterProcessMutex` (child processes, see `peers/`).
//! Floors: Redis `PING` and `SET`, ZooKeeper create+delete, `SELECT 1`, `GET_LOCK`,
//! `pg_advisory_lock`, etcd put+delete, `flock`.

mod report;
mod subjects;

use std::{path::PathBuf, time::Duration};

use clap::Parser;
use report::{Measured, Section};
use subjects::{Scenario, Subject, connect_floor};

/// The peer benchmark (addresses from `eval "$(scripts/services.sh env)"`).
#[derive(Debug, Parser)]
struct Args {
    /// Backends to measure, comma-separated: redis, redlock, zk, mysql, postgres, etcd, file.
    #[arg(long, default_value = "redis,redlock,zk,mysql,postgres,etcd,file")]
    backends: String,
    /// Fewer samples (a smoke run: the figures are not worth quoting).
    #[arg(long)]
    quick: bool,
    /// Measure only the clients whose name starts with one of these (comma-separated), e.g.
    /// `lockkit` for a profile of lockkit alone.
    #[arg(long)]
    only: Option<String>,
    /// Run only these scenarios (comma-separated): same, new, wake, handoff, throughput.
    #[arg(long, default_value = "same,new,wake,handoff,throughput")]
    scenarios: String,
    /// Samples of the wake of a blocked waiter per batch (two batches; 15 by default), to
    /// read its p99 from more than 30 samples.
    #[arg(long)]
    wake_samples: Option<usize>,
    /// Write the tables into this Markdown file, between `<!-- peerbench:begin -->` and
    /// `<!-- peerbench:end -->`.
    #[arg(long)]
    write: Option<PathBuf>,
}

/// How many samples of each kind a run takes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    batches: usize,
    same: usize,
    new: usize,
    wake: usize,
    handoff_rounds: usize,
    /// The time each client runs the throughput scenario, in all.
    throughput: Duration,
    /// In how many interleaved runs it is split.
    throughput_runs: usize,
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name)
        .map_err(|_| format!("{name} is not set: run eval \"$(scripts/services.sh env)\" first"))
}

fn hosts(url: &str) -> String {
    url.split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split(['/', '?'])
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn with_mode(url: &str, mode: &str) -> String {
    if url.contains('?') {
        format!("{url}&mode={mode}")
    } else {
        format!("{url}?mode={mode}")
    }
}

/// This run's scratch directory (Curator's classes, the file backend's lock files), removed
/// when the run ends.
fn scratch_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("lockkit-peerbench-{}", std::process::id()))
}

/// Compiles `peers/CuratorPeer.java` against Debian's Curator jars; the java arguments.
fn curator_command() -> Result<Vec<String>, String> {
    let jars = [
        "curator-client",
        "curator-framework",
        "curator-recipes",
        "zookeeper",
        "guava",
        "slf4j-api",
        "slf4j-nop",
    ]
    .iter()
    .map(|j| format!("/usr/share/java/{j}.jar"))
    .collect::<Vec<_>>();
    if let Some(missing) = jars.iter().find(|j| !std::path::Path::new(j).exists()) {
        return Err(format!(
            "{missing} is missing: scripts/services.sh up installs libcurator-recipes-java"
        ));
    }
    let classpath = jars.join(":");
    let out = scratch_dir();
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/CuratorPeer.java");
    let status = std::process::Command::new("javac")
        .args(["-cp", &classpath, "-d"])
        .arg(&out)
        .arg(source)
        .status()
        .map_err(|e| format!("javac: {e}"))?;
    if !status.success() {
        return Err("javac failed on peers/CuratorPeer.java".into());
    }
    Ok(vec![
        "-cp".into(),
        format!("{}:{classpath}", out.display()),
        "CuratorPeer".into(),
    ])
}

fn python_peer(kind: &str, address: &str) -> Result<(String, Vec<String>), String> {
    let python = env("LOCKKIT_TEST_PYTHON")?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/peer.py");
    Ok((python, vec![script.into(), kind.into(), address.into()]))
}

/// The clients of one backend: lockkit first, then peers, then floors. A peer that cannot
/// start is left out with a note (the run goes on).
async fn subjects_of(backend: &str, notes: &mut Vec<String>) -> Result<Vec<Subject>, String> {
    let mut subjects = Vec::new();
    let mut add = |made: Result<Subject, String>, what: &str, notes: &mut Vec<String>| match made {
        Ok(s) => subjects.push(s),
        Err(e) => notes.push(format!("{backend}: {what} left out: {e}")),
    };
    match backend {
        "redis" => {
            let url = env("LOCKKIT_TEST_REDIS_URL")?;
            add(Subject::lockkit("lockkit", &url).await, "lockkit", notes);
            add(
                Ok(Subject::rslock("rslock 0.10", vec![url.clone()])),
                "rslock",
                notes,
            );
            let (python, args) = python_peer("redis", &url)?;
            add(
                Subject::external("redis-py 5 `Lock`", &python, &args).await,
                "redis-py",
                notes,
            );
            add(
                connect_floor("ping", &url)
                    .await
                    .map(|f| Subject::floor("floor: `PING` (1 round trip); `SET` rate", f)),
                "PING",
                notes,
            );
            add(
                connect_floor("script-pair", &url)
                    .await
                    .map(|f| Subject::floor("floor: two `EVALSHA`s of an empty script", f)),
                "script pair",
                notes,
            );
        }
        "redlock" => {
            let url = env("LOCKKIT_TEST_REDLOCK_URL")?;
            let nodes = hosts(&url);
            add(Subject::lockkit("lockkit", &url).await, "lockkit", notes);
            let masters = nodes.split(',').map(|n| format!("redis://{n}")).collect();
            add(Ok(Subject::rslock("rslock 0.10", masters)), "rslock", notes);
            add(
                connect_floor("ping-all", &nodes)
                    .await
                    .map(|f| Subject::floor("floor: `PING` to the 5 masters at once", f)),
                "PING",
                notes,
            );
        }
        "zk" => {
            let url = env("LOCKKIT_TEST_ZK_URL")?;
            let hosts = hosts(&url);
            add(Subject::lockkit("lockkit", &url).await, "lockkit", notes);
            let (python, args) = python_peer("kazoo", &hosts)?;
            add(
                Subject::external("kazoo 2.11 `Lock`", &python, &args).await,
                "kazoo",
                notes,
            );
            match curator_command() {
                Ok(mut args) => {
                    args.push(hosts.clone());
                    add(
                        Subject::external("Curator 5.4 `InterProcessMutex`", "java", &args).await,
                        "Curator",
                        notes,
                    );
                }
                Err(e) => notes.push(format!("zk: Curator left out: {e}")),
            }
            add(
                connect_floor("zk", &hosts)
                    .await
                    .map(|f| Subject::floor("floor: ephemeral create + delete", f)),
                "create+delete",
                notes,
            );
        }
        "mysql" => {
            let url = env("LOCKKIT_TEST_MYSQL_URL")?;
            add(
                Subject::lockkit("lockkit `mode=row`", &with_mode(&url, "row")).await,
                "lockkit row",
                notes,
            );
            add(
                Subject::lockkit("lockkit `mode=for-update`", &with_mode(&url, "for-update")).await,
                "lockkit for-update",
                notes,
            );
            add(
                connect_floor("mysql-select", &url)
                    .await
                    .map(|f| Subject::floor("floor: `SELECT 1` (sqlx)", f)),
                "SELECT 1",
                notes,
            );
            add(
                connect_floor("mysql-commits", &url)
                    .await
                    .map(|f| Subject::floor("floor: two one-row `UPDATE` commits", f)),
                "two commits",
                notes,
            );
            add(
                connect_floor("mysql-get-lock", &url)
                    .await
                    .map(|f| Subject::floor("floor: `GET_LOCK` + `RELEASE_LOCK`", f)),
                "GET_LOCK",
                notes,
            );
        }
        "postgres" => {
            let url = env("LOCKKIT_TEST_POSTGRES_URL")?;
            add(
                Subject::lockkit("lockkit `mode=row`", &with_mode(&url, "row")).await,
                "lockkit row",
                notes,
            );
            add(
                Subject::lockkit("lockkit `mode=advisory`", &with_mode(&url, "advisory")).await,
                "lockkit advisory",
                notes,
            );
            add(
                connect_floor("pg-select", &url)
                    .await
                    .map(|f| Subject::floor("floor: `SELECT 1` (sqlx)", f)),
                "SELECT 1",
                notes,
            );
            add(
                connect_floor("pg-commits", &url)
                    .await
                    .map(|f| Subject::floor("floor: two one-row `UPDATE` commits", f)),
                "two commits",
                notes,
            );
            add(
                connect_floor("pg-advisory", &url)
                    .await
                    .map(|f| Subject::floor("floor: `pg_advisory_lock` + unlock", f)),
                "pg_advisory_lock",
                notes,
            );
        }
        "etcd" => {
            let url = env("LOCKKIT_TEST_ETCD_URL")?;
            add(Subject::lockkit("lockkit", &url).await, "lockkit", notes);
            add(
                connect_floor("etcd", &hosts(&url))
                    .await
                    .map(|f| Subject::floor("floor: put + delete", f)),
                "put+delete",
                notes,
            );
        }
        "file" => {
            let dir = scratch_dir();
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            add(
                Subject::lockkit("lockkit", &lockkit::FileBackend::url_of(&dir)).await,
                "lockkit",
                notes,
            );
            add(
                connect_floor("flock", &dir.join("floor.lock").display().to_string())
                    .await
                    .map(|f| Subject::floor("floor: `flock` + unlock", f)),
                "flock",
                notes,
            );
        }
        other => return Err(format!("unknown backend {other}")),
    }
    Ok(subjects)
}

async fn measure(
    backend: &str,
    sizes: Sizes,
    only: Option<&str>,
    scenarios: &str,
    notes: &mut Vec<String>,
) -> Result<Section, String> {
    let runs = |name: &str| scenarios.split(',').any(|s| s.trim() == name);
    let mut subjects = subjects_of(backend, notes).await?;
    if let Some(only) = only {
        subjects.retain(|s| {
            only.split(',')
                .any(|prefix| s.label().starts_with(prefix.trim()))
        });
    }
    let mut measured: Vec<Measured> = subjects
        .iter()
        .map(|s| Measured::new(s.label(), s.is_floor(), s.is_lockkit()))
        .collect();
    // Warm-up (connections, script caches, the JIT), not recorded.
    for subject in subjects.iter_mut() {
        if let Err(e) = subject.run(Scenario::SameKey, 50).await {
            notes.push(format!(
                "{backend}: {} failed to warm up: {e}",
                subject.label()
            ));
        }
    }
    let plan = [
        ("same", Scenario::SameKey, sizes.same, sizes.batches),
        ("new", Scenario::NewKey, sizes.new, sizes.batches),
        ("wake", Scenario::Wake, sizes.wake, 2),
        ("handoff", Scenario::Handoff, sizes.handoff_rounds, 1),
    ];
    for (_, scenario, n, batches) in plan.into_iter().filter(|(name, ..)| runs(name)) {
        eprintln!("[peerbench] {backend}: {scenario:?}");
        for _ in 0..batches {
            for (subject, figures) in subjects.iter_mut().zip(measured.iter_mut()) {
                match subject.run(scenario, n).await {
                    Ok(Some(samples)) => figures.add(scenario, samples),
                    Ok(None) => {}
                    Err(e) => notes.push(format!(
                        "{backend}: {} {scenario:?} failed: {e}",
                        subject.label()
                    )),
                }
            }
        }
    }
    eprintln!("[peerbench] {backend}: throughput");
    let throughput = if runs("throughput") {
        subjects.as_slice()
    } else {
        &[]
    };
    // In interleaved runs, as the latencies are: one run of each client at a time met
    // moments of the machine the others did not (a lockkit figure of one run moved by 1.7x
    // from run to run); the median of the runs is reported, with their range.
    let run = sizes.throughput / u32::try_from(sizes.throughput_runs.max(1)).unwrap_or(1);
    for _ in 0..sizes.throughput_runs {
        for (subject, figures) in throughput.iter().zip(measured.iter_mut()) {
            match subject.throughput(32, 1000, run).await {
                Ok(Some(rate)) => figures.add_rate(rate),
                Ok(None) => {}
                Err(e) => notes.push(format!(
                    "{backend}: {} throughput failed: {e}",
                    subject.label()
                )),
            }
        }
    }
    Ok(Section {
        backend: backend.to_owned(),
        measured,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        // e.g. RUST_LOG=sqlx::query=debug: every statement of a run, with its time.
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let sizes = if args.quick {
        Sizes {
            batches: 2,
            same: 50,
            new: 20,
            wake: 2,
            handoff_rounds: 2,
            throughput: Duration::from_millis(500),
            throughput_runs: 1,
        }
    } else {
        Sizes {
            batches: 10,
            same: 200,
            new: 60,
            wake: 15,
            handoff_rounds: 5,
            throughput: Duration::from_secs(6),
            throughput_runs: 3,
        }
    };
    let sizes = Sizes {
        wake: args.wake_samples.unwrap_or(sizes.wake),
        ..sizes
    };
    let mut notes = Vec::new();
    let mut sections = Vec::new();
    for backend in args
        .backends
        .split(',')
        .map(str::trim)
        .filter(|b| !b.is_empty())
    {
        match measure(
            backend,
            sizes,
            args.only.as_deref(),
            &args.scenarios,
            &mut notes,
        )
        .await
        {
            Ok(section) => sections.push(section),
            Err(e) => notes.push(format!("{backend}: not measured: {e}")),
        }
    }
    // Every subject is gone by now (each backend's end with its `measure`).
    if let Err(e) = std::fs::remove_dir_all(scratch_dir())
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("peerbench: cannot remove {}: {e}", scratch_dir().display());
    }
    let markdown = report::markdown(&sections, &notes, args.quick);
    println!("{markdown}");
    if let Some(path) = args.write {
        if let Err(e) = report::splice(&path, &markdown) {
            eprintln!("peerbench: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        eprintln!("[peerbench] wrote {}", path.display());
    }
    if !notes.is_empty() {
        std::process::exit(2);
    }
}
