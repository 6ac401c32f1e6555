//! A waiter behind a holder in another format (a plain `SET NX PX` string: redis-py's
//! `Lock`, redsync, rslock), who publishes nothing when it lets go. Where the server sends
//! keyspace notifications (`notify-keyspace-events` with `K` and `g`), the waiter hears
//! the key's deletion on its keyspace channel and stops polling the holder every 100 ms;
//! elsewhere it polls as before. Each test runs a `redis-server` of its own, so that no
//! shared server's settings change.

use std::time::{Duration, Instant};

use lockkit_conformance::OwnRedis;
use lockkit_core::Locker;
use lockkit_redis::RedisBackend;
use redis::aio::MultiplexedConnection;
use uuid::Uuid;

mod support;
use support::{admin, evalsha_calls, spawn_waiter, subscribers, take_as_foreign};

/// Waits behind a foreign holder for `hold`, then deletes its key; answers the keyspace
/// channel's subscribers seen during the hold, the acquire scripts run during it, and how
/// long after the deletion the waiter was granted.
async fn wait_behind_a_foreign_holder(
    server: &OwnRedis,
    url: &str,
    db: u8,
    hold: Duration,
) -> (i64, u64, Duration) {
    let mut conn = admin(server, db).await;
    let name = format!("foreign/{}", Uuid::new_v4().simple());
    let channel = format!("__keyspace@{db}__:{name}");
    take_as_foreign(&mut conn, &name).await;
    let locker = Locker::new(RedisBackend::connect(&format!("{url}/{db}")).await.unwrap());
    let waiter = spawn_waiter(&locker, &name, "granted once the foreign holder lets go");
    // The first attempts (and, where the server sends them, the keyspace subscription).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let listening = subscribers(&mut conn, &channel).await;
    let before = evalsha_calls(&mut conn).await;
    tokio::time::sleep(hold).await;
    let attempts = evalsha_calls(&mut conn).await - before;
    assert!(
        !waiter.is_finished(),
        "granted while the foreign holder held"
    );
    let deleted = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("a waiter behind a deleted foreign key is granted")
        .unwrap();
    let after = granted.saturating_duration_since(deleted);
    eprintln!(
        "keyspace subscribers {listening}, acquire scripts in {hold:?}: {attempts}, granted {after:?} after the deletion"
    );
    (listening, attempts, after)
}

/// With keyspace notifications on, the waiter subscribes to the key's keyspace channel (of
/// the database its keys live in) and looks at a held key about once a second instead of
/// ten times (before: no subscriber, 39 acquire scripts in the 4 s hold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_holders_deletion_is_heard_where_the_server_says_so() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let (listening, attempts, after) =
        wait_behind_a_foreign_holder(&server, &server.url(), 3, Duration::from_secs(4)).await;
    assert_eq!(
        listening, 1,
        "the waiter listens to the key's keyspace channel"
    );
    assert!(
        attempts <= 12,
        "{attempts} acquire scripts in a 4 s hold: the waiter still polls every 100 ms"
    );
    // Wide: woken by the deletion it takes milliseconds; the safety net is a second.
    assert!(
        after < Duration::from_secs(10),
        "granted {after:?} after the deletion"
    );
}

/// Without keyspace notifications (the server's default), and where `CONFIG` is refused
/// (an ACL user without it, as on managed services), the waiter polls as before: no
/// subscription, and a grant soon after the deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keyspace_notifications_a_foreign_holder_is_polled() {
    let Some(server) = OwnRedis::start(&[]) else {
        return;
    };
    let (listening, attempts, after) =
        wait_behind_a_foreign_holder(&server, &server.url(), 0, Duration::from_secs(2)).await;
    assert_eq!(listening, 0);
    assert!(
        attempts >= 5,
        "{attempts} acquire scripts in 2 s: not polling"
    );
    assert!(
        after < Duration::from_secs(10),
        "granted {after:?} after the deletion"
    );

    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let mut conn = admin(&server, 0).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("app")
        .arg("on")
        .arg(">app-password")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-config")
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = format!("redis://app:app-password@127.0.0.1:{}", server.port);
    let (listening, attempts, after) =
        wait_behind_a_foreign_holder(&server, &url, 0, Duration::from_secs(2)).await;
    assert_eq!(listening, 0, "CONFIG refused: no keyspace subscription");
    assert!(
        attempts >= 5,
        "{attempts} acquire scripts in 2 s: not polling"
    );
    assert!(
        after < Duration::from_secs(10),
        "granted {after:?} after the deletion"
    );
}

