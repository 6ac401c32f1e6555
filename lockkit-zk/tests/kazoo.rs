//! Mixed fleet: kazoo's `Lock` (Python, nodes `<uuid>__lock__<seq>`) and lockkit on the same
//! lock path exclude each other, and a lockkit waiter behind a kazoo holder is woken when
//! kazoo lets go. lockkit counts every sequential child as a contender; kazoo counts other
//! clients' nodes only with `extra_lock_patterns=["-lock-"]` (without it, kazoo ignores
//! lockkit's and Curator's holders). Needs `$LOCKKIT_TEST_PYTHON` with kazoo
//! (scripts/services.sh installs it).
//!
//! Read-write locks: kazoo's `ReadLock` (`<uuid>__rlock__<seq>`) and `WriteLock`
//! (`<uuid>__lock__<seq>`) against lockkit's `read`/`write` (Curator's
//! `_c_<uuid>-__READ__<seq>`, `_c_<uuid>-__WRIT__<seq>`). lockkit reads `__rlock__` as a
//! reader and `__lock__` as a writer. kazoo's contender regex is
//! `(?:<_EXCLUDE_NAMES + extra_lock_patterns>)(-?\d{10})$`, where `_EXCLUDE_NAMES` is
//! `["__lock__"]` for a `ReadLock` and `["__lock__", "__rlock__"]` for a `WriteLock`: so a
//! mixed fleet gives kazoo's readers `extra_lock_patterns=["__WRIT__"]` (blocked by
//! lockkit's writers, not its readers) and kazoo's writers `["__READ__", "__WRIT__"]`.
//!
//! With `layout=kazoo`, lockkit names its nodes as kazoo does and takes permits in kazoo's
//! `Semaphore` layout, so a **stock** kazoo client (no `extra_lock_patterns`) and lockkit
//! exclude and wake each other, and their semaphores count together (the `stock_*` and
//! `semaphore_*` tests below).

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{Error, LockKey, LockKind, Locker};
use lockkit_zk::ZkBackend;
use uuid::Uuid;

const KAZOO: &str = r#"
import sys, time
from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout
hosts, path, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
zk = KazooClient(hosts=hosts)
zk.start(timeout=20)
# kazoo sees other clients' lock nodes only when told their pattern: lockkit's and
# Curator's contenders are `_c_<uuid>-lock-<seq>`, their readers `_c_<uuid>-__READ__<seq>`
# and their writers `_c_<uuid>-__WRIT__<seq>`. A kazoo reader already counts `__lock__`,
# a kazoo writer `__lock__` and `__rlock__`.
if kind == "lock":
    lock = zk.Lock(path, "kazoo", extra_lock_patterns=["-lock-"])
elif kind == "read":
    lock = zk.ReadLock(path, "kazoo", extra_lock_patterns=["__WRIT__"])
elif kind == "write":
    lock = zk.WriteLock(path, "kazoo", extra_lock_patterns=["__READ__", "__WRIT__"])
# Stock kazoo, told nothing about other clients' names (lockkit with layout=kazoo).
elif kind == "stock-lock":
    lock = zk.Lock(path, "kazoo")
elif kind == "stock-read":
    lock = zk.ReadLock(path, "kazoo")
elif kind == "stock-write":
    lock = zk.WriteLock(path, "kazoo")
else:
    # "sem-N": kazoo's Semaphore of N leases.
    lock = zk.Semaphore(path, "kazoo", max_leases=int(kind[4:]))
if mode == "wait":
    # Says "waiting", then waits up to the timeout: "got" (then releases) or "busy".
    print("waiting", flush=True)
    try:
        got = lock.acquire(timeout=float(sys.argv[5]))
    except LockTimeout:
        got = False
    print("got" if got else "busy", flush=True)
    if got:
        lock.release()
elif mode == "hold":
    lock.acquire(timeout=20)
    print("held", flush=True)
    time.sleep(float(sys.argv[5]))
    lock.release()
    print("released", flush=True)
