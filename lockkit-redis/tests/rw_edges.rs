//! Edge cases of Redis read-write locks and semaphores that the conformance suite does not
//! reach: retried attempts, a cancelled writer's marker, a shorter re-entry, a reader that
//! dies without releasing.

use std::{future::IntoFuture, time::Duration};

use lockkit_conformance::env;
use lockkit_core::spi::{AcquireRequest, Released};
use lockkit_core::{LockBackend, LockKey, LockKind, Locker, LossSignal, OwnerId};
use lockkit_redis::RedisBackend;
use redis::AsyncCommands;
use tokio::time::Instant;
use uuid::Uuid;

struct Setup {
    backend: RedisBackend,
    locker: Locker,
    admin: redis::aio::MultiplexedConnection,
    name: String,
    key: LockKey,
}

async fn setup() -> Option<Setup> {
    let url = env::service_url("LOCKKIT_TEST_REDIS_URL")?;
    let backend = RedisBackend::connect(&url).await.unwrap();
    let admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let name = format!("rw-edges/{}", Uuid::new_v4().simple());
    Some(Setup {
        locker: Locker::new(backend.clone()),
        backend,
        admin,
        key: LockKey::new(name.as_str()).unwrap(),
        name,
    })
}

const TTL: Duration = Duration::from_secs(30);

fn request(key: &LockKey, kind: LockKind, ttl: Duration) -> AcquireRequest {
    AcquireRequest::new(
        key.clone(),
        OwnerId::new(Uuid::new_v4(), 1),
        ttl,
        LossSignal::new(),
    )
    .with_kind(kind)
}

/// A request sent twice (its reply lost the first time) takes effect once, for every kind.
#[tokio::test]
async fn a_retried_attempt_takes_effect_once_for_every_kind() {
    let Some(s) = setup().await else { return };
    let two = LockKind::Permit {
        limit: std::num::NonZeroU32::new(2).unwrap(),
    };
    for kind in [LockKind::Read, LockKind::Write, two] {
        let req = request(&s.key, kind, TTL);
        let first = s.backend.try_acquire(&req).await.unwrap().unwrap();
        let again = s.backend.try_acquire(&req).await.unwrap().unwrap();
        assert_eq!((first.depth, again.depth), (1, 1), "{kind}: one hold");
        assert_eq!(first.token, again.token, "{kind}: the same grant");
        if kind == two {
            // One permit taken, so one is left.
            let other = s
                .backend
                .try_acquire(&request(&s.key, kind, TTL))
                .await
                .unwrap();
            let other = other.expect("the retry took no second permit");
            s.backend.release(&other).await.unwrap();
        }
        assert_eq!(s.backend.release(&first).await.unwrap(), Released::Fully);
        // The release retried: changes nothing, and the key is free.
        let retried = s.backend.release(&again).await;
        assert!(
            matches!(
                retried,
                Ok(Released::Fully) | Err(lockkit_core::Error::NotHeld { .. })
            ),
            "{kind}: a retried release: {retried:?}"
        );
        let probe = s
            .backend
            .try_acquire(&request(&s.key, LockKind::Write, TTL))
            .await;
        match kind {
            LockKind::Permit { .. } => {
                // The count string stays (Redisson's semaphores are persistent objects):
                // a lock on the key is refused or busy.
                assert!(
                    matches!(
                        probe,
                        Ok(None) | Err(lockkit_core::Error::KindMismatch { .. })
                    ),
                    "a write on a semaphore's key: {probe:?}"
                );
                let count: i64 = s.admin.clone().get(&s.name).await.unwrap();
                assert_eq!(count, 2, "both permits are back");
                let _: () = redis::cmd("DEL")
                    .arg(&s.name)
                    .query_async(&mut s.admin.clone())
                    .await
                    .unwrap();
            }
            _ => {
                let probe = probe.unwrap().expect("free after one release");
                s.backend.release(&probe).await.unwrap();
            }
        }
    }
}