/// `total_connections_received` of the server so far.
async fn connections_received(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// A user allowed `CONFIG` but only the lock release channels (an ACL with
/// `&redisson_lock__channel:*`, Redis 7's default being no channel at all): the server
/// refuses the keyspace subscription (`NOPERM`). The waiter behind a foreign holder then
/// polls it as before, and the refusal costs nobody else anything: the backend's shared
/// subscriber connection, which every other waiter's wake-ups ride on, stays up, and a
/// waiter behind a lockkit holder on another key sleeps until that holder's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_keyspace_subscription_leaves_the_other_waiters_alone() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let mut conn = admin(&server, 0).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("app")
        .arg("on")
        .arg(">app-password")
        .arg("~*")
        .arg("resetchannels")
        .arg("&redisson_lock__channel:*")
        .arg("+@all")
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = format!("redis://app:app-password@127.0.0.1:{}", server.port);
    let locker = Locker::new(RedisBackend::connect(&url).await.unwrap());

    // A lockkit holder of one key, and a waiter behind it that relies on its release.
    let held = format!("held/{}", Uuid::new_v4().simple());
    let holder = locker.acquire(held.as_str()).await.unwrap();
    let behind_lockkit = {
        let (locker, held) = (locker.clone(), held.clone());
        tokio::spawn(async move {
            let guard = locker
                .acquire(held.as_str())
                .wait(Duration::from_secs(60))
                .await
                .expect("granted at the holder's release");
            let granted = Instant::now();
            guard.release().await.unwrap();
            granted
        })
    };
    // A foreign holder of another key, and a waiter behind it.
    let foreign = format!("foreign/{}", Uuid::new_v4().simple());
    take_as_foreign(&mut conn, &foreign).await;
    let behind_foreign = {
        let (locker, foreign) = (locker.clone(), foreign.clone());
        tokio::spawn(async move {
            let guard = locker
                .acquire(foreign.as_str())
                .wait(Duration::from_secs(60))
                .await
                .expect("granted once the foreign holder lets go");
            guard.release().await.unwrap();
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connections = connections_received(&mut conn).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reconnected = connections_received(&mut conn).await - connections;
    let released = Instant::now();
    holder.release().await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(30), behind_lockkit)
        .await
        .expect("the waiter behind the lockkit holder is granted")
        .unwrap();
    let after = granted.saturating_duration_since(released);
    let _: i64 = redis::cmd("DEL")
        .arg(&foreign)
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), behind_foreign)
        .await
        .expect("the waiter behind the foreign holder is granted")
        .unwrap();
    eprintln!("connections opened in 2 s: {reconnected}; granted {after:?} after the release");
    assert_eq!(
        reconnected, 0,
        "the refused keyspace subscription dropped the shared subscriber connection \
         {reconnected} times in 2 s"
    );
    assert!(
        after < Duration::from_millis(50),
        "the waiter behind the lockkit holder was granted {after:?} after its release"
    );
}

