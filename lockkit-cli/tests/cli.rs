//! `lockkit run` and `lockkit status`: exit codes, the child's environment, loss,
//! signals, and exclusion across concurrent shell loops.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use lockkit::{FileBackend, LockKey, Locker};

const BIN: &str = env!("CARGO_BIN_EXE_lockkit");

fn dir(test: &str) -> String {
    let dir = format!("{}/cli/{test}", env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn lockkit(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("LOCKKIT_URL", url).args(args);
    cmd
}

/// `lockkit <args>` on `url`, returned once CMD has printed its first line, `ready`.
fn run_until_ready(url: &str, args: &[&str]) -> std::process::Child {
    let mut child = lockkit(url, args).stdout(Stdio::piped()).spawn().unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    child
}

/// Waits until `lockkit run` holds `k` in `dir`, then takes the lock away as an operator
/// would; returns when the wait began.
async fn take_away_when_held(dir: &str) -> Instant {
    let backend = FileBackend::open(dir).unwrap();
    let key = LockKey::new("k").unwrap();
    let started = Instant::now();
    while Locker::new(backend.clone())
        .inspect(&key)
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "lockkit never took the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The watchdog notices within a renewal.
    assert!(backend.take_away(&key).await.unwrap());
    started
}

#[test]
fn run_passes_the_exit_code_and_the_token() {
    let url = format!("file://{}", dir("exit"));
    let out = lockkit(
        &url,
        &[
            "run",
            "--key",
            "k",
            "--",
            "sh",
            "-c",
            "echo $LOCKKIT_KEY $LOCKKIT_TOKEN; exit 7",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    assert_eq!(words.next(), Some("k"));
    assert!(words.next().unwrap().parse::<u64>().unwrap() > 0, "{text}");
    // Released on exit: the key is free again.
    let status = lockkit(&url, &["status", "--key", "k"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&status.stdout).trim(), "k: free");
}

#[tokio::test]
async fn a_wait_that_times_out_exits_1_or_the_conflict_code() {
    let dir = dir("conflict");
    let holder = Locker::new(FileBackend::open(&dir).unwrap());
    let held = holder.acquire("k").await.unwrap();
    let url = format!("file://{dir}");
    let out = lockkit(
        &url,
        &["run", "--key", "k", "--wait", "200ms", "--", "true"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("held by"),
        "says who holds it"
    );
    let out = lockkit(
        &url,
        &[
            "run",
            "--key",
            "k",
            "--wait",
            "0",
            "--conflict-exit-code",
            "9",
            "--",
            "true",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(9));
    let status = lockkit(&url, &["status", "--key", "k", "--json"])
        .output()
        .unwrap();
    let json = String::from_utf8_lossy(&status.stdout);
    assert!(
        json.contains("\"held\":true") && json.contains(&held.owner().to_string()),
        "{json}"
    );
    held.release().await.unwrap();
}

#[tokio::test]
async fn a_lost_lock_stops_the_command_and_exits_75() {
    let dir = dir("lost");
    let url = format!("file://{dir}");
    let mut child = lockkit(
        &url,
        &[
            "run", "--key", "k", "--ttl", "600ms", "--grace", "1s", "--", "sleep", "30",
        ],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let started = take_away_when_held(&dir).await;
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(75));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the command was not stopped"
    );
}

/// `lockkit run` of a CMD that exits with `code` on `trap`: `signal` sent to lockkit is
/// passed on to CMD, lockkit exits with CMD's code, and the lock is released.
fn signal_is_passed_on(
    url: &str,
    key: &str,
    trap: &str,
    signal: nix::sys::signal::Signal,
    code: i32,
) {
    let script = format!("trap 'exit {code}' {trap}; echo ready; while :; do sleep 0.05; done");
    let mut child = lockkit(url, &["run", "--key", key, "--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, signal).unwrap();
    assert_eq!(
        child.wait().unwrap().code(),
        Some(code),
        "the command's own exit code after {signal} (None: lockkit was killed by it)"
    );
    let status = lockkit(url, &["status", "--key", key]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&status.stdout).trim(),
        format!("{key}: free")
    );
}

#[test]
fn sigterm_is_passed_on_and_the_lock_released() {
    let url = format!("file://{}", dir("signal"));
    signal_is_passed_on(&url, "k", "TERM", nix::sys::signal::Signal::SIGTERM, 3);
}

/// helper-43's finding: SIGHUP (a terminal closed) killed lockkit, so its lock stayed held
/// until its lease ran out; now it is passed on to CMD, and lockkit releases the lock when
/// CMD ends.
#[test]
fn sighup_is_passed_on_and_the_lock_released() {
    let Some(redis) = lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    // A server-side lease (Redis), 60 s: only a release frees the key in time.
    let url = format!("{redis}?ttl=60s");
    let key = format!("hup-{}", std::process::id());
    signal_is_passed_on(&url, &key, "HUP", nix::sys::signal::Signal::SIGHUP, 4);
}

/// 8 concurrent shell loops x 25 runs of a read-decrement-write on a counter file, each
/// under `lockkit run`: the counter ends exact.
fn counter_loops(url: &str, dir: &str) {
    let counter = format!("{dir}/counter");
    std::fs::write(&counter, "200").unwrap();
    let script = format!(
        "for i in $(seq 25); do {BIN} run --key counter --wait 60s -- sh -c 'v=$(cat {counter}); sleep 0.001; echo $((v - 1)) > {counter}' || exit 1; done"
    );
    let loops: Vec<_> = (0..8)
        .map(|_| {
            Command::new("sh")
                .arg("-c")
                .arg(&script)
                .env("LOCKKIT_URL", url)
                .spawn()
                .unwrap()
        })
        .collect();
    for mut shell in loops {
        assert!(shell.wait().unwrap().success(), "a loop failed under {url}");
    }
    assert_eq!(
        std::fs::read_to_string(&counter).unwrap().trim(),
        "0",
        "lost updates under {url}"
    );
}

/// The counter loops on each backend named by its URL variable (with options), in a
/// directory of their own: one test per group, so the groups run side by side.
fn counter_loops_on(group: &str, backends: &[(&str, &str)]) {
    let dir = dir(&format!("loops-{group}"));
    for (var, options) in backends {
        if let Some(url) = lockkit_conformance::env::service_url(var) {
            counter_loops(&format!("{url}{options}"), &dir);
        }
    }
}

#[test]
fn shell_loops_end_exact_on_file_and_redis() {
    let dir = dir("loops-file");
    counter_loops(&format!("file://{dir}/locks"), &dir);
    counter_loops_on(
        "redis",
        &[
            ("LOCKKIT_TEST_REDIS_URL", ""),
            ("LOCKKIT_TEST_REDLOCK_URL", ""),
        ],
    );
}

#[test]
fn shell_loops_end_exact_on_zookeeper_and_mysql() {
    counter_loops_on(
        "zk-mysql",
        &[
            ("LOCKKIT_TEST_ZK_URL", "?session_timeout=5s"),
            ("LOCKKIT_TEST_MYSQL_URL", "?mode=row&table=lockkit_cli_row"),
            (
                "LOCKKIT_TEST_MYSQL_URL",
                "?mode=for-update&table=lockkit_cli_fu",
            ),
        ],
    );
}

#[test]
fn shell_loops_end_exact_on_postgres() {
    counter_loops_on(
        "postgres",
        &[
            (
                "LOCKKIT_TEST_POSTGRES_URL",
                "?mode=row&table=lockkit_cli_row",
            ),
            (
                "LOCKKIT_TEST_POSTGRES_URL",
                "?mode=advisory&table=lockkit_cli_adv",
            ),
        ],
    );
}

#[test]
fn shell_loops_end_exact_on_etcd() {
    counter_loops_on(
        "etcd",
        &[
            ("LOCKKIT_TEST_ETCD_URL", "?session_ttl=5s"),
            ("LOCKKIT_TEST_ETCD_CLUSTER_URL", "?session_ttl=5s"),
        ],
    );
}

#[tokio::test]
async fn sigterm_while_waiting_gives_up_without_taking_the_lock() {
    let dir = dir("signal-wait");
    let holder = Locker::new(FileBackend::open(&dir).unwrap());
    let held = holder.acquire("k").await.unwrap();
    let url = format!("file://{dir}");
    let mut child = lockkit(&url, &["run", "--key", "k", "--", "true"])
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(143));
    let info = holder.inspect("k").await.unwrap().unwrap();
    assert_eq!(
        info.owner,
        held.owner().to_string(),
        "the waiter must not have taken the lock"
    );
    held.release().await.unwrap();
}

#[test]
fn the_stock_demo_tells_the_story() {
    let url = format!("file://{}", dir("demo"));
    let out = lockkit(&url, &["demo", "stock", "--workers", "10", "--stock", "50"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("under the lock:  20 left, expected 20: exact"),
        "{text}"
    );
    assert!(text.contains("refused: token older"), "{text}");
    assert!(text.contains("items left: 49"), "{text}");
}

#[test]
fn bench_prints_json_with_ratios() {
    let url = format!("file://{}", dir("bench"));
    let out = lockkit(
        &url,
        &[
            "bench",
            "--json",
            "--duration",
            "300ms",
            "--clients",
            "2",
            "--keys",
            "10",
        ],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = String::from_utf8_lossy(&out.stdout);
    for field in [
        "round_trip_p50_us",
        "lock_p50_us",
        "lock_p999_us",
        "lock_to_round_trip",
        "acquire_release_per_s",
        "handoff_p50_us",
    ] {
        assert!(
            json.contains(&format!("\"{field}\":")),
            "{field} missing in {json}"
        );
    }
    // Piped, no progress line.
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("[1/4]"),
        "progress shown while piped"
    );
}

/// On a terminal (a pseudo-terminal from script(1)) `bench` shows its progress, step by
/// step, and clears the line before printing its figures.
#[test]
fn bench_shows_progress_on_a_terminal() {
    let url = format!("file://{}", dir("bench-tty"));
    let line = format!("LOCKKIT_URL={url} {BIN} bench --duration 100ms --clients 2 --keys 4");
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for step in [
        "[1/4] the backend's round trip",
        "[2/4] uncontended",
        "[3/4] throughput",
        "[4/4] handoff",
    ] {
        assert!(text.contains(step), "`{step}` missing from: {text}");
    }
}

#[tokio::test]
async fn a_command_that_ignores_sigterm_is_killed_after_the_grace() {
    let dir = dir("grace");
    let url = format!("file://{dir}");
    let mut child = lockkit(
        &url,
        &[
            "run",
            "--key",
            "k",
            "--ttl",
            "600ms",
            "--grace",
            "500ms",
            "--",
            "sh",
            "-c",
            "trap '' TERM; while :; do sleep 0.05; done",
        ],
    )
    .spawn()
    .unwrap();
    let started = take_away_when_held(&dir).await;
    assert_eq!(
        child.wait().unwrap().code(),
        Some(75),
        "SIGKILL after the grace, then 75"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn lab_lists_scenarios_and_refuses_unknown_ones() {
    let out = Command::new(BIN).args(["lab", "--list"]).output().unwrap();
    assert!(out.status.success());
    let list = String::from_utf8_lossy(&out.stdout);
    for scenario in [
        "holder-paused",
        "server-paused",
        "failover",
        "redlock-restart",
    ] {
        assert!(list.contains(scenario), "{list}");
    }
    let out = Command::new(BIN).args(["lab", "no-such"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("holder-paused"),
        "the error lists the scenarios"
    );
}

/// The CLI runs a scenario with itself as the frozen child holder.
#[test]
fn lab_runs_a_scenario_and_prints_its_timeline() {
    // The lab reads every server URL; without them (outside scripts/test.sh) skip loudly.
    if lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL").is_none() {
        return;
    }
    let out = Command::new(BIN)
        .args(["lab", "holder-paused", "--backend", "file"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for line in [
        "holder SIGSTOPped",
        "rival granted",
        "holder's guard fired lost on resume",
        "refused",
        "verdict: as expected",
        "| `holder-paused` | `file` | CP |",
    ] {
        assert!(text.contains(line), "`{line}` missing from:\n{text}");
    }
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("[1/1]"),
        "progress shown while piped"
    );
}

/// Whether `pid` is a running process (a zombie waiting to be reaped is not).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// Starts `lockkit run` on a command that leaves a grandchild (`sleep 37` in the
/// background) and returns lockkit's process and the grandchild's pid.
fn run_with_grandchild(dir: &str, extra: &[&str]) -> (std::process::Child, i32) {
    let pidfile = format!("{dir}/grandchild.pid");
    let _ = std::fs::remove_file(&pidfile);
    let script = format!("sleep 37 & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait");
    let url = format!("file://{dir}");
    let mut args = vec!["run", "--key", "k", "--ttl", "3s", "--grace", "1s"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", &script]);
    let child = lockkit(&url, &args).spawn().unwrap();
    let started = Instant::now();
    let pid = loop {
        if let Ok(text) = std::fs::read_to_string(&pidfile) {
            break text.trim().parse::<i32>().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(alive(pid), "the grandchild must be running");
    (child, pid)
}

fn assert_gone_soon(pid: i32, what: &str) {
    let started = Instant::now();
    while alive(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{what}: the grandchild {pid} outlived the lock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn a_lost_lock_stops_the_grandchildren_too() {
    let dir = dir("lost-grandchild");
    let (mut child, grandchild) = run_with_grandchild(&dir, &[]);
    take_away_when_held(&dir).await;
    assert_eq!(child.wait().unwrap().code(), Some(75));
    assert_gone_soon(grandchild, "after the lock was lost");
}

#[test]
fn sigterm_to_lockkit_stops_the_grandchildren_too() {
    let dir = dir("term-grandchild");
    let (mut child, grandchild) = run_with_grandchild(&dir, &[]);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let code = child.wait().unwrap().code();
    assert_eq!(
        code,
        Some(128 + 15),
        "sh killed by SIGTERM is reported as 143"
    );
    assert_gone_soon(grandchild, "after SIGTERM to lockkit");
}

#[test]
fn a_sigkilled_lockkit_leaves_no_command_running() {
    let dir = dir("kill-grandchild");
    let (mut child, grandchild) = run_with_grandchild(&dir, &[]);
    child.kill().unwrap();
    let _ = child.wait();
    assert_gone_soon(grandchild, "after lockkit was SIGKILLed");
}

#[test]
fn a_command_killed_by_a_signal_exits_128_plus_n() {
    let url = format!("file://{}", dir("signal-code"));
    let status = lockkit(&url, &["run", "--key", "k", "--", "sh", "-c", "kill -9 $$"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(128 + 9));
}

/// A password in a URL never shows: not in the CLI's errors (a wrong password, a bad
/// port), not in `bench --json`, not in the library's errors or `Debug` output.
#[tokio::test]
async fn passwords_never_show() {
    const SECRET: &str = "wrongpw-S3CR3T";
    let mut urls = vec![format!("redis://u:{SECRET}@127.0.0.1:notaport")];
    if let Some(redis) = lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL") {
        let host = redis.trim_start_matches("redis://");
        urls.push(format!("redis://default:{SECRET}@{host}"));
        urls.push(format!("redlock://default:{SECRET}@{host},{host},{host}"));
    }
    if let Some(mysql) = lockkit_conformance::env::service_url("LOCKKIT_TEST_MYSQL_URL") {
        let rest = mysql.trim_start_matches("mysql://");
        let (_, at_host) = rest.split_once('@').unwrap();
        urls.push(format!("mysql://lockkit:{SECRET}@{at_host}"));
        urls.push(format!(
            "mysql://lockkit:{SECRET}@{at_host}?mode=for-update&bogus=1"
        ));
    }
    if let Some(postgres) = lockkit_conformance::env::service_url("LOCKKIT_TEST_POSTGRES_URL") {
        let rest = postgres.trim_start_matches("postgres://");
        let (_, at_host) = rest.split_once('@').unwrap();
        urls.push(format!("postgres://lockkit:{SECRET}@{at_host}"));
        urls.push(format!("postgres://lockkit:{SECRET}@{at_host}?bogus=1"));
    }
    for url in &urls {
        for args in [
            &["status", "--key", "k"][..],
            &["status", "--key", "k", "--json"][..],
            &["bench", "--json", "--duration", "1s"][..],
        ] {
            let out = lockkit(url, args).output().unwrap();
            let shown = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                !shown.contains(SECRET),
                "`lockkit {args:?}` on {url} printed the password:\n{shown}"
            );
        }
        match lockkit::connect(url).await {
            Ok(locker) => {
                let debug = format!("{locker:?}");
                assert!(
                    !debug.contains(SECRET),
                    "Debug of the locker shows the password: {debug}"
                );
                if let Err(e) = locker.inspect("k").await {
                    assert!(!format!("{e} {e:?}").contains(SECRET), "{e:?}");
                }
            }
            Err(e) => {
                let shown = format!("{e} {e:?}");
                assert!(
                    !shown.contains(SECRET),
                    "connect error shows the password: {shown}"
                );
            }
        }
    }
}

#[test]
fn status_json_is_valid_json_for_any_key() {
    let url = format!("file://{}", dir("json"));
    for key in [
        "plain",
        "quo\"te",
        "back\\slash",
        "ünïcödé/κλειδί",
        "e\u{301}\u{200d}",
        "tab\there",
    ] {
        let out = lockkit(&url, &["status", "--key", key, "--json"])
            .output()
            .unwrap();
        if key.contains('\t') {
            // Control characters are refused as keys, with an error, not bad JSON.
            assert!(!out.status.success());
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let value: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
            panic!("`status --json` for {key:?} printed invalid JSON ({e}): {text}")
        });
        assert_eq!(value["key"], key);
        assert_eq!(value["held"], false);
    }
}

/// `lockkit fence`: a shell job's token is accepted while it is the newest (exit 0), a stale
/// one is refused naming the newer token (exit 1), on each store it supports.
#[test]
fn fence_accepts_the_newest_token_and_refuses_a_stale_one() {
    let dir = dir("fence");
    let unique = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let mut stores = vec![(format!("file://{dir}"), format!("orders-42-{unique}"))];
    for var in [
        "LOCKKIT_TEST_REDIS_URL",
        "LOCKKIT_TEST_MYSQL_URL",
        "LOCKKIT_TEST_POSTGRES_URL",
    ] {
        if let Some(url) = lockkit_conformance::env::service_url(var) {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            stores.push((url, format!("cli-fence/{}-{nanos}", std::process::id())));
        }
    }
    for (url, resource) in stores {
        let fence = |token: &str| {
            lockkit(&url, &["fence", "--resource", &resource, "--token", token])
                .output()
                .unwrap()
        };
        for token in ["5", "5", "9"] {
            let out = fence(token);
            assert_eq!(out.status.code(), Some(0), "{url}: token {token}: {out:?}");
        }
        let stale = fence("7");
        assert_eq!(stale.status.code(), Some(1), "{url}: {stale:?}");
        let said = String::from_utf8_lossy(&stale.stderr);
        assert!(
            said.contains("token 7") && said.contains("token 9"),
            "{url}: {said}"
        );
    }
    let out = lockkit("memory://", &["fence", "--resource", "r", "--token", "1"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "memory:// has no fence store: {out:?}"
    );
}

/// `lockkit fence ... -- CMD` holds the fence while CMD runs (review 15, H1): a stale
/// writer admitted first cannot write after a newer one, and a refused writer's CMD never
/// runs. With MySQL and PostgreSQL, a failing CMD raises the bar all the same.
#[test]
fn fence_runs_the_write_under_the_fence() {
    let dir = dir("fence-cmd");
    let pid = std::process::id();
    // Files of their own per run: the target directory outlives runs.
    let (data, started) = (
        format!("{dir}/orders-7-{pid}"),
        format!("{dir}/started-{pid}"),
    );
    let resource = format!("orders-7-fence-{pid}");
    for stale_file in [&data, &started, &format!("{dir}/{resource}.fence")] {
        let _ = std::fs::remove_file(stale_file);
    }
    let url = format!("file://{dir}");
    let write = |token: &str, cmd: String| {
        lockkit(
            &url,
            &["fence", "--resource", &resource, "--token", token, "--"],
        )
        .args(["sh", "-c", &cmd])
        .spawn()
        .unwrap()
    };
    // The stale writer is admitted first and is still writing when the newer one comes.
    let mut stale = write("5", format!("touch {started}; sleep 1; echo A > {data}"));
    let waiting = Instant::now();
    while !std::path::Path::new(&started).exists() {
        assert!(
            waiting.elapsed() < Duration::from_secs(30),
            "the first writer never ran"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut newer = write("9", format!("echo B > {data}"));
    let (stale, newer) = (stale.wait().unwrap(), newer.wait().unwrap());
    assert!(stale.success() && newer.success(), "{stale:?} {newer:?}");
    assert_eq!(
        std::fs::read_to_string(&data).unwrap().trim(),
        "B",
        "the stale write landed after the newer one"
    );
    let refused = write("6", format!("echo C > {data}")).wait().unwrap();
    assert_eq!(refused.code(), Some(1));
    assert_eq!(
        std::fs::read_to_string(&data).unwrap().trim(),
        "B",
        "a refused CMD ran"
    );

    for var in ["LOCKKIT_TEST_MYSQL_URL", "LOCKKIT_TEST_POSTGRES_URL"] {
        let Some(url) = lockkit_conformance::env::service_url(var) else {
            continue;
        };
        let resource = format!("cli-fence-cmd/{pid}-{:?}", Instant::now());
        let run = |token: &str, cmd: &str| {
            lockkit(
                &url,
                &["fence", "--resource", &resource, "--token", token, "--"],
            )
            .args(["sh", "-c", cmd])
            .status()
            .unwrap()
            .code()
        };
        assert_eq!(run("5", "exit 3"), Some(3), "CMD's code is passed on");
        // CMD's writes are outside the transaction: a failed CMD may have written, so
        // the bar it raised stays (helper-43, finding 1).
        assert_eq!(run("4", "true"), Some(1), "a failed CMD raised the bar too");
        assert_eq!(run("5", "true"), Some(0), "the same token again");
        assert_eq!(run("3", "true"), Some(1), "a successful one did");
    }
}

/// `RUST_LOG=lockkit=debug` (or `-v`) shows the acquire and release spans with the key,
/// backend, token and outcome on stderr; by default nothing is printed for a lock that
/// worked.
#[test]
fn debug_logging_shows_the_acquire_and_release_spans() {
    let url = format!("file://{}", dir("spans"));
    for (env_filter, flag) in [(Some("lockkit=debug"), None), (None, Some("-v"))] {
        let mut args = vec!["run", "--key", "spanned", "--", "true"];
        if let Some(flag) = flag {
            args.insert(0, flag);
        }
        let mut cmd = lockkit(&url, &args);
        match env_filter {
            Some(filter) => cmd.env("RUST_LOG", filter),
            None => cmd.env_remove("RUST_LOG"),
        };
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        let err = String::from_utf8_lossy(&out.stderr);
        let span = |name: &str| {
            err.lines()
                .find(|l| l.contains(name))
                .unwrap_or_else(|| panic!("no {name} span in: {err}"))
                .to_owned()
        };
        let acquire = span("lockkit.acquire{");
        for field in [
            "key=spanned",
            "backend=\"file\"",
            "outcome=\"granted\"",
            "token=",
        ] {
            assert!(acquire.contains(field), "{field} missing from: {acquire}");
        }
        let release = span("lockkit.release{");
        assert!(release.contains("outcome=\"released\""), "{release}");
    }
    let quiet = lockkit(&url, &["run", "--key", "spanned", "--", "true"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(
        quiet.stderr.is_empty(),
        "a lock that worked printed: {}",
        String::from_utf8_lossy(&quiet.stderr)
    );
}

/// A lock lost while the command runs is told on stderr at `error`, with the key and the
/// reason, without any flag.
#[tokio::test]
async fn a_lost_lock_is_logged_as_an_error() {
    let dir = dir("lost-logged");
    let url = format!("file://{dir}");
    let child = lockkit(
        &url,
        &["run", "--key", "k", "--ttl", "600ms", "--", "sleep", "30"],
    )
    .env_remove("RUST_LOG")
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    take_away_when_held(&dir).await;
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(75));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("lock lost while held"))
        .unwrap_or_else(|| panic!("no loss logged: {err}"));
    assert!(line.contains("ERROR") && line.contains("key=k"), "{line}");
}

/// One HTTP GET of `path` on `addr`, the body returned (`None` while nothing listens).
fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// `lockkit run --metrics-addr` serves the acquisition counter and the wait histogram in
/// Prometheus text form while the command runs.
#[test]
fn run_serves_metrics_while_the_command_runs() {
    let url = format!("file://{}", dir("metrics"));
    let addr = {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().to_string()
    };
    let mut child = lockkit(
        &url,
        &[
            "run",
            "--metrics-addr",
            &addr,
            "--key",
            "m",
            "--",
            "sleep",
            "30",
        ],
    )
    .spawn()
    .unwrap();
    let started = Instant::now();
    let body = loop {
        if let Some(body) = http_get(&addr, "/metrics")
            && body.contains("lockkit_acquisitions_total")
        {
            break body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no metrics served at {addr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    assert!(
        body.contains(r#"lockkit_acquisitions_total{backend="file",outcome="granted"} 1"#),
        "{body}"
    );
    assert!(
        body.contains(r#"lockkit_acquire_wait_seconds_count{backend="file"} 1"#)
            && body.contains("lockkit_acquire_wait_seconds_bucket"),
        "{body}"
    );
    assert!(
        body.contains(r#"lockkit_holds{backend="file"} 1"#),
        "{body}"
    );
}

/// Every backend this machine runs, as `lockkit` URLs.
fn every_backend_url(dir: &str) -> Vec<String> {
    let mut urls = vec![format!("file://{dir}/locks")];
    for (var, options) in [
        ("LOCKKIT_TEST_REDIS_URL", ""),
        ("LOCKKIT_TEST_REDIS_CLUSTER_URL", ""),
        ("LOCKKIT_TEST_REDLOCK_URL", ""),
        ("LOCKKIT_TEST_ZK_URL", ""),
        ("LOCKKIT_TEST_MYSQL_URL", "?mode=row&table=lockkit_cli_row"),
        (
            "LOCKKIT_TEST_MYSQL_URL",
            "?mode=for-update&table=lockkit_cli_fu",
        ),
        (
            "LOCKKIT_TEST_POSTGRES_URL",
            "?mode=row&table=lockkit_cli_row",
        ),
        (
            "LOCKKIT_TEST_POSTGRES_URL",
            "?mode=advisory&table=lockkit_cli_adv",
        ),
        ("LOCKKIT_TEST_ETCD_URL", ""),
    ] {
        if let Some(url) = lockkit_conformance::env::service_url(var) {
            urls.push(format!("{url}{options}"));
        }
    }
    urls
}

/// `lockkit run` holding `key` under `url` until killed; returns once CMD has started.
fn hold_with_run(url: &str, key: &str) -> std::process::Child {
    hold_with_run_as(url, key, &[])
}

/// [`hold_with_run`] with more options for `run` (`--read`, `--permits N`).
fn hold_with_run_as(url: &str, key: &str, options: &[&str]) -> std::process::Child {
    use std::io::BufRead;
    let mut args = vec!["run", "--key", key, "--wait", "30s"];
    args.extend_from_slice(options);
    args.extend_from_slice(&["--", "sh", "-c", "echo held; sleep 60"]);
    let mut run = lockkit(url, &args).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(run.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(
        line.trim(),
        "held",
        "`lockkit run` under {url} never held {key}"
    );
    run
}

/// SIGTERM to `lockkit run`: it stops CMD and releases the lock.
fn stop(run: &mut std::process::Child) {
    let _ = Command::new("kill").arg(run.id().to_string()).status();
    let _ = run.wait();
}

fn this_host() -> String {
    String::from_utf8(Command::new("uname").arg("-n").output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_owned()
}

/// `lockkit status --json` names the holding process (host, pid, program) on every backend,
/// in JSON a parser reads; the text form names them too.
#[test]
fn status_names_the_holders_host_and_pid_on_every_backend() {
    let dir = dir("status-holder");
    let host = this_host();
    for url in every_backend_url(&dir) {
        let key = format!(
            "status-holder/{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let mut run = hold_with_run(&url, &key);
        let out = lockkit(&url, &["status", "--key", &key, "--json"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let value: serde_json::Value = serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("invalid JSON under {url} ({e}): {text}"));
        let text_form = lockkit(&url, &["status", "--key", &key]).output().unwrap();
        let text_form = String::from_utf8_lossy(&text_form.stdout).into_owned();
        stop(&mut run);
        assert_eq!(value["held"], true, "{url}: {value}");
        assert_eq!(value["host"], host.as_str(), "{url}: {value}");
        assert_eq!(value["pid"], run.id(), "{url}: {value}");
        assert_eq!(value["program"], "lockkit", "{url}: {value}");
        assert!(
            value["requested_at_ms"].as_u64().is_some(),
            "{url}: {value}"
        );
        assert!(
            text_form.contains(&format!("lockkit pid {} on {host}", run.id())),
            "{url}: {text_form}"
        );
    }
}

/// `lockkit status --watch` prints the free key, then the holder once one takes it.
#[test]
fn status_watch_prints_each_change() {
    use std::io::BufRead;
    let dir = dir("status-watch");
    let url = format!("file://{dir}/locks");
    let mut watch = lockkit(
        &url,
        &["status", "--key", "w", "--json", "--watch", "100ms"],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = std::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(first["held"], false);
    let mut run = hold_with_run(&url, "w");
    let second: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    stop(&mut run);
    let third: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let _ = watch.kill();
    let _ = watch.wait();
    assert_eq!(second["held"], true, "{second}");
    assert_eq!(second["pid"], run.id(), "{second}");
    assert_eq!(
        third["held"], false,
        "a stopped holder's lock is freed: {third}"
    );
}

/// `run --read` jobs share a key, `status` lists each reader, and a `--write` job (or a
/// plain one) cannot start beside them; `--permits 2` lets two jobs run and refuses a
/// third until one ends; on every backend with read-write locks and semaphores.
#[test]
fn read_runs_share_a_key_and_permits_bound_the_runs() {
    let dir = dir("rw-runs");
    let without = ["redlock", "mode=for-update", "mode=advisory"];
    for url in every_backend_url(&dir)
        .into_iter()
        .filter(|url| !without.iter().any(|w| url.contains(w)))
    {
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let tag = format!("rw-runs/{}-{unique}", std::process::id());
        reads_share_and_permits_bound(&url, &format!("{tag}/rw"), &format!("{tag}/sem"));
    }
}

fn reads_share_and_permits_bound(url: &str, rw: &str, sem: &str) {
    let try_run = |key: &str, options: &[&str]| {
        let mut args = vec!["run", "--key", key, "--wait", "0"];
        args.extend_from_slice(options);
        args.extend_from_slice(&["--", "true"]);
        lockkit(url, &args).status().unwrap().code()
    };
    let status = |key: &str| {
        let out = lockkit(url, &["status", "--key", key, "--json"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let value: serde_json::Value = serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("{url}: invalid JSON ({e}): {text}"));
        let words = lockkit(url, &["status", "--key", key]).output().unwrap();
        (value, String::from_utf8_lossy(&words.stdout).into_owned())
    };
    let mut readers = [
        hold_with_run_as(url, rw, &["--read"]),
        hold_with_run_as(url, rw, &["--read"]),
    ];
    let (value, words) = status(rw);
    assert_eq!(value["kind"], "read", "{url}: {value}");
    let mut got: Vec<_> = value["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["pid"].as_u64().unwrap_or(0))
        .collect();
    let mut expected: Vec<_> = readers.iter().map(|r| u64::from(r.id())).collect();
    expected.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, expected, "{url}: {value}");
    assert!(words.contains("read by 2 holders"), "{url}: {words}");
    assert_eq!(
        try_run(rw, &["--write"]),
        Some(1),
        "{url}: a writer beside readers"
    );
    assert_eq!(
        try_run(rw, &[]),
        Some(1),
        "{url}: a plain lock beside readers"
    );
    assert_eq!(try_run(rw, &["--read"]), Some(0), "{url}: a third reader");
    for reader in &mut readers {
        stop(reader);
    }
    assert_eq!(
        try_run(rw, &["--write"]),
        Some(0),
        "{url}: a writer once they left"
    );

    let mut permits = [
        hold_with_run_as(url, sem, &["--permits", "2"]),
        hold_with_run_as(url, sem, &["--permits", "2"]),
    ];
    let (value, words) = status(sem);
    assert_eq!(value["permits"], 2, "{url}: {value}");
    assert_eq!(
        value["holders"].as_array().unwrap().len(),
        2,
        "{url}: {value}"
    );
    assert!(words.contains("2 of 2 permits held"), "{url}: {words}");
    assert_eq!(
        try_run(sem, &["--permits", "2"]),
        Some(1),
        "{url}: a third permit"
    );
    assert_eq!(
        try_run(sem, &["--permits", "3"]),
        Some(2),
        "{url}: another permit count is refused as an error"
    );
    stop(&mut permits[0]);
    assert_eq!(
        try_run(sem, &["--permits", "2"]),
        Some(0),
        "{url}: a permit came back"
    );
    stop(&mut permits[1]);
}

/// helper-43, finding 1: `lockkit fence` on `mysql://` or `postgres://` runs CMD outside the
/// fence's transaction (CMD is another process), so rolling the raise back when CMD fails
/// cannot take back what CMD already wrote. A newer holder whose write landed but whose CMD
/// then failed (a later step of the script, a notification) must still keep every older
/// token out: the stale holder's write must not land after it.
#[test]
fn a_newer_cmd_that_wrote_and_then_failed_still_fences_out_older_tokens() {
    let dir = dir("fence-failed-cmd");
    let pid = std::process::id();
    for var in ["LOCKKIT_TEST_MYSQL_URL", "LOCKKIT_TEST_POSTGRES_URL"] {
        let Some(url) = lockkit_conformance::env::service_url(var) else {
            continue;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let resource = format!("cli-fence-failed/{pid}-{nanos}");
        let data = format!("{dir}/{var}-{pid}-{nanos}");
        let run = |token: &str, cmd: &str| {
            lockkit(
                &url,
                &["fence", "--resource", &resource, "--token", token, "--"],
            )
            .args(["sh", "-c", cmd])
            .output()
            .unwrap()
        };
        // An earlier holder wrote through the fence.
        assert_eq!(run("4", &format!("echo 4 > {data}")).status.code(), Some(0));
        // The newer holder (token 6) writes, then a later step of its job fails.
        let newer = run("6", &format!("echo 6 > {data}; exit 3"));
        assert_eq!(newer.status.code(), Some(3), "CMD's code is passed on");
        assert_eq!(std::fs::read_to_string(&data).unwrap().trim(), "6");
        // The holder of token 5 was paused past its lease and now resumes its write.
        let stale = run("5", &format!("echo 5 > {data}"));
        assert_eq!(
            std::fs::read_to_string(&data).unwrap().trim(),
            "6",
            "{var}: the stale token 5 wrote over token 6's write (exit {:?}, stderr {})",
            stale.status.code(),
            String::from_utf8_lossy(&stale.stderr)
        );
        assert_eq!(stale.status.code(), Some(1), "{var}: refused");
        let said = String::from_utf8_lossy(&stale.stderr);
        assert!(
            said.contains("token 6"),
            "{var}: names the newer token: {said}"
        );
    }
}

/// Starts `lockkit run` on `sh -c SCRIPT`, where SCRIPT's descendant of interest writes its
/// pid to `$PIDFILE`; returns lockkit's process and that pid.
fn run_with_descendant(dir: &str, script: &str) -> (std::process::Child, i32) {
    let pidfile = format!("{dir}/descendant.pid");
    let _ = std::fs::remove_file(&pidfile);
    let _ = std::fs::remove_file(format!("{pidfile}.go"));
    let url = format!("file://{dir}");
    let child = lockkit(
        &url,
        &[
            "run", "--key", "k", "--ttl", "3s", "--grace", "1s", "--", "sh", "-c", script,
        ],
    )
    .env("PIDFILE", &pidfile)
    .spawn()
    .unwrap();
    let started = Instant::now();
    let pid = loop {
        if let Ok(text) = std::fs::read_to_string(&pidfile)
            && let Ok(pid) = text.trim().parse::<i32>()
        {
            break pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(alive(pid), "the descendant must be running");
    (child, pid)
}

/// Kills `pid` if a failed assertion left it running.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// helper-43, finding 2: GNU `timeout` (without `--foreground`) moves itself and its
/// command into a process group of their own, as does any job-control shell or program that
/// starts its children in groups of their own. Stopping CMD's group alone left such a
/// grandchild running after the lock was lost, and after `lockkit run` exited 75.
#[tokio::test]
async fn a_lost_lock_stops_a_grandchild_in_a_process_group_of_its_own() {
    let dir = dir("lost-own-group");
    let (mut child, grandchild) = run_with_descendant(
        &dir,
        "timeout 60 sh -c 'echo $$ > $PIDFILE.tmp; mv $PIDFILE.tmp $PIDFILE; exec sleep 41'; true",
    );
    let _cleanup = KillOnDrop(grandchild);
    take_away_when_held(&dir).await;
    assert_eq!(child.wait().unwrap().code(), Some(75));
    assert_gone_soon(grandchild, "timeout's command after the lock was lost");
}

/// helper-43, finding 2: a grandchild that left the session (`setsid`) is stopped too once
/// the command that started it is gone: `lockkit run` must not exit (and release) while
/// anything CMD started still runs.
#[test]
fn a_command_that_ends_leaves_no_setsid_grandchild_running() {
    let dir = dir("setsid-grandchild");
    let (mut child, grandchild) = run_with_descendant(
        &dir,
        "setsid sh -c 'echo $$ > $PIDFILE.tmp; mv $PIDFILE.tmp $PIDFILE; exec sleep 43' & \
         while [ ! -e $PIDFILE.go ]; do sleep 0.01; done; exit 4",
    );
    let _cleanup = KillOnDrop(grandchild);
    // CMD ends once the test has seen the grandchild running.
    std::fs::write(format!("{dir}/descendant.pid.go"), "").unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(4), "CMD's own code");
    assert_gone_soon(grandchild, "a setsid grandchild after CMD ended");
}

/// helper-43's open item: the supervisor SIGKILLed on its own (an OOM killer's pick, a
/// `kill -9` of the wrong pid) left CMD running, re-parented to init, while lockkit
/// released the lock. lockkit is a child subreaper now: CMD is re-parented to it, and
/// stopped once the supervisor is gone.
#[test]
fn a_supervisor_killed_on_its_own_leaves_no_command_running() {
    let dir = dir("supervisor-killed");
    let (mut child, descendant) = run_with_descendant(
        &dir,
        "sh -c 'echo $$ > $PIDFILE.tmp; mv $PIDFILE.tmp $PIDFILE; exec sleep 44' & wait",
    );
    let _cleanup = KillOnDrop(descendant);
    let supervisor = *children_of(child.id())
        .first()
        .expect("lockkit's supervisor");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert_eq!(
        child.wait().unwrap().code(),
        Some(128 + 9),
        "the supervisor's end, as lockkit reports it"
    );
    assert_gone_soon(descendant, "CMD's process after its supervisor was killed");
}

/// The pids of the processes whose parent is `parent`, from `/proc`.
fn children_of(parent: u32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
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
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(parent) {
            found.push(pid);
        }
    }
    found
}

/// helper-43, finding 3: lockkit SIGKILLed just after it started the supervisor, before the
/// supervisor had looked up its parent. The supervisor took its new parent (init, or a
/// subreaper) for lockkit, never saw lockkit go, and ran CMD with no lock held (lockkit
/// could not release; the lease runs out) for as long as CMD lasted.
#[test]
fn lockkit_killed_while_the_supervisor_starts_leaves_no_command_running() {
    let dir = dir("kill-at-start");
    let url = format!("file://{dir}");
    let pidfile = format!("{dir}/cmd.pid");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for round in 0..20 {
        let _ = std::fs::remove_file(&pidfile);
        let mut run = lockkit(
            &url,
            &[
                "run",
                "--key",
                // Unique: a killed lockkit's lease outlives it (and this test's run).
                &format!("k-{}-{nanos}-{round}", std::process::id()),
                "--",
                "sh",
                "-c",
                &format!("echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 47"),
            ],
        )
        .spawn()
        .unwrap();
        // SIGKILL lockkit the moment its supervisor exists.
        let started = Instant::now();
        let supervisor = loop {
            if let Some(&pid) = children_of(run.id()).first() {
                break pid;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no supervisor started"
            );
        };
        run.kill().unwrap();
        let _ = run.wait();
        // The supervisor may start CMD (and then must stop it) or not start it at all;
        // either way it ends.
        let waiting = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&pidfile)
                && let Ok(pid) = text.trim().parse::<i32>()
            {
                let _cleanup = KillOnDrop(pid);
                assert_gone_soon(
                    pid,
                    &format!("round {round}: CMD after lockkit was SIGKILLed"),
                );
                break;
            }
            if !alive(supervisor) {
                break;
            }
            assert!(
                waiting.elapsed() < Duration::from_secs(20),
                "round {round}: the supervisor outlived lockkit, CMD not started"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// helper-45, finding 3: lockkit stopped (Ctrl-Z in a terminal stops lockkit alone: CMD and
/// its supervisor are in process groups of their own, outside the terminal's foreground
/// group; or `kill -STOP`, a debugger) renews nothing, so its lease runs out and another
/// client takes the lock, while CMD ran on. CMD must not run while lockkit is stopped;
/// when lockkit resumes without its lock, CMD is stopped and lockkit exits 75.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_lockkit_does_not_leave_its_command_running() {
    let Some(redis) = lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let dir = dir("stopped");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let key = format!("stopped-{}", std::process::id());
    let script = format!("echo ready; while :; do echo x >> {output}; sleep 0.02; done");
    let mut child = run_until_ready(
        &redis,
        &[
            "run", "--key", &key, "--ttl", "1s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    // Past the 1 s lease: another client takes the lock.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let other = lockkit::connect(&redis).await.unwrap();
    let held = other
        .acquire(key.as_str())
        .wait(Duration::from_secs(5))
        .await
        .expect("the stopped lockkit's lease ran out");
    let ticks = || std::fs::metadata(&output).map_or(0, |m| m.len());
    let before = ticks();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = ticks();
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let status = child.wait().unwrap();
    held.release().await.unwrap();
    assert_eq!(
        before, after,
        "CMD ran on while lockkit was stopped and another client held the lock"
    );
    assert_eq!(status.code(), Some(75), "lockkit resumed without its lock");
    let last = ticks();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(last, ticks(), "CMD runs on after lockkit exited");
}

/// helper-45, finding 3 (the other side): lockkit stopped briefly, its lock still held when
/// it resumes (Ctrl-Z, then `fg`), lets CMD continue, and releases the lock at CMD's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_stopped_briefly_lets_its_command_continue() {
    let Some(redis) = lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let dir = dir("stopped-briefly");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let key = format!("stopped-briefly-{}", std::process::id());
    let script =
        format!("echo ready; for i in $(seq 100); do echo x >> {output}; sleep 0.02; done");
    let mut child = run_until_ready(
        &redis,
        &[
            "run", "--key", &key, "--ttl", "6s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "CMD ran to its end");
    assert_eq!(std::fs::metadata(&output).unwrap().len(), 200, "every tick");
    let status = lockkit(&redis, &["status", "--key", &key])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&status.stdout).trim(),
        format!("{key}: free")
    );
}

/// helper-45, finding 4: a supervisor stopped (`kill -STOP` of its process group, a
/// debugger) cannot pass lockkit's SIGTERM and SIGUSR1 on. When the lock was lost, lockkit
/// waited for that supervisor forever, so CMD ran on without the lock for as long as the
/// supervisor stayed stopped.
#[tokio::test]
async fn a_lost_lock_stops_the_command_of_a_stopped_supervisor() {
    let dir = dir("stopped-supervisor");
    let (mut child, descendant) = run_with_descendant(
        &dir,
        "sh -c 'echo $$ > $PIDFILE.tmp; mv $PIDFILE.tmp $PIDFILE; exec sleep 45' & wait",
    );
    let _cleanup = KillOnDrop(descendant);
    let supervisor = *children_of(child.id())
        .first()
        .expect("lockkit's supervisor");
    let _continue_it = KillOnDrop(supervisor);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let started = take_away_when_held(&dir).await;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("lockkit still waits for its stopped supervisor after 20 s; CMD runs on");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(75));
    assert_gone_soon(descendant, "CMD's process after the lock was lost");
}

/// A lockkit held by a debugger (a tracing stop: gdb attached, a breakpoint, `strace`) is
/// taken for stopped, and its supervisor stops CMD; but a tracing stop ends without
/// SIGCONT, so lockkit, running again with its lock held, never said so, and CMD stayed
/// stopped for good (the second look at helper-45's finding 3). Here lockkit is attached
/// with `ptrace` for half a second, then let go: CMD must run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stopped_while_lockkit_was_traced_runs_again() {
    use nix::sys::{ptrace, wait};
    let dir = dir("traced");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let script = format!("echo ready; while :; do echo x >> {output}; sleep 0.02; done");
    let url = format!("file://{dir}");
    let mut child = run_until_ready(
        &url,
        &[
            "run", "--key", "k", "--ttl", "30s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    let ticks = || std::fs::metadata(&output).map_or(0, |m| m.len());
    ptrace::attach(lockkit_pid).expect("ptrace attaches lockkit (root)");
    wait::waitpid(lockkit_pid, Some(wait::WaitPidFlag::__WALL)).expect("lockkit stops");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let paused = ticks();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let still_paused = ticks();
    ptrace::detach(lockkit_pid, None).expect("let go");
    // Wide: lockkit says its lock holds every 250 ms.
    let started = Instant::now();
    while ticks() == still_paused && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ran_again = ticks() > still_paused;
    let _ = child.kill();
    let _ = child.wait();
    // Stop whatever CMD left (lockkit was killed: its supervisor stops CMD).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(paused, still_paused, "CMD ran while lockkit was held");
    assert!(
        ran_again,
        "CMD was still stopped 10 s after lockkit ran again with its lock held"
    );
}

/// A lockkit stopped past its lease (Ctrl-Z, then `fg` minutes later) finds its lock gone
/// when it runs again; CMD, stopped meanwhile, must stay stopped and be killed, not be
/// continued to act on a SIGTERM: another client holds the lock by then, and a CMD that
/// finishes its work on SIGTERM (or ignores it, as here) would run beside it for the whole
/// grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stopped_with_lockkit_does_not_run_again_once_the_lock_is_gone() {
    let Some(redis) = lockkit_conformance::env::service_url("LOCKKIT_TEST_REDIS_URL") else {
        return;
    };
    let dir = dir("stopped-past-lease");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let key = format!("stopped-past-lease-{}", std::process::id());
    let script =
        format!("trap '' TERM; echo ready; while :; do echo x >> {output}; sleep 0.02; done");
    let mut child = run_until_ready(
        &redis,
        &[
            "run", "--key", &key, "--ttl", "1s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let other = lockkit::connect(&redis).await.unwrap();
    let held = other
        .acquire(key.as_str())
        .wait(Duration::from_secs(5))
        .await
        .expect("the stopped lockkit's lease ran out");
    let ticks = || std::fs::metadata(&output).map_or(0, |m| m.len());
    let stopped = ticks();
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let status = child.wait().unwrap();
    let after = ticks();
    held.release().await.unwrap();
    assert_eq!(status.code(), Some(75), "lockkit resumed without its lock");
    assert_eq!(
        stopped,
        after,
        "CMD ran {} more ticks after lockkit found its lock gone, while another client held it",
        (after - stopped) / 2
    );
}

/// The same when lockkit dies while stopped (Ctrl-Z, then `kill -9 %1`): its supervisor,
/// left alone, must not continue CMD, stopped since lockkit was, to act on a SIGTERM; the
/// lease lockkit stopped renewing may have gone to another client long ago.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_stopped_with_lockkit_does_not_run_again_when_lockkit_dies() {
    let dir = dir("stopped-then-killed");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let script =
        format!("trap '' TERM; echo ready; while :; do echo x >> {output}; sleep 0.02; done");
    let url = format!("file://{dir}");
    let mut child = run_until_ready(
        &url,
        &[
            "run", "--key", "k", "--ttl", "30s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let supervisor = *children_of(child.id())
        .first()
        .expect("lockkit's supervisor");
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ticks = || std::fs::metadata(&output).map_or(0, |m| m.len());
    let stopped = ticks();
    child.kill().unwrap();
    let _ = child.wait();
    let started = Instant::now();
    while alive(supervisor) && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!alive(supervisor), "the supervisor outlived lockkit");
    let after = ticks();
    assert_eq!(
        stopped,
        after,
        "CMD ran {} more ticks after lockkit, stopped, was killed",
        (after - stopped) / 2
    );
}

/// The grace of a stop is one `--grace`, also when the supervisor is stopped: lockkit
/// waited the whole grace (and 200 ms more) for a stopped supervisor before killing it, and
/// only then began the sweep's own grace, so CMD, which a stopped supervisor passes no
/// signal to, ran on twice the grace after lockkit began to stop it: past the lease, since
/// stopping starts at most one grace before it may run out.
#[tokio::test]
async fn a_stopped_supervisor_does_not_double_the_grace() {
    let dir = dir("stopped-supervisor-grace");
    let pidfile = format!("{dir}/descendant.pid");
    let _ = std::fs::remove_file(&pidfile);
    let log = format!("{dir}/lockkit.err");
    let mut child = lockkit(
        &format!("file://{dir}"),
        &[
            "run",
            "--key",
            "k",
            "--ttl",
            "3s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            // The descendant ignores SIGTERM: only the SIGKILL after the grace ends it.
            "trap '' TERM; echo $$ > $PIDFILE.tmp; mv $PIDFILE.tmp $PIDFILE; exec sleep 45",
        ],
    )
    .env("PIDFILE", &pidfile)
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    let started = Instant::now();
    let descendant = loop {
        if let Ok(text) = std::fs::read_to_string(&pidfile)
            && let Ok(pid) = text.trim().parse::<i32>()
        {
            break pid;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no CMD");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _cleanup = KillOnDrop(descendant);
    let supervisor = *children_of(child.id())
        .first()
        .expect("lockkit's supervisor");
    let _continue_it = KillOnDrop(supervisor);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    take_away_when_held(&dir).await;
    // lockkit begins to stop CMD when its watchdog finds the lock gone (within a renewal):
    // its stderr line says when.
    let started = Instant::now();
    let mut stopping = None;
    while alive(descendant) && started.elapsed() < Duration::from_secs(20) {
        if stopping.is_none()
            && std::fs::read_to_string(&log).is_ok_and(|text| text.contains("stopping"))
        {
            stopping = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The lock is gone, so the sweep kills CMD at once (no grace): CMD may be gone before
    // this loop read the line lockkit wrote just before, which must be there by now (CMD
    // then went within one look of it).
    let stopping = stopping.or_else(|| {
        std::fs::read_to_string(&log)
            .is_ok_and(|text| text.contains("stopping"))
            .then(Instant::now)
    });
    let took = stopping
        .expect("lockkit said it was stopping CMD")
        .elapsed();
    let status = child.wait().unwrap();
    eprintln!("CMD gone {took:?} after lockkit began to stop it");
    assert_eq!(status.code(), Some(75));
    assert!(
        took < Duration::from_millis(1_500),
        "CMD ran {took:?} after lockkit began to stop it, with a 1 s grace"
    );
}

/// The supervisor alone killed (SIGKILL) while CMD is stopped because lockkit was, and
/// lockkit running again only past its lease, with another client holding the lock: lockkit
/// sweeps what was re-parented to it, and its sweep continued CMD (SIGCONT after SIGTERM),
/// which ran for the whole grace beside the new holder (helper-47's open item). Now a sweep
/// with the lock gone kills at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_with_the_lock_gone_does_not_continue_a_stopped_command() {
    let dir = dir("swept-stopped");
    let output = format!("{dir}/ticks");
    let _ = std::fs::remove_file(&output);
    let script =
        format!("trap '' TERM; echo ready; while :; do echo x >> {output}; sleep 0.02; done");
    let url = format!("file://{dir}");
    let mut child = run_until_ready(
        &url,
        &[
            "run", "--key", "k", "--ttl", "1s", "--grace", "1s", "--", "sh", "-c", &script,
        ],
    );
    let supervisor = *children_of(child.id())
        .first()
        .expect("lockkit's supervisor");
    let lockkit_pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    // The supervisor stops CMD within 100 ms; then it is killed on its own.
    tokio::time::sleep(Duration::from_millis(400)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // Past the 1 s lease: another client takes the lock.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let other = Locker::new(FileBackend::open(&dir).unwrap());
    let held = other
        .acquire("k")
        .wait(Duration::from_secs(5))
        .await
        .expect("the stopped lockkit's lease ran out");
    let ticks = || std::fs::metadata(&output).map_or(0, |m| m.len());
    let stopped = ticks();
    nix::sys::signal::kill(lockkit_pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let _ = child.wait().unwrap();
    let after = ticks();
    held.release().await.unwrap();
    assert_eq!(
        stopped,
        after,
        "CMD ran {} more ticks after lockkit swept it with the lock gone",
        (after - stopped) / 2
    );
}