else:
    # "try": without a timeout, one non-blocking attempt; with one, wait that long.
    try:
        if len(sys.argv) > 5:
            got = lock.acquire(timeout=float(sys.argv[5]))
        else:
            got = lock.acquire(blocking=False)
    except LockTimeout:
        got = False
    except ValueError as e:
        # kazoo's Semaphore refuses another max_leases than the node keeps.
        print("mismatch", e, flush=True)
        sys.exit(0)
    print("got" if got else "busy", flush=True)
    if lock.is_acquired:
        lock.release()
zk.stop()
"#;

struct Setup {
    python: String,
    hosts: String,
    backend: ZkBackend,
    key: LockKey,
}

async fn setup() -> Option<Setup> {
    setup_layout("curator").await
}

/// A backend of `layout` on the standalone server, and a fresh key.
async fn setup_layout(layout: &str) -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_ZK_URL")?;
    let python = env::service_url("LOCKKIT_TEST_PYTHON")?;
    let backend = ZkBackend::connect(&format!("{url}?layout={layout}"))
        .await
        .unwrap();
    Some(Setup {
        python,
        hosts: env::host_ports(&url).join(","),
        backend,
        key: LockKey::new(format!("kazoo/{}", Uuid::new_v4().simple())).unwrap(),
    })
}

fn kazoo(s: &Setup, args: &[&str]) -> Child {
    Command::new(&s.python)
        .args(["-c", KAZOO, &s.hosts, &s.backend.lock_dir(&s.key)])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_holder_excludes_lockkit_and_its_release_wakes_a_lockkit_waiter() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["lock", "hold", "2"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    assert!(
        locker.try_acquire(&s.key).await.unwrap().is_none(),
        "lockkit was granted a lock kazoo holds"
    );
    let waited = tokio::time::Instant::now();
    let guard = locker
        .acquire(&s.key)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit waiter must be granted once kazoo releases");
    let waited = waited.elapsed();
    assert_eq!(
        lines.next().unwrap().unwrap(),
        "released",
        "granted before kazoo released"
    );
    assert!(
        waited < Duration::from_secs(10),
        "woken {waited:?} after a 2 s kazoo hold: not by its release"
    );
    guard.release().await.unwrap();
    assert!(holder.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_holder_excludes_kazoo() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.acquire(&s.key).await.unwrap();
    let out = kazoo(&s, &["lock", "try"]).wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "busy",
        "kazoo was granted a lock lockkit holds"
    );
    guard.release().await.unwrap();
    let out = kazoo(&s, &["lock", "try"]).wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "got");
}

/// kazoo's output of a `try` run: "got" or "busy".
fn kazoo_try(s: &Setup, args: &[&str]) -> String {
    let out = kazoo(s, args).wait_with_output().unwrap();
    assert!(out.status.success(), "kazoo {args:?} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

const TTL: Duration = Duration::from_secs(30);

/// A kazoo `WriteLock` holder keeps out both a lockkit reader and a lockkit writer, and a
/// lockkit reader waiting behind it is granted when kazoo releases: woken by the release
/// (well after the hold began, long before the wait's timeout), not by timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_writer_excludes_lockkit_readers_and_writers_and_its_release_wakes_a_reader() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["write", "hold", "3"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    let held = tokio::time::Instant::now();
    assert!(
        locker
            .read(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a read kazoo's writer holds"
    );
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write kazoo's writer holds"
    );
    let guard = locker
        .read(&s.key)
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit reader must be granted once kazoo's writer releases");
    let waited = held.elapsed();
    assert_eq!(lines.next().unwrap().unwrap(), "released");
    assert!(
        waited > Duration::from_secs(1),
        "granted {waited:?} into a 3 s kazoo write hold"
    );
    assert!(
        waited < Duration::from_secs(15),
        "woken {waited:?} after a 3 s kazoo write hold: not by its release"
    );
    guard.release().await.unwrap();
    assert!(holder.wait().unwrap().success());
}

/// A kazoo `ReadLock` holder shares with a lockkit reader (granted at once, without
/// waiting) and keeps out a lockkit writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_reader_shares_with_a_lockkit_reader_and_excludes_a_lockkit_writer() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let mut holder = kazoo(&s, &["read", "hold", "3"]);
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "held");
    let reader = locker
        .read(&s.key)
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("lockkit's reader must share with kazoo's reader");
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write while kazoo and lockkit held reads"
    );
    reader.release().await.unwrap();
    assert!(
        locker
            .write(&s.key)
            .ttl(TTL)
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "lockkit was granted a write kazoo's reader holds"
    );
    assert_eq!(lines.next().unwrap().unwrap(), "released");
    assert!(holder.wait().unwrap().success());
    let writer = locker
        .write(&s.key)
        .ttl(TTL)
        .try_now()
        .await
        .unwrap()
        .expect("the write must be free once kazoo's reader released");
    writer.release().await.unwrap();
}

