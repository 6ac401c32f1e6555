//! etcd's recipe `RWMutex` (`client/v3/experimental/recipes/rwmutex.go`) on the same lock:
//! no CLI drives the recipe, so its keys are written as it writes them (valueless, on a
//! session lease, under `<prefix>/<key>/read/` and `<prefix>/<key>/write/`, never
//! rewritten), by etcdctl and by a raw client; lockkit must honour them, and its own keys
//! must have the recipe's shape so that recipe clients honour lockkit.

use std::{process::Command, time::Duration};

use etcd_client::{GetOptions, PutOptions, SortOrder, SortTarget};
use lockkit_conformance::env;
use lockkit_core::{LockKey, LockKind, Locker};
use lockkit_etcd::EtcdBackend;

struct Setup {
    endpoints: String,
    backend: EtcdBackend,
    locker: Locker,
    key: LockKey,
    range: String,
}

async fn setup(name: &str) -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_ETCD_URL")?;
    let backend = EtcdBackend::connect(&format!("{url}?session_ttl=2s"))
        .await
        .unwrap();
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = LockKey::new(format!("recipe-{name}-{unique}")).unwrap();
    Some(Setup {
        endpoints: env::host_ports(&url).join(","),
        locker: Locker::new(backend.clone()),
        range: backend.lock_range(&key),
        backend,
        key,
    })
}

fn etcdctl(s: &Setup, args: &[&str]) -> String {
    let out = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", s.endpoints))
        .args(args)
        .output()
        .expect("etcdctl (Debian etcd-client; scripts/services.sh installs it)");
    assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A session lease granted by etcdctl (`lease <hex id> granted with TTL(..)`).
fn etcdctl_lease(s: &Setup) -> String {
    let out = etcdctl(s, &["lease", "grant", "30"]);
    out.split_whitespace()
        .nth(1)
        .expect("etcdctl names the lease it granted")
        .to_owned()
}

fn nanos() -> String {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recipe_writer_keeps_lockkit_out_and_its_release_wakes_a_lockkit_reader() {
    let Some(s) = setup("writer").await else {
        return;
    };
    // RWMutex.Lock: a valueless key under `write/` on the session's lease.
    let lease = etcdctl_lease(&s);
    let writer = format!("{}write/{}", s.range, nanos());
    etcdctl(&s, &["put", &format!("--lease={lease}"), &writer, ""]);

    assert!(s.locker.read(&s.key).try_now().await.unwrap().is_none());
    assert!(s.locker.write(&s.key).try_now().await.unwrap().is_none());
    assert!(s.locker.try_acquire(&s.key).await.unwrap().is_none());
    let holders = s.backend.clone();
    let seen = lockkit_core::LockBackend::holders(&holders, &s.key)
        .await
        .unwrap();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].kind, Some(LockKind::Write));

    let (locker, key) = (s.locker.clone(), s.key.clone());
    let reader = tokio::spawn(async move {
        locker
            .read(&key)
            .ttl(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reader.is_finished(),
        "a reader entered beside a recipe writer"
    );
    let released = tokio::time::Instant::now();
    etcdctl(&s, &["lease", "revoke", &lease]);
    let guard = reader.await.unwrap().expect("the reader after the release");
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "the reader was not woken by the recipe writer's release ({:?})",
        released.elapsed()
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recipe_reader_shares_with_lockkit_readers_and_keeps_writers_out() {
    let Some(s) = setup("reader").await else {
        return;
    };
    let mut client = s.backend.client();
    let lease = client.lease_grant(30, None).await.unwrap().id();
    let reader = format!("{}read/{}", s.range, nanos());
    client
        .put(reader, "", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    let read = s.locker.read(&s.key).try_now().await.unwrap();
    let read = read.expect("a lockkit reader shares with a recipe reader");
    assert!(s.locker.write(&s.key).try_now().await.unwrap().is_none());
    read.release().await.unwrap();
    assert!(s.locker.write(&s.key).try_now().await.unwrap().is_none());
    client.lease_revoke(lease).await.unwrap();
    let write = s.locker.write(&s.key).try_now().await.unwrap();
    write
        .expect("free once the recipe reader is gone")
        .release()
        .await
        .unwrap();
}

/// What a recipe writer arriving now waits for: the last key of the whole range by mod
/// revision below its own (`waitOnLastRev`), here below `before`.
async fn recipe_writer_waits_for(s: &Setup, before: i64) -> Option<String> {
    let got = s
        .backend
        .client()
        .get(
            s.range.clone(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Mod, SortOrder::Descend)
                    .with_max_mod_revision(before - 1)
                    .with_limit(1),
            ),
        )
        .await
        .unwrap();
    got.kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn lockkit_keys_have_the_recipe_layout_and_are_never_rewritten() {
    let Some(s) = setup("layout").await else {
        return;
    };
    let owner = s.locker.owner();
    let write = owner.write(&s.key).try_now().await.unwrap().unwrap();
    let again = owner.write(&s.key).try_now().await.unwrap().unwrap();
    let read = owner.read(&s.key).try_now().await.unwrap().unwrap();
    let got = s
        .backend
        .client()
        .get(s.range.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let names: Vec<String> = got
        .kvs()
        .iter()
        .map(|kv| {
            assert_eq!(
                kv.mod_revision(),
                kv.create_revision(),
                "a re-entry rewrote a key"
            );
            assert_ne!(kv.lease(), 0, "every key is on a lease");
            String::from_utf8_lossy(kv.key()).into_owned()
        })
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names
            .iter()
            .any(|n| n.starts_with(&format!("{}write/", s.range)))
    );
    assert!(
        names
            .iter()
            .any(|n| n.starts_with(&format!("{}read/", s.range)))
    );
    // A recipe writer arriving now would wait for lockkit's newest key.
    let now = got.header().unwrap().revision();
    assert!(recipe_writer_waits_for(&s, now + 1).await.is_some());
    assert_eq!(again.token(), write.token());
    assert!(read.token() > write.token(), "a downgrade is a new hold");
    again.release().await.unwrap();
    write.release().await.unwrap();
    // The write key stays (marked) while the downgraded read lasts.
    let left = s
        .backend
        .client()
        .get(
            format!("{}write/", s.range),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    assert_eq!(left.kvs().len(), 2, "the write key and its marker");
    read.release().await.unwrap();
    let gone = s
        .backend
        .client()
        .get(
            s.range.clone(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap();
    assert_eq!(gone.count(), 0, "nothing left after the read");
}
