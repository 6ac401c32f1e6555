//! A Redlock waiter behind a holder in another format on the masters: rslock's (and
//! redsync's) Redlock, which holds the key as a plain `SET NX PX` string on each master and
//! publishes nothing when it lets go. Where the masters send keyspace notifications
//! (`notify-keyspace-events` with `K` and `g`), the waiter hears the key's deletion on each,
//! is woken once enough masters let go for a quorum, and stops asking every master again
//! every 100 ms; elsewhere it polls as before. Each test runs `redis-server`s of its own,
//! so that no shared server's settings change.

use std::time::{Duration, Instant};

use lockkit_conformance::OwnRedis;
use lockkit_core::{LockKey, Locker};
use lockkit_redis::RedlockBackend;
use redis::aio::MultiplexedConnection;
use uuid::Uuid;

mod support;
use support::{
    admin, evalsha_calls_on, five_masters, redlock_url, spawn_waiter, subscribers_on,
    take_as_foreign,
};

/// What a wait behind rslock's Redlock showed: the keyspace channel's subscribers on each
/// master during the hold, the acquire scripts run on all masters in `hold`, and how long
/// after rslock's `unlock` returned the waiter was granted.
struct Behind {
    listening: Vec<i64>,
    attempts: u64,
    after: Duration,
}

/// rslock holds a key on `masters`; a lockkit Redlock waiter waits behind it for `hold`,
/// then rslock unlocks.
async fn wait_behind_rslock(masters: &[OwnRedis], hold: Duration) -> Behind {
    let mut admins = Vec::new();
    for master in masters {
        admins.push(admin(master, 0).await);
    }
    let urls: Vec<String> = masters.iter().map(OwnRedis::url).collect();
    let rslock = rslock::LockManager::new(urls);
    let name = format!("foreign/{}", Uuid::new_v4().simple());
    let held = rslock
        .lock(name.as_bytes(), Duration::from_secs(60))
        .await
        .expect("rslock takes the key");
    let locker = Locker::new(
        RedlockBackend::connect(&redlock_url(masters))
            .await
            .unwrap(),
    );
    let waiter = spawn_waiter(&locker, &name, "granted once the rslock holder lets go");
    // The first rounds (and, where the masters send them, the keyspace subscriptions).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let listening = subscribers_on(&mut admins, &format!("__keyspace@0__:{name}")).await;
    let before = evalsha_calls_on(&mut admins).await;
    tokio::time::sleep(hold).await;
    let attempts = evalsha_calls_on(&mut admins).await - before;
    assert!(!waiter.is_finished(), "granted while rslock held");
    rslock.unlock(&held).await;
    let unlocked = Instant::now();
    let granted = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("a waiter behind an rslock holder that let go is granted")
        .unwrap();
    let after = granted.saturating_duration_since(unlocked);
    eprintln!(
        "keyspace subscribers per master {listening:?}, acquire scripts in {hold:?} on all \
         masters: {attempts}, granted {after:?} after rslock's unlock"
    );
    Behind {
        listening,
        attempts,
        after,
    }
}

/// With keyspace notifications on every master, the waiter listens to the key's keyspace
/// channel on each and asks again about once a second instead of ten times (before: no
/// subscriber, about 55 acquire scripts in a 4 s hold, and a grant 56 ms p50 after rslock's
/// unlock in `examples/foreign_wake.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_waiter_hears_rslock_let_go_where_the_masters_say_so() {
    let Some(masters) = five_masters(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let behind = wait_behind_rslock(&masters, Duration::from_secs(4)).await;
    assert_eq!(
        behind.listening,
        vec![1; 5],
        "the waiter listens to the key's keyspace channel on every master"
    );
    // A round on every master about once a second (20 in 4 s, and a few leader rounds);
    // polling, about 40 leader rounds and 4 full ones.
    assert!(
        behind.attempts <= 32,
        "{} acquire scripts on the masters in a 4 s hold: the waiter still polls every 100 ms",
        behind.attempts
    );
    // Wide: woken by the deletions it takes a millisecond or two; the safety net is a
    // second.
    assert!(
        behind.after < Duration::from_secs(10),
        "granted {:?} after the unlock",
        behind.after
    );
}

/// Without keyspace notifications (the servers' default) the waiter polls as before: no
/// subscription, and a grant soon after rslock's unlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keyspace_notifications_a_redlock_waiter_polls_rslock() {
    let Some(masters) = five_masters(&[]) else {
        return;
    };
    let behind = wait_behind_rslock(&masters, Duration::from_secs(2)).await;
    assert_eq!(behind.listening, vec![0; 5]);
    assert!(
        behind.attempts >= 5,
        "{} acquire scripts in 2 s: not polling",
        behind.attempts
    );
    assert!(
        behind.after < Duration::from_secs(10),
        "granted {:?} after the unlock",
        behind.after
    );
}

/// The deletions that wake the waiter are a quorum's: with a plain string on every master,
/// two masters letting go leave the key held (no grant, however often the waiter asks), and
/// the third wakes it at once rather than at its once-a-second look, also while the key's
/// leader master (which a waiter's rounds ask first) is still held (before: its round asked
/// the leader alone, found it busy, and slept to the next full round, a second later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_waiter_wakes_when_a_quorum_of_masters_let_go() {
    let Some(masters) = five_masters(&["--notify-keyspace-events", "Kg"]) else {
        return;
    };
    let mut admins = Vec::new();
    for master in &masters {
        admins.push(admin(master, 0).await);
    }
    let name = format!("foreign/{}", Uuid::new_v4().simple());
    for conn in &mut admins {
        take_as_foreign(conn, &name).await;
    }
    let backend = RedlockBackend::connect(&redlock_url(&masters))
        .await
        .unwrap();
    // The key's leader master (which a waiter's rounds ask first) stays held throughout.
    let leader = backend.leader_master(&LockKey::new(name.as_str()).unwrap());
    let let_go: Vec<usize> = (0..5).filter(|index| *index != leader).collect();
    let locker = Locker::new(backend);
    let waiter = spawn_waiter(&locker, &name, "granted once the rslock holder lets go");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        subscribers_on(&mut admins, &format!("__keyspace@0__:{name}")).await,
        vec![1; 5]
    );
    let delete = |conn: &mut MultiplexedConnection| {
        let mut conn = conn.clone();
        let name = name.clone();
        async move {
            let deleted: i64 = redis::cmd("DEL")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(deleted, 1);
        }
    };
    delete(&mut admins[let_go[0]]).await;
    delete(&mut admins[let_go[1]]).await;
    // Long enough for a once-a-second look (a split round, given back).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !waiter.is_finished(),
        "granted with three of five masters held by another client"
    );
    // The split round's give-backs left nothing on the two free masters.
    for conn in [let_go[0], let_go[1]]
        .map(|index| admins[index].clone())
        .iter_mut()
    {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(&name)
            .query_async(conn)
            .await
            .unwrap();
        assert_eq!(exists, 0, "a give-back left a hold on a free master");
    }
    let deleted = Instant::now();
    delete(&mut admins[let_go[2]]).await;
    let granted = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter is granted once a quorum is free")
        .unwrap();
    let after = granted.saturating_duration_since(deleted);
    eprintln!("granted {after:?} after the third master let go");
    assert!(
        after < Duration::from_millis(300),
        "granted {after:?} after the third master let go: the waiter slept on to its \
         once-a-second look"
    );
}