/// A lockkit writer keeps out a kazoo reader told lockkit's writer pattern (`__WRIT__`)
/// through `extra_lock_patterns`, as a mixed fleet must configure it: kazoo's try with a
/// 1 s timeout fails while lockkit holds, and succeeds once lockkit releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_writer_excludes_a_kazoo_reader() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.write(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(
        kazoo_try(&s, &["read", "try", "1"]),
        "busy",
        "kazoo was granted a read lockkit's writer holds"
    );
    assert_eq!(
        kazoo_try(&s, &["write", "try", "1"]),
        "busy",
        "kazoo was granted a write lockkit's writer holds"
    );
    guard.release().await.unwrap();
    assert_eq!(kazoo_try(&s, &["read", "try", "1"]), "got");
}

/// A lockkit reader shares with a kazoo reader (kazoo's non-blocking try succeeds) and
/// keeps out a kazoo writer (its try with a 1 s timeout fails); once lockkit releases, the
/// kazoo writer gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_reader_shares_with_a_kazoo_reader_and_excludes_a_kazoo_writer() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.read(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(
        kazoo_try(&s, &["read", "try"]),
        "got",
        "kazoo's reader did not share with lockkit's reader"
    );
    assert_eq!(
        kazoo_try(&s, &["write", "try", "1"]),
        "busy",
        "kazoo was granted a write lockkit's reader holds"
    );
    guard.release().await.unwrap();
    assert_eq!(kazoo_try(&s, &["write", "try", "1"]), "got");
}

// ---- layout=kazoo: a stock kazoo client, told nothing about lockkit ----

/// A running kazoo script whose output lines arrive on a channel, each with the moment it
/// was read.
struct Running {
    child: Child,
    lines: std::sync::mpsc::Receiver<(String, std::time::Instant)>,
}

impl Running {
    /// The next line, if one comes within `within`.
    fn next(&self, within: Duration) -> Option<(String, std::time::Instant)> {
        tokio::task::block_in_place(|| self.lines.recv_timeout(within).ok())
    }

    /// The next line, which must be `line` (within 30 s); when it came.
    fn expect(&self, line: &str) -> std::time::Instant {
        let (got, at) = self
            .next(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("kazoo said nothing where `{line}` was expected"));
        assert_eq!(got, line, "kazoo said `{got}` where `{line}` was expected");
        at
    }

    /// Whether kazoo has said nothing more for `quiet`.
    fn silent_for(&self, quiet: Duration) -> bool {
        self.next(quiet).is_none()
    }

    /// Ends the script at once (its session, and so its holds, end with the session
    /// timeout).
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn finish(mut self) {
        assert!(
            self.child.wait().unwrap().success(),
            "the kazoo script failed"
        );
    }
}

fn run(s: &Setup, args: &[&str]) -> Running {
    let mut child = kazoo(s, args);
    let stdout = child.stdout.take().unwrap();
    let (send, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if send.send((line, std::time::Instant::now())).is_err() {
                return;
            }
        }
    });
    Running { child, lines }
}

/// How long a woken waiter may take to be granted after the release that woke it: wide,
/// yet far below the 30 s waits, so a grant within it was the release's doing.
const WOKEN_WITHIN: Duration = Duration::from_secs(8);

/// How long the `hold` runs whose release a lockkit waiter waits for hold.
const KAZOO_HOLD: Duration = Duration::from_secs(2);
const KAZOO_HOLD_ARG: &str = "2";

