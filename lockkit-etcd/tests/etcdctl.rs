//! Mixed fleet: `etcdctl lock` (etcd's own `concurrency.Mutex`, the Debian `etcd-client`
//! package) and lockkit on the same lock exclude each other both ways, a lockkit waiter
//! behind an etcdctl holder is woken when it lets go, and etcdctl waits behind lockkit.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use lockkit_conformance::env;
use lockkit_core::{LockKey, Locker};
use lockkit_etcd::EtcdBackend;

struct Setup {
    endpoints: String,
    locker: Locker,
    key: LockKey,
}

async fn setup(name: &str) -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_ETCD_URL")?;
    let locker = Locker::new(EtcdBackend::connect(&url).await.unwrap());
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some(Setup {
        endpoints: env::host_ports(&url).join(","),
        locker,
        key: LockKey::new(format!("etcdctl-{name}-{unique}")).unwrap(),
    })
}

/// `etcdctl lock /lockkit/<key> -- sh -c <script>`: runs `script` while holding the lock
/// (with `$ETCD_LOCK_REV`, its key's create revision, in the environment).
fn etcdctl_lock(s: &Setup, script: &str) -> Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args([
            &format!("--endpoints={}", s.endpoints),
            "lock",
            &format!("/lockkit/{}", s.key),
            "--",
            "sh",
            "-c",
            script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl (Debian etcd-client; scripts/services.sh installs it)")
}

/// The next line `child` prints, read off the test's runtime.
async fn next_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (line, stdout) = tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        (line, reader.into_inner())
    })
    .await
    .unwrap();
    child.stdout = Some(stdout);
    line.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn lockkit_waits_behind_etcdctl_and_is_woken_when_it_lets_go() {
    let Some(s) = setup("holder").await else {
        return;
    };
    let mut etcdctl = etcdctl_lock(&s, "echo \"held $ETCD_LOCK_REV\"; sleep 2");
    let line = tokio::time::timeout(Duration::from_secs(20), next_line(&mut etcdctl))
        .await
        .expect("etcdctl took the free lock");
    let etcdctl_revision: u64 = line
        .strip_prefix("held ")
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("etcdctl printed `{line}`"));
    assert!(
        s.locker.try_acquire(&s.key).await.unwrap().is_none(),
        "lockkit took a lock etcdctl holds"
    );
    let holder = s.locker.inspect(&s.key).await.unwrap().expect("a holder");
    assert!(
        holder.owner.starts_with("another client's key"),
        "{holder:?}"
    );
    assert_eq!(holder.token.map(|t| t.get()), Some(etcdctl_revision));
    // etcdctl lets go after two seconds; the waiter must not need its whole wait.
    let guard = s
        .locker
        .acquire(&s.key)
        .wait(Duration::from_secs(30))
        .await
        .expect("woken when etcdctl let go");
    let status = tokio::task::spawn_blocking(move || etcdctl.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "etcdctl failed: {status}");
    assert!(guard.token().get() > etcdctl_revision);
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn etcdctl_waits_behind_lockkit_until_it_releases() {
    let Some(s) = setup("waiter").await else {
        return;
    };
    let guard = s.locker.acquire(&s.key).await.unwrap();
    let mut etcdctl = etcdctl_lock(&s, "echo \"held $ETCD_LOCK_REV\"");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        etcdctl.try_wait().unwrap().is_none(),
        "etcdctl took (and let go of) a lock lockkit holds"
    );
    let token = guard.token().get();
    guard.release().await.unwrap();
    let line = tokio::time::timeout(Duration::from_secs(20), next_line(&mut etcdctl))
        .await
        .expect("etcdctl was not woken when lockkit released");
    let revision: u64 = line
        .strip_prefix("held ")
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("etcdctl printed `{line}`"));
    assert!(
        revision > token,
        "etcdctl queued after lockkit took the lock"
    );
    let status = tokio::task::spawn_blocking(move || etcdctl.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "etcdctl failed: {status}");
    assert!(s.locker.inspect(&s.key).await.unwrap().is_none());
}
