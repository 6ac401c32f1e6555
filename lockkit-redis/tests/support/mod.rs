//! What the tests of waits behind other clients' holders share: an admin connection to a
//! server of the test's own, the server's counters, and a waiter task.

#![allow(dead_code)] // each test file uses some of these

use std::time::{Duration, Instant};

use lockkit_conformance::OwnRedis;
use lockkit_core::Locker;
use redis::aio::MultiplexedConnection;

/// A plain connection to `server`'s database `db`.
pub async fn admin(server: &OwnRedis, db: u8) -> MultiplexedConnection {
    redis::Client::open(format!("{}/{db}", server.url()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `EVALSHA` calls the server has run so far (lockkit's acquire attempts, among others).
pub async fn evalsha_calls(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

/// Subscribers of `channel` (`PUBSUB NUMSUB`).
pub async fn subscribers(conn: &mut MultiplexedConnection, channel: &str) -> i64 {
    let (_, count): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    count
}

/// A task that waits (60 s at most) for `name` through `locker`, releases it at once, and
/// answers when it was granted; `why` says what the grant means.
pub fn spawn_waiter(
    locker: &Locker,
    name: &str,
    why: &'static str,
) -> tokio::task::JoinHandle<Instant> {
    let (locker, name) = (locker.clone(), name.to_owned());
    tokio::spawn(async move {
        let guard = locker
            .acquire(name.as_str())
            .wait(Duration::from_secs(60))
            .await
            .expect(why);
        let granted = Instant::now();
        guard.release().await.unwrap();
        granted
    })
}

/// Takes `name` as a foreign client does: a plain string, set if absent, with a lease.
pub async fn take_as_foreign(conn: &mut MultiplexedConnection, name: &str) {
    let set: Option<String> = redis::cmd("SET")
        .arg(name)
        .arg("a-foreign-token")
        .arg("NX")
        .arg("PX")
        .arg(60_000)
        .query_async(conn)
        .await
        .unwrap();
    assert_eq!(set.as_deref(), Some("OK"));
}

/// Five Redis masters of the test's own started with `args`; `None` when `redis-server` is
/// missing outside CI.
pub fn five_masters(args: &[&str]) -> Option<Vec<OwnRedis>> {
    (0..5).map(|_| OwnRedis::start(args)).collect()
}

/// The `redlock://` URL of `masters`.
pub fn redlock_url(masters: &[OwnRedis]) -> String {
    let hosts: Vec<String> = masters
        .iter()
        .map(|m| format!("127.0.0.1:{}", m.port))
        .collect();
    format!("redlock://{}", hosts.join(","))
}

/// `EVALSHA` calls the servers behind `admins` have run so far, summed.
pub async fn evalsha_calls_on(admins: &mut [MultiplexedConnection]) -> u64 {
    let mut calls = 0;
    for conn in admins {
        calls += evalsha_calls(conn).await;
    }
    calls
}

/// Subscribers of `channel` on each server behind `admins` (`PUBSUB NUMSUB`).
pub async fn subscribers_on(admins: &mut [MultiplexedConnection], channel: &str) -> Vec<i64> {
    let mut counts = Vec::new();
    for conn in admins {
        counts.push(subscribers(conn, channel).await);
    }
    counts
}

/// Deletes `name` (whatever holds it).
pub async fn delete(conn: &mut MultiplexedConnection, name: &str) {
    let _: i64 = redis::cmd("DEL").arg(name).query_async(conn).await.unwrap();
}