/// A lockkit waiter granted now, behind a kazoo hold of `KAZOO_HOLD` that kazoo reported
/// `held` at, was granted by that hold's release: not before it (with a wide margin for
/// how late the report was read), and not long after.
fn granted_after_the_hold(held: std::time::Instant) {
    let since = held.elapsed();
    assert!(
        since >= KAZOO_HOLD / 2,
        "granted {since:?} into a {KAZOO_HOLD:?} kazoo hold"
    );
    assert!(
        since < KAZOO_HOLD + WOKEN_WITHIN,
        "granted {since:?} after a {KAZOO_HOLD:?} kazoo hold began: not woken by its release"
    );
}

/// `name` split as kazoo names its contenders: 32 lowercase hex digits (`uuid4().hex`),
/// `__lock__` or `__rlock__`, a 10-digit sequence.
fn kazoo_label(name: &str) -> Option<&str> {
    let (hex, rest) = (name.get(..32)?, name.get(32..)?);
    let label = rest.get(..rest.len().checked_sub(10)?)?;
    let sequence = &rest[label.len()..];
    (hex.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && sequence.bytes().all(|b| b.is_ascii_digit())
        && ["__lock__", "__rlock__"].contains(&label))
    .then_some(label)
}

/// Without `layout=kazoo`, a stock kazoo client does not see lockkit's (Curator-named)
/// nodes: its writer is granted beside lockkit's writer. This is why the layout exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_kazoo_client_ignores_the_curator_layout() {
    let Some(s) = setup().await else { return };
    let locker = Locker::new(s.backend.clone());
    let guard = locker.write(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(kazoo_try(&s, &["stock-write", "try"]), "got");
    guard.release().await.unwrap();
}

/// With `layout=kazoo`, lockkit's plain, write and read contenders are named as kazoo's
/// `Lock`, `WriteLock` and `ReadLock` name theirs, and a downgrade's read node carries its
/// writer's sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kazoo_layout_names_nodes_as_kazoo_does() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let client = s.backend.client().await.unwrap();
    let dir = s.backend.lock_dir(&s.key);
    let listed = || async { client.list_children(&dir).await.unwrap() };
    let plain = locker.acquire(&s.key).ttl(TTL).await.unwrap();
    let children = listed().await;
    assert_eq!(children.len(), 1, "{children:?}");
    assert_eq!(kazoo_label(&children[0]), Some("__lock__"), "{children:?}");
    plain.release().await.unwrap();
    let owner = locker.owner();
    let write = owner.write(&s.key).ttl(TTL).await.unwrap();
    let read = owner.read(&s.key).ttl(TTL).await.unwrap();
    let mut children = listed().await;
    children.sort_by_key(|c| kazoo_label(c).map(str::len));
    let labels: Vec<_> = children.iter().map(|c| kazoo_label(c)).collect();
    assert_eq!(
        labels,
        [Some("__lock__"), Some("__rlock__")],
        "{children:?}"
    );
    assert_eq!(
        children[0][children[0].len() - 10..],
        children[1][children[1].len() - 10..],
        "a downgrade's read node keeps its writer's sequence: {children:?}"
    );
    write.release().await.unwrap();
    read.release().await.unwrap();
    let reader = locker.read(&s.key).ttl(TTL).await.unwrap();
    let children = listed().await;
    assert_eq!(kazoo_label(&children[0]), Some("__rlock__"), "{children:?}");
    reader.release().await.unwrap();
}

/// Plain locks: a stock kazoo `Lock` and a lockkit lock exclude each other, and each
/// side's release wakes the other side's waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_kazoo_and_lockkit_locks_exclude_and_wake_each_other() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    // kazoo holds; lockkit is kept out, and its waiter is woken by kazoo's release.
    let holder = run(&s, &["stock-lock", "hold", KAZOO_HOLD_ARG]);
    let held = holder.expect("held");
    assert!(
        locker.try_acquire(&s.key).await.unwrap().is_none(),
        "lockkit was granted a lock a stock kazoo Lock holds"
    );
    let guard = locker
        .acquire(&s.key)
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit waiter must be granted once kazoo releases");
    granted_after_the_hold(held);
    holder.expect("released");
    holder.finish();
    // lockkit holds; kazoo is kept out, and its waiter is woken by lockkit's release.
    assert_eq!(kazoo_try(&s, &["stock-lock", "try"]), "busy");
    let waiter = run(&s, &["stock-lock", "wait", "30"]);
    waiter.expect("waiting");
    assert!(
        waiter.silent_for(Duration::from_secs(1)),
        "kazoo got a held lock"
    );
    let released = std::time::Instant::now();
    guard.release().await.unwrap();
    let got = waiter.expect("got");
    assert!(
        got - released < WOKEN_WITHIN,
        "kazoo was not woken by the release"
    );
    waiter.finish();
}

