//! Read-write locks on etcd beyond the conformance suite: the downgrade's kept write key
//! (queued writers stay out, waiting readers are woken by its marker, losing it loses the
//! read), and a waiting reader watches one key.

use std::time::Duration;

use lockkit_conformance::env;
use lockkit_core::{LockBackend, LockKey, LockKind, Locker};
use lockkit_etcd::EtcdBackend;

const TTL: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(20);

async fn setup(name: &str) -> Option<(EtcdBackend, LockKey)> {
    let url = env::service_url("LOCKKIT_TEST_ETCD_URL")?;
    let backend = EtcdBackend::connect(&format!("{url}?session_ttl=2s"))
        .await
        .unwrap();
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Some((
        backend,
        LockKey::new(format!("rw-{name}-{unique}")).unwrap(),
    ))
}

async fn client(backend: &EtcdBackend) -> Locker {
    Locker::new(
        EtcdBackend::from_config(backend.config().clone())
            .await
            .unwrap(),
    )
}

/// A writer queued behind an owner that downgrades stays behind its read, and keeps new
/// readers out (writer preference) although the owner let its write go.
#[tokio::test(flavor = "multi_thread")]
async fn a_writer_queued_behind_a_downgrade_waits_for_the_read() {
    let Some((backend, key)) = setup("queued").await else {
        return;
    };
    let (a, w, b) = (
        client(&backend).await,
        client(&backend).await,
        client(&backend).await,
    );
    let owner = a.owner();
    let write = owner.write(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    let first_writer = write.token();
    let writer = tokio::spawn({
        let key = key.clone();
        async move { w.write(&key).ttl(TTL).wait(WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let read = owner.read(&key).ttl(TTL).try_now().await.unwrap();
    let read = read.expect("a downgrade is granted although a writer waits");
    write.release().await.unwrap();
    assert!(
        b.read(&key).try_now().await.unwrap().is_none(),
        "a new reader passed a waiting writer"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_finished(),
        "the queued writer entered beside the downgraded read"
    );
    let holders = backend.holders(&key).await.unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(holders[0].kind, Some(LockKind::Read));
    assert_eq!(holders[0].token, Some(read.token()));
    read.release().await.unwrap();
    let granted = writer.await.unwrap().expect("the writer after the read");
    // Queued before the read was asked for: its token is below the read's, above the
    // first writer's.
    assert!(granted.token() > first_writer);
    granted.release().await.unwrap();
}

/// A reader waiting behind a writer is let in as soon as the writer, having downgraded,
/// lets its write go (woken by the marker, not by the end of the owner's read).
#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_reader_joins_when_the_writer_downgrades_and_lets_go() {
    let Some((backend, key)) = setup("joins").await else {
        return;
    };
    let (a, b) = (client(&backend).await, client(&backend).await);
    let owner = a.owner();
    let write = owner.write(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    let reader = tokio::spawn({
        let key = key.clone();
        async move { b.read(&key).ttl(TTL).wait(WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let read = owner.read(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    assert!(!reader.is_finished(), "a reader entered beside a writer");
    let let_go = tokio::time::Instant::now();
    write.release().await.unwrap();
    let other = reader.await.unwrap().expect("the waiting reader");
    assert!(
        let_go.elapsed() < Duration::from_secs(2),
        "the reader waited {:?} after the write was let go",
        let_go.elapsed()
    );
    assert!(read.is_valid() && other.is_valid());
    other.release().await.unwrap();
    read.release().await.unwrap();
    let free = a.write(&key).ttl(TTL).try_now().await.unwrap();
    free.expect("free at the end").release().await.unwrap();
}

/// The write key a downgraded read keeps is what keeps queued writers out: deleting it
/// under the owner loses the read.
#[tokio::test(flavor = "multi_thread")]
async fn losing_the_kept_write_key_loses_the_downgraded_read() {
    let Some((backend, key)) = setup("lost").await else {
        return;
    };
    let a = client(&backend).await;
    let owner = a.owner();
    let write = owner.write(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    let read = owner.read(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    write.release().await.unwrap();
    assert!(read.is_valid());
    let range = backend.lock_range(&key);
    let writer = format!("{range}write/");
    let mut admin = backend.client();
    let got = admin
        .get(
            writer.clone(),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let kept = got
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .find(|name| !name.ends_with("/downgraded"))
        .expect("the kept write key");
    admin.delete(kept, None).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), read.lost())
        .await
        .expect("the read was not told its write key went");
    assert_eq!(reason, lockkit_core::LostReason::NotOurs);
    let _ = read.release().await;
}

/// Readers queued behind two writers watch the nearer writer only: the first writer's
/// release wakes the second writer, not them.
#[tokio::test(flavor = "multi_thread")]
async fn readers_behind_writers_watch_the_nearest_writer_only() {
    let Some((backend, key)) = setup("herd").await else {
        return;
    };
    let (first, second) = (client(&backend).await, client(&backend).await);
    let readers = EtcdBackend::from_config(backend.config().clone())
        .await
        .unwrap();
    let reading = Locker::new(readers.clone());
    let one = first.write(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    let two = tokio::spawn({
        let key = key.clone();
        async move { second.write(&key).ttl(TTL).wait(WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut waiting = Vec::new();
    for _ in 0..3 {
        let (reading, key) = (reading.clone(), key.clone());
        waiting.push(tokio::spawn(async move {
            reading.read(&key).ttl(TTL).wait(WAIT).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = readers.watch_wakeups();
    one.release().await.unwrap();
    let two = two.await.unwrap().expect("the second writer");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        readers.watch_wakeups(),
        before,
        "readers were woken by a writer they did not watch"
    );
    assert!(waiting.iter().all(|w| !w.is_finished()));
    two.release().await.unwrap();
    for reader in waiting {
        reader
            .await
            .unwrap()
            .expect("a reader after both writers")
            .release()
            .await
            .unwrap();
    }
}

/// A downgraded read whose own lease goes (revoked under it) is lost, and takes the write
/// key it kept with it at once: a writer queued behind gets the key without waiting for
/// the read to be released.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_downgraded_read_lets_the_kept_write_key_go() {
    let Some((backend, key)) = setup("read-lost").await else {
        return;
    };
    let (a, w) = (client(&backend).await, client(&backend).await);
    let owner = a.owner();
    let write = owner.write(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    let read = owner.read(&key).ttl(TTL).try_now().await.unwrap().unwrap();
    write.release().await.unwrap();
    let writer = tokio::spawn({
        let key = key.clone();
        async move { w.write(&key).ttl(TTL).wait(WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!writer.is_finished(), "a writer entered beside the read");
    let mut admin = backend.client();
    let got = admin
        .get(
            format!("{}read/", backend.lock_range(&key)),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await
        .unwrap();
    let lease = got.kvs().first().expect("the read key").lease();
    admin.lease_revoke(lease).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), read.lost()).await;
    assert!(reason.is_ok(), "the read was not told its lease went");
    let granted = tokio::time::timeout(Duration::from_secs(5), writer)
        .await
        .expect("the queued writer still waits for the lost read's write key")
        .unwrap()
        .expect("the queued writer");
    granted.release().await.unwrap();
    let _ = read.release().await;
}