/// The holder changes format while a waiter listens to the key's keyspace channel: a
/// Redisson holder (a hash, whose release publishes on the lock's channel) hands the key
/// straight to a plain-string holder. The waiter, woken by the Redisson release, finds the
/// plain holder; when that one deletes its key soon after, the waiter hears it and is
/// granted at once (or within the 100 ms poll), not at the once-a-second safety net.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_holder_after_a_redisson_holder_is_heard_letting_go() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let mut conn = admin(&server, 0).await;
    let name = format!("foreign/{}", Uuid::new_v4().simple());
    take_as_foreign(&mut conn, &name).await;
    let locker = Locker::new(RedisBackend::connect(&server.url()).await.unwrap());
    let waiter = spawn_waiter(&locker, &name, "granted once the plain holder lets go");
    // The waiter listens to the keyspace channel by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        subscribers(&mut conn, &format!("__keyspace@0__:{name}")).await,
        1
    );
    // The plain holder hands over to a Redisson holder (a 60 s hold): the waiter, woken by
    // the deletion, finds a hash and sleeps on the lock's release channel.
    let _: () = redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg(&name)
        .ignore()
        .cmd("HSET")
        .arg(&name)
        .arg("0b5a0c6e-0000-4000-8000-000000000001:1")
        .arg(1)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&name)
        .arg(60_000)
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Redisson releases (DEL, PUBLISH 0) and a plain holder takes the key at once.
    let _: () = redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg(&name)
        .ignore()
        .cmd("SET")
        .arg(&name)
        .arg("another-foreign-token")
        .arg("PX")
        .arg(60_000)
        .ignore()
        .cmd("PUBLISH")
        .arg(format!("redisson_lock__channel:{{{name}}}"))
        .arg(0)
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "granted while the plain holder held");
    let deleted = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter is granted")
        .unwrap();
    let after = granted.saturating_duration_since(deleted);
    eprintln!("granted {after:?} after the plain holder's deletion");
    assert!(
        after < Duration::from_millis(300),
        "granted {after:?} after the plain holder's deletion: the waiter slept on to its \
         once-a-second look"
    );
}

/// Read-write locks and semaphores wait behind a plain string too (each kind on a key of
/// its own, held by a foreign client): with keyspace notifications on, each waiter hears
/// its key's deletion instead of polling every 100 ms (before: 87 acquire scripts for the
/// three in a 3 s hold, no keyspace subscriber, grants 16-19 ms after the deletions; now 9,
/// and 1.5-3.4 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_writers_and_permits_hear_a_foreign_holder_let_go() {
    let Some(server) = OwnRedis::start(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let mut conn = admin(&server, 0).await;
    let locker = Locker::new(RedisBackend::connect(&server.url()).await.unwrap());
    let names: Vec<String> = ["read", "write", "permit"]
        .iter()
        .map(|kind| format!("foreign-{kind}/{}", Uuid::new_v4().simple()))
        .collect();
    let mut waiters = Vec::new();
    for (index, name) in names.iter().enumerate() {
        take_as_foreign(&mut conn, name).await;
        let (locker, name) = (locker.clone(), name.clone());
        waiters.push(tokio::spawn(async move {
            let wait = Duration::from_secs(60);
            let guard = match index {
                0 => locker.read(name.as_str()).wait(wait).await,
                1 => locker.write(name.as_str()).wait(wait).await,
                _ => {
                    locker
                        .semaphore(name.as_str(), 2)
                        .acquire()
                        .wait(wait)
                        .await
                }
            }
            .expect("granted once the foreign holder lets go");
            let granted = Instant::now();
            guard.release().await.unwrap();
            granted
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for name in &names {
        assert_eq!(
            subscribers(&mut conn, &format!("__keyspace@0__:{name}")).await,
            1,
            "the waiter on {name} listens to its keyspace channel"
        );
    }
    let before = evalsha_calls(&mut conn).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let attempts = evalsha_calls(&mut conn).await - before;
    assert!(
        waiters.iter().all(|waiter| !waiter.is_finished()),
        "granted while the foreign holder held"
    );
    let deleted = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg(&names)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut afters = Vec::new();
    for waiter in waiters {
        let granted = tokio::time::timeout(Duration::from_secs(30), waiter)
            .await
            .expect("a waiter behind a deleted foreign key is granted")
            .unwrap();
        afters.push(granted.saturating_duration_since(deleted));
    }
    eprintln!("acquire scripts in 3 s: {attempts}; granted {afters:?} after the deletion");
    assert!(
        attempts <= 24,
        "{attempts} acquire scripts for three waiters in a 3 s hold: they still poll every 100 ms"
    );
    // Wide: woken by the deletion it takes milliseconds; the safety net is a second.
    assert!(
        afters.iter().all(|after| *after < Duration::from_secs(10)),
        "granted {afters:?} after the deletion"
    );
}