/// Writes: a stock kazoo `WriteLock` keeps out lockkit's readers and writers and its
/// release wakes a lockkit reader; a lockkit writer keeps out kazoo's readers and writers
/// and its release wakes a kazoo writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_kazoo_and_lockkit_writers_exclude_and_wake_each_other() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let holder = run(&s, &["stock-write", "hold", KAZOO_HOLD_ARG]);
    let held = holder.expect("held");
    let try_read = locker.read(&s.key).ttl(TTL).try_now().await.unwrap();
    assert!(try_read.is_none(), "lockkit read beside kazoo's writer");
    let try_write = locker.write(&s.key).ttl(TTL).try_now().await.unwrap();
    assert!(try_write.is_none(), "lockkit wrote beside kazoo's writer");
    let reader = locker
        .read(&s.key)
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit reader must be granted once kazoo's writer releases");
    granted_after_the_hold(held);
    holder.expect("released");
    holder.finish();
    reader.release().await.unwrap();
    let writer = locker.write(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(kazoo_try(&s, &["stock-read", "try", "1"]), "busy");
    assert_eq!(kazoo_try(&s, &["stock-write", "try", "1"]), "busy");
    let waiter = run(&s, &["stock-write", "wait", "30"]);
    waiter.expect("waiting");
    assert!(
        waiter.silent_for(Duration::from_secs(1)),
        "kazoo got a held write"
    );
    let released = std::time::Instant::now();
    writer.release().await.unwrap();
    let got = waiter.expect("got");
    assert!(
        got - released < WOKEN_WITHIN,
        "kazoo was not woken by the release"
    );
    waiter.finish();
}

/// Reads: a stock kazoo `ReadLock` shares with a lockkit reader and keeps out a lockkit
/// writer, whose wait ends with kazoo's release; a lockkit reader shares with a kazoo
/// reader and keeps out a kazoo writer, whose wait ends with lockkit's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_kazoo_and_lockkit_readers_share_and_wake_writers() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let holder = run(&s, &["stock-read", "hold", KAZOO_HOLD_ARG]);
    let held = holder.expect("held");
    let reader = locker.read(&s.key).ttl(TTL).try_now().await.unwrap();
    let reader = reader.expect("lockkit's reader must share with kazoo's reader");
    let try_write = locker.write(&s.key).ttl(TTL).try_now().await.unwrap();
    assert!(try_write.is_none(), "lockkit wrote beside two readers");
    reader.release().await.unwrap();
    let writer = locker
        .write(&s.key)
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit writer must be granted once kazoo's reader releases");
    granted_after_the_hold(held);
    holder.expect("released");
    holder.finish();
    writer.release().await.unwrap();
    let reader = locker.read(&s.key).ttl(TTL).await.unwrap();
    assert_eq!(kazoo_try(&s, &["stock-read", "try"]), "got");
    assert_eq!(kazoo_try(&s, &["stock-write", "try", "1"]), "busy");
    let waiter = run(&s, &["stock-write", "wait", "30"]);
    waiter.expect("waiting");
    assert!(
        waiter.silent_for(Duration::from_secs(1)),
        "kazoo wrote beside a reader"
    );
    let released = std::time::Instant::now();
    reader.release().await.unwrap();
    let got = waiter.expect("got");
    assert!(
        got - released < WOKEN_WITHIN,
        "kazoo was not woken by the release"
    );
    waiter.finish();
}