/// A writer that stops waiting (cancelled) takes its marker with it at once: new readers
/// enter again well before the marker's own lease would end.
#[tokio::test]
async fn a_cancelled_writer_stops_blocking_readers() {
    let Some(mut s) = setup().await else { return };
    let reader = s.locker.read(s.name.as_str()).ttl(TTL).await.unwrap();
    let wait = s
        .locker
        .write(s.name.as_str())
        .ttl(TTL)
        .wait(Duration::from_secs(30));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), wait)
            .await
            .is_err()
    );
    let markers = format!("{{{}}}:lockkit_wwait", s.name);
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let left: i64 = s.admin.zcard(&markers).await.unwrap();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cancelled writer's marker is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let other = s.locker.read(s.name.as_str()).ttl(TTL).try_now().await;
    let other = other
        .unwrap()
        .expect("a new reader enters once the writer gave up");
    other.release().await.unwrap();
    reader.release().await.unwrap();
    let exists: bool = s.admin.exists(&markers).await.unwrap();
    assert!(!exists);
}

/// Waits until `markers` (a waiting-writer set) is empty, within a second (a marker lives
/// 3 s by itself, so an empty set in time means it was removed).
async fn until_no_marker(s: &mut Setup, markers: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let left: i64 = s.admin.zcard(markers).await.unwrap();
        if left == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the marker is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A plain lock waiting behind readers registers as a waiting writer (it counts as one)
/// and takes the marker with it when its wait ends: by timing out, by being dropped, or by
/// its grant. Behind another plain lock it writes no marker at all.
#[tokio::test]
async fn a_plain_lock_waiters_marker_goes_with_its_wait() {
    let Some(mut s) = setup().await else { return };
    let markers = format!("{{{}}}:lockkit_wwait", s.name);
    let reader = s.locker.read(s.name.as_str()).ttl(TTL).await.unwrap();
    // Timed out.
    let timed_out = s
        .locker
        .acquire(s.name.as_str())
        .ttl(TTL)
        .wait(Duration::from_millis(300))
        .await;
    assert!(matches!(
        timed_out,
        Err(lockkit_core::Error::Timeout { .. })
    ));
    until_no_marker(&mut s, &markers, "a plain lock that timed out").await;
    // Dropped mid-wait, after it marked.
    let waiting = s
        .locker
        .acquire(s.name.as_str())
        .ttl(TTL)
        .wait(Duration::from_secs(30));
    let mut waiting = Box::pin(waiting.into_future());
    let marked = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            tokio::select! {
                _ = &mut waiting => panic!("granted beside a reader"),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
            let n: i64 = s.admin.zcard(&markers).await.unwrap();
            if n == 1 {
                break;
            }
        }
    })
    .await;
    assert!(
        marked.is_ok(),
        "a plain lock waiting behind a reader left no marker"
    );
    let blocked = s.locker.read(s.name.as_str()).ttl(TTL).try_now().await;
    assert!(blocked.unwrap().is_none(), "a new reader passed the marker");
    drop(waiting);
    until_no_marker(&mut s, &markers, "a dropped plain lock").await;
    // Granted when the reader leaves: its grant removes the marker.
    let waiter = tokio::spawn({
        let locker = s.locker.clone();
        let name = s.name.clone();
        async move {
            locker
                .acquire(name.as_str())
                .ttl(TTL)
                .wait(Duration::from_secs(30))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    reader.release().await.unwrap();
    let plain = waiter.await.unwrap().unwrap();
    let exists: bool = s.admin.exists(&markers).await.unwrap();
    assert!(!exists, "the grant left the plain lock's marker behind");
    // Behind another plain lock: nothing to keep out, no marker.
    let behind = s
        .locker
        .acquire(s.name.as_str())
        .ttl(TTL)
        .wait(Duration::from_millis(300))
        .await;
    assert!(behind.is_err());
    let exists: bool = s.admin.exists(&markers).await.unwrap();
    assert!(!exists, "a plain lock behind a plain lock wrote a marker");
    plain.release().await.unwrap();
}

/// A re-entry with a shorter lease never shortens the hold's lease: the hash and the first
/// timeout key keep theirs, and the hold outlives the short lease.
#[tokio::test]
async fn a_shorter_reentry_never_cuts_the_read_lease() {
    let Some(mut s) = setup().await else { return };
    let owner = s.locker.owner();
    let outer = owner
        .read(s.name.as_str())
        .ttl(TTL)
        .no_watchdog()
        .await
        .unwrap();
    let inner = owner
        .read(s.name.as_str())
        .ttl(Duration::from_millis(300))
        .no_watchdog()
        .await
        .unwrap();
    assert_eq!(inner.depth(), 2);
    let pttl: i64 = s.admin.pttl(&s.name).await.unwrap();
    assert!(pttl > 25_000, "the hash lease was cut to {pttl}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        s.locker
            .write(s.name.as_str())
            .try_now()
            .await
            .unwrap()
            .is_none(),
        "the outer read ended with the inner one's lease"
    );
    outer.extend(TTL).await.unwrap();
    inner.release().await.unwrap();
    outer.release().await.unwrap();
    let exists: bool = s.admin.exists(&s.name).await.unwrap();
    assert!(!exists);
}

/// A reader that dies without releasing holds the key for its own lease only: when the
/// last live reader releases, the hash's lease becomes the dead reader's remaining lease
/// (not the longest ever granted), and a writer gets the key once that ran out.
#[tokio::test]
async fn a_dead_readers_lease_bounds_the_key() {
    let Some(mut s) = setup().await else { return };
    // A dies: a raw grant that nobody renews or releases.
    let dead = request(&s.key, LockKind::Read, Duration::from_millis(600));
    s.backend.try_acquire(&dead).await.unwrap().unwrap();
    let live = s.locker.read(s.name.as_str()).ttl(TTL).await.unwrap();
    let before: i64 = s.admin.pttl(&s.name).await.unwrap();
    assert!(before > 25_000);
    live.release().await.unwrap();
    let after: i64 = s.admin.pttl(&s.name).await.unwrap();
    assert!(
        (1..=600).contains(&after),
        "the hash follows the dead reader's lease, got {after}"
    );
    let started = Instant::now();
    let writer = s
        .locker
        .write(s.name.as_str())
        .ttl(TTL)
        .wait(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1_600),
        "the writer waited {:?}",
        started.elapsed()
    );
    writer.release().await.unwrap();
}

/// Two readers renewing while a third comes and goes: the hash never ends before a live
/// reader's lease.
#[tokio::test]
async fn renewals_and_releases_of_readers_interleave_safely() {
    let Some(mut s) = setup().await else { return };
    let a = s.locker.read(s.name.as_str()).ttl(TTL).await.unwrap();
    let b = s
        .locker
        .read(s.name.as_str())
        .ttl(Duration::from_secs(2))
        .await
        .unwrap();
    for round in 0..30 {
        let c = s
            .locker
            .read(s.name.as_str())
            .ttl(Duration::from_millis(200))
            .await
            .unwrap();
        let (x, y, z) = tokio::join!(a.extend(TTL), b.extend(Duration::from_secs(2)), c.release());
        x.unwrap();
        y.unwrap();
        assert_eq!(z.unwrap(), Released::Fully, "round {round}");
        let pttl: i64 = s.admin.pttl(&s.name).await.unwrap();
        assert!(
            pttl > 25_000,
            "round {round}: the hash lease fell to {pttl}"
        );
    }
    a.release().await.unwrap();
    let pttl: i64 = s.admin.pttl(&s.name).await.unwrap();
    assert!(
        (1..=2_000).contains(&pttl),
        "after A left the hash follows B: {pttl}"
    );
    b.release().await.unwrap();
    let exists: bool = s.admin.exists(&s.name).await.unwrap();
    assert!(!exists);
}

/// A stale mutex grant of an owner that now reads the key (its field in the hash is a read
/// count) can neither renew nor release anything there: the readers' hash stays.
#[tokio::test]
async fn a_stale_mutex_grant_never_touches_a_read_hold() {
    let Some(mut s) = setup().await else { return };
    let owner = s.locker.owner();
    let read = owner.read(s.name.as_str()).ttl(TTL).await.unwrap();
    let other = s.locker.read(s.name.as_str()).ttl(TTL).await.unwrap();
    let req = AcquireRequest::new(s.key.clone(), owner.id(), TTL, LossSignal::new());
    let mut stale =
        lockkit_core::spi::Grant::new(&req, lockkit_core::FencingToken::new(1), 1, Instant::now());
    stale.attempt = Uuid::nil();
    assert!(matches!(
        s.backend.renew(&stale, TTL).await,
        Err(lockkit_core::Error::NotHeld { .. })
    ));
    assert!(matches!(
        s.backend.release(&stale).await,
        Err(lockkit_core::Error::NotHeld { .. })
    ));
    let count: String = s.admin.hget(&s.name, owner.id().to_string()).await.unwrap();
    assert_eq!(count, "1", "the read count was taken by a mutex release");
    read.release().await.unwrap();
    other.release().await.unwrap();
}