/// A lockkit downgrade keeps a queued stock kazoo writer out until the read ends, and that
/// kazoo writer, queued, keeps new lockkit readers out (FIFO on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lockkit_downgrade_keeps_a_queued_kazoo_writer_out() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let owner = locker.owner();
    let write = owner.write(&s.key).ttl(TTL).await.unwrap();
    let waiter = run(&s, &["stock-write", "wait", "30"]);
    waiter.expect("waiting");
    assert!(
        waiter.silent_for(Duration::from_secs(1)),
        "kazoo got a held write"
    );
    let read = owner.read(&s.key).ttl(TTL).try_now().await.unwrap();
    let read = read.expect("a downgrade is granted at once");
    write.release().await.unwrap();
    assert!(
        waiter.silent_for(Duration::from_secs(2)),
        "kazoo's writer got the lock while lockkit's downgraded read held it"
    );
    let late = locker.read(&s.key).ttl(TTL).try_now().await.unwrap();
    assert!(
        late.is_none(),
        "a new lockkit reader passed the kazoo writer queued before it"
    );
    let released = std::time::Instant::now();
    read.release().await.unwrap();
    let got = waiter.expect("got");
    assert!(
        got - released < WOKEN_WITHIN,
        "kazoo was not woken by the release"
    );
    waiter.finish();
}

/// The node of a kazoo-layout semaphore: its data is the permit count.
async fn semaphore_count(s: &Setup) -> String {
    let client = s.backend.client().await.unwrap();
    let (data, _) = client.get_data(&s.backend.lock_dir(&s.key)).await.unwrap();
    String::from_utf8(data).unwrap()
}

/// kazoo's `Semaphore` and lockkit's permits count together: lockkit makes the node with
/// the count kazoo expects, kazoo takes the second of two leases, and then neither side
/// gets a third; a lockkit release lets kazoo in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_kazoo_and_lockkit_semaphores_count_together() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let semaphore = locker.semaphore(&s.key, 2);
    let mine = semaphore.try_acquire().ttl(TTL).await.unwrap();
    let mine = mine.expect("a free semaphore");
    assert_eq!(semaphore_count(&s).await, "2");
    let holder = run(&s, &["sem-2", "hold", "30"]);
    holder.expect("held");
    let third = semaphore.try_acquire().ttl(TTL).await.unwrap();
    assert!(third.is_none(), "lockkit took a third permit of two");
    assert_eq!(kazoo_try(&s, &["sem-2", "try"]), "busy");
    let holders = semaphore.holders().await.unwrap();
    assert_eq!(holders.len(), 2, "{holders:?}");
    let two = LockKind::Permit {
        limit: std::num::NonZeroU32::new(2).unwrap(),
    };
    assert!(holders.iter().all(|h| h.kind == Some(two)), "{holders:?}");
    mine.release().await.unwrap();
    assert_eq!(kazoo_try(&s, &["sem-2", "try"]), "got");
    holder.kill();
}

/// A count other than the one kazoo's node keeps is refused both ways: lockkit answers
/// `KindMismatch` (and a plain lock on the key too), kazoo raises its `ValueError`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_count_is_refused_both_ways() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let holder = run(&s, &["sem-2", "hold", "30"]);
    holder.expect("held");
    let three = locker.semaphore(&s.key, 3).try_acquire().ttl(TTL).await;
    assert!(
        matches!(three, Err(Error::KindMismatch { .. })),
        "a 3-permit semaphore on kazoo's 2: {three:?}"
    );
    let plain = locker.try_acquire(&s.key).await;
    assert!(
        matches!(plain, Err(Error::KindMismatch { .. })),
        "a lock on kazoo's semaphore: {plain:?}"
    );
    let two = locker.semaphore(&s.key, 2).try_acquire().ttl(TTL).await;
    let two = two.unwrap().expect("the refused tries took no lease");
    two.release().await.unwrap();
    holder.kill();
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let mine = locker.semaphore(&s.key, 2).try_acquire().ttl(TTL).await;
    let mine = mine.unwrap().expect("a free semaphore");
    let answer = kazoo_try(&s, &["sem-3", "try"]);
    assert!(
        answer.starts_with("mismatch Inconsistent max leases"),
        "kazoo's 3-permit semaphore on lockkit's 2 said `{answer}`"
    );
    mine.release().await.unwrap();
}

/// A release on either side wakes the other side's waiter, and lockkit's permits take
/// growing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_releases_wake_the_other_sides_waiter() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let semaphore = locker.semaphore(&s.key, 1);
    let mine = semaphore.try_acquire().ttl(TTL).await.unwrap();
    let mine = mine.expect("a free semaphore");
    let first = mine.token();
    let waiter = run(&s, &["sem-1", "wait", "30"]);
    waiter.expect("waiting");
    assert!(
        waiter.silent_for(Duration::from_secs(1)),
        "kazoo took a second lease of one"
    );
    let released = std::time::Instant::now();
    mine.release().await.unwrap();
    let got = waiter.expect("got");
    assert!(
        got - released < WOKEN_WITHIN,
        "kazoo was not woken by the release"
    );
    waiter.finish();
    let holder = run(&s, &["sem-1", "hold", KAZOO_HOLD_ARG]);
    let held = holder.expect("held");
    let permit = semaphore
        .acquire()
        .ttl(TTL)
        .wait(Duration::from_secs(30))
        .await
        .expect("the lockkit waiter must be granted once kazoo releases");
    granted_after_the_hold(held);
    holder.expect("released");
    assert!(permit.token() > first, "a new permit's token must grow");
    holder.finish();
    permit.release().await.unwrap();
}

/// Long enough for two sweeps of the server's empty container nodes, and a margin.
fn container_sweeps() -> Duration {
    std::env::var("LOCKKIT_TEST_ZK_CONTAINER_SWEEP_MS")
        .ok()
        .and_then(|ms| ms.parse::<u64>().ok())
        .map_or(Duration::from_secs(75), |ms| {
            Duration::from_millis(2 * ms) + Duration::from_secs(5)
        })
}

/// In kazoo's layout a key's directory is persistent, as kazoo's `ensure_path` makes it: a
/// kazoo `Lock` checks its path once and relies on it after, and a container the server
/// removed while the key was idle made its next acquisition fail with `NoNodeError` (found
/// by the mixed fleet of `tests/mixed_fleet.rs` against servers that sweep every 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_kazoos_layout_an_idle_keys_directory_stays_for_kazoo() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let client = s.backend.client().await.unwrap();
    let dir = s.backend.lock_dir(&s.key);
    locker
        .acquire(&s.key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    tokio::time::sleep(container_sweeps()).await;
    assert!(
        client.get_data(&dir).await.is_ok(),
        "the idle key's directory {dir} was removed (a container), under kazoo's feet"
    );
    assert_eq!(kazoo_try(&s, &["stock-lock", "try"]), "got");
}

/// A key whose lock was given back (its container node lingers until the server's next
/// container sweep) can become a kazoo-layout semaphore: lockkit makes its node the
/// persistent node kazoo expects, with the count as its data. A container would be removed
/// by the server once its last lease went (the sweep runs every 60 s by default), and a
/// kazoo client that had made sure of the path would then fail with `NoNodeError`. The
/// server hides containers in `Stat`, so this waits out two sweeps and a margin: 75 s on a
/// server with the default interval, 9 s on the test servers of `scripts/services.sh`
/// (`LOCKKIT_TEST_ZK_CONTAINER_SWEEP_MS`, 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_lock_container_becomes_kazoos_persistent_semaphore_node() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let client = s.backend.client().await.unwrap();
    let dir = s.backend.lock_dir(&s.key);
    locker
        .acquire(&s.key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let permit = locker.semaphore(&s.key, 2).try_acquire().ttl(TTL).await;
    let permit = permit.unwrap().expect("a free semaphore");
    let (data, _) = client.get_data(&dir).await.unwrap();
    assert_eq!(data, b"2");
    assert_eq!(kazoo_try(&s, &["sem-2", "try"]), "got");
    permit.release().await.unwrap();
    let sweeps = tokio::time::Instant::now() + container_sweeps();
    while tokio::time::Instant::now() < sweeps {
        let node = client.get_data(&dir).await;
        assert!(
            matches!(&node, Ok((data, _)) if data == b"2"),
            "the semaphore node went with its last lease: {node:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(kazoo_try(&s, &["sem-2", "try"]), "got");
}

/// A kazoo lease whose `uuid4().hex` name ends in ten decimal digits (about one name in
/// 110) is a lease, not a lock's contender: lockkit counts it and grants the other permit
/// instead of refusing the key as "used as a lock", and lists it among the holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kazoo_lease_named_like_a_sequence_is_counted_as_a_lease() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let client = s.backend.client().await.unwrap();
    let dir = s.backend.lock_dir(&s.key);
    let root = &s.backend.config().root;
    let persistent =
        zookeeper_client::CreateMode::Persistent.with_acls(zookeeper_client::Acls::anyone_all());
    let ephemeral =
        zookeeper_client::CreateMode::Ephemeral.with_acls(zookeeper_client::Acls::anyone_all());
    client.mkdir(root, &persistent).await.unwrap();
    // As kazoo's Semaphore makes them: the node with its count, a lease in it.
    client.create(&dir, b"2", &persistent).await.unwrap();
    let lease = format!("{dir}/abcdef0123456789abcdef0123456789");
    client.create(&lease, b"kazoo", &ephemeral).await.unwrap();
    let semaphore = locker.semaphore(&s.key, 2);
    let permit = semaphore.try_acquire().ttl(TTL).await;
    let permit = permit.unwrap().expect("one of two permits is free");
    let third = semaphore.try_acquire().ttl(TTL).await.unwrap();
    assert!(third.is_none(), "the kazoo lease was not counted");
    assert_eq!(semaphore.holders().await.unwrap().len(), 2);
    permit.release().await.unwrap();
    client.delete(&lease, None).await.unwrap();
}

/// A lockkit permit holder that stops renewing (paused, or its watchdog off) past its
/// lease loses the permit: its lease node is deleted, a kazoo waiter is granted, and the
/// guard says it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenewed_lockkit_permit_frees_its_lease_for_a_kazoo_waiter() {
    let Some(s) = setup_layout("kazoo&session_timeout=2s").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let lease = Duration::from_secs(2);
    let permit = locker
        .semaphore(&s.key, 1)
        .try_acquire()
        .ttl(lease)
        .no_watchdog()
        .await;
    let permit = permit.unwrap().expect("a free semaphore");
    let granted = std::time::Instant::now();
    let waiter = run(&s, &["sem-1", "wait", "30"]);
    waiter.expect("waiting");
    let got = waiter.expect("got");
    assert!(
        got - granted >= lease / 2,
        "kazoo got the permit {:?} into a {lease:?} lease",
        got - granted
    );
    assert!(
        got - granted < lease + WOKEN_WITHIN,
        "kazoo got the permit {:?} after an unrenewed {lease:?} lease",
        got - granted
    );
    assert!(
        !permit.is_valid(),
        "the unrenewed permit still believed it held"
    );
    waiter.finish();
    assert!(
        permit.release().await.is_err(),
        "a lost permit's release must say so"
    );
}

/// A kazoo holder killed without a release keeps its lease until its session expires
/// (kazoo's default 10 s); then a lockkit waiter is granted the permit (woken by the
/// lease's going, within a wide margin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_kazoo_holders_lease_goes_to_a_lockkit_waiter_with_its_session() {
    let Some(s) = setup_layout("kazoo").await else {
        return;
    };
    let locker = Locker::new(s.backend.clone());
    let holder = run(&s, &["sem-1", "hold", "120"]);
    holder.expect("held");
    holder.kill();
    let killed = std::time::Instant::now();
    let permit = locker
        .semaphore(&s.key, 1)
        .acquire()
        .ttl(TTL)
        .wait(Duration::from_secs(60))
        .await
        .expect("the killed kazoo holder's lease must go with its session");
    let after = killed.elapsed();
    assert!(
        after < Duration::from_secs(10) + WOKEN_WITHIN + Duration::from_secs(10),
        "granted {after:?} after the kill: not when kazoo's 10 s session expired"
    );
    permit.release().await.unwrap();
}
